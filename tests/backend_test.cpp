// FlashKVBackend, mode by mode, against the float64 reference computed from the pools.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backend_harness.h"

namespace flashkv::test {
namespace {

// New requests with cached[i] tokens, an extend adding new_lens[i] tokens to each, then a decode
// step; both passes checked against the reference.
void extend_then_decode(Harness& h, const std::vector<int32_t>& cached,
                        const std::vector<int32_t>& new_lens) {
  std::vector<Request> reqs;
  for (int32_t c : cached) reqs.push_back(h.add_request(c));
  std::vector<Request*> ptrs;
  for (Request& r : reqs) ptrs.push_back(&r);
  h.run_and_check(h.make_batch(ForwardMode::EXTEND, ptrs, new_lens));
  h.run_and_check(h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1)));
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
  for (auto& r : reqs) ptrs.push_back(&r);
  auto b = h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1));
  h.run_and_check(b);
  // A second step on the same requests sees the token the first wrote.
  auto b2 = h.make_batch(ForwardMode::DECODE, ptrs, std::vector<int32_t>(ptrs.size(), 1));
  h.run_and_check(b2);
}

constexpr ExtendPath kExtendPaths[] = {ExtendPath::automatic, ExtendPath::ragged,
                                       ExtendPath::one_paged_pass};

TEST_P(BackendTest, ExtendWithoutPrefixUsesRaggedOnly) {
  for (ExtendPath path : kExtendPaths) {  // a batch without prefixes takes it on every path
    SCOPED_TRACE(extend_path_name(path));
    BackendOptions o;
    o.extend_path = path;
    Harness h(shape(), o);
    Request a = h.add_request(0), b = h.add_request(0);
    auto batch = h.make_batch(ForwardMode::EXTEND, {&a, &b}, {37, 5});
    h.run_and_check(batch);
    EXPECT_TRUE(h.backend().uses_ragged());
    EXPECT_TRUE(h.backend().extend_without_prefix());
  }
}

TEST_P(BackendTest, ExtendWithMixedPrefixes) {
  for (ExtendPath path : kExtendPaths) {
    SCOPED_TRACE(extend_path_name(path));
    BackendOptions o;
    o.extend_path = path;
    Harness h(shape(), o);
    Request a = h.add_request(100), b = h.add_request(0), c = h.add_request(33);
    auto batch = h.make_batch(ForwardMode::EXTEND, {&a, &b, &c}, {20, 9, 1});
    h.run_and_check(batch);
    // automatic: one paged pass (a bf16 pool here).
    const bool ragged = path == ExtendPath::ragged;
    EXPECT_EQ(h.backend().uses_ragged(), ragged);
    EXPECT_EQ(h.backend().reads_new_kv_from_input(h.layer(0)), ragged);
    EXPECT_FALSE(h.backend().extend_without_prefix());
    // Then decode on top of what the extend cached, and a MIXED batch (extend and decode rows).
    auto d = h.make_batch(ForwardMode::DECODE, {&a, &b, &c}, {1, 1, 1});
    h.run_and_check(d);
    h.run_and_check(h.make_batch(ForwardMode::MIXED, {&a, &b, &c}, {1, 14, 1}));
    EXPECT_EQ(h.backend().uses_ragged(), ragged);
  }
}

TEST(BackendExtendPath, NamesRoundTrip) {
  for (ExtendPath path : kExtendPaths) EXPECT_EQ(parse_extend_path(extend_path_name(path)), path);
  EXPECT_STREQ(extend_path_name(ExtendPath::automatic), "auto");
  const std::string what = error_of([] { parse_extend_path("paged"); });
  for (const char* part : {"extend_path", "auto, ragged or one_paged_pass", "'paged'"})
    EXPECT_NE(what.find(part), std::string::npos) << what;
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
  for (int page_size : {1, 16})
    for (bool swa_pool : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << (swa_pool ? "with SWA pool" : "one pool") << ", page size " << page_size);
      ModelShape s = shape();
      s.sliding_window = 13;
      s.swa_pool = swa_pool;
      s.num_layers = 4;
      s.page_size = page_size;
      s.shuffle_pages = page_size > 1;
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

TEST_P(BackendTest, TargetVerifyWithRandomTrees) {
  // Random draft trees of random sizes over random prefixes, in a plain model and in a
  // sliding-window one (whose window layers see the whole sequence and apply the window).
  for (int window : {-1, 5}) {
    ModelShape s = shape();
    s.sliding_window = window;
    s.swa_pool = window >= 0;
    Harness h(s);
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(::testing::Message() << "window " << window << ", round " << round);
      const int bs = h.rng().uniform_int(1, 4), drafts = h.rng().uniform_int(1, 8);
      std::vector<Request> reqs;
      for (int i = 0; i < bs; ++i) reqs.push_back(h.add_request(h.rng().uniform_int(0, 150)));
      std::vector<Request*> ptrs;
      for (auto& r : reqs) ptrs.push_back(&r);
      auto v = h.make_batch(ForwardMode::TARGET_VERIFY, ptrs, std::vector<int32_t>(bs, drafts));
      h.run_and_check(v);
      for (auto& r : reqs) h.finish(r);
    }
  }
}

