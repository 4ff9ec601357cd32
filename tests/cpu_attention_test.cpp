// The CPU attention kernels against the float64 reference, on every ISA level this CPU has
// (scalar, AVX2, AVX-512, AVX-512 BF16): random grids over batch sizes, lengths (0, 1 and
// non-multiples of the KV block), page sizes with shuffled page tables, GQA groups, head dims,
// dtypes (fp8 KV with scales), causal / window / soft cap / sm_scale / custom mask, LSE, forced
// splits and the merges. Unused KV slots hold NaN, outputs are poisoned first.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "flashkv/core/cpu_features.h"
#include "flashkv/kernels/kernels.h"
#include "flashkv/ops/attention.h"
#include "flashkv/reference/reference.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::Rng;

// Every kernel path up to the best this CPU has: each ISA level, and at the AVX-512 BF16 level
// fp8 decode both with the VBMI staging (where the CPU has it) and without it.
struct KernelPath {
  cpu::Isa isa;
  bool fp8_vbmi;
};
std::vector<KernelPath> kernel_paths() {
  std::vector<KernelPath> paths;
  for (int i = 0; i <= static_cast<int>(cpu::detected_isa()); ++i)
    paths.push_back({static_cast<cpu::Isa>(i), false});
  if (cpu::detected_isa() == cpu::Isa::avx512_bf16 && cpu_features().avx512vbmi)
    paths.push_back({cpu::Isa::avx512_bf16, true});
  return paths;
}

// Sets a CPU kernel setting for a scope (the setter returns the previous value).
template <class V, V (*Set)(V)>
class ScopedSetting {
 public:
  explicit ScopedSetting(V value) : previous_(Set(value)) {}
  ~ScopedSetting() { Set(previous_); }
  ScopedSetting(const ScopedSetting&) = delete;
  ScopedSetting& operator=(const ScopedSetting&) = delete;

 private:
  V previous_;
};
using IsaCap = ScopedSetting<cpu::Isa, &cpu::set_isa_cap>;
using SplitPrefetch = ScopedSetting<cpu::Prefetch, &cpu::set_split_prefetch>;
using Fp8Vbmi = ScopedSetting<bool, &cpu::set_fp8_vbmi>;

// A kernel path for a scope.
class PathScope {
 public:
  explicit PathScope(const KernelPath& path) : cap_(path.isa), vbmi_(path.fp8_vbmi) {}

 private:
  IsaCap cap_;
  Fp8Vbmi vbmi_;
};

using test::ScopedEnv;

enum class Op { ragged, paged_prefill, decode };

struct Case {
  Op op = Op::ragged;
  std::vector<int32_t> q_lens, kv_lens;  // decode: q_lens ignored (one row each)
  int hq = 4, hkv = 1, dqk = 64, dv = 64;
  DType dtype = DType::bf16, kv_dtype = DType::bf16;
  int page_size = 1;
  bool in_order_pages = false;  // paged: pages handed out in order (a fresh pool), not shuffled
  bool causal = true;
  int window_left = -1;
  float soft_cap = 0, sm_scale = 0;
  bool custom_mask = false;
  bool want_lse = true;
  int fixed_split = 0;
  int q_tile = 0;  // 0: the planner's default
  float k_scale = 1, v_scale = 1;
  // fp8 paged KV: the used rows hold every finite byte code in turn (instead of random values).
  bool every_fp8_byte = false;
  // Paged: the first element of request 0's first K row (nan_k), or the first two of its V row
  // (nan_v), are NaN; the output is then checked for NaN where it must be and nowhere else,
  // instead of against the reference.
  bool nan_k = false, nan_v = false;
  bool sinks = false;  // random per-query-head sinks (AttentionOptions::sinks)
  // With sinks: query heads 0, 1 and 2 (of at least 3) take the sinks -inf (none), +60 (the sink
  // outweighs every score) and -60 (it weighs nothing), the ends a row's normalisation must take.
  bool extreme_sinks = false;
  bool f32_out = false;  // out in f32 instead of q's dtype

  std::string str() const {
    std::string s = op == Op::ragged ? "ragged" : op == Op::decode ? "decode" : "paged_prefill";
    s += str_cat(
        " B=", kv_lens.size(), " hq=", hq, " hkv=", hkv, " d=", dqk, "/", dv, " ",
        dtype_name(dtype), "/", dtype_name(kv_dtype), " page=", page_size,
        in_order_pages ? " in_order" : " shuffled", " causal=", causal, " window=", window_left,
        " cap=", soft_cap, " scale=", sm_scale, " mask=", custom_mask, " sinks=", sinks,
        " f32_out=", f32_out, " split=", fixed_split, " q_tile=", q_tile,
        " isa=", cpu::isa_name(cpu::active_isa()), " fp8_vbmi=", cpu::fp8_vbmi(), " kv_lens=");
    for (int32_t l : kv_lens) s += str_cat(l, ",");
    if (op != Op::decode) {
      s += " q_lens=";
      for (int32_t l : q_lens) s += str_cat(l, ",");
    }
    return s;
  }
};

// Fills rows (dimension 0) of a [rows, H, D] tensor that are not marked used with NaN.
void poison_rows(const Tensor& t, const std::vector<char>& used) {
  if (t.size(0) == 0) return;  // a batch without K/V rows and no gap around it
  const int64_t row_elems = t.numel() / t.size(0);
  for (int64_t r = 0; r < t.size(0); ++r)
    if (!used[r])
      for (int64_t e = 0; e < row_elems; ++e)
        store_from_double(t.data(), t.dtype(), r * row_elems + e,
                          std::numeric_limits<double>::quiet_NaN());
}

bool finite_fp8(DType t, uint8_t b) {
  return std::isfinite(t == DType::fp8_e4m3 ? to_float(fp8_e4m3_t{b}) : to_float(fp8_e5m2_t{b}));
}

// The used rows (dimension 0) of a [rows, H, D] fp8 tensor: every finite byte code in turn,
// starting at `first`.
void fill_every_fp8_byte(const Tensor& t, const std::vector<char>& used, int first) {
  if (t.size(0) == 0) return;
  const int64_t row_bytes = t.numel() / t.size(0);  // one byte an element
  uint8_t* p = static_cast<uint8_t*>(t.data());
  int code = first;
  for (int64_t r = 0; r < t.size(0); ++r) {
    if (!used[r]) continue;
    for (int64_t e = 0; e < row_bytes; ++e) {
      while (!finite_fp8(t.dtype(), static_cast<uint8_t>(code))) code = (code + 1) % 256;
      p[r * row_bytes + e] = static_cast<uint8_t>(code);
      code = (code + 1) % 256;
    }
  }
}

