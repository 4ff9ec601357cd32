// FlashKVBackend, mode by mode, against the float64 reference computed from the pools.
#include <gtest/gtest.h>

#include "backend_harness.h"

namespace flashkv::test {
namespace {

// The devices the backend tests run on: the CPU always, CUDA when a GPU is visible.
std::vector<Device> devices() {
  std::vector<Device> d = {Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

class BackendTest : public ::testing::TestWithParam<Device> {
 protected:
  ModelShape shape() const {
    ModelShape s;
    s.device = GetParam();
    return s;
  }
};

TEST_P(BackendTest, Decode) {
  Harness h(shape());
  std::vector<Request> reqs;
  for (int32_t len : {1, 17, 300, 64, 0 + 1}) reqs.push_back(h.add_request(len));
  std::vector<Request*> ptrs;
  ptrs.reserve(reqs.size());
  for (auto& r : reqs) ptrs.push_back(&r);
  auto b = h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1));
  h.run_and_check(b);
  // A second step on the same requests sees the token the first wrote.
  auto b2 = h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1));
  h.run_and_check(b2);
}

TEST_P(BackendTest, ExtendWithoutPrefixUsesRaggedOnly) {
  Harness h(shape());
  Request a = h.add_request(0), b = h.add_request(0);
  auto batch = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {37, 5});
  h.run_and_check(batch);
  EXPECT_TRUE(h.backend().uses_ragged());
  EXPECT_TRUE(h.backend().extend_without_prefix());
}

TEST_P(BackendTest, ExtendWithMixedPrefixes) {
  Harness h(shape());
  Request a = h.add_request(100), b = h.add_request(0), c = h.add_request(33);
  auto batch = h.make_batch(ForwardMode::EXTEND, {&a, &b, &c}, {20, 9, 1});
  h.run_and_check(batch);
  EXPECT_TRUE(h.backend().uses_ragged());
  EXPECT_FALSE(h.backend().extend_without_prefix());
  // Then decode on top of what the extend cached.
  auto d = h.make_batch(ForwardMode::DECODE, {&a, &b, &c}, {1, 1, 1});
  h.run_and_check(d);
}

TEST_P(BackendTest, MixedModeRunsAsExtend) {
  Harness h(shape());
  Request a = h.add_request(50), b = h.add_request(10);
  auto batch = h.make_batch(ForwardMode::MIXED, {&a, &b}, {1, 12});
  h.run_and_check(batch);
}

TEST_P(BackendTest, MultimodalExtendIsOnePagedPass) {
  BackendOptions o;
  o.is_multimodal = true;
  Harness h(shape(), o);
  Request a = h.add_request(40), b = h.add_request(0);
  auto batch = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {11, 30});
  h.run_and_check(batch);
  EXPECT_FALSE(h.backend().uses_ragged());
}

TEST_P(BackendTest, SlidingWindowModel) {
  for (bool swa_pool : {false, true}) {
    SCOPED_TRACE(swa_pool ? "with SWA pool" : "one pool");
    ModelShape s = shape();
    s.sliding_window = 13;
    s.swa_pool = swa_pool;
    s.num_layers = 4;
    Harness h(s);
    EXPECT_EQ(h.backend().num_wrappers(), 2);
    Request a = h.add_request(60), b = h.add_request(5), c = h.add_request(0);
    auto e = h.make_batch(ForwardMode::EXTEND, {&a, &b, &c}, {20, 3, 25});
    h.run_and_check(e);
    auto d = h.make_batch(ForwardMode::DECODE, {&a, &b, &c}, {1, 1, 1});
    h.run_and_check(d);
  }
}

TEST_P(BackendTest, EncoderDecoderCrossAttention) {
  ModelShape s = shape();
  s.encoder_decoder = true;
  s.num_layers = 4;
  Harness h(s);
  Request a = h.add_request(0, 30), b = h.add_request(7, 12);
  auto e = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {6, 4});
  h.run_and_check(e);
  auto d = h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1});
  h.run_and_check(d);
}

TEST_P(BackendTest, EncoderOnlyLayers) {
  ModelShape s = shape();
  s.encoder_only = true;
  Harness h(s);
  Request a = h.add_request(0), b = h.add_request(0);
  auto e = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {19, 8});
  h.run_and_check(e);
}

TEST_P(BackendTest, TargetVerifyWithTreeMask) {
  Harness h(shape());
  Request a = h.add_request(40), b = h.add_request(3), c = h.add_request(100);
  auto v = h.make_batch(ForwardMode::TARGET_VERIFY, {&a, &b, &c}, {4, 4, 4});
  h.run_and_check(v);
}

TEST_P(BackendTest, DraftExtendByAcceptedLengths) {
  Harness h(shape());
  Request a = h.add_request(40), b = h.add_request(9);
  auto v = h.make_batch(ForwardMode::DRAFT_EXTEND, {&a, &b}, {3, 1});
  h.run_and_check(v);
}

TEST_P(BackendTest, Fp8KvCacheAndSoftCap) {
  ModelShape s = shape();
  s.kv_dtype = DType::fp8_e4m3;
  s.logit_cap = 30.0f;
  Harness h(s);
  Request a = h.add_request(70), b = h.add_request(0);
  auto e = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {9, 14});
  h.run_and_check(e);
  auto d = h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1});
  h.run_and_check(d);
}

