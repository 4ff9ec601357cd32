#include "flashkv/ops/draft_ops.h"

#include "flashkv/kernels/kv_kernels.h"

namespace flashkv {

void build_draft_kv_indices(const TensorView& req_to_token, const TensorView& req_pool_indices,
                            const TensorView& seq_lens, const TensorView& draft_loc, int step,
                            const TensorView& kv_indptr, const TensorView& kv_indices,
                            const TensorView& step_loc, Stream stream) {
  Expect(req_to_token, "req_to_token").ndim(2).dtype(DType::i32).inner_contiguous();
  const Device dev = req_to_token.device;
  Expect(draft_loc, "draft_loc").ndim(3).device(dev).dtype(DType::i32).contiguous();
  const int64_t bs = draft_loc.shape[0], topk = draft_loc.shape[1], steps = draft_loc.shape[2];
  FLASHKV_CHECK(step >= 0 && step < steps, "step: expected 0..", steps - 1, ", got ", step);
  Expect(req_pool_indices, "req_pool_indices")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, bs, "bs");
  Expect(seq_lens, "seq_lens").ndim(1).device(dev).dtype(DType::i32).contiguous().dim(0, bs, "bs");
  Expect(kv_indptr, "kv_indptr")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, bs * topk + 1, "bs * topk + 1");
  Expect(kv_indices, "kv_indices").ndim(1).device(dev).dtype(DType::i32).contiguous();
  Expect(step_loc, "step_loc")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, bs * topk, "bs * topk");
  DraftKVIndicesParams p;
  p.req_to_token = static_cast<const int32_t*>(req_to_token.data);
  p.req_to_token_stride = req_to_token.stride[0];
  p.max_reqs = req_to_token.shape[0];
  p.max_context_len = req_to_token.shape[1];
  p.req_pool_indices = static_cast<const int32_t*>(req_pool_indices.data);
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data);
  p.draft_loc = static_cast<const int32_t*>(draft_loc.data);
  p.bs = static_cast<int32_t>(bs);
  p.topk = static_cast<int32_t>(topk);
  p.num_steps = static_cast<int32_t>(steps);
  p.step = step;
  p.kv_indptr = static_cast<const int32_t*>(kv_indptr.data);
  p.kv_indices = static_cast<int32_t*>(kv_indices.data);
  p.num_indices = kv_indices.numel();
  p.step_loc = static_cast<int32_t*>(step_loc.data);
  if (dev.is_cpu()) {
    for (int64_t r = 0; r < bs; ++r) {
      const int32_t row = p.req_pool_indices[r], len = p.seq_lens[r];
      FLASHKV_CHECK(row >= 0 && row < p.max_reqs, "req_pool_indices[", r, "] = ", row,
                    ": expected 0..", p.max_reqs - 1);
      FLASHKV_CHECK(len >= 0 && len <= p.max_context_len, "seq_lens[", r, "] = ", len,
                    ": expected 0..", p.max_context_len);
      for (int64_t b = 0; b < topk; ++b) {
        const int64_t i = r * topk + b;
        FLASHKV_CHECK(
            p.kv_indptr[i] >= 0 && p.kv_indptr[i + 1] - p.kv_indptr[i] == len + step + 1 &&
                p.kv_indptr[i + 1] <= p.num_indices,
            "kv_indptr: row ", i, " must span seq_lens[", r, "] + step + 1 = ", len + step + 1,
            " entries inside kv_indices (", p.num_indices, ")");
      }
    }
    cpu::build_draft_kv_indices(p);
    return;
  }
#if FLASHKV_WITH_CUDA
  cuda::build_draft_kv_indices(p, stream);
#else
  (void)stream;
  throw_error(
      "build_draft_kv_indices: CUDA tensors given, but this flashkv was built without CUDA");
#endif
}
}  // namespace flashkv
