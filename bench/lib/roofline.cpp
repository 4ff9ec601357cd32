// CPU roofline: streaming read and copy bandwidth over a buffer several times the last-level
// cache, and the rate of a register-blocked bf16 (or fp32) matrix-product micro-kernel, all run
// on every thread of the global pool. CUDA devices are measured in roofline_cuda.cu.
#include "roofline.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/core/cpu_features.h"
#include "flashkv/core/error.h"
#include "flashkv/core/thread_pool.h"
#include "roofline_cuda.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define FLASHKV_BENCH_X86 1
#else
#define FLASHKV_BENCH_X86 0
#endif

namespace flashkv::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- machine facts ------------------------------------------------------------------------

// "model name" of /proc/cpuinfo with the family and model numbers, which tell CPU generations
// apart when the name does not (e.g. "AMD EPYC (family 25, model 17)").
std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "cpu", family, model;
  auto value = [&line] {
    const size_t colon = line.find(':');
    const size_t b = colon == std::string::npos ? colon : line.find_first_not_of(" \t", colon + 1);
    return b == std::string::npos ? std::string() : line.substr(b);
  };
  while (std::getline(in, line) && !line.empty()) {  // the first processor's block
    if (line.rfind("model name", 0) == 0)
      name = value();
    else if (line.rfind("cpu family", 0) == 0)
      family = value();
    else if (line.rfind("model", 0) == 0 && line.find(':') < 10)
      model = value();
  }
  if (!family.empty() && !model.empty())
    name += str_cat(" (family ", family, ", model ", model, ")");
  return name;
}

// Size of the largest cache level (bytes); sysfs first (what the kernel was told), then libc.
size_t last_level_cache_bytes() {
  size_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string s;
    if (!(in >> s) || s.empty()) continue;
    size_t v = std::strtoull(s.c_str(), nullptr, 10);
    if (s.back() == 'K') v <<= 10;
    if (s.back() == 'M') v <<= 20;
    best = std::max(best, v);
  }
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (best == 0) {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) best = static_cast<size_t>(l3);
  }
#endif
  return best ? best : size_t{32} << 20;
}

// ---- bandwidth ------------------------------------------------------------------------------

constexpr size_t kChunkBytes = size_t{2} << 20;  // unit of work handed to a thread
std::atomic<uint64_t> g_read_sink{0};

uint64_t read_portable(const char* p, size_t bytes) {
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t s[8] = {};
  for (size_t i = 0; i < bytes / 8; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += w[i + j];
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

#if FLASHKV_BENCH_X86
__attribute__((target("avx512f"))) uint64_t read_avx512(const char* p, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  // Fold with XOR: the result only has to depend on every byte read, and the header's signed
  // horizontal add could overflow.
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t r = 0;
  for (uint64_t x : lanes) r ^= x;
  return r;
}

// Non-temporal stores: the destination is not read first, so the bytes moved are what counts.
__attribute__((target("avx512f"))) void copy_avx512(char* dst, const char* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 256) {
    const __m512i x0 = _mm512_load_si512(src + i), x1 = _mm512_load_si512(src + i + 64);
    const __m512i x2 = _mm512_load_si512(src + i + 128), x3 = _mm512_load_si512(src + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), x0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), x1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), x2);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), x3);
  }
  _mm_sfence();
}
#endif

bool has_avx512f() { return FLASHKV_BENCH_X86 && cpu_features().avx512f; }

// Fastest of `repeats` passes of fn(chunk) over all chunks, in bytes per second times `scale`.
template <typename Fn>
double best_rate(size_t bytes, int repeats, double bytes_per_byte, const Fn& fn) {
  ThreadPool& pool = ThreadPool::global();
  const int64_t chunks = static_cast<int64_t>(bytes / kChunkBytes);
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {  // pass 0 warms up (page faults, frequency)
    const auto t0 = Clock::now();
    pool.parallel_for(chunks, [&](int64_t c, int) { fn(static_cast<size_t>(c) * kChunkBytes); });
    const double s = seconds_since(t0);
    if (r > 0) best = std::max(best, double(bytes) * bytes_per_byte / s);
  }
  return best;
}