// Runs the case on the CPU and checks it against the reference; returns the output.
Tensor run_case(const Case& c, Rng& rng) {
  SCOPED_TRACE(c.str());
  const int32_t batch = static_cast<int32_t>(c.kv_lens.size());
  const bool decode = c.op == Op::decode;
  std::vector<int32_t> q_lens = decode ? std::vector<int32_t>(batch, 1) : c.q_lens;
  const std::vector<int32_t> qo = test::indptr_of(q_lens);
  const int64_t num_q = qo.back();
  const bool fp8 = is_fp8(c.kv_dtype);
  Tensor q = test::random_tensor(rng, {num_q, c.hq, c.dqk}, c.dtype);
  Tensor out = Tensor::empty({num_q, c.hq, c.dv}, c.f32_out ? DType::f32 : c.dtype);
  Tensor lse = Tensor::empty({num_q, c.hq}, DType::f32);
  test::poison(out);
  test::poison(lse);

  AttentionOptions opt;
  opt.causal = c.causal;
  opt.window_left = c.window_left;
  opt.logits_soft_cap = c.soft_cap;
  opt.sm_scale = c.sm_scale;
  Tensor sinks;
  if (c.sinks) {
    // Spread wide enough that a sink sometimes dominates a row and sometimes vanishes.
    sinks = test::random_tensor(rng, {c.hq}, DType::f32, 3.0);
    if (c.extreme_sinks) {
      sinks.ptr<float>()[0] = -std::numeric_limits<float>::infinity();
      sinks.ptr<float>()[1] = 60.0f;
      sinks.ptr<float>()[2] = -60.0f;
    }
    opt.sinks = sinks;
  }
  Tensor mask, mask_indptr;
  if (c.custom_mask) {
    std::vector<int32_t> sizes(batch);
    for (int32_t i = 0; i < batch; ++i) sizes[i] = q_lens[i] * c.kv_lens[i];
    const std::vector<int32_t> mi = test::indptr_of(sizes);
    mask = Tensor::empty({std::max<int64_t>(mi.back(), 1)}, DType::u8);
    for (int64_t e = 0; e < mask.numel(); ++e) mask.ptr<uint8_t>()[e] = rng.uniform() < 0.6;
    mask_indptr = Tensor::from_i32(mi);
    opt.custom_mask = mask;
    opt.mask_indptr = mask_indptr;
  }

  BatchShape bs;
  bs.batch_size = batch;
  bs.qo_indptr = decode ? nullptr : qo.data();
  bs.kv_len = c.kv_lens.data();
  bs.num_qo_heads = c.hq;
  bs.num_kv_heads = c.hkv;
  bs.head_dim_qk = c.dqk;
  bs.head_dim_v = c.dv;
  bs.page_size = c.op == Op::ragged ? 1 : c.page_size;
  bs.causal = c.causal && !c.custom_mask;
  bs.window_left = c.window_left;
  PlanOptions po;
  po.fixed_split_size = c.fixed_split;
  po.q_tile = c.q_tile;
  const DeviceInfo dev = device_info(Device::cpu());
  Plan plan;
  DecodePlan decode_plan;
  PrefillPlan prefill_plan;
  if (decode) {
    decode_plan = plan_decode(bs, dev, po);
    plan = decode_plan;
  } else {
    prefill_plan = plan_prefill(bs, dev, po);
    plan = prefill_plan;
  }
  if (c.fixed_split > 0 && decode && c.window_left < 0) {
    int32_t longest = 0;
    for (int32_t l : c.kv_lens) longest = std::max(longest, l);
    if (longest > c.fixed_split + 32) EXPECT_FALSE(plan.merges.empty()) << "expected split items";
  }
  Workspace ws(plan.layout.total_bytes, Device::cpu());
  ws.upload(plan);
  const TensorView lse_view = c.want_lse ? TensorView(lse) : TensorView();
  Tensor qo_t = Tensor::from_i32(qo);

  reference::Result ref;
  if (c.op == Op::ragged) {
    // K/V rows: a NaN gap before and after the batch's rows.
    const int32_t front = rng.uniform_int(0, 3), back = rng.uniform_int(0, 3);
    std::vector<int32_t> kvp = test::indptr_of(c.kv_lens);
    for (int32_t& x : kvp) x += front;
    const int64_t rows = kvp.back() + back;
    Tensor k = test::random_tensor(rng, {rows, c.hkv, c.dqk}, c.kv_dtype);
    Tensor v = test::random_tensor(rng, {rows, c.hkv, c.dv}, c.kv_dtype);
    std::vector<char> used(rows, 0);
    for (int64_t r = front; r < kvp.back(); ++r) used[r] = 1;
    poison_rows(k, used);
    poison_rows(v, used);
    Tensor kv_t = Tensor::from_i32(kvp);
    ragged_prefill(prefill_plan, q, k, v, qo_t, kv_t, opt, out, lse_view, ws);
    ref = reference::ragged_attention(q, k, v, qo_t, kv_t, opt);
  } else {
    // Paged pool: each request's pages drawn from a shuffled list (or, in order, consecutive
    // pages after a few unused ones); slots not holding a token (other pages, the tail of last
    // pages) are NaN.
    const int ps = c.page_size;
    std::vector<int32_t> pages_of(batch);
    int32_t total_pages = 0;
    for (int32_t i = 0; i < batch; ++i) {
      pages_of[i] = (c.kv_lens[i] + ps - 1) / ps;
      total_pages += pages_of[i];
    }
    const int32_t pool_pages = total_pages + rng.uniform_int(1, 4);
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    if (c.in_order_pages)
      std::rotate(perm.begin(), perm.begin() + (pool_pages - total_pages), perm.end());
    else
      std::shuffle(perm.begin(), perm.end(), rng.gen());
    std::vector<int32_t> indices(perm.begin(), perm.begin() + total_pages);
    std::vector<int32_t> last(batch, 0);
    const int64_t slots = int64_t{pool_pages} * ps;
    std::vector<char> used(slots, 0);
    int32_t e = 0;
    for (int32_t i = 0; i < batch; ++i) {
      for (int32_t t = 0; t < c.kv_lens[i]; ++t)
        used[int64_t{indices[e + t / ps]} * ps + t % ps] = 1;
      last[i] = c.kv_lens[i] == 0 ? 0 : (c.kv_lens[i] - 1) % ps + 1;
      e += pages_of[i];
    }
    Tensor k =
        test::random_tensor(rng, {slots, c.hkv, c.dqk}, c.kv_dtype, fp8 ? 1.0 / c.k_scale : 1.0);
    Tensor v =
        test::random_tensor(rng, {slots, c.hkv, c.dv}, c.kv_dtype, fp8 ? 1.0 / c.v_scale : 1.0);
    poison_rows(k, used);
    poison_rows(v, used);
    if (c.every_fp8_byte) {
      fill_every_fp8_byte(k, used, 0);
      fill_every_fp8_byte(v, used, 101);
    }
    if (c.nan_k || c.nan_v) test::put_nan_in_kv_row(k, v, int64_t{indices[0]} * ps, c.nan_k);
    Tensor indptr = Tensor::from_i32(test::indptr_of(pages_of));
    Tensor idx = Tensor::from_i32(indices.empty() ? std::vector<int32_t>{0} : indices);
    Tensor last_t = Tensor::from_i32(last);
    PagedKV kv{k, v, indptr, idx, ps > 1 ? TensorView(last_t) : TensorView(), ps};
    kv.k_scale = c.k_scale;
    kv.v_scale = c.v_scale;
    if (decode) {
      paged_decode(decode_plan, q, kv, opt, out, lse_view, ws);
      ref = reference::paged_attention(q, TensorView(), kv, opt);
    } else {
      paged_prefill(prefill_plan, q, qo_t, kv, opt, out, lse_view, ws);
      ref = reference::paged_attention(q, qo_t, kv, opt);
    }
  }
  if (c.nan_k || c.nan_v) {
    // Every row of request 0 sees the NaN (the case is not causal) in the query heads of KV
    // head 0: through their scores, every dim and the LSE; through V, dims 0 and 1. Nothing
    // else is NaN. The comparison with the reference below checks the numbers.
    test::expect_nan_from_first_kv_row(out, lse_view, q_lens[0], c.hq / c.hkv, c.nan_k);
  }
  test::expect_close(out, lse_view, ref, c.dtype, fp8);
  return out;
}

