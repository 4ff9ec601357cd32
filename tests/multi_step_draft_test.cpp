// MultiStepDraftBackend: every step of every branch against the float64 reference.
#include "flashkv/backend/multi_step_draft.h"

#include <gtest/gtest.h>

#include <cstring>

#include "backend_harness.h"

namespace flashkv::test {
namespace {

class MultiStepDraftTest : public ::testing::TestWithParam<std::tuple<Device, int>> {};

// Runs all steps for `reqs` and checks every row of every step.
void run_steps(Harness& h, MultiStepDraftBackend& ms, std::vector<Request*> reqs, bool graph,
               bool capture) {
  const ModelShape& s = h.shape();
  const int topk = ms.topk(), steps = ms.num_steps();
  const int bs = static_cast<int>(reqs.size());
  ForwardBatch batch;
  batch.batch_size = bs;
  batch.req_to_token_pool = &h.req_to_token();
  batch.token_to_kv_pool = &h.pool();
  std::vector<int32_t> rows;
  for (Request* r : reqs) {
    rows.push_back(r->row);
    batch.seq_lens_cpu.push_back(r->seq_len);
  }
  Tensor rpi = Tensor::from_i32(rows, s.device);
  batch.req_pool_indices = rpi;
  auto slots = h.allocator().alloc(int64_t{bs} * topk * steps);
  ASSERT_TRUE(slots.has_value());
  Tensor loc_host = Tensor::empty({bs, topk, steps}, DType::i32);
  std::memcpy(loc_host.data(), slots->data(), slots->size() * 4);
  Tensor loc = loc_host.to(s.device);
  if (!graph)
    ms.init_forward_metadata(batch, loc);
  else if (capture)
    ms.init_forward_metadata_capture_cuda_graph(batch, loc);
  else
    ms.init_forward_metadata_replay_cuda_graph(batch, loc);
  const int64_t n = int64_t{bs} * topk;
  for (int step = 0; step < steps; ++step) {
    const LayerSpec layer = h.layer(0);
    Tensor q = random_tensor(h.rng(), {n, s.hq, s.head_dim}, s.dtype);
    Tensor k = random_tensor(h.rng(), {n, s.hkv, s.head_dim}, s.dtype);
    Tensor v = random_tensor(h.rng(), {n, s.hkv, s.head_dim}, s.dtype);
    Tensor out = Tensor::empty({n, int64_t{s.hq} * s.head_dim}, s.dtype, s.device);
    ms.forward(step, q.to(s.device), k.to(s.device), v.to(s.device), layer, true, out);
    Tensor host = out.to(Device::cpu());
    // Reference: row (r, b) sees r's cached tokens then draft tokens 0..step of branch b.
    std::vector<int32_t> kv_slots, kv_lens;
    for (int r = 0; r < bs; ++r)
      for (int b = 0; b < topk; ++b) {
        for (int32_t j = 0; j < reqs[r]->seq_len; ++j) kv_slots.push_back(reqs[r]->slots[j]);
        for (int st = 0; st <= step; ++st)
          kv_slots.push_back((*slots)[(r * topk + b) * steps + st]);
        kv_lens.push_back(reqs[r]->seq_len + step + 1);
      }
    Tensor indptr = Tensor::from_i32(indptr_of(kv_lens)), idx = Tensor::from_i32(kv_slots);
    Tensor kp = Tensor::empty({h.pool().num_rows(), s.hkv, s.head_dim}, s.kv_dtype);
    Tensor vp = Tensor::empty({h.pool().num_rows(), s.hkv, s.head_dim}, s.kv_dtype);
    copy_bytes(kp.data(), Device::cpu(), h.pool().k(0).data, s.device, kp.view().nbytes());
    copy_bytes(vp.data(), Device::cpu(), h.pool().v(0).data, s.device, vp.view().nbytes());
    PagedKV kv{kp, vp, indptr, idx, TensorView(), 1, h.pool().k_scale(0), h.pool().v_scale(0)};
    AttentionOptions opt;
    opt.sm_scale = layer.scaling;
    auto ref = reference::paged_attention(q, TensorView(), kv, opt);
    TensorView h3 = host.view();
    h3.ndim = 3;
    h3.shape[1] = s.hq;
    h3.shape[2] = s.head_dim;
    h3.stride[1] = s.head_dim;
    h3.stride[2] = 1;
    SCOPED_TRACE(::testing::Message() << "step " << step);
    expect_close(h3, TensorView(), ref, s.dtype);
  }
  h.allocator().free(*slots);
}

TEST_P(MultiStepDraftTest, EveryStepAndBranchMatchesReference) {
  auto [device, topk] = GetParam();
  ModelShape s;
  s.device = device;
  s.num_layers = 1;
  Harness h(s);
  Request a = h.add_request(30), b = h.add_request(1), c = h.add_request(77);
  // Each step's decode through the decode operator (default) and through the prefill kernel.
  for (bool tensor_cores : {false, true}) {
    SCOPED_TRACE(tensor_cores ? "use_tensor_cores" : "decode operator");
    BackendOptions o = h.backend().options();
    o.use_tensor_cores = tensor_cores;
    MultiStepDraftBackend ms(o, topk, 3);
    run_steps(h, ms, {&a, &b, &c}, false, false);
  }
}

TEST_P(MultiStepDraftTest, GraphCaptureThenReplayWithOtherRequests) {
  auto [device, topk] = GetParam();
  ModelShape s;
  s.device = device;
  s.num_layers = 1;
  Harness h(s);
  MultiStepDraftBackend ms(h.backend().options(), topk, 2);
  ms.init_cuda_graph_state(3);
  Request a = h.add_request(10), b = h.add_request(40), c = h.add_request(5), d = h.add_request(64);
  // Captures at batch sizes 1..3, then replays of each size with other requests.
  run_steps(h, ms, {&a}, true, true);
  run_steps(h, ms, {&b, &c}, true, true);
  run_steps(h, ms, {&a, &b, &d}, true, true);
  run_steps(h, ms, {&c, &d}, true, false);
  run_steps(h, ms, {&d}, true, false);
  run_steps(h, ms, {&c, &a, &b}, true, false);
  EXPECT_THROW(run_steps(h, ms, {&a, &b, &c, &d}, true, false), Error);  // past capacity
}

TEST(MultiStepDraft, BadArguments) {
  ModelShape s;
  Harness h(s);
  EXPECT_THROW(MultiStepDraftBackend(h.backend().options(), 0, 2), Error);
  EXPECT_THROW(MultiStepDraftBackend(h.backend().options(), 2, 0), Error);
  MultiStepDraftBackend ms(h.backend().options(), 2, 2);
  Request a = h.add_request(3);
  ForwardBatch batch;
  batch.batch_size = 1;
  batch.req_to_token_pool = &h.req_to_token();
  batch.token_to_kv_pool = &h.pool();
  batch.seq_lens_cpu = {a.seq_len};
  Tensor rpi = Tensor::from_i32({a.row});
  batch.req_pool_indices = rpi;
  Tensor wrong = Tensor::empty({1, 3, 2}, DType::i32);  // topk 3 != 2
  EXPECT_THROW(ms.init_forward_metadata(batch, wrong), Error);
  EXPECT_THROW(ms.step_batch(2), Error);
}

INSTANTIATE_TEST_SUITE_P(DevicesAndTopk, MultiStepDraftTest,
                         ::testing::Combine(::testing::ValuesIn(backend_test_devices()),
                                            ::testing::Values(1, 4)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).is_cpu() ? "cpu" : "cuda") +
                                  "_topk" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace flashkv::test