void measure_bandwidth(const RooflineOptions& opt, Roofline& out) {
  size_t bytes = opt.buffer_bytes;
  if (bytes == 0)
    bytes = std::clamp<size_t>(8 * last_level_cache_bytes(), size_t{256} << 20, size_t{1} << 30);
  bytes = std::max(kChunkBytes, bytes / kChunkBytes * kChunkBytes);
  out.buffer_bytes = bytes;
  Buffer src(bytes, Device::cpu()), dst(bytes, Device::cpu());
  // Touch every page from the pool's threads, with non-zero data.
  ThreadPool::global().parallel_for(static_cast<int64_t>(bytes / kChunkBytes), [&](int64_t c, int) {
    auto* s = static_cast<uint64_t*>(src.data()) + c * (kChunkBytes / 8);
    for (size_t i = 0; i < kChunkBytes / 8; ++i)
      s[i] = (c * kChunkBytes / 8 + i) * 0x9E3779B97F4A7C15ull;
    std::memset(static_cast<char*>(dst.data()) + c * kChunkBytes, 1, kChunkBytes);
  });
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  const bool wide = has_avx512f();
  out.read_gbps = best_rate(bytes, opt.repeats, 1.0,
                            [&](size_t off) {
#if FLASHKV_BENCH_X86
                              const uint64_t x = wide ? read_avx512(s + off, kChunkBytes)
                                                      : read_portable(s + off, kChunkBytes);
#else
    const uint64_t x = read_portable(s + off, kChunkBytes);
#endif
                              g_read_sink.fetch_xor(
                                  x, std::memory_order_relaxed);  // keeps the loads observable
                            }) /
                  1e9;
  out.copy_gbps = best_rate(bytes, opt.repeats, 2.0,
                            [&](size_t off) {
#if FLASHKV_BENCH_X86
                              if (wide) {
                                copy_avx512(d + off, s + off, kChunkBytes);
                                return;
                              }
#endif
                              std::memcpy(d + off, s + off, kChunkBytes);
                            }) /
                  1e9;
  // The copy must have happened.
  FLASHKV_CHECK(std::memcmp(d + bytes - 4096, s + bytes - 4096, 4096) == 0,
                "roofline: copy loop produced wrong bytes");
}

// ---- matrix rate ----------------------------------------------------------------------------
// A register-blocked micro-kernel C[kRows, cols] += A[kRows, kDepth] * B[kDepth, cols] over
// kPanels B panels of `cols` columns (the panels stay in L2, the current one in L1), the inner
// loop of any blocked GEMM. One "job" = all panels once.

constexpr int kDepth = 256;
constexpr int kPanels = 8;

// bf16: 12 rows x 32 columns = 24 zmm accumulators; A/B in the pair-interleaved layout
// vdpbf16ps reads: A [kDepth/2][12] pairs, B [kDepth/2][32] pairs per panel.
constexpr int kBf16Rows = 12, kBf16Cols = 32;
// fp32: 6 rows x 16 columns = 12 ymm accumulators; A [kDepth][6], B [kDepth][16] per panel.
constexpr int kF32Rows = 6, kF32Cols = 16;

struct MatmulKernel {
  const char* kind;
  bool bf16;  // operands in the bf16 pair layout (else fp32)
  int rows, cols;
  // Runs one panel: c [rows, cols] += a * b.
  void (*panel)(const void* a, const void* b, float* c);
};

#if FLASHKV_BENCH_X86
__attribute__((target("avx512bf16,avx512f"))) void panel_bf16(const void* a_, const void* b_,
                                                              float* c) {
  const auto* a = static_cast<const int32_t*>(a_);
  const auto* b = static_cast<const int32_t*>(b_);
  __m512 acc[kBf16Rows][2];
#pragma GCC unroll 12
  for (int r = 0; r < kBf16Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int kp = 0; kp < kDepth / 2; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + kp * kBf16Cols);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + kp * kBf16Cols + 16);
#pragma GCC unroll 12
    for (int r = 0; r < kBf16Rows; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(a[kp * kBf16Rows + r]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kBf16Rows; ++r) {
    float* cr = c + r * kBf16Cols;
    _mm512_storeu_ps(cr, _mm512_add_ps(_mm512_loadu_ps(cr), acc[r][0]));
    _mm512_storeu_ps(cr + 16, _mm512_add_ps(_mm512_loadu_ps(cr + 16), acc[r][1]));
  }
}

