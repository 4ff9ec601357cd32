// core/options.h: each environment switch read and checked in one place.
#include "flashkv/core/options.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "flashkv/core/error.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::error_of;
using test::ScopedEnv;

bool listed(const char* name) {
  for (const EnvSwitch& s : kEnvSwitches)
    if (std::strcmp(s.name, name) == 0) return true;
  return false;
}

TEST(Options, EverySwitchIsListed) {
  EXPECT_EQ(kNumEnvSwitches, 8u);
  for (const char* name :
       {"FLASHKV_NUM_THREADS", "FLASHKV_CPU_ISA", "FLASHKV_CPU_PREFETCH", "FLASHKV_PREFILL_SM90",
        "FLASHKV_PREFILL_SM90_WS", "FLASHKV_PREFILL_SM90_WS_PAGED",
        "FLASHKV_PREFILL_SM90_PAGED_TMA", "FLASHKV_DECODE_PDL"})
    EXPECT_TRUE(listed(name)) << name;
  for (const EnvSwitch& s : kEnvSwitches) {
    EXPECT_GT(std::strlen(s.values), 0u) << s.name;
    EXPECT_GT(std::strlen(s.meaning), 0u) << s.name;
  }
}

TEST(Options, NumThreadsReadsAsAtoi) {
  {
    ScopedEnv e("FLASHKV_NUM_THREADS", nullptr);
    EXPECT_EQ(env_num_threads(), 0);
  }
  {
    ScopedEnv e("FLASHKV_NUM_THREADS", "6");
    EXPECT_EQ(env_num_threads(), 6);
  }
  {
    ScopedEnv e("FLASHKV_NUM_THREADS", "-2");  // <= 0: the hardware threads
    EXPECT_EQ(env_num_threads(), -2);
  }
  {
    ScopedEnv e("FLASHKV_NUM_THREADS", "many");  // not a number: 0, the hardware threads
    EXPECT_EQ(env_num_threads(), 0);
  }
}

TEST(Options, CpuIsaCap) {
  {
    ScopedEnv e("FLASHKV_CPU_ISA", nullptr);
    EXPECT_EQ(env_cpu_isa_cap(), nullptr);
  }
  for (const char* name : {"scalar", "avx2", "avx512", "avx512_bf16"}) {
    ScopedEnv e("FLASHKV_CPU_ISA", name);
    ASSERT_NE(env_cpu_isa_cap(), nullptr);
    EXPECT_STREQ(env_cpu_isa_cap(), name);
  }
  for (const char* bad : {"", "avx", "AVX2", "avx512bf16", "sse"}) {
    ScopedEnv e("FLASHKV_CPU_ISA", bad);
    EXPECT_THROW(env_cpu_isa_cap(), Error) << "'" << bad << "'";
    const std::string what = error_of([] { env_cpu_isa_cap(); });
    EXPECT_NE(what.find("FLASHKV_CPU_ISA"), std::string::npos) << what;
    EXPECT_NE(what.find("scalar, avx2, avx512 or avx512_bf16"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
  }
}

TEST(Options, CpuPrefetch) {
  {
    ScopedEnv e("FLASHKV_CPU_PREFETCH", nullptr);
    EXPECT_EQ(env_cpu_prefetch(), std::nullopt);
  }
  {
    ScopedEnv e("FLASHKV_CPU_PREFETCH", "on");
    EXPECT_EQ(env_cpu_prefetch(), std::optional<bool>(true));
  }
  {
    ScopedEnv e("FLASHKV_CPU_PREFETCH", "off");
    EXPECT_EQ(env_cpu_prefetch(), std::optional<bool>(false));
  }
  for (const char* bad : {"", "1", "ON", "yes"}) {
    ScopedEnv e("FLASHKV_CPU_PREFETCH", bad);
    EXPECT_THROW(env_cpu_prefetch(), Error) << "'" << bad << "'";
    const std::string what = error_of([] { env_cpu_prefetch(); });
    EXPECT_NE(what.find("FLASHKV_CPU_PREFETCH"), std::string::npos) << what;
    EXPECT_NE(what.find("on or off"), std::string::npos) << what;
  }
}

// The CUDA kernels' switches: off only for "0", read on every call.
TEST(Options, CudaSwitchesAreOffOnlyForZero) {
  struct Switch {
    const char* name;
    bool (*read)();
  };
  for (const Switch& s : {Switch{"FLASHKV_PREFILL_SM90", &env_prefill_sm90},
                          Switch{"FLASHKV_PREFILL_SM90_WS", &env_prefill_sm90_ws},
                          Switch{"FLASHKV_PREFILL_SM90_WS_PAGED", &env_prefill_sm90_ws_paged},
                          Switch{"FLASHKV_PREFILL_SM90_PAGED_TMA", &env_prefill_sm90_paged_tma},
                          Switch{"FLASHKV_DECODE_PDL", &env_decode_pdl}}) {
    SCOPED_TRACE(s.name);
    {
      ScopedEnv e(s.name, nullptr);
      EXPECT_TRUE(s.read());
    }
    {
      ScopedEnv e(s.name, "0");
      EXPECT_FALSE(s.read());
    }
    for (const char* on : {"1", "", "00", "off"}) {
      ScopedEnv e(s.name, on);
      EXPECT_TRUE(s.read()) << "'" << on << "'";
    }
  }
}

}  // namespace
}  // namespace flashkv
