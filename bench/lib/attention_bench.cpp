#include "attention_bench.h"

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <random>
#include <utility>

#include "cuda_timing.h"
#include "flashkv/core/buffer.h"
#include "flashkv/core/options.h"
#include "flashkv/core/thread_pool.h"
#include "flashkv/ops/attention.h"

namespace flashkv::bench {
namespace {

// ---- random inputs --------------------------------------------------------------------------

// Counter-based: value i depends only on (seed, i), so inputs do not depend on the thread count.
inline float uniform_pm1(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <typename Store>
void fill_with(int64_t n, uint64_t seed, const Store& store) {
  constexpr int64_t kBlock = int64_t{1} << 16;
  ThreadPool::global().parallel_for((n + kBlock - 1) / kBlock, [&](int64_t b, int) {
    const int64_t end = std::min(n, (b + 1) * kBlock);
    // Unit variance: uniform on [-sqrt(3), sqrt(3)).
    for (int64_t i = b * kBlock; i < end; ++i) store(i, 1.7320508f * uniform_pm1(seed, i));
  });
}

}  // namespace

void fill_random(const Tensor& t, uint64_t seed) {
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::f32:
      fill_with(n, seed, [p = t.ptr<float>()](int64_t i, float x) { p[i] = x; });
      return;
    case DType::f16:
      fill_with(n, seed, [p = t.ptr<f16_t>()](int64_t i, float x) { p[i] = to_f16(x); });
      return;
    case DType::bf16:
      fill_with(n, seed, [p = t.ptr<bf16_t>()](int64_t i, float x) { p[i] = to_bf16(x); });
      return;
    case DType::fp8_e4m3:
      fill_with(n, seed, [p = t.ptr<fp8_e4m3_t>()](int64_t i, float x) { p[i] = to_fp8_e4m3(x); });
      return;
    case DType::fp8_e5m2:
      fill_with(n, seed, [p = t.ptr<fp8_e5m2_t>()](int64_t i, float x) { p[i] = to_fp8_e5m2(x); });
      return;
    default:
      throw_error(str_cat("fill_random: expected a float dtype, got ", dtype_name(t.dtype())));
  }
}

namespace {

// Everything one case's runs touch; lives until its timing is done.
struct CaseState {
  Device device;
  uint64_t seed = 1;
  std::mt19937_64 gen;

  Tensor q, out;
  // decode / prefix of extend: the paged KV pool and its tables.
  Tensor pool_k, pool_v, kv_indptr, kv_indices, last_page_len;
  PagedKV paged;
  // prefill / new tokens of extend: contiguous K/V and their indptrs.
  Tensor new_k, new_v, qo_indptr, new_kv_indptr;
  // extend: the ragged pass's LSE (its output is `out`, which the paged pass merges into).
  Tensor lse_new;
  // verify: the tree mask of every request (u8, request after request) and its offsets.
  Tensor mask, mask_indptr;
  Tensor sinks;  // f32 [num_qo_heads] (BenchCase::sinks)
  DecodePlan decode_plan;
  PrefillPlan ragged_plan, paged_plan;
  Workspace ragged_ws, paged_ws;

  Tensor random(std::initializer_list<int64_t> shape, DType dtype) {
    Tensor host = Tensor::empty(shape, dtype);
    fill_random(host, seed++);
    return device.is_cpu() ? host : host.to(device);
  }
  Tensor empty(std::initializer_list<int64_t> shape, DType dtype) const {
    return Tensor::empty(shape, dtype, device);
  }
  Tensor ints(const std::vector<int32_t>& v) const { return Tensor::from_i32(v, device); }