__attribute__((target("avx2,fma"))) void panel_f32_avx2(const void* a_, const void* b_, float* c) {
  const auto* a = static_cast<const float*>(a_);
  const auto* b = static_cast<const float*>(b_);
  __m256 acc[kF32Rows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kF32Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int k = 0; k < kDepth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kF32Cols), b1 = _mm256_loadu_ps(b + k * kF32Cols + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kF32Rows; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + k * kF32Rows + r);
      acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kF32Rows; ++r) {
    float* cr = c + r * kF32Cols;
    _mm256_storeu_ps(cr, _mm256_add_ps(_mm256_loadu_ps(cr), acc[r][0]));
    _mm256_storeu_ps(cr + 8, _mm256_add_ps(_mm256_loadu_ps(cr + 8), acc[r][1]));
  }
}
#endif

void panel_f32_portable(const void* a_, const void* b_, float* c) {
  const auto* a = static_cast<const float*>(a_);
  const auto* b = static_cast<const float*>(b_);
  float acc[kF32Rows][kF32Cols] = {};
  for (int k = 0; k < kDepth; ++k)
    for (int r = 0; r < kF32Rows; ++r)
      for (int n = 0; n < kF32Cols; ++n) acc[r][n] += a[k * kF32Rows + r] * b[k * kF32Cols + n];
  for (int r = 0; r < kF32Rows; ++r)
    for (int n = 0; n < kF32Cols; ++n) c[r * kF32Cols + n] += acc[r][n];
}

MatmulKernel pick_kernel(const std::string& want) {
  const CpuFeatures& features = cpu_features();
  const bool bf16 = FLASHKV_BENCH_X86 && features.avx512bf16;
  const bool avx2 = FLASHKV_BENCH_X86 && features.avx2 && features.fma;
  const MatmulKernel portable{"fp32 FMA, portable loop", false, kF32Rows, kF32Cols,
                              panel_f32_portable};
#if FLASHKV_BENCH_X86
  const MatmulKernel k_bf16{"bf16 dot products, AVX-512 BF16 vdpbf16ps", true, kBf16Rows, kBf16Cols,
                            panel_bf16};
  const MatmulKernel k_avx2{"fp32 FMA, AVX2", false, kF32Rows, kF32Cols, panel_f32_avx2};
  if (want.empty()) return bf16 ? k_bf16 : avx2 ? k_avx2 : portable;
  if (want == "avx512bf16") {
    FLASHKV_CHECK(bf16, "cpu_matmul: this CPU has no AVX-512 BF16");
    return k_bf16;
  }
  if (want == "avx2") {
    FLASHKV_CHECK(avx2, "cpu_matmul: this CPU has no AVX2/FMA");
    return k_avx2;
  }
#else
  (void)bf16;
  (void)avx2;
  if (want.empty()) return portable;
  FLASHKV_CHECK(want == "portable", "cpu_matmul: this CPU has no '", want, "' (not x86-64)");
#endif
  FLASHKV_CHECK(want == "portable", "cpu_matmul: expected '', avx512bf16, avx2 or portable, got '",
                want, "'");
  return portable;
}

// Operands of one kernel in its layout, filled with values exactly representable in bf16.
struct MatmulData {
  std::vector<uint16_t> a16, b16;  // bf16 layout: pairs along the depth
  std::vector<float> a32, b32;     // fp32 layout
  bool bf16;
  int rows, cols;
  const void* a() const { return bf16 ? static_cast<const void*>(a16.data()) : a32.data(); }
  const void* b(int panel) const {
    const size_t per = size_t{kDepth} * cols;
    return bf16 ? static_cast<const void*>(b16.data() + panel * per) : b32.data() + panel * per;
  }
  // Logical A[r][k] and B_panel[k][n] as floats.
  float a_at(int r, int k) const {
    return bf16 ? bits_to_float(uint32_t{a16[(k / 2 * rows + r) * 2 + k % 2]} << 16)
                : a32[k * rows + r];
  }
  float b_at(int panel, int k, int n) const {
    const size_t base = size_t(panel) * kDepth * cols;
    return bf16 ? bits_to_float(uint32_t{b16[base + (k / 2 * cols + n) * 2 + k % 2]} << 16)
                : b32[base + k * cols + n];
  }
};