std::vector<int32_t> random_lengths(Rng& rng, int n, int max_len) {
  std::vector<int32_t> lens(n);
  for (int32_t& l : lens) {
    const double u = rng.uniform();
    l = u < 0.1 ? 0 : u < 0.2 ? 1 : rng.uniform_int(2, max_len);
  }
  return lens;
}

TEST(CpuAttention, DetectsAnIsa) {
  const cpu::Isa best = cpu::detected_isa();
  EXPECT_LE(cpu::active_isa(), best);
  IsaCap cap(cpu::Isa::scalar);
  EXPECT_EQ(cpu::active_isa(), cpu::Isa::scalar);
  EXPECT_STREQ(cpu::isa_name(cpu::Isa::avx512_bf16), "avx512_bf16");
}

TEST(CpuAttention, IsaCapArgumentsAreChecked) {
  EXPECT_THROW(cpu::set_isa_cap(static_cast<cpu::Isa>(7)), Error);
  EXPECT_THROW(cpu::set_isa_cap(static_cast<cpu::Isa>(-1)), Error);
  bool outer = false;
  {
    ScopedEnv env("FLASHKV_CPU_ISA");
    outer = env.had();
    env.set("avx9000");
    EXPECT_THROW(cpu::active_isa(), Error);
    env.set("scalar");
    EXPECT_EQ(cpu::active_isa(), cpu::Isa::scalar);
  }
  if (!outer) EXPECT_EQ(cpu::active_isa(), cpu::detected_isa());
}

TEST(CpuAttention, RaggedPrefillGrid) {
  FLASHKV_SEEDED_RNG(rng, 101);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 10; ++iter) {
      Case c;
      c.op = Op::ragged;
      const int batch = rng.uniform_int(1, 6);
      c.q_lens = random_lengths(rng, batch, 40);
      c.kv_lens = random_lengths(rng, batch, 90);
      const int gqa[] = {1, 4, 8};
      c.hkv = rng.uniform_int(1, 2);
      c.hq = c.hkv * gqa[rng.uniform_int(0, 2)];
      c.dqk = c.dv = 64;
      c.dtype = c.kv_dtype = iter % 3 == 0 ? DType::f32 : iter % 3 == 1 ? DType::bf16 : DType::f16;
      c.causal = rng.uniform() < 0.7;
      c.window_left = rng.uniform() < 0.3 ? rng.uniform_int(0, 40) : -1;
      c.soft_cap = rng.uniform() < 0.3 ? 5.0f : 0.0f;
      c.sm_scale = rng.uniform() < 0.3 ? 0.3f : 0.0f;
      c.want_lse = rng.uniform() < 0.8;
      c.fixed_split = rng.uniform() < 0.3 ? 32 : 0;
      // Few rows per item (the decode-style path), the default, and more rows than a chunk.
      const int q_tiles[] = {0, 0, 1, 2, 40};
      c.q_tile = q_tiles[rng.uniform_int(0, 4)];
      run_case(c, rng);
    }
  }
}

TEST(CpuAttention, PagedPrefillGrid) {
  FLASHKV_SEEDED_RNG(rng, 102);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 10; ++iter) {
      Case c;
      c.op = Op::paged_prefill;
      const int batch = rng.uniform_int(1, 6);
      c.kv_lens = random_lengths(rng, batch, 100);
      c.q_lens.resize(batch);
      for (int i = 0; i < batch; ++i) c.q_lens[i] = rng.uniform_int(0, std::min(c.kv_lens[i], 37));
      const int gqa[] = {1, 4, 8};
      c.hkv = rng.uniform_int(1, 2);
      c.hq = c.hkv * gqa[rng.uniform_int(0, 2)];
      c.page_size = iter % 2 ? 16 : 1;
      c.dtype = c.kv_dtype = iter % 3 == 0 ? DType::f32 : DType::bf16;
      c.causal = rng.uniform() < 0.8;
      c.window_left = rng.uniform() < 0.3 ? rng.uniform_int(0, 50) : -1;
      c.soft_cap = rng.uniform() < 0.2 ? 8.0f : 0.0f;
      c.want_lse = rng.uniform() < 0.8;
      c.fixed_split = rng.uniform() < 0.3 ? 48 : 0;
      const int q_tiles[] = {0, 0, 1, 3, 40};
      c.q_tile = q_tiles[rng.uniform_int(0, 4)];
      run_case(c, rng);
    }
  }
}

TEST(CpuAttention, PagedDecodeGrid) {
  FLASHKV_SEEDED_RNG(rng, 103);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 8; ++iter) {
      Case c;
      c.op = Op::decode;
      const int batch = iter == 0 ? 64 : rng.uniform_int(1, 40);
      c.kv_lens = random_lengths(rng, batch, 300);
      const int gqa[] = {1, 4, 8};
      c.hkv = rng.uniform_int(1, 2);
      c.hq = c.hkv * gqa[iter % 3];
      c.page_size = iter % 2 ? 16 : 1;
      c.dtype = c.kv_dtype = iter % 4 == 0 ? DType::f32 : iter % 4 == 3 ? DType::f16 : DType::bf16;
      c.causal = rng.uniform() < 0.5;
      c.window_left = rng.uniform() < 0.3 ? rng.uniform_int(0, 100) : -1;
      c.soft_cap = rng.uniform() < 0.3 ? 20.0f : 0.0f;
      c.want_lse = rng.uniform() < 0.8;
      c.fixed_split = iter % 3 == 1 ? 64 : 0;
      run_case(c, rng);
    }
  }
}

