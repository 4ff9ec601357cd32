// Sharded extend: the new tokens' q (and k/v, unless they go round a ring) all-gathered, every new
// row over this rank's prefix shard, the prefix states routed to the rows' owners and merged, then
// the owned rows over all new tokens (causal on their global positions) merged with them as they
// are written: in one pass over the gathered K/V, or one pass per rank's block as the blocks go
// round the ring.
#include <algorithm>
#include <optional>
#include <tuple>

#include "copy.h"
#include "flashkv/core/error.h"
#include "flashkv/ops/kv_ops.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::parallel {

namespace {
enum ExtendBuf : size_t {
  kGatherQ,
  kGatherK,
  kGatherV,
  kAllQ,
  kAllK,
  kAllV,
  kPrefixO,
  kPrefixLse,
  kSendO,
  kSendLse,
  kRecvO,
  kRecvLse,
  kPickO,
  kPickLse,
  kLseByRow,
  kMergedO,
  kMergedLse,
  kLocalNewK,
  kLocalNewV,
  kRingA,  // the ring's two blocks: the one this rank attends and sends, the one it receives
  kRingB,
  kRingScratch,  // the partial states of the ring steps' split work, shared (one step at a time)
  kNumExtendBufs
};

Tensor on_device(const Tensor& host, Device dev) { return dev.is_cpu() ? host : host.to(dev); }

// A rank's contiguous [rows, heads, dim] tensor of the extend's dtype on its device (q, k, v).
void expect_rows(const TensorView& t, const char* name, Device dev, DType dtype, int64_t rows,
                 int64_t heads, int64_t dim) {
  Expect e(t, name);
  e.ndim(3).device(dev).dtype(dtype).contiguous();
  e.dim(0, rows).dim(1, heads).dim(2, dim);
}

Tensor mask_tensor(const std::vector<uint8_t>& bits, Device dev) {
  Tensor t = Tensor::empty({std::max<int64_t>(static_cast<int64_t>(bits.size()), 1)}, DType::u8);
  t.ptr<uint8_t>()[0] = 0;
  std::copy(bits.begin(), bits.end(), t.ptr<uint8_t>());
  return on_device(t, dev);
}

}  // namespace

// The host arrays of a NewPass while it is planned: per pass request (an owned chunk), its query
// rows, its entries (rows of the K/V buffer) and, for a masked pass, its [rows, entries] mask.
struct CpExtend::PassLists {
  std::vector<int32_t> qo{0}, kv_len, kv_indptr{0}, kv_indices, mask_indptr{0};
  std::vector<uint8_t> bits;
  bool masked = false, causal = false;
  int32_t window_left = -1;
  // A request of `rows` query rows over `entries`; with a mask, seen(q, e) tells whether query
  // row q sees entry e.
  template <class Seen>
  void add(int64_t rows, const std::vector<int32_t>& entries, Seen seen) {
    qo.push_back(qo.back() + static_cast<int32_t>(rows));
    kv_len.push_back(static_cast<int32_t>(entries.size()));
    kv_indices.insert(kv_indices.end(), entries.begin(), entries.end());
    kv_indptr.push_back(static_cast<int32_t>(kv_indices.size()));
    if (!masked) return;
    for (int64_t q = 0; q < rows; ++q)
      for (size_t e = 0; e < entries.size(); ++e) bits.push_back(seen(q, e) ? 1 : 0);
    FLASHKV_CHECK(bits.size() <= static_cast<size_t>(INT32_MAX),
                  "CpExtendShape: the new tokens' mask of this rank exceeds 2^31 elements");
    mask_indptr.push_back(static_cast<int32_t>(bits.size()));
  }
};

// Plans `pass` from its lists (the batch's heads and dims from `shape`) and puts its index
// tensors and mask on the communicator's device; upload_pass() then sizes its workspace (its
// partial states in `scratch` when given: one run at a time uses it) and uploads the plan.
void CpExtend::build_pass(NewPass& pass, const PassLists& lists, const BatchShape& shape,
                          const DeviceInfo& info, const PlanOptions& plan_options) {
  const Device dev = comm_.device();
  BatchShape nb = shape;
  nb.batch_size = static_cast<int32_t>(lists.kv_len.size());
  nb.qo_indptr = lists.qo.data();
  nb.kv_len = lists.kv_len.data();
  nb.page_size = 1;
  nb.causal = !lists.masked && lists.causal;
  nb.window_left = lists.masked ? -1 : lists.window_left;
  pass.plan = plan_prefill(nb, info, plan_options);
  pass.masked = lists.masked;
  pass.causal = nb.causal;
  pass.window_left = nb.window_left;
  pass.kv_indptr = on_device(Tensor::from_i32(lists.kv_indptr), dev);
  pass.kv_indices = on_device(
      Tensor::from_i32(lists.kv_indices.empty() ? std::vector<int32_t>{0} : lists.kv_indices), dev);
  pass.mask = lists.masked ? mask_tensor(lists.bits, dev) : Tensor();
  pass.mask_indptr = lists.masked ? on_device(Tensor::from_i32(lists.mask_indptr), dev) : Tensor();
}