  // `batch` requests of `len` tokens each on the pool's pages, in order or shuffled.
  void make_pool(const BenchCase& c, int len) {
    const int p = c.page_size;
    const int pages_per_request = (len + p - 1) / p;
    const int64_t num_pages = int64_t{c.batch} * pages_per_request;
    pool_k = random({num_pages * p, c.num_kv_heads, c.head_dim}, c.kv_dtype);
    pool_v = random({num_pages * p, c.num_kv_heads, c.head_dim}, c.kv_dtype);
    std::vector<int32_t> order(num_pages), indptr(c.batch + 1), last(c.batch);
    std::iota(order.begin(), order.end(), 0);
    if (c.kv_layout == KvLayout::shuffled) std::shuffle(order.begin(), order.end(), gen);
    for (int i = 0; i <= c.batch; ++i) indptr[i] = i * pages_per_request;
    for (int i = 0; i < c.batch; ++i) last[i] = len - (pages_per_request - 1) * p;
    kv_indptr = ints(indptr);
    kv_indices = ints(order);
    last_page_len = ints(last);
    paged = PagedKV{
        pool_k, pool_v, kv_indptr, kv_indices, p > 1 ? last_page_len.view() : TensorView(), p};
  }
};

BatchShape batch_shape(const BenchCase& c, const std::vector<int32_t>* qo_indptr,
                       const std::vector<int32_t>& kv_lens, bool causal, int page_size) {
  BatchShape bs;
  bs.batch_size = c.batch;
  bs.qo_indptr = qo_indptr ? qo_indptr->data() : nullptr;
  bs.kv_len = kv_lens.data();
  bs.num_qo_heads = c.num_qo_heads;
  bs.num_kv_heads = c.num_kv_heads;
  bs.head_dim_qk = bs.head_dim_v = c.head_dim;
  bs.page_size = page_size;
  bs.causal = causal;
  return bs;
}

// Builds the inputs, plans and uploads; returns the function one timed run calls.
std::function<void(Stream)> prepare(const BenchCase& c, const BenchOptions& o, CaseState& s) {
  s.device = c.device;
  s.seed = o.seed;
  s.gen.seed(o.seed);
  const DeviceInfo info = device_info(c.device);
  const int64_t rows = int64_t{c.batch} * c.qo_len;
  s.q = s.random({rows, c.num_qo_heads, c.head_dim}, c.dtype);
  s.out = s.empty({rows, c.num_qo_heads, c.head_dim}, c.dtype);
  const PlanOptions po;
  AttentionOptions causal;  // the new tokens' own pass: causal (unless the case is not), window
  causal.causal = c.causal;
  causal.window_left = c.window_left;
  causal.logits_soft_cap = c.logit_cap;
  AttentionOptions non_causal;
  non_causal.causal = false;
  non_causal.logits_soft_cap = c.logit_cap;
  if (c.sinks) s.sinks = s.random({c.num_qo_heads}, DType::f32);
  // The pass that writes a row's final result takes the sinks (once per row).
  AttentionOptions final_causal = causal;
  if (c.sinks) final_causal.sinks = s.sinks;

  if (c.op == BenchOp::verify) {
    // As the backend runs TARGET_VERIFY: the draft tokens' K/V are already in the pool (appended
    // before attention), and one non-causal paged pass over prefix + drafts applies the tree mask
    // (planned non-causal: a custom mask replaces causal).
    s.make_pool(c, c.kv_len);
    const int64_t mask_size = int64_t{c.qo_len} * c.kv_len;
    FLASHKV_CHECK(mask_size * c.batch <= INT32_MAX, "verify: the tree mask has more than 2^31 - 1 ",
                  "entries (batch ", c.batch, " x ", c.qo_len, " x ", c.kv_len, ")");
    std::vector<int32_t> qo(c.batch + 1), mask_offsets(c.batch + 1);
    for (int i = 0; i <= c.batch; ++i) {
      qo[i] = i * c.qo_len;
      mask_offsets[i] = static_cast<int32_t>(i * mask_size);
    }
    const std::vector<uint8_t> one = verify_tree_mask(c);
    Tensor mask = Tensor::empty({int64_t{c.batch} * c.qo_len * c.kv_len}, DType::u8);
    for (int i = 0; i < c.batch; ++i)
      std::copy(one.begin(), one.end(), mask.ptr<uint8_t>() + mask_offsets[i]);
    s.mask = c.device.is_cpu() ? mask : mask.to(c.device);
    s.mask_indptr = s.ints(mask_offsets);
    s.qo_indptr = s.ints(qo);
    const std::vector<int32_t> lens(c.batch, c.kv_len);
    s.paged_plan = plan_prefill(batch_shape(c, &qo, lens, false, c.page_size), info, po);
    s.paged_ws.reserve(s.paged_plan.layout.total_bytes, c.device);
    s.paged_ws.upload(s.paged_plan);
    synchronize(c.device);
    AttentionOptions tree = final_causal;
    tree.causal = false;
    tree.custom_mask = s.mask;
    tree.mask_indptr = s.mask_indptr;
    return [&s, tree](Stream st) {
      paged_prefill(s.paged_plan, s.q, s.qo_indptr, s.paged, tree, s.out, TensorView(), s.paged_ws,
                    st);
    };
  }

  if (c.op == BenchOp::decode) {
    s.make_pool(c, c.kv_len);
    const std::vector<int32_t> lens(c.batch, c.kv_len);
    s.decode_plan = plan_decode(batch_shape(c, nullptr, lens, false, c.page_size), info, po);
    s.ragged_ws.reserve(s.decode_plan.layout.total_bytes, c.device);
    s.ragged_ws.upload(s.decode_plan);
    synchronize(c.device);
    return [&s, final_causal](Stream st) {
      paged_decode(s.decode_plan, s.q, s.paged, final_causal, s.out, TensorView(), s.ragged_ws, st);
    };
  }

  // prefill and extend: the new tokens attend to themselves (causally unless c.causal is false).
  std::vector<int32_t> qo(c.batch + 1);
  for (int i = 0; i <= c.batch; ++i) qo[i] = i * c.qo_len;
  const std::vector<int32_t> new_lens(c.batch, c.qo_len);
  s.qo_indptr = s.ints(qo);
  if (c.one_paged_pass) {
    // Extend in one paged pass: prefix and new tokens in the pool, each new row seeing the
    // whole prefix and (causally) the new tokens.
    s.make_pool(c, c.kv_len);
    const std::vector<int32_t> lens(c.batch, c.kv_len);
    s.paged_plan = plan_prefill(batch_shape(c, &qo, lens, c.causal, c.page_size), info, po);
    s.paged_ws.reserve(s.paged_plan.layout.total_bytes, c.device);
    s.paged_ws.upload(s.paged_plan);
    synchronize(c.device);
    return [&s, final_causal](Stream st) {
      paged_prefill(s.paged_plan, s.q, s.qo_indptr, s.paged, final_causal, s.out, TensorView(),
                    s.paged_ws, st);
    };
  }
  s.new_kv_indptr = s.qo_indptr;
  s.new_k = s.random({rows, c.num_kv_heads, c.head_dim}, c.dtype);
  s.new_v = s.random({rows, c.num_kv_heads, c.head_dim}, c.dtype);
  s.ragged_plan = plan_prefill(batch_shape(c, &qo, new_lens, c.causal, 1), info, po);
  s.ragged_ws.reserve(s.ragged_plan.layout.total_bytes, c.device);
  s.ragged_ws.upload(s.ragged_plan);
  if (c.op == BenchOp::prefill || c.prefix_len() == 0) {
    synchronize(c.device);
    return [&s, final_causal](Stream st) {
      ragged_prefill(s.ragged_plan, s.q, s.new_k, s.new_v, s.qo_indptr, s.new_kv_indptr,
                     final_causal, s.out, TensorView(), s.ragged_ws, st);
    };
  }

  // extend with a prefix: + non-causal paged attention over the prefix, merged by LSE, as the
  // backend's ragged path runs it: the paged pass merges each row with the ragged pass's state as
  // it writes it (in place, launched to overlap the ragged pass where the GPU can).
  s.make_pool(c, c.prefix_len());
  const std::vector<int32_t> prefix_lens(c.batch, c.prefix_len());
  s.paged_plan = plan_prefill(batch_shape(c, &qo, prefix_lens, false, c.page_size), info, po);
  s.paged_ws.reserve(s.paged_plan.layout.total_bytes, c.device);
  s.paged_ws.upload(s.paged_plan);
  s.lse_new = s.empty({rows, c.num_qo_heads}, DType::f32);
  synchronize(c.device);
  AttentionOptions prefix = non_causal;
  prefix.merge_o = s.out;
  prefix.merge_lse = s.lse_new;
  prefix.overlap_previous = true;
  if (c.sinks) prefix.sinks = s.sinks;
  return [&s, causal, prefix](Stream st) {
    ragged_prefill(s.ragged_plan, s.q, s.new_k, s.new_v, s.qo_indptr, s.new_kv_indptr, causal,
                   s.out, s.lse_new, s.ragged_ws, st);
    paged_prefill(s.paged_plan, s.q, s.qo_indptr, s.paged, prefix, s.out, s.lse_new, s.paged_ws,
                  st);
  };
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times the callables of `runs` on the CPU in turns (run 0, run 1, ..., then run 0 again), one
// sample a call into times[i], after o.warmup untimed turns: until each has o.min_runs samples
// and the turns took o.min_seconds for each callable, or each has o.max_runs.
void time_cpu_turns(std::initializer_list<const std::function<void(Stream)>*> runs,
                    const BenchOptions& o, detail::TimedRuns* times) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < o.warmup; ++i)
    for (const auto* run : runs) (*run)(Stream{});
  const auto start = Clock::now();
  for (;;) {
    detail::TimedRuns* t = times;
    for (const auto* run : runs) {
      const auto t0 = Clock::now();
      (*run)(Stream{});
      t->us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      t->runs++;
      ++t;
    }
    const double spent = std::chrono::duration<double>(Clock::now() - start).count();
    if (times->runs >= o.min_runs &&
        (spent >= static_cast<double>(runs.size()) * o.min_seconds || times->runs >= o.max_runs))
      break;
  }
}

detail::TimedRuns time_cpu(const std::function<void(Stream)>& run, const BenchOptions& o) {
  detail::TimedRuns t;
  time_cpu_turns({&run}, o, &t);
  return t;
}

}  // namespace