TEST_P(BackendTest, DraftExtendByAcceptedLengths) {
  Harness h(shape());
  Request a = h.add_request(40), b = h.add_request(9);
  auto v = h.make_batch(ForwardMode::DRAFT_EXTEND, {&a, &b}, {3, 1});
  h.run_and_check(v);
}

TEST_P(BackendTest, Fp8KvCacheAndSoftCap) {
  for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    SCOPED_TRACE(dtype_name(kv));
    ModelShape s = shape();
    s.kv_dtype = kv;
    s.logit_cap = 30.0f;
    // Both extend paths: ragged (the new tokens' K/V read as given, the prefix from the fp8
    // pool; the reference reads them where the pass did; the automatic path with an fp8 pool,
    // on every device) and one paged pass over the pool (multimodal). e5m2's 2-bit mantissa
    // would put the ragged pass past the fp8 tolerance against a reference that read the new
    // tokens back from the pool.
    for (bool multimodal : {false, true}) {
      SCOPED_TRACE(multimodal ? "one paged pass" : "ragged");
      BackendOptions o;
      o.is_multimodal = multimodal;
      Harness h(s, o);
      Request a = h.add_request(70), b = h.add_request(0);
      h.run_and_check(h.make_batch(ForwardMode::EXTEND, {&a, &b}, {9, 14}));
      EXPECT_EQ(h.backend().uses_ragged(), !multimodal);
      EXPECT_EQ(h.backend().reads_new_kv_from_input(h.layer(0)), !multimodal);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1}));
      EXPECT_FALSE(h.backend().reads_new_kv_from_input(h.layer(0)));
    }
  }
}

TEST_P(BackendTest, SoftCapAlone) {
  ModelShape s = shape();
  s.logit_cap = 5.0f;  // small enough that the cap changes the result
  Harness h(s);
  extend_then_decode(h, {33, 0}, {12, 7});
}

TEST_P(BackendTest, DecodeKernelChoice) {
  // Unset: the decode operator (fast everywhere, tensor cores included on CUDA).
  EXPECT_FALSE(Harness(shape()).backend().decode_uses_prefill_kernel());
  // use_tensor_cores true (the prefill kernel, one query row per request) and false (the decode
  // operator) both match the reference, in every decode flavour: plain, sliding window through
  // the SWA pool, fp8 KV with soft cap, encoder-decoder cross attention, and CUDA-graph replay.
  for (bool tensor_cores : {false, true}) {
    SCOPED_TRACE(tensor_cores ? "use_tensor_cores" : "decode operator");
    BackendOptions o;
    o.use_tensor_cores = tensor_cores;
    {
      Harness h(shape(), o);
      EXPECT_EQ(h.backend().decode_uses_prefill_kernel(), tensor_cores);
      Request a = h.add_request(1), b = h.add_request(260), c = h.add_request(31);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b, &c}, {1, 1, 1}));
    }
    {
      ModelShape s = shape();
      s.sliding_window = 9;
      s.swa_pool = true;
      Harness h(s, o);
      Request a = h.add_request(50), b = h.add_request(4);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1}));
    }
    {
      ModelShape s = shape();
      s.kv_dtype = DType::fp8_e4m3;
      s.logit_cap = 20.0f;
      Harness h(s, o);
      Request a = h.add_request(90), b = h.add_request(2);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1}));
    }
    {
      ModelShape s = shape();
      s.encoder_decoder = true;
      Harness h(s, o);
      Request a = h.add_request(6, 20), b = h.add_request(1, 3);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b}, {1, 1}));
    }
    {
      Harness h(shape(), o);
      h.backend().init_cuda_graph_state(3, 3);
      std::vector<Request> reqs;
      for (int32_t len : {7, 120, 3, 64, 1, 300}) reqs.push_back(h.add_request(len));
      auto cap = h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1], &reqs[2]}, {1, 1, 1});
      h.backend().init_forward_metadata_capture_cuda_graph(cap);
      h.forward_and_check(cap);
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&reqs[3], &reqs[4], &reqs[5]}, {1, 1, 1}),
                      /*use_graph_state=*/true);
    }
  }
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

