#include "parallel_cases.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "flashkv/reference/compare.h"
#include "test_util.h"

namespace flashkv::test {

using parallel::Communicator;
using parallel::CpExchange;
using parallel::CpLayout;
using parallel::CpOptions;
using parallel::CpShard;

namespace {

std::string lens_str(const std::vector<int32_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

// A paged pool holding, for each request, the rows `rows[i]` of k_src / v_src in that order, on
// pages drawn from a shuffled list; slots holding no token are NaN.
struct Pool {
  Tensor k, v, indptr, indices, last;
  PagedKV kv;
};

Pool make_pool(Rng& rng, const Tensor& k_src, const Tensor& v_src,
               const std::vector<std::vector<int64_t>>& rows, int page_size) {
  const int64_t hkv = k_src.size(1), dqk = k_src.size(2), dv = v_src.size(2);
  std::vector<int32_t> pages_of(rows.size()), last(rows.size());
  int32_t total = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t len = static_cast<int64_t>(rows[i].size());
    pages_of[i] = static_cast<int32_t>((len + page_size - 1) / page_size);
    last[i] = len == 0 ? 0 : static_cast<int32_t>((len - 1) % page_size + 1);
    total += pages_of[i];
  }
  const int32_t pool_pages = total + 2;
  std::vector<int32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen());
  std::vector<int32_t> indices(perm.begin(), perm.begin() + total);
  const int64_t slots = int64_t{pool_pages} * page_size;
  Pool p;
  p.k = Tensor::empty({slots, hkv, dqk}, k_src.dtype());
  p.v = Tensor::empty({slots, hkv, dv}, v_src.dtype());
  poison(p.k);
  poison(p.v);
  const size_t kb = hkv * dqk * dtype_size(k_src.dtype()),
               vb = hkv * dv * dtype_size(v_src.dtype());
  int32_t e = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t t = 0; t < rows[i].size(); ++t) {
      const int64_t slot = int64_t{indices[e + t / page_size]} * page_size + t % page_size;
      std::memcpy(static_cast<char*>(p.k.data()) + slot * kb,
                  static_cast<const char*>(k_src.data()) + rows[i][t] * kb, kb);
      std::memcpy(static_cast<char*>(p.v.data()) + slot * vb,
                  static_cast<const char*>(v_src.data()) + rows[i][t] * vb, vb);
    }
    e += pages_of[i];
  }
  p.indptr = Tensor::from_i32(indptr_of(pages_of));
  p.indices = Tensor::from_i32(indices.empty() ? std::vector<int32_t>{0} : indices);
  p.last = Tensor::from_i32(last);
  p.kv = PagedKV{
      p.k, p.v, p.indptr, p.indices, page_size > 1 ? TensorView(p.last) : TensorView(), page_size};
  return p;
}

reference::Result result_of(const Tensor& out, const Tensor& lse) {
  reference::Result r;
  r.rows = out.size(0);
  r.heads = static_cast<int>(out.size(1));
  r.head_dim = static_cast<int>(out.size(2));
  r.o.resize(out.numel());
  r.lse.resize(lse.numel());
  for (int64_t i = 0; i < out.numel(); ++i) r.o[i] = load_as_double(out.data(), out.dtype(), i);
  for (int64_t i = 0; i < lse.numel(); ++i) r.lse[i] = lse.ptr<float>()[i];
  return r;
}

reference::Result rows_of(const reference::Result& all, const std::vector<int64_t>& rows) {
  reference::Result r;
  r.rows = static_cast<int64_t>(rows.size());
  r.heads = all.heads;
  r.head_dim = all.head_dim;
  const int64_t ro = int64_t{all.heads} * all.head_dim;
  for (int64_t row : rows) {
    r.o.insert(r.o.end(), all.o.begin() + row * ro, all.o.begin() + (row + 1) * ro);
    r.lse.insert(r.lse.end(), all.lse.begin() + row * all.heads,
                 all.lse.begin() + (row + 1) * all.heads);
  }
  return r;
}

Tensor sinks_tensor(Rng& rng, int hq) {
  Tensor s = Tensor::empty({hq}, DType::f32);
  for (int h = 0; h < hq; ++h) s.ptr<float>()[h] = static_cast<float>(rng.normal() * 2.0);
  return s;
}

// Copies rows `rows` of src into a new tensor, in that order.
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Tensor t = Tensor::empty({n, src.size(1), src.size(2)}, src.dtype());
  const size_t rb = src.size(1) * src.size(2) * dtype_size(src.dtype());
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(static_cast<char*>(t.data()) + r * rb,
                static_cast<const char*>(src.data()) + rows[r] * rb, rb);
  return t;
}

}  // namespace