void CpExtend::upload_pass(NewPass& pass, void* scratch, size_t scratch_bytes, Stream stream) {
  pass.ws.set_external_scratch(scratch, scratch_bytes);
  pass.ws.reserve(pass.ws.bytes_needed(pass.plan), comm_.device());
  pass.ws.upload(pass.plan, stream);
}

// Copies each segment's rows from src (row offset src_base + seg.src) to dst (dst_base + seg.dst).
void CpExtend::copy_segments(void* dst, int64_t dst_base, const void* src, int64_t src_base,
                             const std::vector<Segment>& segments, size_t row_bytes,
                             Stream stream) {
  const Device dev = comm_.device();
  for (const Segment& seg : segments)
    copy_bytes(static_cast<char*>(dst) + (dst_base + seg.dst) * row_bytes, dev,
               static_cast<const char*>(src) + (src_base + seg.src) * row_bytes, dev,
               seg.rows * row_bytes, stream);
}

CpExtend::CpExtend(Communicator& comm, const CpOptions& options) : comm_(comm), options_(options) {
  CpShard(options, comm.size());  // validates the options
  FLASHKV_CHECK(
      options.exchange == CpExchange::all_gather || options.exchange == CpExchange::all_to_all,
      "CpOptions::exchange: expected all_gather or all_to_all, got ",
      static_cast<int>(options.exchange));
  FLASHKV_CHECK(options.kv_pass == CpKvPass::all_gather || options.kv_pass == CpKvPass::ring,
                "CpOptions::kv_pass: expected all_gather or ring, got ",
                static_cast<int>(options.kv_pass));
}

