// Sharded decode: the local decode over this rank's shard, the states exchanged, merge_states.
#include <algorithm>
#include <climits>
#include <optional>

#include "copy.h"
#include "flashkv/core/error.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::parallel {

namespace {
enum DecodeBuf : size_t {
  kLocalO,
  kLocalLse,
  kRecvO,
  kRecvLse,
  kLseByRow,
  kSendO,
  kSendLse,
  kMergedO,
  kMergedLse,
  kGatheredO,
  kGatheredLse,
  kNumDecodeBufs
};
}  // namespace

CpDecode::CpDecode(Communicator& comm, const CpOptions& options) : comm_(comm), options_(options) {
  CpShard(options, comm.size());  // validates the options
  FLASHKV_CHECK(
      options.exchange == CpExchange::all_gather || options.exchange == CpExchange::all_to_all,
      "CpOptions::exchange: expected all_gather or all_to_all, got ",
      static_cast<int>(options.exchange));
}

void CpDecode::plan(const CpDecodeShape& shape, const PlanOptions& plan_options, Stream stream) {
  planned_ = false;
  const CpShard shard(options_, comm_.size());
  FLASHKV_CHECK(is_float(shape.dtype) && !is_fp8(shape.dtype), "CpDecodeShape::dtype: expected ",
                "f32, f16 or bf16, got ", dtype_name(shape.dtype));
  std::vector<int32_t> local(shape.kv_len.size());
  for (size_t i = 0; i < shape.kv_len.size(); ++i) {
    FLASHKV_CHECK(shape.kv_len[i] >= 0, "CpDecodeShape::kv_len[", i, "] = ", shape.kv_len[i],
                  ": expected >= 0");
    local[i] = static_cast<int32_t>(shard.local_len(comm_.rank(), shape.kv_len[i]));
  }
  BatchShape bs;
  bs.batch_size = static_cast<int32_t>(shape.kv_len.size());
  bs.kv_len = local.data();
  bs.num_qo_heads = shape.num_qo_heads;
  bs.num_kv_heads = shape.num_kv_heads;
  bs.head_dim_qk = shape.head_dim_qk;
  bs.head_dim_v = shape.head_dim_v;
  bs.page_size = shape.page_size;
  const Device dev = comm_.device();
  const int32_t window = shape.window_left < 0 ? -1 : shape.window_left;
  const bool masked = window >= 0 && comm_.size() > 1;
  DecodePlan plan;
  PrefillPlan masked_plan;
  Tensor qo_indptr, mask, mask_indptr;
  std::vector<int32_t> qo(local.size() + 1);
  if (masked) {
    // Request i's row sits at global position kv_len[i] - 1 and sees positions >= kv_len[i] - 1 -
    // window: on this rank, the local entries whose global position is that far on.
    std::vector<int32_t> mi(local.size() + 1, 0);
    std::vector<uint8_t> bits;
    for (size_t i = 0; i < local.size(); ++i) {
      qo[i + 1] = static_cast<int32_t>(i + 1);
      const int64_t first = int64_t{shape.kv_len[i]} - 1 - window;
      for (int64_t j = 0; j < local[i]; ++j)
        bits.push_back(shard.global_pos(comm_.rank(), j) >= first ? 1 : 0);
      FLASHKV_CHECK(bits.size() <= static_cast<size_t>(INT32_MAX),
                    "CpDecodeShape: the window mask of this rank exceeds 2^31 elements");
      mi[i + 1] = static_cast<int32_t>(bits.size());
    }
    bs.qo_indptr = qo.data();
    masked_plan = plan_prefill(bs, device_info(dev), plan_options);
    Tensor m = Tensor::empty({std::max<int64_t>(static_cast<int64_t>(bits.size()), 1)}, DType::u8);
    m.ptr<uint8_t>()[0] = 0;
    std::copy(bits.begin(), bits.end(), m.ptr<uint8_t>());
    qo_indptr = Tensor::from_i32(qo);
    mask_indptr = Tensor::from_i32(mi);
    mask = m;
    if (dev.is_cuda()) {
      qo_indptr = qo_indptr.to(dev);
      mask_indptr = mask_indptr.to(dev);
      mask = mask.to(dev);
    }
  } else {
    bs.window_left = window;
    plan = plan_decode(bs, device_info(dev), plan_options);
  }
  const Plan& any_plan = masked ? static_cast<const Plan&>(masked_plan) : plan;

  const int world = comm_.size();
  const int64_t b = bs.batch_size, hq = shape.num_qo_heads, dv = shape.head_dim_v;
  const size_t es = dtype_size(shape.dtype);
  std::vector<int64_t> head_begin(world + 1);
  for (int s = 0; s <= world; ++s) head_begin[s] = s * hq / world;
  const size_t o_bytes = static_cast<size_t>(b * hq * dv) * es;
  const size_t lse_bytes = static_cast<size_t>(b * hq) * sizeof(float);
  ws_.reserve(ws_.bytes_needed(any_plan), dev);
  ws_.upload(any_plan, stream);
  if (world > 1) {
    detail::reserve(bufs_, kLocalO, o_bytes, dev);
    detail::reserve(bufs_, kLocalLse, lse_bytes, dev);
    if (options_.exchange == CpExchange::all_gather) {
      detail::reserve(bufs_, kRecvO, o_bytes * world, dev);
      detail::reserve(bufs_, kRecvLse, lse_bytes * world, dev);
      detail::reserve(bufs_, kLseByRow, lse_bytes * world, dev);
    } else {
      const int r = comm_.rank();
      const int64_t hr = head_begin[r + 1] - head_begin[r];
      const size_t slice_o = static_cast<size_t>(b * hr * dv) * es;
      const size_t slice_lse = static_cast<size_t>(b * hr) * sizeof(float);
      detail::reserve(bufs_, kSendO, o_bytes, dev);
      detail::reserve(bufs_, kSendLse, lse_bytes, dev);
      detail::reserve(bufs_, kRecvO, slice_o * world, dev);
      detail::reserve(bufs_, kRecvLse, slice_lse * world, dev);
      detail::reserve(bufs_, kLseByRow, slice_lse * world, dev);
      detail::reserve(bufs_, kMergedO, slice_o, dev);
      detail::reserve(bufs_, kMergedLse, slice_lse, dev);
      detail::reserve(bufs_, kGatheredO, o_bytes, dev);
      detail::reserve(bufs_, kGatheredLse, lse_bytes, dev);
    }
  }
  plan_ = std::move(plan);
  masked_plan_ = std::move(masked_plan);
  masked_ = masked;
  qo_indptr_ = qo_indptr;
  mask_ = mask;
  mask_indptr_ = mask_indptr;
  shape_ = shape;
  shape_.window_left = window;
  local_kv_len_ = std::move(local);
  head_begin_ = std::move(head_begin);
  planned_ = true;
}