TEST_P(BackendTest, IdleReturnsEmpty) {
  Harness h(shape());
  ForwardBatch b;
  b.mode = ForwardMode::IDLE;
  h.backend().init_forward_metadata(b);
  Tensor q = Tensor::empty({0, 8, 64}, DType::bf16, GetParam());
  EXPECT_FALSE(h.backend().forward(q, TensorView(), TensorView(), h.layer(0), b).defined());
}

TEST_P(BackendTest, GraphModeReplaysOtherBatchesOfTheSameSize) {
  Harness h(shape());
  h.backend().init_cuda_graph_state(4, 4);
  std::vector<Request> reqs;
  for (int32_t len : {5, 90, 33, 1, 200, 64, 7, 11}) reqs.push_back(h.add_request(len));
  auto cap =
      h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1], &reqs[2], &reqs[3]}, {1, 1, 1, 1});
  h.backend().init_forward_metadata_capture_cuda_graph(cap);
  h.run_and_check(cap, /*use_graph_state=*/true);
  auto rep =
      h.make_batch(ForwardMode::DECODE, {&reqs[4], &reqs[5], &reqs[6], &reqs[7]}, {1, 1, 1, 1});
  h.run_and_check(rep, true);
  // An eager batch in between does not disturb the graph buffers.
  auto eager = h.make_batch(ForwardMode::EXTEND, {&reqs[0], &reqs[4]}, {30, 2});
  h.run_and_check(eager);
  auto rep2 =
      h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[2], &reqs[4], &reqs[6]}, {1, 1, 1, 1});
  h.run_and_check(rep2, true);
}

TEST_P(BackendTest, DeterministicModeIsBatchInvariant) {
  BackendOptions o;
  o.deterministic = true;
  o.decode_split_size = 64;  // small, so splits happen at these lengths
  ModelShape s = shape();
  s.num_layers = 1;
  Harness h(s, o);
  Request probe = h.add_request(300);
  const uint64_t seed = 4242;
  // The same probe request (same q/k/v rows first in the batch) next to different companions.
  std::vector<Tensor> first;
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<Request> others;
    const int companions = trial == 0 ? 0 : h.rng().uniform_int(1, 4);
    others.reserve(companions);
    for (int i = 0; i < companions; ++i)
      others.push_back(h.add_request(h.rng().uniform_int(1, 200)));
    std::vector<Request*> ptrs = {&probe};
    for (auto& r : others) ptrs.push_back(&r);
    const int32_t saved_len = probe.seq_len;
    auto b = h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1));
    auto outs = h.run_and_check(b, false, seed);
    // Row 0 is the probe: compare its bits with the first trial's.
    const size_t row_bytes = outs[0].view().nbytes() / outs[0].size(0);
    if (trial == 0)
      first = outs;
    else
      EXPECT_EQ(0, std::memcmp(first[0].data(), outs[0].data(), row_bytes)) << "trial " << trial;
    // Roll the probe back so every trial decodes the same position.
    for (auto& r : others) h.finish(r);
    h.rollback(probe, saved_len);
  }
}

TEST_P(BackendTest, BadInputIsAClearErrorAndChangesNothing) {
  Harness h(shape());
  Request a = h.add_request(10);
  auto b = h.make_batch(ForwardMode::EXTEND, {&a}, {4});
  ForwardBatch bad = b;
  bad.extend_prefix_lens_cpu = {3};  // 3 + 4 != 14
  EXPECT_THROW(h.backend().init_forward_metadata(bad), Error);
  bad = b;
  bad.seq_lens_cpu = {5000};  // past max_context_len
  EXPECT_THROW(h.backend().init_forward_metadata(bad), Error);
  bad = b;
  bad.token_to_kv_pool = nullptr;
  EXPECT_THROW(h.backend().init_forward_metadata(bad), Error);
  bad = b;
  bad.mode = ForwardMode::TARGET_VERIFY;  // no draft_token_num / mask
  EXPECT_THROW(h.backend().init_forward_metadata(bad), Error);
  // A layer call before planning, and with mismatched shapes.
  Tensor q = Tensor::empty({4, 8, 64}, DType::bf16, GetParam());
  EXPECT_THROW(h.backend().forward(q, q, q, h.layer(0), b), Error);
  h.backend().init_forward_metadata(b);
  Tensor wrong_q = Tensor::empty({3, 8, 64}, DType::bf16, GetParam());
  Tensor kv = Tensor::empty({4, 2, 64}, DType::bf16, GetParam());
  EXPECT_THROW(h.backend().forward(wrong_q, kv, kv, h.layer(0), b), Error);
  LayerSpec bad_layer = h.layer(0);
  bad_layer.layer_id = 7;
  EXPECT_THROW(h.backend().forward(q, kv, kv, bad_layer, b), Error);
  EXPECT_THROW(h.backend().init_forward_metadata_replay_cuda_graph(b), Error);  // no graph state
}

INSTANTIATE_TEST_SUITE_P(Devices, BackendTest, ::testing::ValuesIn(devices()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda"; });

}  // namespace
}  // namespace flashkv::test
