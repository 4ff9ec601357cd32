// The environment switches: every variable flashkv reads, what it means and what it accepts, and
// one function per switch that reads and checks it. Nothing else in flashkv calls getenv (the
// benchmarks' own knobs and the tests' FLASHKV_TEST_SEED aside).
//
// Each function reads the environment on every call, so a test or a benchmark can change a
// switch between calls in one process; a caller that wants the value fixed for the process
// (decode's launch attribute) keeps it in a static of its own. A value a switch does not accept
// throws flashkv::Error naming the variable and the values it accepts; the on/off switches of
// the CUDA kernels accept anything and are off only for "0", but those that choose a kernel not
// yet the default, which are on only for "1".
#pragma once

#include <cstddef>
#include <optional>

namespace flashkv {

struct EnvSwitch {
  const char* name;     // the environment variable
  const char* values;   // the values it accepts
  const char* meaning;  // what it does, and the default
};

// Every switch, in the order the README lists them.
inline constexpr EnvSwitch kEnvSwitches[] = {
    {"FLASHKV_NUM_THREADS", "a positive integer",
     "threads of the CPU thread pool (CPU kernels, the float64 reference); unset, 0, negative or "
     "not a number: the machine's hardware threads"},
    {"FLASHKV_CPU_ISA", "scalar, avx2, avx512, avx512_bf16",
     "caps the instruction set the CPU kernels use (they use the best the CPU has, up to this "
     "cap); unset: no cap"},
    {"FLASHKV_CPU_PREFETCH", "on, off",
     "software prefetch on the AVX2 decode path; unset: off on AMD cores before Zen 4, on "
     "elsewhere"},
    {"FLASHKV_PREFILL_SM90", "0",
     "0: prefill at head dims 64, 128, 256 and 192 / 128 runs the sm_80 kernel where an sm_90a "
     "kernel would be chosen"},
    {"FLASHKV_PREFILL_SM90_WS", "0",
     "0: ragged and paged K/V skip the warp-specialized sm_90a prefill kernel (16-bit K/V at head "
     "dim 128: the cp.async sm_90a kernel runs instead; else the sm_80 kernel)"},
    {"FLASHKV_PREFILL_SM90_WS_PAGED", "0",
     "0: paged K/V skips the warp-specialized sm_90a prefill kernel, as with "
     "FLASHKV_PREFILL_SM90_WS=0 (ragged K/V keeps it)"},
    {"FLASHKV_PREFILL_SM90_PAGED_TMA", "0",
     "0: the warp-specialized sm_90a prefill kernel gathers paged 16-bit K/V with cp.async at "
     "every page size (else whole tiles of 16- to 128-token pages come by TMA, a page a copy)"},
    {"FLASHKV_DECODE_PDL", "0", "0: decode launches without programmatic dependent launch (sm_90)"},
};
inline constexpr size_t kNumEnvSwitches = sizeof(kEnvSwitches) / sizeof(kEnvSwitches[0]);

// FLASHKV_NUM_THREADS as std::atoi reads it: 0 when unset; a value <= 0 (0 for text that is not a
// number) means "the hardware threads" to ThreadPool.
int env_num_threads();

// FLASHKV_CPU_ISA: the cap's name, one of "scalar", "avx2", "avx512", "avx512_bf16" (a string
// with static storage), or nullptr when unset. Throws flashkv::Error for any other value.
const char* env_cpu_isa_cap();

// FLASHKV_CPU_PREFETCH: true for "on", false for "off", nullopt when unset (the CPU decides).
// Throws flashkv::Error for any other value.
std::optional<bool> env_cpu_prefetch();

// FLASHKV_PREFILL_SM90: false only for "0" (the sm_90a prefill kernels are not chosen).
bool env_prefill_sm90();

// FLASHKV_PREFILL_SM90_WS: false only for "0" (prefill skips the warp-specialized kernel).
bool env_prefill_sm90_ws();

// FLASHKV_PREFILL_SM90_WS_PAGED: false only for "0" (paged K/V skips the warp-specialized kernel).
bool env_prefill_sm90_ws_paged();
// FLASHKV_PREFILL_SM90_PAGED_TMA: false only for "0" (paged tiles by cp.async at every page size).
bool env_prefill_sm90_paged_tma();

// FLASHKV_DECODE_PDL: false only for "0" (decode launches without programmatic dependent launch).
bool env_decode_pdl();

}  // namespace flashkv
