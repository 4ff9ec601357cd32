// CPU attention: the schedule and the run-time ISA choice. Every (work item, KV head) pair of the
// plan is one task on the global thread pool, handed out dynamically; split items write partial
// states that a second pass merges. The math lives in cpu/attention_kernel.h, compiled once per
// ISA (cpu/attention_<isa>.cpp); this file is built for plain x86-64 and only calls into a wider
// ISA after checking that the CPU has it.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "flashkv/core/cpu_features.h"
#include "flashkv/core/error.h"
#include "flashkv/core/options.h"
#include "flashkv/core/thread_pool.h"
#include "kernel_common.h"

namespace flashkv::cpu {
namespace {

Isa detect_isa() {
  const CpuFeatures& f = cpu_features();
  if (!f.avx2 || !f.fma || !f.f16c) return Isa::scalar;
  if (!f.avx512f || !f.avx512dq || !f.avx512bw || !f.avx512vl) return Isa::avx2;
  return f.avx512bf16 ? Isa::avx512_bf16 : Isa::avx512;
}

Isa isa_from_env() {
  const char* cap = env_cpu_isa_cap();  // checked: one of the names below, or null
  if (!cap) return Isa::avx512_bf16;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (std::strcmp(cap, isa_name(isa)) == 0) return isa;
  return Isa::avx512_bf16;
}

// The cap set_isa_cap() sets (the environment variable is read on every call, so it can change).
std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{static_cast<int>(Isa::avx512_bf16)};
  return cap;
}

ItemKernel select_item_kernel(Isa isa, DType kv_dtype) {
#if FLASHKV_CPU_X86
  if (isa == Isa::avx512_bf16 && (kv_dtype == DType::bf16 || is_fp8(kv_dtype)))
    return avx512bf16::item_kernel(kv_dtype);
  if (isa >= Isa::avx512) return avx512::item_kernel(kv_dtype);
  if (isa == Isa::avx2) return avx2::item_kernel(kv_dtype);
#endif
  return scalar::item_kernel(kv_dtype);
}

PartialMergeKernel select_partial_merge(Isa isa) {
#if FLASHKV_CPU_X86
  if (isa >= Isa::avx512) return &avx512::merge_partials;
  if (isa == Isa::avx2) return &avx2::merge_partials;
#endif
  return &scalar::merge_partials;
}

MergeRowKernel select_merge_row(Isa isa) {
#if FLASHKV_CPU_X86
  if (isa >= Isa::avx512) return &avx512::merge_row;
  if (isa == Isa::avx2) return &avx2::merge_row;
#endif
  return &scalar::merge_row;
}

Fp8Tables build_fp8_tables() {
  Fp8Tables t;
  for (int b = 0; b < 256; ++b) {
    const float e4m3 = to_float(fp8_e4m3_t{static_cast<uint8_t>(b)});
    const float e5m2 = to_float(fp8_e5m2_t{static_cast<uint8_t>(b)});
    t.f32[0][b] = e4m3;
    t.f32[1][b] = e5m2;
    t.bf16[0][b] = to_bf16(e4m3).bits;  // exact: every fp8 value is a bf16 value
    t.bf16[1][b] = to_bf16(e5m2).bits;
  }
  for (int f = 0; f < 2; ++f)
    for (int m = 0; m < 128; ++m) {
      t.bf16_lo[f][m] = static_cast<uint8_t>(t.bf16[f][m] & 0xff);
      t.bf16_hi[f][m] = static_cast<uint8_t>(t.bf16[f][m] >> 8);
    }
  return t;
}

// KV heads per task. A task of few rows per head (decode) is bound by memory, and reading all
// heads of a slot together turns the per-head pieces (D elements at a stride of Hkv * D) into
// contiguous runs; so such tasks take as many heads as still leave 4 tasks per thread, up to
// runs of 2 KB per slot: the few-rows path prefetches two 32-slot blocks ahead, so longer runs
// make a window that no longer fits beside the current block in a 1 MB L2 (figures:
// docs/perf/cpu.md, the 2 KB cap on a task's heads). Tasks of many rows are
// bound by compute and take one head (the most parallelism, the smallest state).
int32_t heads_per_task(const AttentionParams& p, int threads) {
  constexpr int kMemoryBoundRows = 16;
  constexpr int64_t kMaxRunBytes = 2048;
  const int group = p.num_qo_heads / p.num_kv_heads;
  int32_t max_q_len = 0;
  for (int32_t i = 0; i < p.num_items; ++i) max_q_len = std::max(max_q_len, p.items[i].q_len);
  if (int64_t{max_q_len} * group > kMemoryBoundRows) return 1;
  const int64_t head_bytes =
      int64_t{std::max(p.head_dim_qk, p.head_dim_v)} * static_cast<int64_t>(dtype_size(p.kv_dtype));
  for (int32_t heads = p.num_kv_heads; heads > 1; --heads)
    if (p.num_kv_heads % heads == 0 && heads * head_bytes <= kMaxRunBytes &&
        int64_t{p.num_items} * (p.num_kv_heads / heads) >= 4 * int64_t{threads})
      return heads;
  return 1;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::avx512_bf16:
      return "avx512_bf16";
  }
  return "?";
}