// Decode tasks that hold several KV heads and walk many KV blocks (the next block's slots
// prefetched while the current one is computed): GQA 1/4/8, head dims 64/128/256, page size 1
// and 16, pages in order and shuffled, empty requests, split chunks.
TEST(CpuAttention, DecodeMultiHeadTasksOverManyBlocks) {
  FLASHKV_SEEDED_RNG(rng, 109);
  // Groups of 1 - 4, 6 and 8: every row tile of the AVX2 split path (4, 2 and 1 rows).
  const int gqa[] = {1, 2, 3, 4, 8, 6};
  const int dims[] = {64, 128, 256};
  for (const KernelPath& path : kernel_paths())
    for (cpu::Prefetch prefetch : {cpu::Prefetch::off, cpu::Prefetch::on}) {
      // The split path with and without its software prefetch (see split_prefetch()).
      PathScope scope(path);
      SplitPrefetch pf(prefetch);
      for (int iter = 0; iter < 6; ++iter) {
        Case c;
        c.op = Op::decode;
        c.hkv = iter % 2 ? 8 : 4;
        c.hq = c.hkv * gqa[iter];
        c.dqk = c.dv = dims[(iter / 2) % 3];
        const int batch = iter < 3 ? 10 : rng.uniform_int(1, 6);
        c.kv_lens = random_lengths(rng, batch, 330);
        c.kv_lens[0] = 0;                                         // an empty request
        if (batch > 1) c.kv_lens[1] = rng.uniform_int(200, 330);  // many blocks
        c.page_size = iter % 4 < 2 ? 1 : 16;
        c.in_order_pages = iter % 2 == 0;
        c.dtype = c.kv_dtype = iter == 5 ? DType::f32 : DType::bf16;
        if (iter == 1 || iter == 4) {  // fp8 at head dims 64 and 256
          c.kv_dtype = iter == 1 ? DType::fp8_e5m2 : DType::fp8_e4m3;
          c.k_scale = 0.5f;
          c.v_scale = 2.0f;
        }
        c.fixed_split = iter % 3 == 2 ? 96 : 0;
        c.causal = false;
        run_case(c, rng);
      }
    }
}

TEST(CpuAttention, SplitPrefetchPolicy) {
  if (!std::getenv("FLASHKV_CPU_PREFETCH"))  // the default follows the CPU
    EXPECT_EQ(cpu::split_prefetch(), cpu::split_prefetch_default(cpu_features()));
  const auto cpu_of = [](bool amd, int family, int model) {
    CpuFeatures f;
    f.amd = amd;
    f.family = family;
    f.model = model;
    return f;
  };
  EXPECT_TRUE(cpu::split_prefetch_default(cpu_of(false, 6, 0xcf)));     // Xeon (Emerald Rapids)
  EXPECT_FALSE(cpu::split_prefetch_default(cpu_of(true, 0x19, 0x01)));  // Zen 3 (Milan)
  EXPECT_FALSE(cpu::split_prefetch_default(cpu_of(true, 0x19, 0x21)));  // Zen 3 (Vermeer)
  EXPECT_FALSE(cpu::split_prefetch_default(cpu_of(true, 0x17, 0x31)));  // Zen 2 (Rome)
  EXPECT_TRUE(cpu::split_prefetch_default(cpu_of(true, 0x19, 0x11)));   // Zen 4 (Genoa)
  EXPECT_TRUE(cpu::split_prefetch_default(cpu_of(true, 0x19, 0x61)));   // Zen 4 (Raphael)
  EXPECT_TRUE(cpu::split_prefetch_default(cpu_of(true, 0x1a, 0x02)));   // Zen 5 (Turin)
  {
    SplitPrefetch on(cpu::Prefetch::on);
    EXPECT_TRUE(cpu::split_prefetch());
    SplitPrefetch off(cpu::Prefetch::off);
    EXPECT_FALSE(cpu::split_prefetch());
  }
  EXPECT_THROW(cpu::set_split_prefetch(static_cast<cpu::Prefetch>(2)), Error);
  EXPECT_THROW(cpu::set_split_prefetch(static_cast<cpu::Prefetch>(-2)), Error);
  ScopedEnv env("FLASHKV_CPU_PREFETCH");
  env.set("sometimes");
  EXPECT_THROW(cpu::split_prefetch(), Error);
  {
    FLASHKV_SEEDED_RNG(rng, 111);
    Case c;  // the attention call reads it once, on the calling thread, and says so
    c.op = Op::decode;
    c.kv_lens = {5, 40};
    EXPECT_THROW(run_case(c, rng), Error);
  }
  env.set("on");
  EXPECT_TRUE(cpu::split_prefetch());
  SplitPrefetch off(cpu::Prefetch::off);  // the setting wins over the environment
  EXPECT_FALSE(cpu::split_prefetch());
}

// Head dims 64/80/96/128/256, D_qk != D_v, on the fast paths and the scalar one.
TEST(CpuAttention, HeadDims) {
  FLASHKV_SEEDED_RNG(rng, 104);
  const int dims[][2] = {{64, 64},   {80, 80}, {96, 96},  {128, 128},
                         {256, 256}, {96, 64}, {64, 128}, {72, 40}};
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (const auto& d : dims) {
      for (DType dt : {DType::bf16, DType::f32}) {
        Case c;
        c.op = Op::paged_prefill;
        c.kv_lens = {45, 70};
        c.q_lens = {13, 33};
        c.hq = 8;
        c.hkv = 2;
        c.dqk = d[0];
        c.dv = d[1];
        c.page_size = 16;
        c.dtype = c.kv_dtype = dt;
        run_case(c, rng);
      }
    }
  }
}

TEST(CpuAttention, Fp8KvWithScales) {
  FLASHKV_SEEDED_RNG(rng, 105);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
      for (DType q : {DType::bf16, DType::f32, DType::f16}) {
        Case c;
        c.op = q == DType::bf16 ? Op::decode : Op::paged_prefill;
        c.kv_lens = random_lengths(rng, 5, 120);
        c.q_lens.resize(5);
        for (int i = 0; i < 5; ++i) c.q_lens[i] = std::min(c.kv_lens[i], rng.uniform_int(0, 20));
        c.hq = 8;
        c.hkv = 2;
        c.dqk = c.dv = kv == DType::fp8_e5m2 ? 64 : 96;  // 64: the VBMI staging, 96: not
        c.page_size = 16;
        c.dtype = q;
        c.kv_dtype = kv;
        c.k_scale = 0.5f;
        c.v_scale = 2.0f;
        c.soft_cap = kv == DType::fp8_e5m2 ? 10.0f : 0.0f;
        run_case(c, rng);
      }
    }
  }
}

