// FlashKVBackend under real CUDA graphs, as SGLang's CUDA-graph runner uses it: one backend
// whose graph state holds fixed buffers; a graph captured per batch size 1..N (metadata planned
// for the capture batch, every layer's forward captured on the backend's stream); then each
// graph replayed for other batches of its size after init_forward_metadata_replay_cuda_graph
// refreshed the plans and index buffers. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <optional>

#include "backend_harness.h"

#if FLASHKV_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda_capture.h"

namespace flashkv::test {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

struct GraphCase {
  const char* name;
  ForwardMode mode;
  std::optional<bool> use_tensor_cores;
};

TEST(CudaBackendGraph, CaptureEveryBatchSizeReplayOtherBatches) {
  FLASHKV_REQUIRE_GPU();
  const GraphCase cases[] = {
      {"decode", ForwardMode::DECODE, std::nullopt},
      {"decode through the prefill kernel", ForwardMode::DECODE, true},
      {"tree verify", ForwardMode::TARGET_VERIFY, std::nullopt},
  };
  for (const GraphCase& gc : cases) {
    SCOPED_TRACE(gc.name);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    ModelShape s;
    s.device = Device::cuda(0);
    s.num_layers = 2;
    BackendOptions o;
    o.stream = Stream{stream};
    o.use_tensor_cores = gc.use_tensor_cores;
    Harness h(s, o);
    const int max_bs = 3, per_req = gc.mode == ForwardMode::DECODE ? 1 : 4;
    const int max_tokens = max_bs * per_req;
    h.backend().init_cuda_graph_state(max_bs, max_tokens);
    std::vector<Request> reqs;
    for (int i = 0; i < 12; ++i) reqs.push_back(h.add_request(h.rng().uniform_int(1, 700)));
    // What the graphs read and write lives at fixed addresses; each batch is copied in, and a
    // graph of bs requests uses the first rows.
    Tensor rpi = Tensor::empty({max_bs}, DType::i32, s.device);
    Tensor loc = Tensor::empty({max_tokens}, DType::i32, s.device);
    Tensor mask = Tensor::empty({int64_t{max_tokens} * s.max_context}, DType::u8, s.device);
    Tensor q = Tensor::empty({max_tokens, s.hq, s.head_dim}, s.dtype, s.device);
    Tensor k = Tensor::empty({max_tokens, s.hkv, s.head_dim}, s.dtype, s.device);
    Tensor v = Tensor::empty({max_tokens, s.hkv, s.head_dim}, s.dtype, s.device);
    std::vector<Tensor> outs;
    for (int l = 0; l < s.num_layers; ++l)
      outs.push_back(Tensor::empty({max_tokens, int64_t{s.hq} * s.head_dim}, s.dtype, s.device));
    std::vector<cudaGraphExec_t> graphs(max_bs + 1, nullptr);

    auto run = [&](int bs, bool capture) {
      SCOPED_TRACE(::testing::Message() << (capture ? "capture" : "replay") << " bs " << bs);
      const int T = bs * per_req;
      std::vector<int> pick(reqs.size());
      std::iota(pick.begin(), pick.end(), 0);
      std::shuffle(pick.begin(), pick.end(), h.rng().gen());
      std::vector<Request*> batch_reqs;
      for (int i = 0; i < bs; ++i) batch_reqs.push_back(&reqs[pick[i]]);
      ForwardBatch b = h.make_batch(gc.mode, batch_reqs, std::vector<int32_t>(bs, per_req));
      copy_bytes(rpi.data(), s.device, b.req_pool_indices.data, s.device, bs * sizeof(int32_t));
      copy_bytes(loc.data(), s.device, b.out_cache_loc.data, s.device, T * sizeof(int32_t));
      b.req_pool_indices = rpi.view().rows(0, bs);
      b.out_cache_loc = loc.view().rows(0, T);
      if (gc.mode == ForwardMode::TARGET_VERIFY) {
        ASSERT_LE(b.spec.custom_mask.numel(), mask.numel());
        copy_bytes(mask.data(), s.device, b.spec.custom_mask.data, s.device,
                   b.spec.custom_mask.numel());
        b.spec.custom_mask = mask;
      }
      if (capture)
        h.backend().init_forward_metadata_capture_cuda_graph(b);
      else
        h.backend().init_forward_metadata_replay_cuda_graph(b);
      // Fresh activations in the fixed buffers (one q/k/v for all layers).
      const Tensor q_host = random_tensor(h.rng(), {T, s.hq, s.head_dim}, s.dtype);
      const Tensor k_host = random_tensor(h.rng(), {T, s.hkv, s.head_dim}, s.dtype);
      const Tensor v_host = random_tensor(h.rng(), {T, s.hkv, s.head_dim}, s.dtype);
      copy_bytes(q.data(), s.device, q_host.data(), Device::cpu(), q_host.view().nbytes());
      copy_bytes(k.data(), s.device, k_host.data(), Device::cpu(), k_host.view().nbytes());
      copy_bytes(v.data(), s.device, v_host.data(), Device::cpu(), v_host.view().nbytes());
      CUDA_OK(cudaDeviceSynchronize());
      if (capture) {
        cudaGraph_t graph = test::capture_graph(stream, [&] {
          for (int l = 0; l < s.num_layers; ++l)
            h.backend().forward(q.view().rows(0, T), k.view().rows(0, T), v.view().rows(0, T),
                                h.layer(l), b, true, outs[l].view().rows(0, T));
        });
        ASSERT_NE(graph, nullptr);
        CUDA_OK(cudaGraphInstantiate(&graphs[bs], graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
      for (Tensor& out : outs)
        fill_bytes(out.data(), s.device, 0xff, out.view().nbytes(), Stream{stream});
      CUDA_OK(cudaGraphLaunch(graphs[bs], stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      for (int l = 0; l < s.num_layers; ++l) h.check_layer(b, l, q_host, outs[l].view().rows(0, T));
    };
    for (int bs = 1; bs <= max_bs && !HasFatalFailure(); ++bs) run(bs, true);
    for (int bs : {2, 1, 3, 3, 1, 2})
      if (!HasFatalFailure()) run(bs, false);
    for (cudaGraphExec_t g : graphs)
      if (g) CUDA_OK(cudaGraphExecDestroy(g));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// A forward that rejects its arguments while a graph is being captured (as a model runner's
// capture of a wrongly sized batch would): the error is a flashkv::Error, the capture is ended
// with it, and the same thread can synchronize, capture and replay the pass afterwards.
TEST(CudaBackendGraph, ARejectedForwardInsideACaptureLeavesTheThreadUsable) {
  FLASHKV_REQUIRE_GPU();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  ModelShape s;
  s.device = Device::cuda(0);
  s.num_layers = 1;
  BackendOptions o;
  o.stream = Stream{stream};
  Harness h(s, o);
  h.backend().init_cuda_graph_state(2, 2);
  std::vector<Request> reqs = {h.add_request(300), h.add_request(41)};
  ForwardBatch b = h.make_batch(ForwardMode::DECODE, {&reqs[0], &reqs[1]}, {1, 1});
  h.backend().init_forward_metadata_capture_cuda_graph(b);
  const Tensor q_host = random_tensor(h.rng(), {2, s.hq, s.head_dim}, s.dtype);
  const Tensor k_host = random_tensor(h.rng(), {2, s.hkv, s.head_dim}, s.dtype);
  const Tensor v_host = random_tensor(h.rng(), {2, s.hkv, s.head_dim}, s.dtype);
  Tensor q = Tensor::empty({2, s.hq, s.head_dim}, s.dtype, s.device);
  Tensor k = Tensor::empty({2, s.hkv, s.head_dim}, s.dtype, s.device);
  Tensor v = Tensor::empty({2, s.hkv, s.head_dim}, s.dtype, s.device);
  q.copy_from(q_host);
  k.copy_from(k_host);
  v.copy_from(v_host);
  Tensor out = Tensor::empty({2, int64_t{s.hq} * s.head_dim}, s.dtype, s.device);
  Tensor narrow = Tensor::empty({2, int64_t{s.hq} * s.head_dim - 8}, s.dtype, s.device);
  CUDA_OK(cudaDeviceSynchronize());
  const std::string error = error_of([&] {
    (void)capture_graph(stream,
                        [&] { h.backend().forward(q, k, v, h.layer(0), b, true, narrow.view()); });
  });
  EXPECT_NE(error.find("out"), std::string::npos) << error;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CUDA_OK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  CUDA_OK(
      cudaDeviceSynchronize());  // cudaErrorStreamCaptureUnsupported had the capture stayed open
  cudaGraph_t graph =
      capture_graph(stream, [&] { h.backend().forward(q, k, v, h.layer(0), b, true, out.view()); });
  ASSERT_NE(graph, nullptr);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  h.check_layer(b, 0, q_host, out);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace flashkv::test
#endif  // FLASHKV_WITH_CUDA