const char* op_name(BenchOp op) {
  switch (op) {
    case BenchOp::decode:
      return "decode";
    case BenchOp::prefill:
      return "prefill";
    case BenchOp::extend:
      return "extend";
    case BenchOp::verify:
      return "verify";
  }
  return "?";
}

BenchOp parse_op(const std::string& name) {
  if (name == "decode") return BenchOp::decode;
  if (name == "prefill") return BenchOp::prefill;
  if (name == "extend") return BenchOp::extend;
  if (name == "verify") return BenchOp::verify;
  throw_error(str_cat("op: expected decode, prefill, extend or verify, got '", name, "'"));
}

const char* kv_layout_name(KvLayout layout) {
  return layout == KvLayout::in_order ? "in_order" : "shuffled";
}

const char* BenchCase::layout_name() const {
  return reads_pool() ? kv_layout_name(kv_layout) : "none";
}

const char* BenchCase::mask_name() const {
  switch (op) {
    case BenchOp::decode:
      return "none";
    case BenchOp::verify:
      return "tree";
    case BenchOp::prefill:
    case BenchOp::extend:
      break;
  }
  return causal ? "causal" : "non-causal";
}

std::string BenchCase::str() const {
  return str_cat(op_name(op), " B=", batch, " qo=", qo_len, " kv=", kv_len, " ", num_qo_heads, "/",
                 num_kv_heads, "/", head_dim, " P=", page_size, " ", layout_name(), " ",
                 dtype_name(dtype), "/", dtype_name(kv_dtype), " ", device.str(),
                 window_left >= 0 ? str_cat(" win=", window_left) : std::string(),
                 logit_cap > 0 ? str_cat(" cap=", logit_cap) : std::string(), sinks ? " sinks" : "",
                 one_paged_pass ? " one-pass" : "",
                 op == BenchOp::verify              ? " tree-mask"
                 : !causal && op != BenchOp::decode ? " non-causal"
                                                    : "",
                 env.empty() ? std::string() : str_cat(" ", env));
}