// Every finite fp8 code through each ISA's conversion (subnormals, the largest values, both
// signs), with scales that keep the logits moderate; and NaN codes in V reach the output dims
// they belong to. Groups of 4 and 8 (the AVX2 split path), 2 (the others).
TEST(CpuAttention, Fp8EveryCodeAndNaN) {
  FLASHKV_SEEDED_RNG(rng, 107);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
      for (int group : {2, 4, 8}) {
        Case c;
        c.op = Op::decode;
        c.kv_lens = {77, 300, 1};
        c.hq = 2 * group;
        c.hkv = 2;
        c.dqk = c.dv = 128;
        c.kv_dtype = kv;
        c.k_scale = kv == DType::fp8_e4m3 ? 1.0f / 512 : 1.0f / 65536;
        c.v_scale = 0.25f;
        c.every_fp8_byte = true;
        run_case(c, rng);
        c.nan_v = true;
        run_case(c, rng);
      }
    }
  }
}

// NaN in the cache is not hidden: a NaN key makes the scores of the query heads that see it NaN
// and so their whole output (as in the reference), on every ISA level and path (few rows and
// the tiles, with and without the soft cap, whole and split items); a NaN value reaches its own
// dims.
TEST(CpuAttention, NaNInKvReachesTheOutput) {
  FLASHKV_SEEDED_RNG(rng, 108);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (DType kv : {DType::bf16, DType::f32, DType::fp8_e4m3}) {
      for (int group : {1, 4, 8}) {
        for (Op op : {Op::decode, Op::paged_prefill}) {
          // first 1: the NaN key is all the first request sees (a block whose only visible
          // score is NaN).
          for (int first : {90, 1}) {
            Case c;
            c.op = op;
            c.kv_lens = {first, 40};
            // paged_prefill: 24 x G rows take the tiles
            c.q_lens = {op == Op::decode ? 1 : std::min(24, first), 3};
            c.hq = 2 * group;
            c.hkv = 2;
            c.dtype = kv == DType::f32 ? DType::f32 : DType::bf16;
            c.kv_dtype = kv;
            c.soft_cap = group == 4 ? 30.0f : 0.0f;
            c.causal = false;
            for (int split : {0, 32}) {  // 32: split items, merged (with the NaN chunk's state)
              c.fixed_split = split;
              for (bool k : {true, false}) {
                c.nan_k = k;
                c.nan_v = !k;
                run_case(c, rng);
              }
            }
          }
        }
      }
    }
  }
}

// Tree-verify style: draft tokens against a prefix through a random mask, with and without a
// window; non-causal cross attention.
TEST(CpuAttention, CustomMaskAndNonCausal) {
  FLASHKV_SEEDED_RNG(rng, 106);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 4; ++iter) {
      Case c;
      c.op = iter % 2 ? Op::paged_prefill : Op::ragged;
      c.kv_lens = random_lengths(rng, 4, 80);
      c.q_lens.resize(4);
      for (int i = 0; i < 4; ++i) c.q_lens[i] = std::min(c.kv_lens[i], rng.uniform_int(1, 9));
      c.hq = 8;
      c.hkv = 2;
      c.page_size = 16;
      c.custom_mask = iter < 3;
      c.causal = iter == 1;  // ignored with a mask
      c.window_left = iter == 2 ? 20 : -1;
      c.dtype = c.kv_dtype = iter == 0 ? DType::f32 : DType::bf16;
      c.fixed_split = iter == 2 ? 32 : 0;
      run_case(c, rng);
    }
  }
}

// Rows with nothing to attend: KV length 0, queries before the first key (causal), a window
// past the keys, a mask row of zeros: O = 0, LSE = -inf, never NaN.
TEST(CpuAttention, EmptyRows) {
  FLASHKV_SEEDED_RNG(rng, 107);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    Case c;
    c.op = Op::ragged;
    c.q_lens = {5, 3, 40};
    c.kv_lens = {0, 2, 35};  // request 1: row 0 sees nothing causally
    c.hq = 4;
    c.hkv = 4;
    c.dtype = c.kv_dtype = DType::f32;
    Tensor out = run_case(c, rng);
    for (int64_t i = 0; i < 5 * 4 * 64; ++i) ASSERT_EQ(out.ptr<float>()[i], 0.0f);
    c.dtype = c.kv_dtype = DType::bf16;
    c.window_left = 0;
    run_case(c, rng);
    Case d;
    d.op = Op::decode;
    d.kv_lens = {0, 0, 1, 33};
    d.hq = 8;
    d.hkv = 1;
    run_case(d, rng);
  }
}

// Deterministic mode: with a fixed split size, a request's output is bitwise the same alone or
// in a batch (whatever the thread schedule).
TEST(CpuAttention, FixedSplitIsBatchInvariant) {
  FLASHKV_SEEDED_RNG(rng, 108);
  const int hq = 8, hkv = 2, d = 64, slots = 1200;
  Tensor kc = test::random_tensor(rng, {slots, hkv, d}, DType::bf16);
  Tensor vc = test::random_tensor(rng, {slots, hkv, d}, DType::bf16);
  Tensor q = test::random_tensor(rng, {3, hq, d}, DType::bf16);
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen());
  const std::vector<int32_t> lens = {700, 150, 300};
  auto run = [&](int32_t batch) {
    std::vector<int32_t> l(lens.begin(), lens.begin() + batch);
    std::vector<int32_t> idx(perm.begin(), perm.begin() + 1150);
    Tensor indptr = Tensor::from_i32(test::indptr_of(l)), idx_t = Tensor::from_i32(idx);
    PagedKV kv{kc, vc, indptr, idx_t, TensorView(), 1};
    BatchShape bs;
    bs.batch_size = batch;
    bs.kv_len = l.data();
    bs.num_qo_heads = hq;
    bs.num_kv_heads = hkv;
    bs.head_dim_qk = bs.head_dim_v = d;
    PlanOptions po;
    po.fixed_split_size = 128;
    DecodePlan plan = plan_decode(bs, device_info(Device::cpu()), po);
    Workspace ws(plan.layout.total_bytes, Device::cpu());
    ws.upload(plan);
    Tensor out = Tensor::empty({batch, hq, d}, DType::bf16);
    test::poison(out);
    paged_decode(plan, q.view().rows(0, batch), kv, AttentionOptions(), out, TensorView(), ws);
    return out;
  };
  Tensor alone = run(1), batched = run(3);
  EXPECT_EQ(std::memcmp(alone.data(), batched.data(), hq * d * sizeof(bf16_t)), 0);
}

