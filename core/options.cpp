#include "flashkv/core/options.h"

#include <cstdlib>
#include <cstring>

#include "flashkv/core/error.h"

namespace flashkv {
namespace {

// A switch that is on unless set to "0".
bool on_unless_zero(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || std::strcmp(env, "0") != 0;
}

}  // namespace

int env_num_threads() {
  const char* env = std::getenv("FLASHKV_NUM_THREADS");
  return env ? std::atoi(env) : 0;
}

const char* env_cpu_isa_cap() {
  const char* env = std::getenv("FLASHKV_CPU_ISA");
  if (!env) return nullptr;
  for (const char* name : {"scalar", "avx2", "avx512", "avx512_bf16"})
    if (std::strcmp(env, name) == 0) return name;
  throw_error(
      str_cat("FLASHKV_CPU_ISA: expected scalar, avx2, avx512 or avx512_bf16, got '", env, "'"));
}

std::optional<bool> env_cpu_prefetch() {
  const char* env = std::getenv("FLASHKV_CPU_PREFETCH");
  if (!env) return std::nullopt;
  if (std::strcmp(env, "on") == 0) return true;
  if (std::strcmp(env, "off") == 0) return false;
  throw_error(str_cat("FLASHKV_CPU_PREFETCH: expected on or off, got '", env, "'"));
}

bool env_prefill_sm90() { return on_unless_zero("FLASHKV_PREFILL_SM90"); }

bool env_prefill_sm90_ws() { return on_unless_zero("FLASHKV_PREFILL_SM90_WS"); }

bool env_prefill_sm90_ws_paged() { return on_unless_zero("FLASHKV_PREFILL_SM90_WS_PAGED"); }

bool env_prefill_sm90_paged_tma() { return on_unless_zero("FLASHKV_PREFILL_SM90_PAGED_TMA"); }

bool env_decode_pdl() { return on_unless_zero("FLASHKV_DECODE_PDL"); }

}  // namespace flashkv