std::string CpDecodeCase::str() const {
  return str_cat("decode kv_len ", lens_str(kv_len), " hq ", hq, " hkv ", hkv, " d ", head_dim,
                 " page ", page_size, " ", dtype_name(dtype), sinks ? " sinks" : "",
                 soft_cap > 0 ? " soft_cap" : "", " window ", window_left, " seed ", seed);
}

std::string CpExtendCase::str() const {
  return str_cat("extend prefix ", lens_str(prefix_len), " new ", lens_str(extend_len), " hq ", hq,
                 " hkv ", hkv, " d ", head_dim, " page ", page_size, " ", dtype_name(dtype),
                 causal ? " causal" : " non-causal", " window ", window_left,
                 tree_mask ? " tree mask" : "", sinks ? " sinks" : "", " split ", fixed_split_size,
                 " seed ", seed);
}

std::string str(const CpOptions& o) {
  return str_cat(o.layout == CpLayout::interleaved ? "interleaved" : "contiguous", " block ",
                 o.block, o.exchange == CpExchange::all_gather ? " all_gather" : " all_to_all",
                 o.kv_pass == parallel::CpKvPass::ring ? " ring" : "");
}

std::vector<CpOptions> cp_option_sweep(parallel::CpKvPass kv_pass) {
  std::vector<CpOptions> out;
  for (CpExchange ex : {CpExchange::all_gather, CpExchange::all_to_all}) {
    out.push_back({CpLayout::interleaved, 1, ex, kv_pass});
    out.push_back({CpLayout::interleaved, 16, ex, kv_pass});
    out.push_back({CpLayout::contiguous, 37, ex, kv_pass});
  }
  return out;
}

std::vector<CpOptions> cp_extend_option_sweep() {
  std::vector<CpOptions> out = cp_option_sweep();
  for (const CpOptions& o : cp_option_sweep(parallel::CpKvPass::ring)) out.push_back(o);
  return out;
}

void check_cp_decode(Communicator& comm, const CpOptions& options, const CpDecodeCase& c) {
  SCOPED_TRACE(str_cat(c.str(), ", ", str(options), ", rank ", comm.rank(), " of ", comm.size()));
  Rng rng(c.seed);
  const int64_t b = static_cast<int64_t>(c.kv_len.size());
  const int64_t tokens = std::accumulate(c.kv_len.begin(), c.kv_len.end(), int64_t{0});
  Tensor q = random_tensor(rng, {b, c.hq, c.head_dim}, c.dtype);
  Tensor k = random_tensor(rng, {std::max<int64_t>(tokens, 1), c.hkv, c.head_dim}, c.dtype);
  Tensor v = random_tensor(rng, {std::max<int64_t>(tokens, 1), c.hkv, c.head_dim}, c.dtype);
  Tensor sinks = c.sinks ? sinks_tensor(rng, c.hq) : Tensor();
  const CpShard shard(options, comm.size());
  std::vector<std::vector<int64_t>> all_rows(b), my_rows(b);
  int64_t at = 0;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t t = 0; t < c.kv_len[i]; ++t) {
      all_rows[i].push_back(at + t);
      if (shard.owner(t) == comm.rank()) my_rows[i].push_back(at + t);
    }
    at += c.kv_len[i];
  }
  Rng pages(c.seed * 31 + comm.rank() + 1);
  Pool global = make_pool(pages, k, v, all_rows, c.page_size);
  Pool mine = make_pool(pages, k, v, my_rows, c.page_size);

  AttentionOptions opt;
  opt.logits_soft_cap = c.soft_cap;
  opt.window_left = c.window_left;
  if (c.sinks) opt.sinks = sinks;
  const reference::Result ref = reference::paged_attention(q, TensorView(), global.kv, opt);

  parallel::CpDecodeShape shape;
  shape.kv_len = c.kv_len;
  shape.num_qo_heads = c.hq;
  shape.num_kv_heads = c.hkv;
  shape.head_dim_qk = shape.head_dim_v = c.head_dim;
  shape.page_size = c.page_size;
  shape.dtype = c.dtype;
  shape.window_left = c.window_left;
  parallel::CpDecode cp(comm, options);
  cp.plan(shape);
  for (int64_t i = 0; i < b; ++i)
    ASSERT_EQ(cp.local_kv_len()[i], static_cast<int32_t>(my_rows[i].size())) << "request " << i;
  Tensor out = Tensor::empty({b, c.hq, c.head_dim}, c.dtype);
  Tensor lse = Tensor::empty({b, c.hq}, DType::f32);
  poison(out);
  poison(lse);
  cp.run(q, mine.kv, opt, out, lse);
  expect_close(out, lse, ref, c.dtype);

  // The same batch on one rank, with the whole KV.
  parallel::OneRankCommunicator one;
  parallel::CpDecode cp1(one, options);
  cp1.plan(shape);
  Tensor out1 = Tensor::empty({b, c.hq, c.head_dim}, c.dtype);
  Tensor lse1 = Tensor::empty({b, c.hq}, DType::f32);
  poison(out1);
  poison(lse1);
  cp1.run(q, global.kv, opt, out1, lse1);
  expect_close(out1, lse1, ref, c.dtype);
  expect_close(out, lse, result_of(out1, lse1), c.dtype);
}