reference::Result result_of(const Tensor& o, const Tensor& lse) {
  reference::Result r;
  r.rows = o.size(0);
  r.heads = static_cast<int>(o.size(1));
  r.head_dim = static_cast<int>(o.size(2));
  for (int64_t i = 0; i < o.numel(); ++i) r.o.push_back(load_as_double(o.data(), o.dtype(), i));
  for (int64_t i = 0; i < lse.numel(); ++i) r.lse.push_back(lse.ptr<float>()[i]);
  return r;
}

// Random states (some with LSE = -inf and garbage O) merged against the reference merge.
TEST(CpuAttention, MergeStateAndStates) {
  FLASHKV_SEEDED_RNG(rng, 109);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const int rows = 7, heads = 3, dim = 72;
      auto random_lse = [&](Tensor& lse) {
        for (int64_t i = 0; i < lse.numel(); ++i)
          lse.ptr<float>()[i] = rng.uniform() < 0.15 ? -std::numeric_limits<float>::infinity()
                                                     : static_cast<float>(rng.normal() * 4);
      };
      Tensor oa = test::random_tensor(rng, {rows, heads, dim}, dt);
      Tensor ob = test::random_tensor(rng, {rows, heads, dim}, dt);
      Tensor la = Tensor::empty({rows, heads}, DType::f32),
             lb = Tensor::empty({rows, heads}, DType::f32);
      random_lse(la);
      random_lse(lb);
      la.ptr<float>()[0] = lb.ptr<float>()[0] = -std::numeric_limits<float>::infinity();
      Tensor o = Tensor::empty({rows, heads, dim}, dt),
             l = Tensor::empty({rows, heads}, DType::f32);
      test::poison(o);
      test::poison(l);
      merge_state(oa, la, ob, lb, o, l);
      // The reference treats a -inf state as empty; its O (random here) must not leak in.
      auto ra = result_of(oa, la), rb = result_of(ob, lb);
      for (int64_t i = 0; i < rows * heads; ++i) {
        if (std::isinf(ra.lse[i])) std::fill_n(&ra.o[i * dim], dim, 0.0);
        if (std::isinf(rb.lse[i])) std::fill_n(&rb.o[i * dim], dim, 0.0);
      }
      test::expect_close(o, l, reference::merge_states({ra, rb}), dt);

      const int n = 5;
      Tensor states = test::random_tensor(rng, {rows, n, heads, dim}, dt);
      Tensor ls = Tensor::empty({rows, n, heads}, DType::f32);
      random_lse(ls);
      Tensor o2 = Tensor::empty({rows, heads, dim}, dt),
             l2 = Tensor::empty({rows, heads}, DType::f32);
      test::poison(o2);
      test::poison(l2);
      merge_states(states, ls, o2, l2);
      std::vector<reference::Result> parts(n);
      for (int s = 0; s < n; ++s) {
        auto& r = parts[s];
        r.rows = rows;
        r.heads = heads;
        r.head_dim = dim;
        for (int64_t i = 0; i < rows; ++i)
          for (int h = 0; h < heads; ++h) {
            const float lv = ls.ptr<float>()[(i * n + s) * heads + h];
            r.lse.push_back(lv);
            for (int d = 0; d < dim; ++d)
              r.o.push_back(std::isinf(lv) ? 0.0
                                           : load_as_double(states.data(), dt,
                                                            ((i * n + s) * heads + h) * dim + d));
          }
      }
      test::expect_close(o2, l2, reference::merge_states(parts), dt);
    }
  }
}

// A few Llama-like medium cases on the best ISA: long KV, GQA 4, bf16, decode and prefill.
TEST(CpuAttention, MediumLlamaShapes) {
  FLASHKV_SEEDED_RNG(rng, 110);
  Case c;
  c.op = Op::decode;
  c.kv_lens = {1500, 777, 2049};
  c.hq = 8;
  c.hkv = 2;
  c.dqk = c.dv = 128;
  c.page_size = 16;
  run_case(c, rng);
  c.fixed_split = 256;
  run_case(c, rng);
  Case p;
  p.op = Op::paged_prefill;
  p.kv_lens = {300, 517};
  p.q_lens = {300, 129};
  p.hq = 8;
  p.hkv = 2;
  p.dqk = p.dv = 128;
  p.page_size = 16;
  run_case(p, rng);
}

// --- attention sinks ---------------------------------------------------------------------------

// Every path with random sinks against the reference: ragged and paged prefill, decode, split KV
// (the planner's own splits, forced small chunks, the deterministic fixed split), sliding window,
// soft cap, GQA 1/4/8, head dims 64/128/256, empty requests; at each ISA level.
TEST(CpuAttention, SinksOnEveryPath) {
  FLASHKV_SEEDED_RNG(rng, 131);
  const int gqa[] = {1, 4, 8};
  const int dims[] = {64, 128, 256};
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 9; ++iter) {
      const Op ops[] = {Op::ragged, Op::paged_prefill, Op::decode};
      Case c;
      c.op = ops[iter % 3];
      c.sinks = true;
      const int batch = rng.uniform_int(1, 5);
      c.kv_lens = random_lengths(rng, batch, c.op == Op::decode ? 300 : 90);
      c.kv_lens[0] = 0;  // an empty request: O = 0, LSE = the sink
      if (c.op == Op::ragged) {
        c.q_lens = random_lengths(rng, batch, 30);
      } else {
        c.q_lens.resize(batch);
        for (int i = 0; i < batch; ++i)
          c.q_lens[i] = rng.uniform_int(0, std::min(c.kv_lens[i], 30));
      }
      c.q_lens[0] = c.op == Op::ragged ? 3 : 0;
      c.hkv = rng.uniform_int(1, 2);
      c.hq = c.hkv * gqa[(iter / 3) % 3];
      c.dqk = c.dv = dims[(iter + iter / 3) % 3];
      c.page_size = iter % 2 ? 16 : 1;
      c.dtype = c.kv_dtype = iter % 4 == 0 ? DType::f32 : iter % 4 == 1 ? DType::f16 : DType::bf16;
      c.causal = c.op == Op::decode ? rng.uniform() < 0.5 : rng.uniform() < 0.8;
      c.window_left = iter % 3 == 1 ? rng.uniform_int(0, 40) : -1;
      c.soft_cap = iter % 2 == 0 ? 6.0f : 0.0f;
      c.want_lse = iter != 4;
      // Forced small chunks (many splits), the deterministic size, or the planner's choice.
      const int splits[] = {16, 64, 0};
      c.fixed_split = splits[iter % 3];
      const int q_tiles[] = {0, 1, 40};
      if (c.op != Op::decode) c.q_tile = q_tiles[(iter / 3) % 3];
      run_case(c, rng);
    }
  }
}

