// FlashKVBackend and MultiStepDraftBackend on bad input: every call answers with a
// flashkv::Error, and the K/V pools, req_to_token and the allocators are byte-for-byte what they
// were; a failed init_forward_metadata leaves the previous plan usable.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include "backend_harness.h"
#include "flashkv/backend/multi_step_draft.h"

namespace flashkv::test {
namespace {

// Runs `fn`, expects a flashkv::Error, and expects the pools unchanged.
void expect_error_changes_nothing(Harness& h, const std::string& what,
                                  const std::function<void()>& fn) {
  SCOPED_TRACE(what);
  const PoolSnapshot before = h.snapshot();
  EXPECT_FALSE(error_of(fn).empty()) << "expected a flashkv::Error";
  h.expect_unchanged(before);
}

// One batch of a model: the valid batch, and the model's layers the checks call.
struct Scenario {
  const char* name;
  ForwardMode mode;
  std::vector<int32_t> cached, new_lens, encoder;
  bool sliding_window = false, encoder_decoder = false, multimodal = false;
  std::optional<bool> use_tensor_cores;
};

std::vector<Scenario> scenarios() {
  return {
      {"decode", ForwardMode::DECODE, {10, 33}, {1, 1}, {}},
      {"decode_prefill_kernel",
       ForwardMode::DECODE,
       {10, 33},
       {1, 1},
       {},
       false,
       false,
       false,
       true},
      {"extend_ragged", ForwardMode::EXTEND, {10, 0}, {4, 6}, {}},
      {"extend_paged", ForwardMode::EXTEND, {10, 0}, {4, 6}, {}, false, false, true},
      {"mixed", ForwardMode::MIXED, {20, 5}, {1, 7}, {}},
      {"target_verify", ForwardMode::TARGET_VERIFY, {30, 12}, {4, 4}, {}},
      {"draft_extend", ForwardMode::DRAFT_EXTEND, {25, 9}, {3, 1}, {}},
      {"window_decode", ForwardMode::DECODE, {40, 3}, {1, 1}, {}, true},
      {"window_extend", ForwardMode::EXTEND, {40, 3}, {9, 2}, {}, true},
      {"encoder_decoder_extend", ForwardMode::EXTEND, {5, 2}, {3, 4}, {8, 6}, false, true},
      {"encoder_decoder_decode", ForwardMode::DECODE, {5, 2}, {1, 1}, {8, 6}, false, true},
  };
}

void PrintTo(const Scenario& sc, std::ostream* os) { *os << sc.name; }

class BackendBadInputTest : public ::testing::TestWithParam<std::tuple<Device, Scenario>> {};

TEST_P(BackendBadInputTest, ClearErrorPoolsUnchangedPlanKept) {
  const auto& [device, sc] = GetParam();
  ModelShape s;
  s.device = device;
  s.slots = 1024;
  s.max_reqs = 8;
  s.max_context = 256;
  s.num_layers = 2;
  s.sliding_window = sc.sliding_window ? 7 : -1;
  s.swa_pool = sc.sliding_window;
  s.encoder_decoder = sc.encoder_decoder;
  BackendOptions o;
  o.is_multimodal = sc.multimodal;
  o.use_tensor_cores = sc.use_tensor_cores;
  Harness h(s, o);
  std::vector<Request> reqs;
  for (size_t i = 0; i < sc.cached.size(); ++i)
    reqs.push_back(h.add_request(sc.cached[i], sc.encoder.empty() ? 0 : sc.encoder[i]));
  std::vector<Request*> ptrs;
  for (Request& r : reqs) ptrs.push_back(&r);
  const ForwardBatch b = h.make_batch(sc.mode, ptrs, sc.new_lens);
  const uint64_t seed = 99;
  h.run_and_check(b, false, seed);
  const int32_t B = b.batch_size;
  const int64_t T = b.num_tokens();
  const bool on_host = device.is_cpu();
  FlashKVBackend& be = h.backend();

  // --- init_forward_metadata: the batch against its mode, the pools and the capacities ---
  auto bad_batch = [&](const std::string& what, const std::function<void(ForwardBatch&)>& edit) {
    ForwardBatch bad = b;
    edit(bad);
    expect_error_changes_nothing(h, what, [&] { be.init_forward_metadata(bad); });
  };
  Tensor rpi_i64 = Tensor::empty({B}, DType::i64, device);
  Tensor loc_i64 = Tensor::empty({T}, DType::i64, device);
  Tensor bad_rows = Tensor::from_i32(std::vector<int32_t>(B, s.max_reqs + 3), device);
  std::vector<int32_t> bad_slots(T, 1);
  bad_slots.back() = static_cast<int32_t>(h.pool().num_rows());
  Tensor bad_loc = Tensor::from_i32(bad_slots, device);
  KVPoolConfig other_cfg = h.pool().config();
  other_cfg.num_kv_heads = s.hkv * 2;
  other_cfg.num_slots = 16;
  KVPool other_pool(other_cfg);
  bad_batch("batch_size < 0", [](ForwardBatch& x) { x.batch_size = -1; });
  bad_batch("seq_lens_cpu size", [](ForwardBatch& x) { x.seq_lens_cpu.push_back(5); });
  bad_batch("seq_len past max_context_len",
            [&](ForwardBatch& x) { x.seq_lens_cpu[0] = s.max_context + 1; });
  bad_batch("no token_to_kv_pool", [](ForwardBatch& x) { x.token_to_kv_pool = nullptr; });
  bad_batch("no req_to_token_pool", [](ForwardBatch& x) { x.req_to_token_pool = nullptr; });
  bad_batch("pool of another model", [&](ForwardBatch& x) { x.token_to_kv_pool = &other_pool; });
  bad_batch("req_pool_indices i64", [&](ForwardBatch& x) { x.req_pool_indices = rpi_i64; });
  bad_batch("req_pool_indices short",
            [&](ForwardBatch& x) { x.req_pool_indices = b.req_pool_indices.rows(0, B - 1); });
  bad_batch("out_cache_loc short",
            [&](ForwardBatch& x) { x.out_cache_loc = b.out_cache_loc.rows(0, T - 1); });
  bad_batch("out_cache_loc i64", [&](ForwardBatch& x) { x.out_cache_loc = loc_i64; });
  bad_batch("out_cache_loc undefined", [](ForwardBatch& x) { x.out_cache_loc = TensorView(); });
  if (on_host) {
    // Index contents are checked where they can be read without a device synchronization.
    bad_batch("req_pool_indices row outside req_to_token",
              [&](ForwardBatch& x) { x.req_pool_indices = bad_rows; });
    bad_batch("out_cache_loc slot outside the pool",
              [&](ForwardBatch& x) { x.out_cache_loc = bad_loc; });
  }
  // Mode/field mismatches.
  switch (sc.mode) {
    case ForwardMode::EXTEND:
    case ForwardMode::MIXED:
      bad_batch("extend prefix + new != seq",
                [](ForwardBatch& x) { x.extend_prefix_lens_cpu[0] += 1; });
      bad_batch("extend_seq_lens_cpu size",
                [](ForwardBatch& x) { x.extend_seq_lens_cpu.pop_back(); });
      bad_batch("extend_prefix_lens_cpu size",
                [](ForwardBatch& x) { x.extend_prefix_lens_cpu.clear(); });
      bad_batch("more new tokens than seq_len", [](ForwardBatch& x) {
        x.extend_seq_lens_cpu[0] = x.seq_lens_cpu[0] + 1;
        x.extend_prefix_lens_cpu[0] = -1;
      });
      bad_batch("EXTEND batch as DRAFT_EXTEND", [](ForwardBatch& x) {
        x.mode = ForwardMode::DRAFT_EXTEND;
        x.spec.accept_length_cpu.clear();
      });
      break;
    case ForwardMode::TARGET_VERIFY:
      bad_batch("draft_token_num 0", [](ForwardBatch& x) { x.spec.draft_token_num = 0; });
      bad_batch("draft_token_num past seq_len",
                [](ForwardBatch& x) { x.spec.draft_token_num = x.seq_lens_cpu[1] + 1; });
      bad_batch("custom_mask short", [](ForwardBatch& x) {
        x.spec.custom_mask = x.spec.custom_mask.rows(0, x.spec.custom_mask.numel() - 1);
      });
      bad_batch("custom_mask missing", [](ForwardBatch& x) { x.spec.custom_mask = TensorView(); });
      bad_batch("custom_mask i32", [&](ForwardBatch& x) { x.spec.custom_mask = loc_i64; });
      break;
    case ForwardMode::DRAFT_EXTEND:
      bad_batch("accept_length_cpu size",
                [](ForwardBatch& x) { x.spec.accept_length_cpu.pop_back(); });
      bad_batch("accepted past seq_len",
                [](ForwardBatch& x) { x.spec.accept_length_cpu[1] = x.seq_lens_cpu[1] + 1; });
      break;
    case ForwardMode::DECODE:
      bad_batch("DECODE batch as TARGET_VERIFY (no draft tokens, no mask)",
                [](ForwardBatch& x) { x.mode = ForwardMode::TARGET_VERIFY; });
      bad_batch("DECODE batch as EXTEND (no extend lengths)", [](ForwardBatch& x) {
        x.mode = ForwardMode::EXTEND;
        x.extend_seq_lens_cpu.clear();
      });
      break;
    default:
      break;
  }
  if (sc.encoder_decoder) {
    bad_batch("encoder_lens_cpu size", [](ForwardBatch& x) { x.encoder_lens_cpu.pop_back(); });
    bad_batch("encoder_lens_cpu negative", [](ForwardBatch& x) { x.encoder_lens_cpu[0] = -1; });
    bad_batch("encoder + decoder tokens past max_context_len",
              [&](ForwardBatch& x) { x.encoder_lens_cpu[0] = s.max_context; });
    bad_batch("encoder_out_cache_loc i64",
              [&](ForwardBatch& x) { x.encoder_out_cache_loc = loc_i64; });
  }
  expect_error_changes_nothing(h, "graph replay without init_cuda_graph_state",
                               [&] { be.init_forward_metadata_replay_cuda_graph(b); });

  // The plan of `b` survived every failed call: the layers run again (same q/k/v, so the pool
  // gets the same bytes) and match the reference.
  {
    SCOPED_TRACE("the previous plan after failed init_forward_metadata calls");
    const PoolSnapshot before = h.snapshot();
    h.forward_and_check(b, seed);
    h.expect_unchanged(before);
  }

  // --- forward (save_kv_cache = true): the layer call against the plan and the backend ---
  const int full_layer = sc.sliding_window ? 1 : 0;  // a layer that caches the batch's tokens
  const LayerSpec layer = h.layer(full_layer);
  Harness::LayerInputs in = h.layer_inputs(T);
  auto bad_call = [&](const std::string& what, const TensorView& q, const TensorView& k,
                      const TensorView& v, const LayerSpec& l, const ForwardBatch& batch,
                      const TensorView& out) {
    expect_error_changes_nothing(h, what, [&] { be.forward(q, k, v, l, batch, true, out); });
  };
  Harness::LayerInputs short_in = h.layer_inputs(T - 1), long_in = h.layer_inputs(T + 1);
  Tensor q_f16 = Tensor::empty({T, s.hq, s.head_dim}, DType::f16, device);
  Tensor k_f16 = Tensor::empty({T, s.hkv, s.head_dim}, DType::f16, device);
  Tensor q_heads = Tensor::empty({T, s.hq * 2, s.head_dim}, s.dtype, device);
  Tensor v_dim = Tensor::empty({T, s.hkv, s.head_dim * 2}, s.dtype, device);
  Tensor out_f32 = Tensor::empty({T, int64_t{s.hq} * s.head_dim}, DType::f32, device);
  // An out view whose head_dim is strided (inner stride 2): fine for the backend's shape
  // checks, refused by the operator, which must still come before the pool write.
  Tensor out_wide = Tensor::empty({T, s.hq, s.head_dim * 2}, s.dtype, device);
  TensorView out_strided = out_wide.view();
  out_strided.shape[2] = s.head_dim;
  out_strided.stride[2] = 2;
  bad_call("q with too few rows", short_in.q, in.k, in.v, layer, b, in.out);
  bad_call("q dtype", q_f16, in.k, in.v, layer, b, in.out);
  bad_call("q heads", q_heads, in.k, in.v, layer, b, in.out);
  bad_call("k with more rows than tokens", in.q, long_in.k, long_in.v, layer, b, in.out);
  bad_call("k dtype", in.q, k_f16, in.v, layer, b, in.out);
  bad_call("v missing", in.q, in.k, TensorView(), layer, b, in.out);
  bad_call("v head_dim", in.q, in.k, v_dim, layer, b, in.out);
  bad_call("out dtype", in.q, in.k, in.v, layer, b, out_f32);
  bad_call("out rows", in.q, in.k, in.v, layer, b, short_in.out);
  bad_call("out with a strided head_dim", in.q, in.k, in.v, layer, b, out_strided);
  LayerSpec bad_layer = layer;
  bad_layer.layer_id = s.num_layers;
  bad_call("layer_id outside the pool", in.q, in.k, in.v, bad_layer, b, in.out);
  bad_layer = layer;
  bad_layer.num_kv_heads = s.hkv * 2;
  bad_call("layer heads", in.q, in.k, in.v, bad_layer, b, in.out);
  bad_layer = layer;
  bad_layer.sliding_window_size = sc.sliding_window ? 3 : 5;
  bad_call("layer window differs from the backend's", in.q, in.k, in.v, bad_layer, b, in.out);
  if (!sc.encoder_decoder) {
    bad_layer = layer;
    bad_layer.is_cross_attention = true;
    bad_call("cross attention without is_encoder_decoder", in.q, in.k, in.v, bad_layer, b, in.out);
  }
  ForwardBatch other_mode = b;
  other_mode.mode = sc.mode == ForwardMode::DECODE ? ForwardMode::EXTEND : ForwardMode::DECODE;
  bad_call("a batch of another mode than the plan's", in.q, in.k, in.v, layer, other_mode, in.out);
  ForwardBatch other_size = b;
  other_size.batch_size = B + 1;
  bad_call("a batch of another size than the plan's", in.q, in.k, in.v, layer, other_size, in.out);

  if (on_host && sc.cached[0] > 0) {
    // A req_to_token entry outside the pool passes planning (the gather copies it) but not the
    // attention call, which must refuse it before the layer's K/V reach the pool.
    const int32_t pos = reqs[0].encoder_len;  // request 0's first cached decoder token
    const std::vector<int32_t> saved = h.req_to_token().read(reqs[0].row, pos, 1);
    h.req_to_token().write(reqs[0].row, pos,
                           std::vector<int32_t>{static_cast<int32_t>(h.pool().num_rows()) + 5});
    const std::string plan_error = error_of([&] { be.init_forward_metadata(b); });
    const Harness::LayerInputs fresh = h.layer_inputs(T);  // K/V bytes no earlier call wrote
    if (plan_error.empty())
      bad_call("req_to_token entry outside the pool", fresh.q, fresh.k, fresh.v, layer, b,
               fresh.out);
    h.req_to_token().write(reqs[0].row, pos, saved);
  }
}

INSTANTIATE_TEST_SUITE_P(DevicesAndModes, BackendBadInputTest,
                         ::testing::Combine(::testing::ValuesIn(backend_test_devices()),
                                            ::testing::ValuesIn(scenarios())),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).is_cpu() ? "cpu_" : "cuda_") +
                                  std::get<1>(info.param).name;
                         });

