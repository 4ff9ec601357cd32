// FlashKVBackend under a real CUDA graph: metadata planned for the capture batch, every layer's
// forward captured once on the backend's stream, then replayed for other batches of the same
// size after init_forward_metadata_replay_cuda_graph refreshed the plans and index buffers.
#include <gtest/gtest.h>

#include "backend_harness.h"

#if FLASHKV_WITH_CUDA
#include <cuda_runtime_api.h>

namespace flashkv::test {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

TEST(CudaBackendGraph, CaptureOnceReplayOtherBatches) {
  FLASHKV_REQUIRE_GPU();
  for (ForwardMode mode : {ForwardMode::DECODE, ForwardMode::TARGET_VERIFY}) {
    SCOPED_TRACE(mode_name(mode));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    ModelShape s;
    s.device = Device::cuda(0);
    s.num_layers = 2;
    BackendOptions o;
    o.stream = Stream{stream};
    Harness h(s, o);
    const int bs = 3, per_req = mode == ForwardMode::DECODE ? 1 : 4, T = bs * per_req;
    h.backend().init_cuda_graph_state(bs, T);
    std::vector<Request> reqs;
    for (int32_t len : {5, 90, 33, 1, 700, 64, 17, 300, 2}) reqs.push_back(h.add_request(len));
    // What the graph reads and writes lives at fixed addresses; each batch is copied in.
    Tensor rpi = Tensor::empty({bs}, DType::i32, s.device),
           loc = Tensor::empty({T}, DType::i32, s.device);
    Tensor mask = Tensor::empty({int64_t{T} * 1024}, DType::u8, s.device);
    Tensor q = Tensor::empty({T, s.hq, s.head_dim}, s.dtype, s.device);
    Tensor k = Tensor::empty({T, s.hkv, s.head_dim}, s.dtype, s.device);
    Tensor v = Tensor::empty({T, s.hkv, s.head_dim}, s.dtype, s.device);
    std::vector<Tensor> outs;
    for (int l = 0; l < s.num_layers; ++l)
      outs.push_back(Tensor::empty({T, int64_t{s.hq} * s.head_dim}, s.dtype, s.device));
    auto fix = [&](ForwardBatch b) {
      copy_bytes(rpi.data(), s.device, b.req_pool_indices.data, s.device, bs * 4);
      copy_bytes(loc.data(), s.device, b.out_cache_loc.data, s.device, T * 4);
      b.req_pool_indices = rpi;
      b.out_cache_loc = loc;
      if (mode == ForwardMode::TARGET_VERIFY) {
        copy_bytes(mask.data(), s.device, b.spec.custom_mask.data, s.device,
                   b.spec.custom_mask.numel());
        b.spec.custom_mask = mask;
      }
      return b;
    };
    cudaGraphExec_t exec = nullptr;
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(::testing::Message() << "round " << round);
      std::vector<Request*> batch_reqs = {&reqs[3 * round], &reqs[3 * round + 1],
                                          &reqs[3 * round + 2]};
      ForwardBatch b = fix(h.make_batch(mode, batch_reqs, std::vector<int32_t>(bs, per_req)));
      if (round == 0)
        h.backend().init_forward_metadata_capture_cuda_graph(b);
      else
        h.backend().init_forward_metadata_replay_cuda_graph(b);
      // Fresh activations in the fixed buffers (one q/k/v for all layers).
      Tensor q_host = random_tensor(h.rng(), {T, s.hq, s.head_dim}, s.dtype);
      q.copy_from(q_host);
      k.copy_from(random_tensor(h.rng(), {T, s.hkv, s.head_dim}, s.dtype));
      v.copy_from(random_tensor(h.rng(), {T, s.hkv, s.head_dim}, s.dtype));
      CUDA_OK(cudaDeviceSynchronize());
      if (round == 0) {
        cudaGraph_t graph;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < s.num_layers; ++l)
          h.backend().forward(q, k, v, h.layer(l), b, true, outs[l]);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
      for (Tensor& out : outs)
        fill_bytes(out.data(), s.device, 0xff, out.view().nbytes(), Stream{stream});
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      for (int l = 0; l < s.num_layers; ++l) h.check_layer(b, l, q_host, outs[l]);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace flashkv::test
#endif  // FLASHKV_WITH_CUDA