// Outputs in f32 (FlashInfer's o_data_type) from 16-bit inputs, on every path: within the
// tolerance, and the same values as the 16-bit output before its rounding.
TEST(CpuAttention, F32OutputOnEveryPath) {
  FLASHKV_SEEDED_RNG(rng, 134);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 6; ++iter) {
      const Op ops[] = {Op::ragged, Op::paged_prefill, Op::decode};
      Case c;
      c.op = ops[iter % 3];
      const int batch = rng.uniform_int(1, 4);
      // Rows that see a few keys at least: the check below wants most outputs off the 16-bit grid
      // (a row that sees one key returns that V row exactly).
      c.kv_lens.resize(batch);
      c.q_lens.resize(batch);
      for (int i = 0; i < batch; ++i) {
        c.kv_lens[i] = rng.uniform_int(20, c.op == Op::decode ? 300 : 90);
        c.q_lens[i] = rng.uniform_int(1, 20);
      }
      c.hkv = 2;
      c.hq = iter < 3 ? 2 : 8;
      c.dqk = c.dv = iter < 3 ? 64 : 128;
      c.page_size = iter % 2 ? 16 : 1;
      c.dtype = c.kv_dtype = iter % 2 ? DType::f16 : DType::bf16;
      c.sinks = iter >= 3;
      c.soft_cap = iter == 4 ? 5.0f : 0.0f;
      c.fixed_split = iter % 3 == 2 || iter == 4 ? 32 : 0;  // split items merge into f32 too
      Rng same = rng;                                       // both calls draw the same inputs
      const Tensor out16 = run_case(c, rng);
      c.f32_out = true;
      const Tensor out32 = run_case(c, same);
      SCOPED_TRACE(c.str());
      test::expect_unrounded_f32(out32, out16);
    }
  }
}

// Sinks on an empty batch row and on a row that sees nothing causally: O = 0, LSE = the sink in
// base 2 (split or not).
TEST(CpuAttention, SinksOnEmptyRows) {
  FLASHKV_SEEDED_RNG(rng, 132);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    Case c;
    c.op = Op::ragged;
    c.q_lens = {5, 3, 40};
    c.kv_lens = {0, 2, 35};
    c.hq = 4;
    c.hkv = 4;
    c.dtype = c.kv_dtype = DType::f32;
    c.sinks = true;
    Tensor out = run_case(c, rng);
    for (int64_t i = 0; i < 5 * 4 * 64; ++i) ASSERT_EQ(out.ptr<float>()[i], 0.0f);
    Case d;
    d.op = Op::decode;
    d.kv_lens = {0, 0, 1, 400};
    d.hq = 8;
    d.hkv = 1;
    d.sinks = true;
    d.fixed_split = 32;
    run_case(d, rng);
    // The extreme sinks, on rows with keys and without, whole and split.
    for (const int split : {0, 32}) {
      Case x;
      x.op = Op::decode;
      x.kv_lens = {0, 7, 1, 300};
      x.hq = 8;
      x.hkv = 2;
      x.sinks = x.extreme_sinks = true;
      x.fixed_split = split;
      run_case(x, rng);
      x.op = Op::ragged;
      x.q_lens = {3, 5, 1, 40};
      x.kv_lens = {0, 5, 1, 60};
      run_case(x, rng);
    }
  }
}

// Extend with a cached prefix as the backend runs it: the new tokens' causal ragged pass (no
// sinks) writes out and its LSE; the prefix's paged pass merges into them (merge_o / merge_lse)
// and adds the sinks once. The merged result equals the reference over the whole sequence with
// the sinks. Unsplit and split prefix passes; LSE wanted or not; outputs in f32 from bf16 inputs.
TEST(CpuAttention, SinksCountOnceInExtendMerge) {
  FLASHKV_SEEDED_RNG(rng, 133);
  for (const KernelPath& path : kernel_paths()) {
    PathScope scope(path);
    for (int iter = 0; iter < 6; ++iter) {
      const int hq = iter % 2 ? 8 : 4, hkv = iter % 2 ? 1 : 2, d = iter % 4 < 2 ? 64 : 128;
      const DType dt = iter == 0 ? DType::f32 : DType::bf16;
      const DType out_dt = iter >= 4 ? DType::f32 : dt;  // f32 partial and merged outputs
      const std::vector<int32_t> prefix = {0, 37, 5, 150}, news = {4, 9, 1, 12};
      const int32_t batch = 4;
      std::vector<int32_t> total(batch);
      for (int i = 0; i < batch; ++i) total[i] = prefix[i] + news[i];
      const std::vector<int32_t> qo = test::indptr_of(news);
      const int64_t tq = qo.back();
      // The whole sequences as ragged K/V (the reference's view); the new tokens are the last
      // news[i] rows of each, the prefix the first prefix[i] rows, read through token slots.
      const std::vector<int32_t> all = test::indptr_of(total);
      Tensor k = test::random_tensor(rng, {all.back(), hkv, d}, dt);
      Tensor v = test::random_tensor(rng, {all.back(), hkv, d}, dt);
      Tensor q = test::random_tensor(rng, {tq, hq, d}, dt);
      Tensor sinks = test::random_tensor(rng, {hq}, DType::f32, 3.0);
      Tensor qo_t = Tensor::from_i32(qo), all_t = Tensor::from_i32(all);
      AttentionOptions whole;
      whole.sinks = sinks;
      const reference::Result ref = reference::ragged_attention(q, k, v, qo_t, all_t, whole);

      std::vector<int32_t> new_kv(batch + 1, 0), slots, prefix_indptr(batch + 1, 0);
      Tensor k_new = Tensor::empty({tq, hkv, d}, dt), v_new = Tensor::empty({tq, hkv, d}, dt);
      const size_t row_bytes = size_t(hkv) * d * dtype_size(dt);
      for (int i = 0; i < batch; ++i) {
        std::memcpy(static_cast<char*>(k_new.data()) + qo[i] * row_bytes,
                    static_cast<char*>(k.data()) + (all[i] + prefix[i]) * row_bytes,
                    news[i] * row_bytes);
        std::memcpy(static_cast<char*>(v_new.data()) + qo[i] * row_bytes,
                    static_cast<char*>(v.data()) + (all[i] + prefix[i]) * row_bytes,
                    news[i] * row_bytes);
        for (int t = 0; t < prefix[i]; ++t) slots.push_back(all[i] + t);
        prefix_indptr[i + 1] = prefix_indptr[i] + prefix[i];
      }
      Tensor out = Tensor::empty({tq, hq, d}, out_dt), lse_a = Tensor::empty({tq, hq}, DType::f32);
      Tensor lse = Tensor::empty({tq, hq}, DType::f32);
      test::poison(out);
      test::poison(lse_a);
      test::poison(lse);
      const DeviceInfo dev = device_info(Device::cpu());
      BatchShape bs;
      bs.batch_size = batch;
      bs.qo_indptr = qo.data();
      bs.kv_len = news.data();
      bs.num_qo_heads = hq;
      bs.num_kv_heads = hkv;
      bs.head_dim_qk = bs.head_dim_v = d;
      PrefillPlan ragged_plan = plan_prefill(bs, dev, PlanOptions());
      Workspace ws_r(ragged_plan.layout.total_bytes, Device::cpu());
      ws_r.upload(ragged_plan);
      AttentionOptions new_opt;  // no sinks: the prefix pass adds them
      ragged_prefill(ragged_plan, q, k_new, v_new, qo_t, qo_t, new_opt, out, lse_a, ws_r);

      BatchShape ps = bs;
      ps.kv_len = prefix.data();
      ps.causal = false;
      PlanOptions po;
      po.fixed_split_size = iter % 2 ? 32 : 0;  // split prefix rows merge their chunks first
      PrefillPlan paged_plan = plan_prefill(ps, dev, po);
      if (iter % 2) EXPECT_FALSE(paged_plan.merges.empty()) << "expected split items";
      Workspace ws_p(paged_plan.layout.total_bytes, Device::cpu());
      ws_p.upload(paged_plan);
      Tensor indptr_t = Tensor::from_i32(prefix_indptr);
      Tensor idx_t = Tensor::from_i32(slots.empty() ? std::vector<int32_t>{0} : slots);
      PagedKV kv{k, v, indptr_t, idx_t, TensorView(), 1};
      AttentionOptions prefix_opt;
      prefix_opt.causal = false;
      prefix_opt.merge_o = out;
      prefix_opt.merge_lse = lse_a;
      prefix_opt.sinks = sinks;
      const bool want_lse = iter != 2;
      paged_prefill(paged_plan, q, qo_t, kv, prefix_opt, out,
                    want_lse ? TensorView(lse) : TensorView(), ws_p);
      SCOPED_TRACE(str_cat("iter ", iter, " isa ", cpu::isa_name(cpu::active_isa())));
      test::expect_close(out, want_lse ? TensorView(lse) : TensorView(), ref, dt, false);
    }
  }
}