TEST(BackendBadInput, ForwardBeforeAnyPlan) {
  ModelShape s;
  s.slots = 256;
  Harness h(s);
  Request a = h.add_request(4);
  auto b = h.make_batch(ForwardMode::DECODE, {&a}, {1});
  Harness::LayerInputs in = h.layer_inputs(1);
  expect_error_changes_nothing(h, "forward before init_forward_metadata", [&] {
    h.backend().forward(in.q, in.k, in.v, h.layer(0), b, true, in.out);
  });
}

TEST(BackendBadInput, GraphBatchPastCapacityKeepsTheGraphPlan) {
  ModelShape s;
  s.slots = 1024;
  Harness h(s);
  h.backend().init_cuda_graph_state(2, 2);
  std::vector<Request> reqs;
  for (int32_t len : {5, 40, 9}) reqs.push_back(h.add_request(len));
  auto cap = h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1]}, {1, 1});
  h.backend().init_forward_metadata_capture_cuda_graph(cap);
  h.forward_and_check(cap, 5);
  auto big = h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1], &reqs[2]}, {1, 1, 1});
  expect_error_changes_nothing(h, "3 requests into a graph of 2",
                               [&] { h.backend().init_forward_metadata_replay_cuda_graph(big); });
  // The batch the last failure interrupted is gone from the pools' view: roll the requests
  // back to the captured batch and replay it on the plan that survived.
  for (Request& r : reqs) h.rollback(r, r.seq_len - 1);
  auto again = h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1]}, {1, 1});
  h.run_and_check(again, /*use_graph_state=*/true);
}