TEST_P(BackendTest, GraphCaptureAtEveryBatchSizeThenReplay) {
  // As a model runner does: one graph state, a capture per batch size 1..N (decode and tree
  // verify), then replays of each size with other requests, in a mixed order.
  const int max_bs = 4, drafts = 3;
  Harness h(shape());
  h.backend().init_cuda_graph_state(max_bs, max_bs * drafts);
  std::vector<Request> reqs;
  for (int i = 0; i < 3 * max_bs; ++i) reqs.push_back(h.add_request(h.rng().uniform_int(1, 400)));
  auto batch_of = [&](int bs, int first, ForwardMode mode) {
    std::vector<Request*> ptrs;
    for (int i = 0; i < bs; ++i) ptrs.push_back(&reqs[(first + i) % reqs.size()]);
    const int32_t n = mode == ForwardMode::DECODE ? 1 : drafts;
    return h.make_batch(mode, ptrs, std::vector<int32_t>(bs, n));
  };
  for (ForwardMode mode : {ForwardMode::DECODE, ForwardMode::TARGET_VERIFY}) {
    for (int bs = 1; bs <= max_bs; ++bs) {
      SCOPED_TRACE(::testing::Message() << mode_name(mode) << " capture bs " << bs);
      auto b = batch_of(bs, bs, mode);
      h.backend().init_forward_metadata_capture_cuda_graph(b);
      h.forward_and_check(b);
    }
    for (int bs : {3, 1, 4, 2, 4, 1}) {
      SCOPED_TRACE(::testing::Message() << mode_name(mode) << " replay bs " << bs);
      h.run_and_check(batch_of(bs, h.rng().uniform_int(0, 3 * max_bs - 1), mode), true);
    }
  }
}

// Deterministic mode: a probe request, first in every batch (so its q/k/v rows are the same),
// next to companions drawn at random, in random number and order, from a set of cached requests
// of random lengths: the probe's output rows keep their bits. Every trial's new tokens are
// rolled back, so each trial runs the same positions.
void expect_batch_invariant(Harness& h, ForwardMode mode, int32_t probe_cached, int32_t probe_new,
                            int trials) {
  Request probe = h.add_request(probe_cached);
  std::vector<Request> pool;
  for (int i = 0; i < 12; ++i) pool.push_back(h.add_request(h.rng().uniform_int(1, 250)));
  const uint64_t seed = 4242;
  Tensor first;
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<Request*> ptrs;
    for (auto& r : pool) ptrs.push_back(&r);
    std::shuffle(ptrs.begin(), ptrs.end(), h.rng().gen());
    ptrs.resize(trial == 0 ? 0 : h.rng().uniform_int(1, 4));
    ptrs.insert(ptrs.begin(), &probe);
    std::vector<int32_t> new_lens = {probe_new}, saved;
    for (size_t i = 1; i < ptrs.size(); ++i)
      new_lens.push_back(mode == ForwardMode::DECODE ? 1 : h.rng().uniform_int(1, 24));
    for (Request* r : ptrs) saved.push_back(r->seq_len);
    auto b = h.make_batch(mode, ptrs, new_lens);
    // Every trial compares bits; every 50th also checks the values against the reference.
    auto outs = h.run_and_check(b, false, seed, /*check_reference=*/trial % 50 == 0);
    const size_t bytes = outs[0].view().nbytes() / outs[0].size(0) * probe_new;
    if (trial == 0)
      first = outs[0];
    else
      ASSERT_EQ(0, std::memcmp(first.data(), outs[0].data(), bytes)) << "trial " << trial;
    for (size_t i = 0; i < ptrs.size(); ++i) h.rollback(*ptrs[i], saved[i]);
  }
}

TEST_P(BackendTest, DeterministicDecodeIsBatchInvariant) {
  BackendOptions o;
  o.deterministic = true;
  o.decode_split_size = 64;  // small, so splits happen at these lengths
  ModelShape s = shape();
  s.num_layers = 1;
  Harness h(s, o);
  expect_batch_invariant(h, ForwardMode::DECODE, 300, 1, 2000);
}

TEST_P(BackendTest, DeterministicExtendIsBatchInvariant) {
  // An extend on top of a cached prefix: deterministic mode runs it as one paged pass with the
  // KV cut at fixed multiples.
  BackendOptions o;
  o.deterministic = true;
  o.prefill_split_size = 64;
  ModelShape s = shape();
  s.num_layers = 1;
  Harness h(s, o);
  expect_batch_invariant(h, ForwardMode::EXTEND, 150, 21, 500);
  EXPECT_FALSE(h.backend().uses_ragged());
}