void check_cp_extend(Communicator& comm, const CpOptions& options, const CpExtendCase& c) {
  SCOPED_TRACE(str_cat(c.str(), ", ", str(options), ", rank ", comm.rank(), " of ", comm.size()));
  const int world = comm.size(), rank = comm.rank();
  Rng rng(c.seed);
  const int64_t b = static_cast<int64_t>(c.prefix_len.size());
  std::vector<int32_t> seq_len(b);
  for (int64_t i = 0; i < b; ++i) seq_len[i] = c.prefix_len[i] + c.extend_len[i];
  const std::vector<int32_t> qo = indptr_of(c.extend_len), kvp = indptr_of(seq_len);
  const int64_t total = qo.back(), tokens = kvp.back();
  Tensor q = random_tensor(rng, {std::max<int64_t>(total, 1), c.hq, c.head_dim}, c.dtype);
  Tensor k = random_tensor(rng, {std::max<int64_t>(tokens, 1), c.hkv, c.head_dim}, c.dtype);
  Tensor v = random_tensor(rng, {std::max<int64_t>(tokens, 1), c.hkv, c.head_dim}, c.dtype);
  Tensor sinks = c.sinks ? sinks_tensor(rng, c.hq) : Tensor();
  Tensor mask, mask_indptr;
  if (c.tree_mask) {
    std::vector<int32_t> sizes(b);
    for (int64_t i = 0; i < b; ++i) sizes[i] = c.extend_len[i] * seq_len[i];
    const std::vector<int32_t> mi = indptr_of(sizes);
    mask = Tensor::empty({std::max<int64_t>(mi.back(), 1)}, DType::u8);
    mask.ptr<uint8_t>()[0] = 0;
    for (int64_t i = 0; i < b; ++i) {
      const int64_t n = c.prefix_len[i], m = c.extend_len[i];
      std::vector<int64_t> parent(m);
      for (int64_t t = 0; t < m; ++t) parent[t] = t == 0 ? -1 : rng.uniform_int(-1, int(t) - 1);
      uint8_t* mat = mask.ptr<uint8_t>() + mi[i];
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < n; ++j) mat[t * (n + m) + j] = rng.uniform() < 0.9;
        for (int64_t u = 0; u < m; ++u) mat[t * (n + m) + n + u] = 0;
        for (int64_t a = t; a >= 0; a = parent[a]) mat[t * (n + m) + n + a] = 1;
      }
    }
    mask_indptr = Tensor::from_i32(mi);
  }

  AttentionOptions opt;
  opt.causal = c.causal;
  opt.window_left = c.window_left;
  if (c.sinks) opt.sinks = sinks;
  AttentionOptions ref_opt = opt;
  if (c.tree_mask) {
    ref_opt.custom_mask = mask;
    ref_opt.mask_indptr = mask_indptr;
  }
  Tensor qo_t = Tensor::from_i32(qo), kvp_t = Tensor::from_i32(kvp);
  const reference::Result ref = reference::ragged_attention(q, k, v, qo_t, kvp_t, ref_opt);

  // This rank's prefix shard, and its own new tokens (zigzag).
  const CpShard shard(options, world);
  std::vector<std::vector<int64_t>> all_prefix(b), my_prefix(b);
  std::vector<int64_t> own_q_rows, own_kv_rows;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t t = 0; t < c.prefix_len[i]; ++t) {
      all_prefix[i].push_back(kvp[i] + t);
      if (shard.owner(t) == rank) my_prefix[i].push_back(kvp[i] + t);
    }
    const parallel::ZigzagRows z = parallel::zigzag_rows(c.extend_len[i], world, rank);
    for (int part = 0; part < 2; ++part) {
      for (int64_t t = z.begin[part]; t < z.begin[part] + z.len[part]; ++t) {
        own_q_rows.push_back(qo[i] + t);
        own_kv_rows.push_back(kvp[i] + c.prefix_len[i] + t);
      }
    }
  }
  Rng pages(c.seed * 31 + rank + 1);
  Pool global = make_pool(pages, k, v, all_prefix, c.page_size);
  Pool mine = make_pool(pages, k, v, my_prefix, c.page_size);

  parallel::CpExtendShape shape;
  shape.prefix_len = c.prefix_len;
  shape.extend_len = c.extend_len;
  shape.num_qo_heads = c.hq;
  shape.num_kv_heads = c.hkv;
  shape.head_dim_qk = shape.head_dim_v = c.head_dim;
  shape.page_size = c.page_size;
  shape.dtype = c.dtype;
  shape.causal = c.causal;
  shape.window_left = c.window_left;
  if (c.tree_mask) {
    shape.custom_mask = mask;
    shape.mask_indptr = mask_indptr;
  }
  PlanOptions plan_options;
  plan_options.fixed_split_size = c.fixed_split_size;
  parallel::CpExtend cp(comm, options);
  cp.plan(shape, plan_options);
  const int64_t own = static_cast<int64_t>(own_q_rows.size());
  ASSERT_EQ(cp.num_own_rows(), own);
  for (int64_t i = 0; i < b; ++i)
    ASSERT_EQ(cp.local_prefix_len()[i], static_cast<int32_t>(my_prefix[i].size()));
  Tensor out = Tensor::empty({own, c.hq, c.head_dim}, c.dtype);
  Tensor lse = Tensor::empty({own, c.hq}, DType::f32);
  poison(out);
  poison(lse);
  const Tensor k_own = gather_rows(k, own_kv_rows), v_own = gather_rows(v, own_kv_rows);
  cp.run(gather_rows(q, own_q_rows), k_own, v_own, mine.kv, opt, out, lse);
  expect_close(out, lse, rows_of(ref, own_q_rows), c.dtype);

  // The new tokens this rank keeps go into its pool: with its prefix share they make its share of
  // the whole sequence, and their K/V are the given ones, bit for bit.
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < b; ++i) {
    int64_t kept_i = 0;
    for (int64_t t = 0; t < c.extend_len[i]; ++t) {
      if (shard.owner(c.prefix_len[i] + t) != rank) continue;
      kept.push_back(kvp[i] + c.prefix_len[i] + t);
      ++kept_i;
    }
    EXPECT_EQ(my_prefix[i].size() + kept_i, shard.local_len(rank, seq_len[i])) << "request " << i;
  }
  const int64_t num_kept = static_cast<int64_t>(kept.size());
  ASSERT_EQ(cp.num_local_new(), num_kept);
  Tensor k_pool = Tensor::empty({num_kept + 1, c.hkv, c.head_dim}, c.dtype);
  Tensor v_pool = Tensor::empty({num_kept + 1, c.hkv, c.head_dim}, c.dtype);
  poison(k_pool);
  poison(v_pool);
  std::vector<int32_t> slots(num_kept);
  std::iota(slots.begin(), slots.end(), 1);  // slot 0 is the pool's dummy
  cp.append_local_kv(k_own, v_own, Tensor::from_i32(slots), k_pool, v_pool);
  const Tensor k_kept = gather_rows(k, kept), v_kept = gather_rows(v, kept);
  const size_t row_bytes = size_t(c.hkv) * c.head_dim * dtype_size(c.dtype);
  if (num_kept > 0) {  // an empty tensor has no data pointer to compare
    EXPECT_EQ(std::memcmp(static_cast<char*>(k_pool.data()) + row_bytes, k_kept.data(),
                          num_kept * row_bytes),
              0);
    EXPECT_EQ(std::memcmp(static_cast<char*>(v_pool.data()) + row_bytes, v_kept.data(),
                          num_kept * row_bytes),
              0);
  }

  // One rank: every new token, the whole prefix.
  parallel::OneRankCommunicator one;
  parallel::CpExtend cp1(one, options);
  cp1.plan(shape, plan_options);
  std::vector<int64_t> all_q(total), all_kv;
  std::iota(all_q.begin(), all_q.end(), 0);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < c.extend_len[i]; ++t) all_kv.push_back(kvp[i] + c.prefix_len[i] + t);
  Tensor out1 = Tensor::empty({total, c.hq, c.head_dim}, c.dtype);
  Tensor lse1 = Tensor::empty({total, c.hq}, DType::f32);
  poison(out1);
  poison(lse1);
  cp1.run(gather_rows(q, all_q), gather_rows(k, all_kv), gather_rows(v, all_kv), global.kv, opt,
          out1, lse1);
  const reference::Result one_rank = result_of(out1, lse1);
  expect_close(out1, lse1, ref, c.dtype);
  expect_close(out, lse, rows_of(one_rank, own_q_rows), c.dtype);
}

}  // namespace flashkv::test