MatmulData make_matmul_data(const MatmulKernel& kern) {
  const bool bf16 = kern.bf16;
  MatmulData m;
  m.bf16 = bf16;
  m.rows = kern.rows;
  m.cols = kern.cols;
  uint64_t state = 0x243F6A8885A308D3ull;
  auto next = [&] {  // small values k/64, k in [-64, 64): exact in bf16
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int>((state >> 33) % 128) - 64) / 64.0f;
  };
  const size_t na = size_t{kDepth} * kern.rows, nb = size_t{kPanels} * kDepth * kern.cols;
  if (bf16) {
    m.a16.resize(na);
    m.b16.resize(nb);
    for (auto& x : m.a16) x = to_bf16(next()).bits;
    for (auto& x : m.b16) x = to_bf16(next()).bits;
  } else {
    m.a32.resize(na);
    m.b32.resize(nb);
    for (auto& x : m.a32) x = next();
    for (auto& x : m.b32) x = next();
  }
  return m;
}

void measure_matmul(const RooflineOptions& opt, Roofline& out) {
  const MatmulKernel kern = pick_kernel(opt.cpu_matmul);
  const MatmulData data = make_matmul_data(kern);
  const size_t c_elems = size_t{kPanels} * kern.rows * kern.cols;
  // The kernel must compute the product: one job from zero against a double-precision sum.
  {
    std::vector<float> c(c_elems, 0.0f);
    for (int p = 0; p < kPanels; ++p)
      kern.panel(data.a(), data.b(p), c.data() + p * kern.rows * kern.cols);
    for (int p = 0; p < kPanels; ++p)
      for (int r = 0; r < kern.rows; ++r)
        for (int n = 0; n < kern.cols; ++n) {
          double want = 0;
          for (int k = 0; k < kDepth; ++k) want += double(data.a_at(r, k)) * data.b_at(p, k, n);
          const double got = c[(size_t(p) * kern.rows + r) * kern.cols + n];
          FLASHKV_CHECK(std::fabs(got - want) <= 1e-3 * (1 + std::fabs(want)),
                        "roofline: matrix kernel (", kern.kind, ") computed ", got, ", expected ",
                        want);
        }
  }
  ThreadPool& pool = ThreadPool::global();
  const int threads = pool.size();
  const double flops_per_job = 2.0 * kern.rows * kern.cols * kDepth * kPanels;
  std::vector<std::vector<float>> c(threads, std::vector<float>(c_elems, 0.0f));
  double best = 0;
  for (int round = 0; round < 4; ++round) {  // round 0 warms up
    std::atomic<int64_t> jobs{0};
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::duration<double>(opt.matmul_seconds);
    pool.parallel_for(threads, [&](int64_t, int worker) {
      float* cw = c[worker].data();
      int64_t n = 0;
      do {
        for (int j = 0; j < 16; ++j, ++n)
          for (int p = 0; p < kPanels; ++p)
            kern.panel(data.a(), data.b(p), cw + p * kern.rows * kern.cols);
      } while (Clock::now() < deadline);
      jobs += n;
    });
    const double s = seconds_since(t0);
    if (round > 0) best = std::max(best, double(jobs.load()) * flops_per_job / s);
  }
  out.matmul_gflops = best / 1e9;
  out.matmul_kind = kern.kind;
}

Roofline measure_cpu(const RooflineOptions& opt) {
  FLASHKV_CHECK(opt.repeats >= 1, "repeats: expected >= 1, got ", opt.repeats);
  FLASHKV_CHECK(opt.matmul_seconds > 0, "matmul_seconds: expected > 0, got ", opt.matmul_seconds);
  Roofline r;
  r.device = Device::cpu();
  r.name = cpu_model_name();
  r.cores_or_sms = ThreadPool::global().size();
  measure_bandwidth(opt, r);
  measure_matmul(opt, r);
  return r;
}

}  // namespace

Roofline measure_roofline(Device device) { return measure_roofline(device, RooflineOptions{}); }

Roofline measure_roofline(Device device, const RooflineOptions& options) {
  if (device.is_cpu()) return measure_cpu(options);
#if FLASHKV_WITH_CUDA
  return detail::measure_roofline_cuda(device, options);
#else
  throw_error(
      str_cat("measure_roofline: device ", device.str(), ": this flashkv was built without CUDA"));
#endif
}

}  // namespace flashkv::bench