void CpExtend::plan(const CpExtendShape& shape, const PlanOptions& plan_options, Stream stream) {
  planned_ = false;
  const int world = comm_.size(), rank = comm_.rank();
  const CpShard shard(options_, world);
  const Device dev = comm_.device();
  const size_t batch = shape.prefix_len.size();
  FLASHKV_CHECK(shape.extend_len.size() == batch, "CpExtendShape::extend_len: expected ", batch,
                " entries (one per prefix_len entry), got ", shape.extend_len.size());
  FLASHKV_CHECK(is_float(shape.dtype) && !is_fp8(shape.dtype), "CpExtendShape::dtype: expected ",
                "f32, f16 or bf16, got ", dtype_name(shape.dtype));
  const int64_t b = static_cast<int64_t>(batch);
  const int32_t w = shape.window_left < 0 ? -1 : shape.window_left;
  const bool custom = shape.custom_mask.defined();
  for (int64_t i = 0; i < b; ++i) {
    FLASHKV_CHECK(shape.prefix_len[i] >= 0, "CpExtendShape::prefix_len[", i,
                  "] = ", shape.prefix_len[i], ": expected >= 0");
    FLASHKV_CHECK(shape.extend_len[i] >= 0, "CpExtendShape::extend_len[", i,
                  "] = ", shape.extend_len[i], ": expected >= 0");
  }
  std::vector<int64_t> mask_at(batch, 0);
  if (custom) {
    Expect(shape.custom_mask, "CpExtendShape::custom_mask").ndim(1).on_host().dtype(DType::u8);
    Expect(shape.mask_indptr, "CpExtendShape::mask_indptr")
        .ndim(1)
        .on_host()
        .index_dtype()
        .dim(0, b + 1);
    for (int64_t i = 0; i < b; ++i) {
      mask_at[i] = index_at(shape.mask_indptr, i);
      const int64_t need =
          int64_t{shape.extend_len[i]} * (int64_t{shape.prefix_len[i]} + shape.extend_len[i]);
      FLASHKV_CHECK(mask_at[i] >= 0 && mask_at[i] + need <= shape.custom_mask.shape[0],
                    "CpExtendShape::custom_mask: request ", i, "'s ", need,
                    " elements from mask_indptr[", i, "] = ", mask_at[i], " do not fit the mask's ",
                    shape.custom_mask.shape[0], " elements");
    }
  } else {
    FLASHKV_CHECK(!shape.mask_indptr.defined(),
                  "CpExtendShape::mask_indptr: given without custom_mask");
  }
  auto tree = [&](int64_t i, int64_t row, int64_t col) {
    const int64_t cols = int64_t{shape.prefix_len[i]} + shape.extend_len[i];
    return shape.custom_mask.ptr<uint8_t>()[mask_at[i] + row * cols + col] != 0;
  };
  // Whether request i's new token t sees column `col` of its [prefix + new] row: the tree mask,
  // or causal masking, and the window, all on global positions (new token u is column n + u).
  auto seen = [&](int64_t i, int64_t t, int64_t col) {
    const int64_t pos = int64_t{shape.prefix_len[i]} + t;
    const bool base = custom ? tree(i, t, col) : (!shape.causal || col <= pos);
    return base && (w < 0 || col >= pos - w);
  };

  // Rows: global order (request by request), and each rank's own rows (zigzag).
  std::vector<int32_t> new_indptr(batch + 1, 0);
  for (size_t i = 0; i < batch; ++i) new_indptr[i + 1] = new_indptr[i] + shape.extend_len[i];
  std::vector<int64_t> rank_rows(world, 0), rank_row_begin(world + 1, 0);
  std::vector<Segment> to_global, own_of_global;
  for (int s = 0; s < world; ++s) {
    int64_t at = rank_row_begin[s];
    for (size_t i = 0; i < batch; ++i) {
      const ZigzagRows z = zigzag_rows(shape.extend_len[i], world, s);
      for (int k = 0; k < 2; ++k) {
        if (z.len[k] == 0) continue;
        to_global.push_back({at, new_indptr[i] + z.begin[k], z.len[k]});
        if (s == rank)
          own_of_global.push_back({new_indptr[i] + z.begin[k], at - rank_row_begin[s], z.len[k]});
        at += z.len[k];
      }
    }
    rank_rows[s] = at - rank_row_begin[s];
    rank_row_begin[s + 1] = at;
  }
  // The new tokens whose positions this rank keeps, as runs of consecutive rows.
  std::vector<Segment> local_new;
  int64_t num_local_new = 0;
  for (size_t i = 0; i < batch; ++i) {
    for (int64_t t = 0; t < shape.extend_len[i]; ++t) {
      if (shard.owner(int64_t{shape.prefix_len[i]} + t) != rank) continue;
      const int64_t src = new_indptr[i] + t;
      if (!local_new.empty() && local_new.back().src + local_new.back().rows == src)
        ++local_new.back().rows;
      else
        local_new.push_back({src, num_local_new, 1});
      ++num_local_new;
    }
  }
  std::vector<Segment> to_owner;
  to_owner.reserve(to_global.size());
  for (const Segment& g : to_global) to_owner.push_back({g.dst, g.src, g.rows});

  // The prefix pass: every new row over this rank's prefix shard. Its positions are global, so a
  // window or a tree mask becomes a per-request mask over the local entries.
  std::vector<int32_t> local_prefix(batch);
  for (size_t i = 0; i < batch; ++i)
    local_prefix[i] = static_cast<int32_t>(shard.local_len(rank, shape.prefix_len[i]));
  const bool prefix_masked = custom || w >= 0;
  std::vector<uint8_t> prefix_bits;
  std::vector<int32_t> prefix_mask_indptr(batch + 1, 0);
  if (prefix_masked) {
    for (size_t i = 0; i < batch; ++i) {
      for (int64_t t = 0; t < shape.extend_len[i]; ++t) {
        for (int64_t j = 0; j < local_prefix[i]; ++j)
          prefix_bits.push_back(seen(i, t, shard.global_pos(rank, j)) ? 1 : 0);
      }
      FLASHKV_CHECK(prefix_bits.size() <= static_cast<size_t>(INT32_MAX),
                    "CpExtendShape: the prefix mask of this rank exceeds 2^31 elements");
      prefix_mask_indptr[i + 1] = static_cast<int32_t>(prefix_bits.size());
    }
  }
  BatchShape pb;
  pb.batch_size = static_cast<int32_t>(batch);
  pb.qo_indptr = new_indptr.data();
  pb.kv_len = local_prefix.data();
  pb.num_qo_heads = shape.num_qo_heads;
  pb.num_kv_heads = shape.num_kv_heads;
  pb.head_dim_qk = shape.head_dim_qk;
  pb.head_dim_v = shape.head_dim_v;
  pb.page_size = shape.page_size;
  pb.causal = false;
  const DeviceInfo info = device_info(dev);
  PrefillPlan prefix_plan = plan_prefill(pb, info, plan_options);

  // The new-token passes: this rank's two chunks of each request, each a request of its own.
  std::vector<int32_t> own_qo(1, 0);
  for (size_t i = 0; i < batch; ++i) {
    const ZigzagRows z = zigzag_rows(shape.extend_len[i], world, rank);
    for (int k = 0; k < 2; ++k) own_qo.push_back(own_qo.back() + static_cast<int32_t>(z.len[k]));
  }
  const bool ring = options_.kv_pass == CpKvPass::ring;
  std::vector<int32_t> entries;
  std::vector<int64_t> cols;  // each entry's new-token index u
  if (!ring) {
    // One pass over the gathered new tokens: a chunk's KV is [0, end of the chunk) (causal) or all
    // of them (a mask or none), so that the kernel's positions (the query rows last) are the
    // chunk's positions shifted by the prefix, which causal masking and a window do not see.
    PassLists lists;
    lists.masked = custom || (!shape.causal && w >= 0);
    lists.causal = shape.causal;
    lists.window_left = w;
    for (size_t i = 0; i < batch; ++i) {
      const int64_t m = shape.extend_len[i];
      const ZigzagRows z = zigzag_rows(m, world, rank);
      for (int k = 0; k < 2; ++k) {
        const int64_t kv = z.len[k] == 0               ? 0
                           : (custom || !shape.causal) ? m
                                                       : z.begin[k] + z.len[k];
        entries.clear();
        for (int64_t u = 0; u < kv; ++u) entries.push_back(new_indptr[i] + static_cast<int32_t>(u));
        lists.add(z.len[k], entries, [&](int64_t q, size_t e) {
          return seen(static_cast<int64_t>(i), z.begin[k] + q,
                      shape.prefix_len[i] + static_cast<int64_t>(e));
        });
      }
    }
    build_pass(new_pass_, lists, pb, info, plan_options);
    ring_passes_.clear();
    ring_keep_.clear();
  } else {
    // One pass a ring step: step j holds rank s = (rank - j) mod P's block, its own rows of each
    // request in its own order (chunk s, then chunk 2P - 1 - s). A chunk of the block is an entry
    // list of the pass where some row of this rank's chunk sees some of its tokens. Without a
    // mask or window, whole chunks before the row's chunk are seen by every row, and the row's
    // own chunk (held at step 0, as the last entries) causally, so step 0 is causal and the
    // others are not; otherwise every pass takes a mask over global positions.
    const bool masked = custom || w >= 0;
    ring_passes_.resize(world);
    ring_keep_.assign(world, {});
    std::vector<int64_t> block_at(world, 0);   // request i's first row in each rank's block
    std::vector<int64_t> keep_step, keep_row;  // request i's new token t: its block and row
    int64_t kept = 0;
    std::vector<PassLists> lists(world);
    for (int j = 0; j < world; ++j) {
      lists[j].masked = masked;
      lists[j].causal = shape.causal && j == 0;
    }
    for (size_t i = 0; i < batch; ++i) {
      const int64_t m = shape.extend_len[i], n = shape.prefix_len[i];
      const ZigzagRows zq = zigzag_rows(m, world, rank);
      keep_step.assign(m, 0);
      keep_row.assign(m, 0);
      for (int j = 0; j < world; ++j) {
        const int s = (rank - j + world) % world;
        const ZigzagRows zk = zigzag_rows(m, world, s);
        for (int a = 0, row = 0; a < 2; row += static_cast<int>(zk.len[a]), ++a)
          for (int64_t u = 0; u < zk.len[a]; ++u) {
            keep_step[zk.begin[a] + u] = j;
            keep_row[zk.begin[a] + u] = block_at[s] + row + u;
          }
        for (int k = 0; k < 2; ++k) {
          const int64_t qb = zq.begin[k], ql = zq.len[k];
          entries.clear();
          cols.clear();
          for (int a = 0, row = 0; a < 2 && ql > 0; row += static_cast<int>(zk.len[a]), ++a) {
            const int64_t kb = zk.begin[a], kl = zk.len[a];
            bool any = false;
            if (masked) {
              for (int64_t t = qb; t < qb + ql && !any; ++t)
                for (int64_t u = kb; u < kb + kl && !any; ++u) any = seen(i, t, n + u);
            } else {
              any = kl > 0 && (!shape.causal || kb + kl <= qb || kb == qb);
            }
            if (!any) continue;
            for (int64_t u = 0; u < kl; ++u) {
              entries.push_back(static_cast<int32_t>(block_at[s] + row + u));
              cols.push_back(kb + u);
            }
          }
          lists[j].add(ql, entries, [&](int64_t q, size_t e) {
            return seen(static_cast<int64_t>(i), qb + q, n + cols[e]);
          });
        }
      }
      for (int s = 0; s < world; ++s) block_at[s] += zigzag_rows(m, world, s).total();
      for (int64_t t = 0; t < m; ++t) {
        if (shard.owner(n + t) != rank) continue;
        std::vector<Segment>& keep = ring_keep_[keep_step[t]];
        if (!keep.empty() && keep.back().src + keep.back().rows == keep_row[t] &&
            keep.back().dst + keep.back().rows == kept)
          ++keep.back().rows;
        else
          keep.push_back({keep_row[t], kept, 1});
        ++kept;
      }
    }
    for (int j = 0; j < world; ++j)
      FLASHKV_CHECK(lists[j].kv_indices.size() <= static_cast<size_t>(INT32_MAX),
                    "CpExtendShape: a ring step's entries on this rank exceed 2^31");
    for (int j = 0; j < world; ++j) build_pass(ring_passes_[j], lists[j], pb, info, plan_options);
  }

  // Device memory: index tensors, masks, workspaces, exchange buffers.
  qo_indptr_ = on_device(Tensor::from_i32(new_indptr), dev);
  own_qo_indptr_ = on_device(Tensor::from_i32(own_qo), dev);
  prefix_mask_ = prefix_masked ? mask_tensor(prefix_bits, dev) : Tensor();
  prefix_mask_indptr_ =
      prefix_masked ? on_device(Tensor::from_i32(prefix_mask_indptr), dev) : Tensor();
  prefix_ws_.reserve(prefix_ws_.bytes_needed(prefix_plan), dev);
  prefix_ws_.upload(prefix_plan, stream);
  if (!ring) {
    upload_pass(new_pass_, nullptr, 0, stream);
  } else {  // 256 bytes more: the workspace aligns the scratch's start
    size_t scratch = 0;
    for (const NewPass& p : ring_passes_)
      scratch = std::max(scratch, p.plan.layout.total_bytes - p.plan.layout.plan_bytes);
    void* at = detail::reserve(bufs_, kRingScratch, scratch + 256, dev);
    for (NewPass& p : ring_passes_) upload_pass(p, at, bufs_[kRingScratch].bytes(), stream);
  }

  const int64_t total = new_indptr.back(), own = rank_rows[rank];
  const size_t es = dtype_size(shape.dtype);
  const size_t row_q = static_cast<size_t>(shape.num_qo_heads) * shape.head_dim_qk * es;
  const size_t row_k = static_cast<size_t>(shape.num_kv_heads) * shape.head_dim_qk * es;
  const size_t row_v = static_cast<size_t>(shape.num_kv_heads) * shape.head_dim_v * es;
  const size_t row_o = static_cast<size_t>(shape.num_qo_heads) * shape.head_dim_v * es;
  const size_t row_l = static_cast<size_t>(shape.num_qo_heads) * sizeof(float);
  detail::reserve(bufs_, kAllQ, total * row_q, dev);
  if (!ring) {
    detail::reserve(bufs_, kAllK, total * row_k, dev);
    detail::reserve(bufs_, kAllV, total * row_v, dev);
  }
  detail::reserve(bufs_, kPrefixO, total * row_o, dev);
  detail::reserve(bufs_, kPrefixLse, total * row_l, dev);
  if (world > 1) {
    // The rows' states merged before their last pass: the prefix states, and the ring's earlier
    // steps' states.
    const int64_t states = ring ? 2 * world - 1 : world;
    detail::reserve(bufs_, kGatherQ, total * row_q, dev);
    if (ring) {  // the largest block, K then V
      const int64_t most = *std::max_element(rank_rows.begin(), rank_rows.end());
      detail::reserve(bufs_, kRingA, most * (row_k + row_v), dev);
      detail::reserve(bufs_, kRingB, most * (row_k + row_v), dev);
    } else {
      detail::reserve(bufs_, kGatherK, total * row_k, dev);
      detail::reserve(bufs_, kGatherV, total * row_v, dev);
    }
    if (options_.exchange == CpExchange::all_to_all) {
      detail::reserve(bufs_, kSendO, total * row_o, dev);
      detail::reserve(bufs_, kSendLse, total * row_l, dev);
      detail::reserve(bufs_, kRecvO, states * own * row_o, dev);
      detail::reserve(bufs_, kRecvLse, states * own * row_l, dev);
    } else {
      detail::reserve(bufs_, kRecvO, world * total * row_o, dev);
      detail::reserve(bufs_, kRecvLse, world * total * row_l, dev);
      detail::reserve(bufs_, kPickO, states * own * row_o, dev);
      detail::reserve(bufs_, kPickLse, states * own * row_l, dev);
    }
    detail::reserve(bufs_, kLseByRow, states * own * row_l, dev);
    detail::reserve(bufs_, kMergedO, own * row_o, dev);
    detail::reserve(bufs_, kMergedLse, own * row_l, dev);
  }
  detail::reserve(bufs_, kLocalNewK, num_local_new * row_k, dev);
  detail::reserve(bufs_, kLocalNewV, num_local_new * row_v, dev);

  shape_ = shape;
  shape_.window_left = w;
  shape_.custom_mask = TensorView();  // read here only; the derived masks are kept
  shape_.mask_indptr = TensorView();
  prefix_masked_ = prefix_masked;
  local_prefix_len_ = std::move(local_prefix);
  new_indptr_ = std::move(new_indptr);
  own_indptr_.assign(batch + 1, 0);
  for (size_t i = 0; i < batch; ++i)
    own_indptr_[i + 1] = own_indptr_[i] + own_qo[2 * i + 2] - own_qo[2 * i];
  rank_rows_ = std::move(rank_rows);
  rank_row_begin_ = std::move(rank_row_begin);
  to_global_ = std::move(to_global);
  to_owner_ = std::move(to_owner);
  own_of_global_ = std::move(own_of_global);
  local_new_ = std::move(local_new);
  num_local_new_ = num_local_new;
  ran_ = false;
  prefix_plan_ = std::move(prefix_plan);
  custom_ = custom;
  planned_ = true;
}

