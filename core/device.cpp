#include "flashkv/core/device.h"

#include <cstring>
#include <string>

#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/core/thread_pool.h"

#if FLASHKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashkv {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s == "gpu") return Device::cuda(0);
  // At most 9 digits: every such index fits an int (std::stoi would throw a std::out_of_range,
  // not a flashkv::Error, past that).
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 14 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos) {
    return Device::cuda(std::stoi(s.substr(5)));
  }
  throw_error(str_cat("device: expected cpu, cuda or cuda:N, got '", s, "'"));
}

bool built_with_cuda() { return FLASHKV_WITH_CUDA != 0; }

#if FLASHKV_WITH_CUDA

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

namespace detail {
void cuda_check(int status, const char* what) {
  if (status != cudaSuccess) {
    const auto err = static_cast<cudaError_t>(status);
    throw_error(
        str_cat(what, ": CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
  }
}
void cuda_set_device(Device device) {
  FLASHKV_CHECK(device.is_cuda(), "cuda_set_device: ", device.str(), " is not a CUDA device");
  const int n = cuda_device_count();
  FLASHKV_CHECK(n > 0, "device ", device.str(), ": no GPU is visible to this process");
  FLASHKV_CHECK(device.index >= 0 && device.index < n, "device: expected cuda:0..cuda:", n - 1,
                ", got ", device.str());
  cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
}
void* cuda_malloc(size_t bytes, Device device) {
  cuda_set_device(device);
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}
void cuda_free(void* p, Device device) noexcept {
  if (cudaSetDevice(device.index) == cudaSuccess) cudaFree(p);
}
}  // namespace detail

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                Stream stream) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  detail::cuda_set_device(dst_device.is_cuda() ? dst_device : src_device);
  const cudaMemcpyKind kind = dst_device.is_cpu()   ? cudaMemcpyDeviceToHost
                              : src_device.is_cpu() ? cudaMemcpyHostToDevice
                                                    : cudaMemcpyDeviceToDevice;
  detail::cuda_check(
      cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream.handle)),
      "copy_bytes");
  if (kind == cudaMemcpyDeviceToHost) synchronize(src_device, stream);
}

void fill_bytes(void* dst, Device device, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(dst, value, bytes);
    return;
  }
  detail::cuda_set_device(device);
  detail::cuda_check(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream.handle)),
                     "fill_bytes");
}

void synchronize(Device device, Stream stream) {
  if (device.is_cpu()) return;
  detail::cuda_set_device(device);
  detail::cuda_check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)),
                     "cudaStreamSynchronize");
}

DeviceInfo device_info(Device d) {
  DeviceInfo info;
  info.device = d;
  if (d.is_cpu()) {
    info.name = "cpu";
    info.num_threads = ThreadPool::global().size();
    return info;
  }
  detail::cuda_set_device(d);
  cudaDeviceProp prop{};
  detail::cuda_check(cudaGetDeviceProperties(&prop, d.index), "cudaGetDeviceProperties");
  info.name = prop.name;
  info.num_sms = prop.multiProcessorCount;
  info.memory_bytes = prop.totalGlobalMem;
  info.compute_capability = prop.major * 10 + prop.minor;
  return info;
}

#else  // !FLASHKV_WITH_CUDA

int cuda_device_count() { return 0; }

namespace detail {
[[noreturn]] static void no_cuda(const char* what) {
  throw_error(
      str_cat(what, ": this flashkv was built without CUDA (configure with FLASHKV_CUDA=ON)"));
}
void cuda_check(int status, const char* what) {
  if (status != 0) no_cuda(what);
}
void cuda_set_device(Device) { no_cuda("cuda_set_device"); }
void* cuda_malloc(size_t, Device) { no_cuda("cuda_malloc"); }
void cuda_free(void*, Device) noexcept {}
}  // namespace detail

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                Stream) {
  if (bytes == 0) return;
  if (!dst_device.is_cpu() || !src_device.is_cpu()) detail::no_cuda("copy_bytes");
  std::memcpy(dst, src, bytes);
}

void fill_bytes(void* dst, Device device, int value, size_t bytes, Stream) {
  if (bytes == 0) return;
  if (!device.is_cpu()) detail::no_cuda("fill_bytes");
  std::memset(dst, value, bytes);
}

void synchronize(Device device, Stream) {
  if (!device.is_cpu()) detail::no_cuda("synchronize");
}

DeviceInfo device_info(Device d) {
  if (d.is_cuda()) detail::no_cuda("device_info");
  DeviceInfo info;
  info.device = d;
  info.name = "cpu";
  info.num_threads = ThreadPool::global().size();
  return info;
}

#endif

bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace flashkv