// A small bf16 decode (2 requests of 5 and 9 tokens, 4/2 heads, head dim 64) planned and
// uploaded on the CPU, for the tests of one argument's checks.
struct SmallDecode {
  static constexpr int hq = 4, hkv = 2, d = 64;
  const std::vector<int32_t> lens = {5, 9};
  Tensor kc, vc, q, indptr, indices;
  PagedKV kv;
  DecodePlan plan;
  Workspace ws;

  explicit SmallDecode(Rng& rng)
      : kc(test::random_tensor(rng, {16, hkv, d}, DType::bf16)),
        vc(test::random_tensor(rng, {16, hkv, d}, DType::bf16)),
        q(test::random_tensor(rng, {2, hq, d}, DType::bf16)),
        indptr(Tensor::from_i32({0, 5, 14})) {
    std::vector<int32_t> idx(14);
    std::iota(idx.begin(), idx.end(), 0);
    indices = Tensor::from_i32(idx);
    kv = PagedKV{kc, vc, indptr, indices, TensorView(), 1};
    BatchShape bs;
    bs.batch_size = 2;
    bs.kv_len = lens.data();
    bs.num_qo_heads = hq;
    bs.num_kv_heads = hkv;
    bs.head_dim_qk = bs.head_dim_v = d;
    plan = plan_decode(bs, device_info(Device::cpu()), PlanOptions());
    ws.reserve(plan.layout.total_bytes, Device::cpu());
    ws.upload(plan);
  }
  // The error message of paged_decode with these options into `out` ("" when it runs).
  std::string error(const AttentionOptions& opt, const Tensor& out) {
    return test::error_of([&] { paged_decode(plan, q, kv, opt, out, TensorView(), ws); });
  }
};

// sinks: dtype, shape, layout and device checked, each error naming it.
TEST(CpuAttention, SinksBadInput) {
  FLASHKV_SEEDED_RNG(rng, 134);
  SmallDecode call(rng);
  const int hq = SmallDecode::hq;
  Tensor out = Tensor::empty({2, hq, SmallDecode::d}, DType::bf16);
  auto error_with = [&](const TensorView& sinks) {
    AttentionOptions opt;
    opt.sinks = sinks;
    return call.error(opt, out);
  };
  Tensor f16 = test::random_tensor(rng, {hq}, DType::f16);
  EXPECT_NE(error_with(f16).find("sinks: expected dtype f32"), std::string::npos)
      << error_with(f16);
  Tensor wrong = test::random_tensor(rng, {hq + 1}, DType::f32);
  EXPECT_NE(error_with(wrong).find("sinks: expected size 4"), std::string::npos)
      << error_with(wrong);
  Tensor two_d = test::random_tensor(rng, {1, hq}, DType::f32);
  EXPECT_NE(error_with(two_d).find("sinks"), std::string::npos) << error_with(two_d);
  Tensor strided = test::random_tensor(rng, {2 * hq}, DType::f32);
  TensorView every_other = strided.view();
  every_other.shape[0] = hq;
  every_other.stride[0] = 2;
  EXPECT_NE(error_with(every_other).find("sinks"), std::string::npos) << error_with(every_other);
  Tensor good = test::random_tensor(rng, {hq}, DType::f32);
  TensorView on_gpu = good.view();
  on_gpu.device = Device::cuda(0);
  EXPECT_NE(error_with(on_gpu).find("sinks: expected device cpu"), std::string::npos)
      << error_with(on_gpu);
}

// out: q's dtype or f32 (o_data_type); another dtype is refused naming out and what it takes.
TEST(CpuAttention, OutDtypeBadInput) {
  FLASHKV_SEEDED_RNG(rng, 135);
  SmallDecode call(rng);
  auto error_with = [&](DType out_dtype) {
    return call.error({}, Tensor::empty({2, SmallDecode::hq, SmallDecode::d}, out_dtype));
  };
  EXPECT_EQ(error_with(DType::bf16), "");
  EXPECT_EQ(error_with(DType::f32), "");
  const std::string e = error_with(DType::f16);
  EXPECT_NE(e.find("out: expected dtype bf16/f32, got f16"), std::string::npos) << e;
}

}  // namespace
}  // namespace flashkv