void CpExtend::run(const TensorView& q, const TensorView& k, const TensorView& v,
                   const PagedKV& prefix, const AttentionOptions& opt, const TensorView& out,
                   const TensorView& lse, Stream stream) {
  FLASHKV_CHECK(planned_, "CpExtend::run: call plan first");
  detail::PhaseClock clock(timing_, comm_, stream);
  const Device dev = comm_.device();
  const int world = comm_.size(), rank = comm_.rank();
  const int64_t b = static_cast<int64_t>(shape_.prefix_len.size());
  const int64_t total = new_indptr_.back(), own = rank_rows_[rank];
  const int64_t hq = shape_.num_qo_heads, hkv = shape_.num_kv_heads;
  const int64_t dqk = shape_.head_dim_qk, dv = shape_.head_dim_v;
  FLASHKV_CHECK(custom_ || opt.causal == shape_.causal, "opt.causal = ", opt.causal,
                ": expected the plan's ", shape_.causal);
  FLASHKV_CHECK(normalize_window_left(opt.window_left) == shape_.window_left,
                "opt.window_left = ", opt.window_left, ": expected the plan's ",
                shape_.window_left);
  FLASHKV_CHECK(!opt.custom_mask.defined() && !opt.mask_indptr.defined(),
                "opt.custom_mask: the sharded extend takes its mask at plan time "
                "(CpExtendShape::custom_mask)");
  FLASHKV_CHECK(!opt.merge_o.defined() && !opt.merge_lse.defined(),
                "opt.merge_o: the sharded extend takes no merge state");
  expect_rows(q, "q", dev, shape_.dtype, own, hq, dqk);
  expect_rows(k, "k", dev, shape_.dtype, own, hkv, dqk);
  expect_rows(v, "v", dev, shape_.dtype, own, hkv, dv);
  Expect(out, "out").ndim(3).device(dev).dtype(shape_.dtype).dim(0, own).dim(1, hq).dim(2, dv);
  if (lse.defined())
    Expect(lse, "lse").ndim(2).device(dev).dtype(DType::f32).contiguous().dim(0, own).dim(1, hq);
  if (prefix.indptr.defined() && prefix.indptr.device.is_cpu() && prefix.indices.device.is_cpu() &&
      (prefix.page_size == 1 || prefix.last_page_len.device.is_cpu())) {
    Expect(prefix.indptr, "prefix.indptr").ndim(1).dim(0, b + 1);
    for (int64_t i = 0; i < b; ++i)
      FLASHKV_CHECK(paged_kv_len(prefix, i) == local_prefix_len_[i], "prefix: request ", i,
                    " holds ", paged_kv_len(prefix, i), " tokens on rank ", rank, ": expected ",
                    local_prefix_len_[i], " (its share of ", shape_.prefix_len[i], ")");
  }

  const size_t es = dtype_size(shape_.dtype);
  const size_t row_q = hq * dqk * es, row_k = hkv * dqk * es, row_v = hkv * dv * es;
  const size_t row_o = hq * dv * es, row_l = hq * sizeof(float);
  // One rank owns every row, in global order: its q/k/v are the gathered ones. The ring gathers
  // no k/v.
  const bool ring = options_.kv_pass == CpKvPass::ring;
  void* all_q = world == 1 ? q.data : bufs_[kAllQ].data();
  void* all_k = world == 1 ? k.data : ring ? nullptr : bufs_[kAllK].data();
  void* all_v = world == 1 ? v.data : ring ? nullptr : bufs_[kAllV].data();
  void* pre_o = bufs_[kPrefixO].data();
  void* pre_l = bufs_[kPrefixLse].data();
  void* merged_o = world == 1 ? pre_o : bufs_[kMergedO].data();
  void* merged_l = world == 1 ? pre_l : bufs_[kMergedLse].data();

  // Validate both passes before the first collective.
  AttentionOptions prefix_opt;
  prefix_opt.causal = false;
  prefix_opt.sm_scale = opt.sm_scale;
  prefix_opt.logits_soft_cap = opt.logits_soft_cap;
  if (prefix_masked_) {
    prefix_opt.custom_mask = prefix_mask_;
    prefix_opt.mask_indptr = prefix_mask_indptr_;
  }
  const TensorView merged_o_view = detail::view(merged_o, shape_.dtype, {own, hq, dv}, dev);
  const TensorView merged_l_view = detail::view(merged_l, DType::f32, {own, hq}, dev);
  // The rows' states before their last pass, rank-major [N, T_own, ...] (N = P, the prefix
  // states; with the ring, then the P - 1 earlier steps' states), merged with merge_states.
  const int num_states = ring ? 2 * world - 1 : world;
  char* states_o = nullptr;
  char* states_l = nullptr;
  if (world > 1) {
    const bool a2a = options_.exchange == CpExchange::all_to_all;
    states_o = static_cast<char*>(bufs_[a2a ? kRecvO : kPickO].data());
    states_l = static_cast<char*>(bufs_[a2a ? kRecvLse : kPickLse].data());
  }
  // A new-token pass's options: its masks; the last pass merges with the rows' merged state as it
  // writes them, with the sinks (it writes each row once, so the sink enters once). An earlier
  // ring step writes its own state, kept for the merge.
  auto new_opt = [&](const NewPass& pass, bool last) {
    AttentionOptions o;
    o.causal = pass.causal;
    o.window_left = pass.window_left;
    o.sm_scale = opt.sm_scale;
    o.logits_soft_cap = opt.logits_soft_cap;
    if (pass.masked) {
      o.custom_mask = pass.mask;
      o.mask_indptr = pass.mask_indptr;
    }
    if (last) {
      o.sinks = opt.sinks;
      o.merge_o = merged_o_view;
      o.merge_lse = merged_l_view;
    }
    return o;
  };
  ran_ = true;
  if (total == 0) return;
  const PreparedAttention prefix_pass = prepare_paged_prefill(
      prefix_plan_, detail::view(all_q, shape_.dtype, {total, hq, dqk}, dev), qo_indptr_, prefix,
      prefix_opt, detail::view(pre_o, shape_.dtype, {total, hq, dv}, dev),
      detail::view(pre_l, DType::f32, {total, hq}, dev), prefix_ws_);
  // The new-token passes: one over the gathered K/V, or one a ring step over the block it holds
  // (step 0: this rank's own k/v; step j: ring buffer j % 2, K then V), step j < P - 1 writing
  // state P + j.
  auto prepare_new = [&](NewPass& pass, const void* kd, const void* vd, int64_t rows, int step,
                         bool last) {
    rows = std::max<int64_t>(rows, 1);  // an empty block: a dummy row no entry reads
    PagedKV kv{detail::view(const_cast<void*>(kd), shape_.dtype, {rows, hkv, dqk}, dev),
               detail::view(const_cast<void*>(vd), shape_.dtype, {rows, hkv, dv}, dev),
               pass.kv_indptr,
               pass.kv_indices,
               TensorView(),
               1};
    const int64_t slot = world + step;
    return prepare_paged_prefill(
        pass.plan, q, own_qo_indptr_, kv, new_opt(pass, last),
        last ? out : detail::view(states_o + slot * own * row_o, shape_.dtype, {own, hq, dv}, dev),
        last ? lse : detail::view(states_l + slot * own * row_l, DType::f32, {own, hq}, dev),
        pass.ws);
  };
  char* blocks[2] = {nullptr, nullptr};
  std::vector<std::optional<PreparedAttention>> new_passes(ring ? world : 1);
  if (ring && world > 1) {
    blocks[0] = static_cast<char*>(bufs_[kRingA].data());
    blocks[1] = static_cast<char*>(bufs_[kRingB].data());
  }
  for (int j = 0; j < static_cast<int>(new_passes.size()) && own > 0; ++j) {
    const bool last = j + 1 == static_cast<int>(new_passes.size());
    if (!ring) {
      new_passes[j] = prepare_new(new_pass_, all_k, all_v, total, j, true);
    } else {
      const int64_t rows = rank_rows_[(rank - j + world) % world];
      const char* held = j == 0 ? nullptr : blocks[j % 2];
      new_passes[j] = prepare_new(ring_passes_[j], j == 0 ? k.data : held,
                                  j == 0 ? v.data : held + rows * row_k, rows, j, last);
    }
  }
  clock.local();  // the checks and the passes' preparation

  if (world > 1) {
    std::vector<size_t> counts(world), displs(world);
    void* gathered[3] = {bufs_[kGatherQ].data(), bufs_[kGatherK].data(), bufs_[kGatherV].data()};
    const void* mine[3] = {q.data, k.data, v.data};
    void* all[3] = {all_q, all_k, all_v};
    const size_t row[3] = {row_q, row_k, row_v};
    for (int t = 0; t < (ring ? 1 : 3); ++t) {
      for (int s = 0; s < world; ++s) {
        counts[s] = rank_rows_[s] * row[t];
        displs[s] = rank_row_begin_[s] * row[t];
      }
      comm_.all_gather_v(mine[t], gathered[t], counts, displs, stream);
      clock.comm();
      copy_segments(all[t], 0, gathered[t], 0, to_global_, row[t], stream);
      clock.merge();
    }
  }
  prefix_pass.run(stream);
  clock.local();

  if (world > 1) {  // the prefix states to the rows' owners: states 0 .. P - 1
    if (options_.exchange == CpExchange::all_to_all) {
      char* send_o = static_cast<char*>(bufs_[kSendO].data());
      char* send_l = static_cast<char*>(bufs_[kSendLse].data());
      copy_segments(send_o, 0, pre_o, 0, to_owner_, row_o, stream);
      copy_segments(send_l, 0, pre_l, 0, to_owner_, row_l, stream);
      clock.merge();
      for (const auto& [dst, src, row] :
           {std::tuple{states_o, send_o, row_o}, std::tuple{states_l, send_l, row_l}}) {
        std::vector<size_t> sc(world), sd(world), rc(world), rd(world);
        for (int s = 0; s < world; ++s) {
          sc[s] = rank_rows_[s] * row;
          sd[s] = rank_row_begin_[s] * row;
          rc[s] = own * row;
          rd[s] = s * own * row;
        }
        comm_.all_to_all_v(src, sc, sd, dst, rc, rd, stream);
      }
      clock.comm();
    } else {
      char* all_o = static_cast<char*>(bufs_[kRecvO].data());
      char* all_l = static_cast<char*>(bufs_[kRecvLse].data());
      comm_.all_gather(pre_o, total * row_o, all_o, stream);
      comm_.all_gather(pre_l, total * row_l, all_l, stream);
      clock.comm();
      for (int s = 0; s < world; ++s) {
        copy_segments(states_o, s * own, all_o, s * total, own_of_global_, row_o, stream);
        copy_segments(states_l, s * own, all_l, s * total, own_of_global_, row_l, stream);
      }
    }
  }

  // The ring (on one rank, its only step): step j attends the block of rank (rank - j) mod P and
  // keeps the rows of it this rank stores; then, but at the last step, it sends that block to
  // rank + 1 and receives rank - 1's.
  const int next = (rank + 1) % world, prev = (rank - 1 + world) % world;
  for (int j = 0; ring && j + 1 < world; ++j) {
    const int64_t rows = rank_rows_[(rank - j + world) % world];
    keep_ring_rows(j, j == 0 ? k.data : blocks[j % 2],
                   j == 0 ? v.data : blocks[j % 2] + rows * row_k, row_k, row_v, stream);
    clock.merge();
    if (new_passes[j]) new_passes[j]->run(stream);
    clock.local();
    if (j == 0) {  // this rank's own block, K then V, into the first ring buffer
      copy_bytes(blocks[0], dev, k.data, dev, rows * row_k, stream);
      copy_bytes(blocks[0] + rows * row_k, dev, v.data, dev, rows * row_v, stream);
      clock.merge();
    }
    const int64_t incoming = rank_rows_[(rank - j - 1 + 2 * world) % world];
    comm_.send_recv(blocks[j % 2], rows * (row_k + row_v), next, blocks[(j + 1) % 2],
                    incoming * (row_k + row_v), prev, stream);
    clock.comm();
  }

  if (world > 1 && own > 0) {  // [N, T_own, H] -> [T_own, N, H], then the merge
    char* by_row = static_cast<char*>(bufs_[kLseByRow].data());
    for (int s = 0; s < num_states; ++s)
      detail::copy_2d(by_row + s * row_l, num_states * row_l, states_l + s * own * row_l, row_l,
                      row_l, own, dev, stream);
    TensorView states(states_o, shape_.dtype, {own, num_states, hq, dv}, dev);
    states.stride[0] = hq * dv;
    states.stride[1] = own * hq * dv;
    merge_states(states, detail::view(by_row, DType::f32, {own, num_states, hq}, dev),
                 merged_o_view, merged_l_view, stream);
  }
  if (world > 1) clock.merge();
  if (ring) {  // the last step's block (on one rank, the rank's own)
    const int j = world - 1;
    const int64_t rows = rank_rows_[(rank - j + world) % world];
    keep_ring_rows(j, j == 0 ? k.data : blocks[j % 2],
                   j == 0 ? v.data : blocks[j % 2] + rows * row_k, row_k, row_v, stream);
    clock.merge();
  }
  if (new_passes.back()) new_passes.back()->run(stream);
  clock.local();
}