BenchCase decode_case(int batch, int kv_len, Device device, int hq, int hkv, int d, DType kv_dtype,
                      KvLayout layout) {
  BenchCase c;
  c.op = BenchOp::decode;
  c.batch = batch;
  c.qo_len = 1;
  c.kv_len = kv_len;
  c.num_qo_heads = hq;
  c.num_kv_heads = hkv;
  c.head_dim = d;
  c.kv_dtype = kv_dtype;
  c.kv_layout = layout;
  c.device = device;
  return c;
}

BenchCase prefill_case(int batch, int len, Device device, int hq, int hkv, int d) {
  BenchCase c = decode_case(batch, len, device, hq, hkv, d);
  c.op = BenchOp::prefill;
  c.qo_len = len;
  return c;
}

BenchCase extend_case(int batch, int prefix_len, int new_len, Device device, int hq, int hkv,
                      int d) {
  BenchCase c = decode_case(batch, prefix_len + new_len, device, hq, hkv, d);
  c.op = BenchOp::extend;
  c.qo_len = new_len;
  return c;
}

BenchCase verify_case(int batch, int prefix_len, int drafts, Device device, int hq, int hkv,
                      int d) {
  BenchCase c = extend_case(batch, prefix_len, drafts, device, hq, hkv, d);
  c.op = BenchOp::verify;
  return c;
}

int verify_tree_parent(int t) { return t <= 0 ? -1 : (t - 1) / 2; }

std::vector<uint8_t> verify_tree_mask(const BenchCase& c) {
  const int n = c.qo_len, kv = c.kv_len, prefix = c.prefix_len();
  std::vector<uint8_t> m(size_t(n) * size_t(kv), 0);
  for (int t = 0; t < n; ++t) {
    uint8_t* row = m.data() + size_t(t) * size_t(kv);
    std::fill(row, row + prefix, uint8_t{1});
    for (int a = t; a >= 0; a = verify_tree_parent(a)) row[prefix + a] = 1;
  }
  return m;
}

double case_flops(const BenchCase& c) {
  // Each allowed (query row, key) pair costs 2 * D FLOPs in QK^T and 2 * D in PV, per query
  // head. Pairs a mask hides are not counted, whether or not a kernel computes them: they are
  // not useful work, so the rate says how fast the case's own work was done.
  const double per_pair = 4.0 * c.num_qo_heads * c.head_dim;
  const double n = c.qo_len, prefix = c.prefix_len();
  if (c.op == BenchOp::verify) {
    // The ones of the tree mask: the whole prefix for each draft, plus its ancestors and itself.
    const std::vector<uint8_t> m = verify_tree_mask(c);
    const double pairs = double(std::count(m.begin(), m.end(), uint8_t{1}));
    return double(c.batch) * per_pair * pairs;
  }
  if (c.op == BenchOp::decode) return double(c.batch) * per_pair * c.kv_len;
  // prefill and extend: every new row sees the whole prefix; among the new tokens, non-causal
  // rows see all n, causal row q sees q + 1 (sum n (n + 1) / 2), at most w + 1 with a window.
  double own = c.causal ? n * (n + 1) / 2 : n * n;
  if (c.causal && c.window_left >= 0 && n > c.window_left + 1) {
    const double w1 = c.window_left + 1.0;
    own = w1 * (w1 + 1) / 2 + (n - w1) * w1;
  }
  return double(c.batch) * per_pair * (n * prefix + own);
}