TEST(BackendBadInput, KernelLimitsOfTheDeviceChangeNothing) {
  // The CUDA kernels take bf16/f16 activations only: an f32 model plans fine but its layer
  // calls fail in the attention operator, which is validated before the K/V append.
  FLASHKV_REQUIRE_GPU();
  ModelShape s;
  s.device = Device::cuda(0);
  s.dtype = DType::f32;
  s.kv_dtype = DType::f32;
  s.slots = 256;
  Harness h(s);
  Request a = h.add_request(7);
  auto b = h.make_batch(ForwardMode::DECODE, {&a}, {1});
  h.backend().init_forward_metadata(b);
  Harness::LayerInputs in = h.layer_inputs(1);
  expect_error_changes_nothing(h, "f32 decode on CUDA", [&] {
    h.backend().forward(in.q, in.k, in.v, h.layer(0), b, true, in.out);
  });
}

// --- MultiStepDraftBackend ---

class MultiStepBadInputTest : public ::testing::TestWithParam<Device> {};

TEST_P(MultiStepBadInputTest, ClearErrorPoolsUnchangedPlanKept) {
  ModelShape s;
  s.device = GetParam();
  s.num_layers = 1;
  s.slots = 1024;
  s.max_context = 128;
  Harness h(s);
  const int topk = 2, steps = 3;
  MultiStepDraftBackend ms(h.backend().options(), topk, steps);
  Request a = h.add_request(20), c = h.add_request(4);
  ForwardBatch batch;
  batch.batch_size = 2;
  batch.req_to_token_pool = &h.req_to_token();
  batch.token_to_kv_pool = &h.pool();
  batch.seq_lens_cpu = {a.seq_len, c.seq_len};
  Tensor rpi = Tensor::from_i32({a.row, c.row}, s.device);
  batch.req_pool_indices = rpi;
  auto slots = h.allocator().alloc(2 * topk * steps);
  ASSERT_TRUE(slots.has_value());
  Tensor loc_host = Tensor::empty({2, topk, steps}, DType::i32);
  std::memcpy(loc_host.data(), slots->data(), slots->size() * sizeof(int32_t));
  Tensor loc = loc_host.to(s.device);
  ms.init_forward_metadata(batch, loc);
  // Step 0's layer call on fixed q/k/v; its output is what the plan must still give later.
  const int64_t rows = 2 * topk;
  Harness::LayerInputs in = h.layer_inputs(rows);
  ms.forward(0, in.q, in.k, in.v, h.layer(0), true, in.out);
  const Tensor first = in.out.to(Device::cpu());

  auto bad_plan = [&](const std::string& what, const ForwardBatch& bb, const TensorView& dl) {
    expect_error_changes_nothing(h, what, [&] { ms.init_forward_metadata(bb, dl); });
  };
  ForwardBatch bad = batch;
  bad.seq_lens_cpu[1] = s.max_context - steps + 1;
  bad_plan("draft tokens past max_context_len", bad, loc);
  bad = batch;
  bad.seq_lens_cpu.pop_back();
  bad_plan("seq_lens_cpu size", bad, loc);
  bad = batch;
  bad.token_to_kv_pool = nullptr;
  bad_plan("no pool", bad, loc);
  Tensor rows_out = Tensor::from_i32({a.row, s.max_reqs + 1}, s.device);
  bad = batch;
  bad.req_pool_indices = rows_out;
  bad_plan("req_pool_indices row outside req_to_token", bad, loc);
  Tensor wrong_topk = Tensor::empty({2, topk + 1, steps}, DType::i32, s.device);
  bad_plan("draft_loc topk", batch, wrong_topk);
  Tensor loc_i64 = Tensor::empty({2, topk, steps}, DType::i64, s.device);
  bad_plan("draft_loc i64", batch, loc_i64);
  if (s.device.is_cpu()) {
    Tensor outside = loc_host.to(Device::cpu());
    outside.ptr<int32_t>()[3] = static_cast<int32_t>(h.pool().num_rows());
    bad_plan("draft_loc slot outside the pool", batch, outside);
  }
  expect_error_changes_nothing(h, "graph replay without init_cuda_graph_state",
                               [&] { ms.init_forward_metadata_replay_cuda_graph(batch, loc); });
  // Layer calls with bad arguments.
  Harness::LayerInputs short_in = h.layer_inputs(rows - 1);
  Tensor q_f16 = Tensor::empty({rows, s.hq, s.head_dim}, DType::f16, s.device);
  expect_error_changes_nothing(h, "step past num_steps", [&] {
    ms.forward(steps, in.q, in.k, in.v, h.layer(0), true, in.out);
  });
  expect_error_changes_nothing(
      h, "q rows", [&] { ms.forward(1, short_in.q, in.k, in.v, h.layer(0), true, in.out); });
  expect_error_changes_nothing(
      h, "k rows", [&] { ms.forward(1, in.q, short_in.k, short_in.v, h.layer(0), true, in.out); });
  expect_error_changes_nothing(h, "q dtype",
                               [&] { ms.forward(1, q_f16, in.k, in.v, h.layer(0), true, in.out); });
  // The plan survived: step 0 again gives the same bits (same inputs, same pool).
  const PoolSnapshot before = h.snapshot();
  ms.forward(0, in.q, in.k, in.v, h.layer(0), true, in.out);
  const Tensor again = in.out.to(Device::cpu());
  EXPECT_EQ(0, std::memcmp(first.data(), again.data(), first.view().nbytes()));
  h.expect_unchanged(before);
  h.allocator().free(*slots);
}

INSTANTIATE_TEST_SUITE_P(Devices, MultiStepBadInputTest,
                         ::testing::ValuesIn(backend_test_devices()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda"; });

}  // namespace
}  // namespace flashkv::test