// Copies the rows of ring step j's block that this rank keeps (append_local_kv) out of it.
void CpExtend::keep_ring_rows(int step, const void* k, const void* v, size_t row_k, size_t row_v,
                              Stream stream) {
  if (comm_.size() == 1) return;  // one rank keeps its own k/v, as given
  copy_segments(bufs_[kLocalNewK].data(), 0, k, 0, ring_keep_[step], row_k, stream);
  copy_segments(bufs_[kLocalNewV].data(), 0, v, 0, ring_keep_[step], row_v, stream);
}

void CpExtend::append_local_kv(const TensorView& k, const TensorView& v,
                               const TensorView& out_cache_loc, const TensorView& k_pool,
                               const TensorView& v_pool, float k_scale, float v_scale,
                               Stream stream) {
  FLASHKV_CHECK(planned_, "CpExtend::append_local_kv: call plan first");
  FLASHKV_CHECK(ran_, "CpExtend::append_local_kv: call run first");
  const Device dev = comm_.device();
  const int world = comm_.size();
  const int64_t own = rank_rows_[comm_.rank()];
  const int64_t hkv = shape_.num_kv_heads, dqk = shape_.head_dim_qk, dv = shape_.head_dim_v;
  expect_rows(k, "k", dev, shape_.dtype, own, hkv, dqk);
  expect_rows(v, "v", dev, shape_.dtype, own, hkv, dv);
  Expect(out_cache_loc, "out_cache_loc").ndim(1).dim(0, num_local_new_);
  if (num_local_new_ == 0) return;
  if (world == 1) {  // the rank keeps every new token, in the order given
    append_kv(k, v, out_cache_loc, k_pool, v_pool, k_scale, v_scale, stream);
    return;
  }
  const size_t es = dtype_size(shape_.dtype);
  void* k_new = bufs_[kLocalNewK].data();
  void* v_new = bufs_[kLocalNewV].data();
  // Validated before anything is copied or written.
  const PreparedAppendKV append =
      prepare_append_kv(detail::view(k_new, shape_.dtype, {num_local_new_, hkv, dqk}, dev),
                        detail::view(v_new, shape_.dtype, {num_local_new_, hkv, dv}, dev),
                        out_cache_loc, k_pool, v_pool, k_scale, v_scale);
  if (options_.kv_pass == CpKvPass::all_gather) {  // the ring kept them as the blocks passed
    copy_segments(k_new, 0, bufs_[kAllK].data(), 0, local_new_, hkv * dqk * es, stream);
    copy_segments(v_new, 0, bufs_[kAllV].data(), 0, local_new_, hkv * dv * es, stream);
  }
  append.run(stream);
}

}  // namespace flashkv::parallel