double case_bytes(const BenchCase& c) {
  const double row = double(c.batch) * c.qo_len;
  const double qo_bytes = 2.0 * row * c.num_qo_heads * c.head_dim * dtype_size(c.dtype);
  const double kv_row = 2.0 * c.num_kv_heads * c.head_dim;  // K and V of one token
  // Verify's drafts are in the pool (kv_len tokens a request, all paged), and it reads its u8
  // tree mask, [qo_len, kv_len] a request.
  const bool all_paged = c.op == BenchOp::decode || c.op == BenchOp::verify ||
                         (c.op == BenchOp::extend && c.one_paged_pass);
  const double paged_tokens = all_paged                 ? double(c.batch) * c.kv_len
                              : c.op == BenchOp::extend ? double(c.batch) * c.prefix_len()
                                                        : 0.0;
  const double new_tokens = all_paged ? 0.0 : row;
  const double mask_bytes = c.op == BenchOp::verify ? row * c.kv_len : 0.0;
  return qo_bytes + mask_bytes +
         kv_row * (paged_tokens * dtype_size(c.kv_dtype) + new_tokens * dtype_size(c.dtype));
}

namespace {

// The variable a case's switch sets (BenchCase::env: "NAME=VALUE"); throws flashkv::Error unless
// NAME is one of kEnvSwitches.
std::string switch_name(const std::string& env) {
  const size_t eq = env.find('=');
  FLASHKV_CHECK(eq != std::string::npos && eq > 0, "env: expected NAME=VALUE, got '", env, "'");
  std::string name = env.substr(0, eq);
  for (const EnvSwitch& s : kEnvSwitches)
    if (name == s.name) return name;
  std::string known;
  for (const EnvSwitch& s : kEnvSwitches) known += str_cat(known.empty() ? "" : ", ", s.name);
  throw_error(str_cat("env: '", name, "' is not a flashkv switch (expected one of ", known, ")"));
}

// Sets a case's switch for its lifetime, then puts back what the variable held (or unsets it).
class CaseSwitch {
 public:
  explicit CaseSwitch(const std::string& env) {
    if (env.empty()) return;
    name_ = switch_name(env);
    if (const char* outer = std::getenv(name_.c_str())) {
      had_ = true;
      saved_ = outer;
    }
    FLASHKV_CHECK(setenv(name_.c_str(), env.c_str() + name_.size() + 1, 1) == 0, "env: setenv ",
                  name_, " failed");
  }
  ~CaseSwitch() {
    if (name_.empty()) return;
    if (had_)
      setenv(name_.c_str(), saved_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  CaseSwitch(const CaseSwitch&) = delete;
  CaseSwitch& operator=(const CaseSwitch&) = delete;

 private:
  std::string name_, saved_;
  bool had_ = false;
};

}  // namespace

void validate_case(const BenchCase& c) {
  if (!c.env.empty()) switch_name(c.env);
  FLASHKV_CHECK(c.batch >= 1, "batch: expected >= 1, got ", c.batch);
  FLASHKV_CHECK(c.qo_len >= 1, "qo_len: expected >= 1, got ", c.qo_len);
  FLASHKV_CHECK(c.kv_len >= c.qo_len, "kv_len: expected >= qo_len (", c.qo_len, "), got ",
                c.kv_len);
  FLASHKV_CHECK(c.op != BenchOp::decode || c.qo_len == 1, "qo_len: decode expects 1, got ",
                c.qo_len);
  FLASHKV_CHECK(c.op != BenchOp::prefill || c.qo_len == c.kv_len,
                "kv_len: prefill expects kv_len == qo_len (", c.qo_len, "), got ", c.kv_len);
  FLASHKV_CHECK(c.op != BenchOp::verify || c.prefix_len() >= 1,
                "kv_len: verify expects a prefix (kv_len > qo_len ", c.qo_len, "), got ", c.kv_len);
  // One paged pass is an extend's alternative (without a window, whose keys the two passes cut
  // differently).
  FLASHKV_CHECK(!c.one_paged_pass || (c.op == BenchOp::extend && c.window_left < 0),
                "one_paged_pass: expected an extend case without a window, got ", c.str());
  // The FLOP count of a non-causal case has no window term; a verify case's mask is its tree.
  FLASHKV_CHECK(c.window_left < 0 || (c.causal && c.op != BenchOp::verify),
                "window_left: a non-causal or verify case takes no window, got ", c.window_left);
  FLASHKV_CHECK(c.num_kv_heads >= 1 && c.num_qo_heads >= 1 && c.num_qo_heads % c.num_kv_heads == 0,
                "num_qo_heads/num_kv_heads: expected a positive multiple, got ", c.num_qo_heads,
                "/", c.num_kv_heads);
  FLASHKV_CHECK(c.head_dim >= 1, "head_dim: expected >= 1, got ", c.head_dim);
  FLASHKV_CHECK(c.page_size >= 1, "page_size: expected >= 1, got ", c.page_size);
  FLASHKV_CHECK(is_float(c.dtype) && !is_fp8(c.dtype), "dtype: expected f32/f16/bf16, got ",
                dtype_name(c.dtype));
  FLASHKV_CHECK(c.kv_dtype == c.dtype || is_fp8(c.kv_dtype), "kv_dtype: expected ",
                dtype_name(c.dtype), " or fp8, got ", dtype_name(c.kv_dtype));
}

namespace {

void check_runnable(const BenchCase& c, const Roofline& machine, const BenchOptions& o) {
  validate_case(c);
  FLASHKV_CHECK(c.device == machine.device, "device: case on ", c.device.str(),
                ", roofline measured on ", machine.device.str());
  FLASHKV_CHECK(o.min_runs >= 1 && o.max_runs >= o.min_runs && o.warmup >= 0,
                "BenchOptions: expected warmup >= 0 and 1 <= min_runs <= max_runs, got ", o.warmup,
                ", ", o.min_runs, ", ", o.max_runs);
}

detail::TimedRuns time_run(Device device, const std::function<void(Stream)>& run,
                           const BenchOptions& o) {
  if (device.is_cpu()) return time_cpu(run, o);
#if FLASHKV_WITH_CUDA
  return detail::time_cuda(device, run, o);
#else
  throw_error(str_cat("device ", device.str(), ": this flashkv was built without CUDA"));
#endif
}

CaseResult result_of(const BenchCase& c, const detail::TimedRuns& t, const Roofline& machine) {
  CaseResult r;
  r.c = c;
  r.us = median(t.us);
  r.runs = t.runs;
  r.cuda_graph = t.cuda_graph;
  set_rates(r, machine);
  return r;
}

// CPU: times a and b call by call in turn (a, b, a, b, ...) for the time budget of both, so that
// what changes in the machine from one millisecond to the next falls on both alike. Returns the
// median of the calls' ratios b / a.
double time_cpu_interleaved(const std::function<void(Stream)>& a,
                            const std::function<void(Stream)>& b, const BenchOptions& o,
                            detail::TimedRuns& ta, detail::TimedRuns& tb) {
  detail::TimedRuns t[2];
  time_cpu_turns({&a, &b}, o, t);
  std::vector<double> ratios(t[0].us.size());
  for (size_t i = 0; i < ratios.size(); ++i) ratios[i] = t[1].us[i] / t[0].us[i];
  ta = std::move(t[0]);
  tb = std::move(t[1]);
  return median(ratios);
}

// Times a case and its twin (b.paired) in alternating rounds, each round giving each side
// 1/kRounds of the time budget (on the CPU, their calls alternate inside a round too): what
// changes in the machine during the pair's timing (clocks, heat, a neighbour's load) then falls
// on both, and the rounds' ratios show the spread that is left.
std::pair<CaseResult, CaseResult> run_pair(const BenchCase& a, const BenchCase& b,
                                           const Roofline& machine, const BenchOptions& o) {
  constexpr int kRounds = 7;
  CaseState sa, sb;
  // Each side under its own switch (BenchCase::env): while it is prepared and timed, and on the
  // CPU, whose calls alternate inside a round, around each call.
  const auto prepared = [&](const BenchCase& c, CaseState& state) {
    CaseSwitch on(c.env);
    std::function<void(Stream)> run = prepare(c, o, state);
    if (c.env.empty() || !c.device.is_cpu()) return run;
    return std::function<void(Stream)>([run, env = c.env](Stream s) {
      CaseSwitch each(env);
      run(s);
    });
  };
  const std::function<void(Stream)> run_a = prepared(a, sa), run_b = prepared(b, sb);
  BenchOptions round = o;
  round.min_seconds = o.min_seconds / kRounds;
  round.max_runs = std::max(o.min_runs, o.max_runs / kRounds);
  detail::TimedRuns ta, tb;
  std::vector<double> ratios;
  for (int i = 0; i < kRounds; ++i) {
    detail::TimedRuns ra, rb;
    if (a.device.is_cpu()) {
      ratios.push_back(time_cpu_interleaved(run_a, run_b, round, ra, rb));
    } else {
      {
        CaseSwitch on(a.env);
        ra = time_run(a.device, run_a, round);
      }
      {
        CaseSwitch on(b.env);
        rb = time_run(b.device, run_b, round);
      }
      ratios.push_back(median(rb.us) / median(ra.us));
    }
    for (auto [to, from] : {std::pair{&ta, &ra}, std::pair{&tb, &rb}}) {
      to->us.insert(to->us.end(), from->us.begin(), from->us.end());
      to->runs += from->runs;
      to->cuda_graph = from->cuda_graph;
    }
  }
  std::pair<CaseResult, CaseResult> r{result_of(a, ta, machine), result_of(b, tb, machine)};
  r.first.rounds = r.second.rounds = kRounds;
  r.second.vs_twin = median(ratios);
  r.second.vs_twin_min = *std::min_element(ratios.begin(), ratios.end());
  r.second.vs_twin_max = *std::max_element(ratios.begin(), ratios.end());
  return r;
}

}  // namespace

CaseResult run_case(const BenchCase& c, const Roofline& machine, const BenchOptions& o) {
  check_runnable(c, machine, o);
  const CaseSwitch on(c.env);
  CaseState state;
  const std::function<void(Stream)> run = prepare(c, o, state);
  return result_of(c, time_run(c.device, run, o), machine);
}

std::vector<BenchCase> switch_twins(const std::vector<BenchCase>& cases, const std::string& env) {
  const std::string name = switch_name(env);
  // The cases before the twins run with the variable as the environment has it: unset, so that
  // they run the default.
  FLASHKV_CHECK(std::getenv(name.c_str()) == nullptr, "env: ", name,
                " is set in the environment; unset it, so that the cases the twins are compared "
                "with run the default");
  std::vector<BenchCase> out;
  for (BenchCase c : cases) {
    c.paired = false;
    c.env.clear();
    out.push_back(c);
    c.paired = true;
    c.env = env;
    out.push_back(c);
  }
  return out;
}

void set_rates(CaseResult& r, const Roofline& machine, double scale) {
  const BenchCase& c = r.c;
  r.gbps = case_bytes(c) / (r.us * 1e-6) / 1e9;
  r.tflops = case_flops(c) / (r.us * 1e-6) / 1e12;
  const double read = scale * machine.read_gbps;
  const double of_bandwidth = read > 0 ? r.gbps / read : 0;
  // The fraction of the bound that applies, with `matmul` as the matrix rate.
  const auto of_bound = [&](double matmul) {
    const double of_matmul = matmul > 0 ? r.tflops * 1e3 / matmul : 0;
    return c.op == BenchOp::decode   ? of_bandwidth
           : c.op == BenchOp::verify ? std::max(of_bandwidth, of_matmul)
                                     : of_matmul;
  };
  r.roofline_fraction = of_bound(scale * machine.matmul_gflops);
  const double sustained = scale * machine.matmul_sustained_gflops;
  r.sustained_fraction = sustained > 0 && c.op != BenchOp::decode ? of_bound(sustained) : 0;
}

BenchReport run_cases(const std::vector<BenchCase>& cases, const Roofline& machine,
                      const BenchOptions& options,
                      const std::function<void(const CaseResult&)>& on_result) {
  BenchReport report;
  report.machine = machine;
  for (size_t i = 0; i < cases.size(); ++i) {
    FLASHKV_CHECK(!cases[i].paired || i > 0, "cases[0]: a paired case needs its twin before it");
    if (i + 1 < cases.size() && cases[i + 1].paired) {
      check_runnable(cases[i], machine, options);
      check_runnable(cases[i + 1], machine, options);
      auto [a, b] = run_pair(cases[i], cases[i + 1], machine, options);
      report.cases.push_back(a);
      if (on_result) on_result(report.cases.back());
      report.cases.push_back(b);
      ++i;
    } else {
      report.cases.push_back(run_case(cases[i], machine, options));
    }
    if (on_result) on_result(report.cases.back());
  }
  return report;
}

std::vector<BenchCase> model_grid(const std::string& name, Device device, const ModelShape& m) {
  FLASHKV_CHECK(name == "quick" || name == "full", "grid: expected quick or full, got '", name,
                "'");
  const bool quick = name == "quick", cpu = device.is_cpu();
  // (batch, kv_len) of decode; (batch, prefix, new) of extend.
  const int db = quick ? 2 : cpu ? 16 : 64, dkv = quick ? 300 : 4096;
  const int eb = quick ? 2 : cpu ? 1 : 4, eprefix = quick ? 64 : 3072, enew = quick ? 33 : 1024;
  std::vector<BenchCase> g;
  for (const bool windowed : {false, true}) {
    if (windowed ? !m.has_window : !m.has_full) continue;
    const int w = windowed ? m.window_left : -1;
    BenchCase d = decode_case(db, w >= 0 ? std::min(dkv, w + 1) : dkv, device, m.num_qo_heads,
                              m.num_kv_heads, m.head_dim);
    BenchCase e = extend_case(eb, w >= 0 ? std::min(eprefix, w) : eprefix, enew, device,
                              m.num_qo_heads, m.num_kv_heads, m.head_dim);
    for (BenchCase* c : {&d, &e}) {
      c->window_left = w;
      c->logit_cap = m.logit_cap;
      g.push_back(*c);
      // A model with sinks: the same case with them, right after and timed in alternating
      // rounds with it (BenchCase::paired), so the two compare in one run.
      if (m.sinks) {
        c->sinks = true;
        c->paired = true;
        g.push_back(*c);
      }
    }
  }
  return g;
}

std::vector<BenchCase> bench_grid(const std::string& name, Device device) {
  if (name == "quick") {
    // Small GQA shapes with lengths off any tile size; a second or so on a 2-core CPU.
    return {decode_case(2, 300, device, 4, 2, 64), prefill_case(1, 96, device, 4, 2, 64),
            extend_case(2, 64, 33, device, 4, 2, 64)};
  }
  FLASHKV_CHECK(name == "full", "grid: expected quick or full, got '", name, "'");
  if (device.is_cpu()) {
    // Issue 5 (Llama-3-8B shapes, bf16): decode 16 x 4096 on a fresh pool (slots in order) and
    // after churn (shuffled slots), and a 2048-token causal prefill; plus one extend on top of a
    // cached prefix, by the ragged pass and the merging prefix pass, then as one paged pass (the
    // backend's default on the CPU), timed in alternating rounds with it.
    BenchCase one_pass = extend_case(1, 3072, 1024, device);
    one_pass.one_paged_pass = true;
    one_pass.paired = true;
    return {decode_case(16, 4096, device, 32, 8, 128, DType::bf16, KvLayout::in_order),
            decode_case(16, 4096, device), prefill_case(1, 2048, device),
            extend_case(1, 3072, 1024, device), one_pass};
  }
  // Issue 6: decode, page size 1 with a shuffled slot layout, bf16 KV, then the group-size
  // variants, then fp8 KV on the large shapes.
  std::vector<BenchCase> g;
  using Shapes = std::initializer_list<std::pair<int, int>>;  // (batch, kv_len)
  for (auto [b, kv] : Shapes{{1, 1024},
                             {1, 4096},
                             {1, 32768},
                             {16, 4096},
                             {64, 4096},
                             {256, 2048},
                             {64, 16384},
                             {8, 65536}})
    g.push_back(decode_case(b, kv, device));
  g.push_back(decode_case(64, 4096, device, 8, 1, 128));
  g.push_back(decode_case(64, 4096, device, 32, 32, 128));
  for (auto [b, kv] : Shapes{{64, 4096}, {256, 2048}, {64, 16384}, {8, 65536}})
    g.push_back(decode_case(b, kv, device, 32, 8, 128, DType::fp8_e4m3));
  // Issue 7: causal prefill and extend with a cached prefix.
  g.push_back(prefill_case(1, 8192, device));
  g.push_back(prefill_case(4, 4096, device));
  g.push_back(prefill_case(1, 16384, device));
  // Issue 28: prefill 4 x 4096 non-causal, and causal at head dims 64 (32/32) and 256 (16/16).
  BenchCase full = prefill_case(4, 4096, device);
  full.causal = false;
  g.push_back(full);
  g.push_back(prefill_case(4, 4096, device, 32, 32, 64));
  g.push_back(prefill_case(4, 4096, device, 16, 16, 256));
  // Each extend by the ragged pass and the merging prefix pass (the backend's path with an fp8
  // pool), then as one paged pass over prefix and new tokens (its default with a 16-bit pool),
  // timed in alternating rounds with it.
  for (BenchCase e : {extend_case(4, 3072, 1024, device), extend_case(16, 4096, 256, device)}) {
    g.push_back(e);
    e.one_paged_pass = true;
    e.paired = true;
    g.push_back(e);
  }
  // Issue 28: the same extends on a pool of 16-token pages, each with its one-pass twin, then a
  // TARGET_VERIFY: 64 requests of 8 draft tokens in a tree over a 4096-token prefix.
  for (BenchCase e : {extend_case(4, 3072, 1024, device), extend_case(16, 4096, 256, device)}) {
    e.page_size = 16;
    g.push_back(e);
    e.one_paged_pass = true;
    e.paired = true;
    g.push_back(e);
  }
  g.push_back(verify_case(64, 4096, 8, device));
  // Issue 28: the extends with an fp8 (e4m3) pool, page size 1: the new tokens' K/V stay 16-bit,
  // as the backend passes them.
  for (BenchCase e : {extend_case(4, 3072, 1024, device), extend_case(16, 4096, 256, device)}) {
    e.kv_dtype = DType::fp8_e4m3;
    g.push_back(e);
  }
  return g;
}

std::vector<PlanResult> run_plan_grid(const std::string& name, Device device,
                                      const std::vector<PlanKind>& kinds,
                                      const std::function<void(const PlanResult&)>& on_result) {
  FLASHKV_CHECK(name == "quick" || name == "full", "grid: expected quick or full, got '", name,
                "'");
  const bool quick = name == "quick";
  std::vector<PlanResult> out;
  for (const PlanCase& c : bench_plan_grid(device_info(device))) {
    if (!kinds.empty() && std::find(kinds.begin(), kinds.end(), c.kind) == kinds.end()) continue;
    out.push_back({c, time_plan(c, quick ? 200 : 2000, quick ? 5 : 15)});
    if (on_result) on_result(out.back());
  }
  return out;
}

}  // namespace flashkv::bench