Isa detected_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

Isa active_isa() {
  const Isa cap = static_cast<Isa>(isa_cap().load(std::memory_order_relaxed));
  return std::min({detected_isa(), cap, isa_from_env()});
}

Isa set_isa_cap(Isa cap) {
  FLASHKV_CHECK(cap >= Isa::scalar && cap <= Isa::avx512_bf16,
                "set_isa_cap: cap: expected scalar, avx2, avx512 or avx512_bf16, got ",
                static_cast<int>(cap));
  return static_cast<Isa>(isa_cap().exchange(static_cast<int>(cap)));
}

namespace {
std::atomic<int>& prefetch_mode() {
  static std::atomic<int> mode{static_cast<int>(Prefetch::by_cpu)};
  return mode;
}
}  // namespace

bool split_prefetch() {
  const auto mode = static_cast<Prefetch>(prefetch_mode().load(std::memory_order_relaxed));
  if (mode != Prefetch::by_cpu) return mode == Prefetch::on;
  if (const std::optional<bool> on = env_cpu_prefetch()) return *on;
  return split_prefetch_default(cpu_features());
}

bool split_prefetch_default(const CpuFeatures& cpu) {
  if (!cpu.amd) return true;
  // Family 0x17: Zen and Zen 2 (taken to be like Zen 3). Family 0x19: Zen 3 is
  // models 0x00 - 0x0f and 0x20 - 0x5f, Zen 4 the rest. Later families: like Zen 4.
  const bool zen3 =
      cpu.family == 0x19 && (cpu.model < 0x10 || (cpu.model >= 0x20 && cpu.model < 0x60));
  return !(cpu.family < 0x19 || zen3);
}

Prefetch set_split_prefetch(Prefetch mode) {
  FLASHKV_CHECK(mode >= Prefetch::by_cpu && mode <= Prefetch::on,
                "set_split_prefetch: mode: expected by_cpu, off or on, got ",
                static_cast<int>(mode));
  return static_cast<Prefetch>(prefetch_mode().exchange(static_cast<int>(mode)));
}

namespace {
std::atomic<bool>& fp8_vbmi_setting() {
  static std::atomic<bool> enabled{true};
  return enabled;
}
}  // namespace

bool fp8_vbmi() {
  return cpu_features().avx512vbmi && fp8_vbmi_setting().load(std::memory_order_relaxed);
}

bool set_fp8_vbmi(bool enabled) { return fp8_vbmi_setting().exchange(enabled); }

void* thread_scratch(size_t bytes) {
  thread_local std::unique_ptr<void, FreeDeleter> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    capacity = std::max(bytes, capacity * 2);
    capacity = (capacity + 63) / 64 * 64;
    buffer.reset(std::aligned_alloc(64, capacity));
    FLASHKV_CHECK(buffer != nullptr, "cpu attention: out of memory for ", capacity,
                  " bytes of scratch");
  }
  return buffer.get();
}

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = build_fp8_tables();
  return tables;
}

void attention(const AttentionParams& p) {
  const Isa isa = active_isa();
  const ItemKernel kernel = select_item_kernel(isa, p.kv_dtype);
  FLASHKV_CHECK(kernel != nullptr, "cpu attention: no kernel for KV dtype ",
                dtype_name(p.kv_dtype));
  ThreadPool& pool = ThreadPool::global();
  const int32_t group = heads_per_task(p, pool.size());
  const int64_t groups = p.num_kv_heads / group;
  // Head-major order: the tasks a thread takes one after another read the same KV head, whose
  // K/V then stays in its caches (prefill re-reads a head's keys for every query tile).
  const int64_t items = p.num_items;
  TaskOptions options;
  options.split_prefetch = split_prefetch();  // here, not per task: it reads the environment
  options.fp8_vbmi = fp8_vbmi();
  pool.parallel_for(items * groups, [&](int64_t t, int) {
    kernel(p, p.items[t % items], static_cast<int32_t>(t / items) * group, group, options);
  });
  if (p.num_merges == 0) return;
  const PartialMergeKernel merge_partials = select_partial_merge(isa);
  pool.parallel_for(p.num_merges, [&](int64_t i, int) {
    const MergeItem& m = p.merges[i];
    for (int32_t row = 0; row < m.q_len; ++row) merge_partials(p, m, row);
  });
}

void merge(const MergeParams& p) {
  const MergeRowKernel merge_row = select_merge_row(active_isa());
  ThreadPool::global().parallel_for(p.rows, [&](int64_t row, int) { merge_row(p, row); });
}

}  // namespace flashkv::cpu
