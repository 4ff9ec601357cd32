// Devices, streams and what the planner needs to know about a device.
#pragma once

#include <cstddef>
#include <string>

namespace flashkv {

enum class DeviceKind : unsigned char { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  std::string str() const;  // "cpu" or "cuda:N"
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
// "cpu", "cuda", "cuda:N" -> Device; anything else throws flashkv::Error.
Device parse_device(const std::string& s);

// A CUDA stream handle (cudaStream_t) or null for the default stream; ignored on the CPU.
struct Stream {
  void* handle = nullptr;
};

// True when this build has CUDA and the process sees at least one GPU.
bool cuda_available();
int cuda_device_count();  // 0 without CUDA or without a GPU
bool built_with_cuda();

// What the planner and the benchmarks need to know about a device.
struct DeviceInfo {
  Device device;
  std::string name;
  int num_sms = 0;             // CUDA: multiprocessors; CPU: 0
  int num_threads = 0;         // CPU: worker threads of the global pool; CUDA: 0
  size_t memory_bytes = 0;     // CUDA: global memory; CPU: 0
  int compute_capability = 0;  // CUDA: major*10+minor
};
// Throws flashkv::Error for a CUDA device when CUDA is unavailable or the index is out of range.
DeviceInfo device_info(Device d);

// Byte copies between any two devices, ordered on `stream` when either side is CUDA (the host
// side must then stay alive until the stream reaches the copy).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                Stream stream = {});
void fill_bytes(void* dst, Device device, int value, size_t bytes, Stream stream = {});
// Waits for all work on `stream` (no-op on the CPU).
void synchronize(Device device, Stream stream = {});

}  // namespace flashkv
