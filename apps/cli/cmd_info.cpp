#include <cstdio>

#include "args.h"
#include "commands.h"
#include "flashkv/core/cpu_features.h"
#include "flashkv/core/device.h"

namespace flashkv::app {
namespace {

void print_cpu_features() {
  // The same detection the CPU kernels are chosen by (cpuid + xgetbv, not compiler builtins).
  const CpuFeatures& f = cpu_features();
  std::printf("cpu: %sfamily %d, model %d\n", f.amd ? "AMD, " : "", f.family, f.model);
  std::printf("cpu features:");
  if (f.avx2) std::printf(" avx2");
  if (f.fma) std::printf(" fma");
  if (f.f16c) std::printf(" f16c");
  if (f.avx512f) std::printf(" avx512f");
  if (f.avx512dq) std::printf(" avx512dq");
  if (f.avx512bw) std::printf(" avx512bw");
  if (f.avx512vl) std::printf(" avx512vl");
  if (f.avx512bf16) std::printf(" avx512bf16");
  if (f.avx512vbmi) std::printf(" avx512vbmi");
  std::printf("\n");
}

}  // namespace

int cmd_info(int argc, char** argv) {
  Args args(argc, argv, 2, "info", "Describes this build of flashkv and the devices it sees.", {});
  const DeviceInfo cpu = device_info(Device::cpu());
  std::printf("flashkv %s\n", FLASHKV_VERSION);
  std::printf("cuda kernels: %s\n", built_with_cuda() ? "built" : "not built");
  std::printf("cpu threads: %d\n", cpu.num_threads);
  print_cpu_features();
  const int gpus = cuda_device_count();
  std::printf("gpus: %d\n", gpus);
  for (int i = 0; i < gpus; ++i) {
    const DeviceInfo g = device_info(Device::cuda(i));
    std::printf("  cuda:%d %s, %d SMs, sm_%d, %.1f GiB\n", i, g.name.c_str(), g.num_sms,
                g.compute_capability, g.memory_bytes / double(1 << 30));
  }
  return 0;
}

}  // namespace flashkv::app
