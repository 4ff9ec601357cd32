#include "copy.h"

#include <cstring>

#if FLASHKV_WITH_CUDA
#include <cuda_runtime.h>

#include "flashkv/core/cuda_runtime.h"
#endif

namespace flashkv::parallel::detail {

void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Device device, Stream stream) {
  if (width == 0 || height == 0) return;
  if (device.is_cpu()) {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                  width);
    return;
  }
#if FLASHKV_WITH_CUDA
  flashkv::detail::cuda_set_device(device);
  flashkv::detail::cuda_check(
      cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice,
                        static_cast<cudaStream_t>(stream.handle)),
      "cudaMemcpy2DAsync (context parallelism)");
#else
  (void)stream;
  throw_error("context parallelism: a CUDA device in a build without CUDA");
#endif
}

void* reserve(std::vector<Buffer>& bufs, size_t i, size_t bytes, Device device) {
  if (bufs.size() <= i) bufs.resize(i + 1);
  bytes = bytes < 64 ? 64 : bytes;  // never a null buffer, even for empty views
  if (bufs[i].bytes() < bytes || bufs[i].device() != device) {
    bufs[i] = Buffer();
    bufs[i] = Buffer(bytes, device);
  }
  return bufs[i].data();
}

TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  return TensorView(data, dtype, shape, device);
}

}  // namespace flashkv::parallel::detail