// Attention sinks per layer (gpt-oss style: window layers alternating with full ones, soft cap
// off and on): every mode against the layer reference, which adds each sink once. An extend on
// a cached prefix runs two passes merged into one output; the sink must count once there too.
TEST_P(BackendTest, SinksInEveryMode) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    ModelShape s = shape();
    s.sinks = true;
    if (variant == 1) {
      s.sliding_window = 6;
      s.swa_pool = true;
    }
    if (variant == 2) s.logit_cap = 5.0f;
    for (bool tensor_cores : {false, true}) {
      BackendOptions o;
      o.use_tensor_cores = tensor_cores;
      Harness h(s, o);
      // Extend: one request without a prefix, two on prefixes (ragged + paged, merged).
      Request a = h.add_request(100), b = h.add_request(0), c = h.add_request(33);
      h.run_and_check(h.make_batch(ForwardMode::EXTEND, {&a, &b, &c}, {20, 9, 1}));
      // Extend where no request has a prefix: the ragged pass alone adds the sink.
      Request d = h.add_request(0);
      h.run_and_check(h.make_batch(ForwardMode::EXTEND, {&d}, {13}));
      h.run_and_check(h.make_batch(ForwardMode::DECODE, {&a, &b, &c, &d}, {1, 1, 1, 1}));
      h.run_and_check(h.make_batch(ForwardMode::TARGET_VERIFY, {&a, &b}, {4, 4}));
      h.run_and_check(h.make_batch(ForwardMode::DRAFT_EXTEND, {&c, &d}, {3, 1}));
    }
    // One paged pass over everything (multimodal): the sink in that single pass.
    BackendOptions mm;
    mm.is_multimodal = true;
    Harness h(s, mm);
    Request a = h.add_request(50), b = h.add_request(0);
    h.run_and_check(h.make_batch(ForwardMode::EXTEND, {&a, &b}, {7, 11}));
  }
}

// LayerSpec::sinks of the wrong dtype or shape: a flashkv::Error naming sinks, and the pool is
// left as it was.
TEST_P(BackendTest, SinksBadInput) {
  Harness h(shape());
  Request a = h.add_request(20);
  auto b = h.make_batch(ForwardMode::DECODE, {&a}, {1});
  h.backend().init_forward_metadata(b);
  const PoolSnapshot before = h.snapshot();
  Harness::LayerInputs in = h.layer_inputs(1);
  const int hq = h.shape().hq;
  for (int bad = 0; bad < 2; ++bad) {
    Tensor sinks =
        Tensor::empty({bad == 0 ? hq : hq + 1}, bad == 0 ? DType::f16 : DType::f32, GetParam());
    LayerSpec l = h.layer(0);
    l.sinks = sinks;
    const std::string e =
        error_of([&] { h.backend().forward(in.q, in.k, in.v, l, b, true, in.out); });
    EXPECT_NE(e.find("sinks"), std::string::npos) << e;
  }
  h.expect_unchanged(before);
}

INSTANTIATE_TEST_SUITE_P(Devices, BackendTest, ::testing::ValuesIn(backend_test_devices()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda"; });

// Awkward sizes: GQA groups 1, 4, 8; head dims 64, 128, 256; pages of 1 and 16 tokens handed out
// in a shuffled order; decode through both kernels.
class BackendShapeTest : public ::testing::TestWithParam<std::tuple<Device, int, int, int>> {};

TEST_P(BackendShapeTest, ExtendThenDecode) {
  const auto [device, group, head_dim, page_size] = GetParam();
  ModelShape s;
  s.device = device;
  s.num_layers = 1;
  s.hkv = 2;
  s.hq = 2 * group;
  s.head_dim = head_dim;
  s.page_size = page_size;
  s.shuffle_pages = true;
  s.slots = 2048;
  for (bool tensor_cores : {false, true}) {
    SCOPED_TRACE(tensor_cores ? "decode through the prefill kernel" : "decode operator");
    BackendOptions o;
    o.use_tensor_cores = tensor_cores;
    Harness h(s, o);
    extend_then_decode(h, {0, 37, 130}, {17, 5, 1});
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BackendShapeTest,
                         ::testing::Combine(::testing::ValuesIn(backend_test_devices()),
                                            ::testing::Values(1, 4, 8),
                                            ::testing::Values(64, 128, 256),
                                            ::testing::Values(1, 16)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).is_cpu() ? "cpu" : "cuda") +
                                  "_group" + std::to_string(std::get<1>(info.param)) + "_d" +
                                  std::to_string(std::get<2>(info.param)) + "_page" +
                                  std::to_string(std::get<3>(info.param));
                         });

}  // namespace
}  // namespace flashkv::test