void CpDecode::run(const TensorView& q, const PagedKV& kv, const AttentionOptions& opt,
                   const TensorView& out, const TensorView& lse, Stream stream) {
  FLASHKV_CHECK(planned_, "CpDecode::run: call plan first");
  detail::PhaseClock clock(timing_, comm_, stream);
  const Device dev = comm_.device();
  const int world = comm_.size(), rank = comm_.rank();
  const int64_t b = static_cast<int64_t>(shape_.kv_len.size()), hq = shape_.num_qo_heads,
                dv = shape_.head_dim_v;
  FLASHKV_CHECK(normalize_window_left(opt.window_left) == shape_.window_left,
                "opt.window_left = ", opt.window_left, ": expected the plan's ",
                shape_.window_left);
  FLASHKV_CHECK(!opt.custom_mask.defined() && !opt.mask_indptr.defined(),
                "opt.custom_mask: the sharded decode takes no mask");
  Expect(q, "q").defined().device(dev).dtype(shape_.dtype);
  Expect(out, "out")
      .ndim(3)
      .device(dev)
      .dtype(shape_.dtype)
      .contiguous()
      .dim(0, b)
      .dim(1, hq)
      .dim(2, dv);
  if (lse.defined())
    Expect(lse, "lse").ndim(2).device(dev).dtype(DType::f32).contiguous().dim(0, b).dim(1, hq);
  if (kv.indptr.defined() && kv.indptr.device.is_cpu() && kv.indices.device.is_cpu() &&
      (kv.page_size == 1 || kv.last_page_len.device.is_cpu())) {
    Expect(kv.indptr, "kv.indptr").ndim(1).dim(0, b + 1);
    for (int64_t i = 0; i < b; ++i)
      FLASHKV_CHECK(paged_kv_len(kv, i) == local_kv_len_[i], "kv: request ", i, " holds ",
                    paged_kv_len(kv, i), " tokens on rank ", rank, ": expected ", local_kv_len_[i],
                    " (its share of ", shape_.kv_len[i], ")");
  }
  if (world == 1) {  // the one-rank path: the plain decode
    prepare_paged_decode(plan_, q, kv, opt, out, lse, ws_).run(stream);
    clock.local();
    return;
  }
  const size_t es = dtype_size(shape_.dtype);
  AttentionOptions local_opt = opt;
  // A sink is one more state of the row; rank 0's local state carries it, so it enters the merge
  // once.
  if (rank != 0) local_opt.sinks = TensorView();
  void* lo = bufs_[kLocalO].data();
  float* ll = static_cast<float*>(bufs_[kLocalLse].data());
  const TensorView lo_view = detail::view(lo, shape_.dtype, {b, hq, dv}, dev);
  const TensorView ll_view = detail::view(ll, DType::f32, {b, hq}, dev);
  std::optional<PreparedAttention> local;
  if (masked_) {
    local_opt.window_left = -1;  // in the mask
    local_opt.causal = false;
    local_opt.custom_mask = mask_;
    local_opt.mask_indptr = mask_indptr_;
    local =
        prepare_paged_prefill(masked_plan_, q, qo_indptr_, kv, local_opt, lo_view, ll_view, ws_);
  } else {
    local = prepare_paged_decode(plan_, q, kv, local_opt, lo_view, ll_view, ws_);
  }
  if (b == 0) return;
  local->run(stream);
  clock.local();

  const size_t row_o = static_cast<size_t>(hq * dv) * es, row_lse = hq * sizeof(float);
  if (options_.exchange == CpExchange::all_gather) {
    char* ro = static_cast<char*>(bufs_[kRecvO].data());
    char* rl = static_cast<char*>(bufs_[kRecvLse].data());
    char* lt = static_cast<char*>(bufs_[kLseByRow].data());
    comm_.all_gather(lo, b * row_o, ro, stream);
    comm_.all_gather(ll, b * row_lse, rl, stream);
    clock.comm();
    for (int s = 0; s < world; ++s)  // [P, B, H] -> [B, P, H]
      detail::copy_2d(lt + s * row_lse, world * row_lse, rl + s * b * row_lse, row_lse, row_lse, b,
                      dev, stream);
    TensorView states(ro, shape_.dtype, {b, world, hq, dv}, dev);
    states.stride[0] = hq * dv;
    states.stride[1] = b * hq * dv;
    merge_states(states, detail::view(lt, DType::f32, {b, world, hq}, dev), out, lse, stream);
    clock.merge();
    return;
  }

  // all_to_all by heads: rank s merges heads [head_begin_[s], head_begin_[s + 1]) of every row.
  std::vector<size_t> send_counts(world), send_displs(world), recv_counts(world),
      recv_displs(world), lse_counts(world), lse_displs(world), lse_recv_counts(world),
      lse_recv_displs(world);
  const int64_t hr = head_begin_[rank + 1] - head_begin_[rank];
  char* so = static_cast<char*>(bufs_[kSendO].data());
  char* sl = static_cast<char*>(bufs_[kSendLse].data());
  for (int s = 0; s < world; ++s) {
    const int64_t h0 = head_begin_[s], hs = head_begin_[s + 1] - h0;
    send_displs[s] = static_cast<size_t>(b * h0 * dv) * es;
    send_counts[s] = static_cast<size_t>(b * hs * dv) * es;
    lse_displs[s] = static_cast<size_t>(b * h0) * sizeof(float);
    lse_counts[s] = static_cast<size_t>(b * hs) * sizeof(float);
    recv_counts[s] = static_cast<size_t>(b * hr * dv) * es;
    recv_displs[s] = s * recv_counts[s];
    lse_recv_counts[s] = static_cast<size_t>(b * hr) * sizeof(float);
    lse_recv_displs[s] = s * lse_recv_counts[s];
    // [B, H, D] -> [P][B, H_s, D]
    detail::copy_2d(so + send_displs[s], hs * dv * es, static_cast<char*>(lo) + h0 * dv * es, row_o,
                    hs * dv * es, b, dev, stream);
    detail::copy_2d(sl + lse_displs[s], hs * sizeof(float), ll + h0, row_lse, hs * sizeof(float), b,
                    dev, stream);
  }
  clock.merge();
  char* ro = static_cast<char*>(bufs_[kRecvO].data());
  char* rl = static_cast<char*>(bufs_[kRecvLse].data());
  char* lt = static_cast<char*>(bufs_[kLseByRow].data());
  comm_.all_to_all_v(so, send_counts, send_displs, ro, recv_counts, recv_displs, stream);
  comm_.all_to_all_v(sl, lse_counts, lse_displs, rl, lse_recv_counts, lse_recv_displs, stream);
  clock.comm();
  void* mo = bufs_[kMergedO].data();
  void* ml = bufs_[kMergedLse].data();
  if (hr > 0) {
    const size_t slice_lse = hr * sizeof(float);
    for (int s = 0; s < world; ++s)  // [P, B, H_r] -> [B, P, H_r]
      detail::copy_2d(lt + s * slice_lse, world * slice_lse, rl + lse_recv_displs[s], slice_lse,
                      slice_lse, b, dev, stream);
    TensorView states(ro, shape_.dtype, {b, world, hr, dv}, dev);
    states.stride[0] = hr * dv;
    states.stride[1] = b * hr * dv;
    merge_states(states, detail::view(lt, DType::f32, {b, world, hr}, dev),
                 detail::view(mo, shape_.dtype, {b, hr, dv}, dev),
                 detail::view(ml, DType::f32, {b, hr}, dev), stream);
  }
  clock.merge();
  char* go = static_cast<char*>(bufs_[kGatheredO].data());
  comm_.all_gather_v(mo, go, send_counts, send_displs, stream);
  clock.comm();
  for (int s = 0; s < world; ++s) {  // [P][B, H_s, D] -> [B, H, D]
    const int64_t h0 = head_begin_[s], hs = head_begin_[s + 1] - h0;
    detail::copy_2d(static_cast<char*>(out.data) + h0 * dv * es, row_o, go + send_displs[s],
                    hs * dv * es, hs * dv * es, b, dev, stream);
  }
  // Gathered whether or not this rank wants the LSE: every rank must run the same collectives.
  clock.merge();
  char* gl = static_cast<char*>(bufs_[kGatheredLse].data());
  comm_.all_gather_v(ml, gl, lse_counts, lse_displs, stream);
  clock.comm();
  if (lse.defined()) {
    for (int s = 0; s < world; ++s) {
      const int64_t h0 = head_begin_[s], hs = head_begin_[s + 1] - h0;
      detail::copy_2d(static_cast<float*>(lse.data) + h0, row_lse, gl + lse_displs[s],
                      hs * sizeof(float), hs * sizeof(float), b, dev, stream);
    }
  }
  clock.merge();
}

}  // namespace flashkv::parallel
