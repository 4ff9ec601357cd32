#include "flashkv/backend/multi_step_draft.h"

#include <algorithm>

#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/ops/draft_ops.h"

namespace flashkv {

// Device buffers of one planning mode (eager, or fixed for CUDA graphs).
struct MultiStepDraftBackend::Buffers {
  Tensor rows, seq_lens;  // i32 [bs * topk] request rows repeated per branch; i32 [bs]
  std::vector<Tensor> indptr, indices, loc;  // per step
  std::vector<std::vector<int32_t>> indptr_cpu;
};

namespace {
void ensure(Tensor& t, int64_t n, Device d, bool fixed) {
  n = std::max<int64_t>(n, 1);
  if (t.defined() && t.numel() >= n) return;
  FLASHKV_CHECK(!fixed, "MultiStepDraftBackend: the batch needs ", n,
                " entries, past the CUDA-graph capacity (init_cuda_graph_state)");
  t = Tensor::empty({n}, DType::i32, d);
}
void upload(const Tensor& dst, const std::vector<int32_t>& src) {
  copy_bytes(dst.data(), dst.device(), src.data(), Device::cpu(), src.size() * sizeof(int32_t));
}
}  // namespace

MultiStepDraftBackend::MultiStepDraftBackend(const BackendOptions& options, int topk, int num_steps)
    : options_(options), topk_(topk), num_steps_(num_steps), eager_(std::make_unique<Buffers>()),
      graph_(std::make_unique<Buffers>()) {
  FLASHKV_CHECK(topk >= 1, "MultiStepDraftBackend: topk: expected >= 1, got ", topk);
  FLASHKV_CHECK(num_steps >= 1, "MultiStepDraftBackend: num_steps: expected >= 1, got ", num_steps);
  FLASHKV_CHECK(options.sliding_window_size < 0 && !options.is_encoder_decoder,
                "MultiStepDraftBackend: draft models with sliding-window or cross-attention layers are not supported");
  for (int i = 0; i < num_steps; ++i) steps_.push_back(std::make_unique<FlashKVBackend>(options));
  step_batches_.resize(num_steps);
  for (Buffers* b : {eager_.get(), graph_.get()}) {
    b->indptr.resize(num_steps);
    b->indices.resize(num_steps);
    b->loc.resize(num_steps);
    b->indptr_cpu.resize(num_steps);
  }
}

MultiStepDraftBackend::~MultiStepDraftBackend() = default;

void MultiStepDraftBackend::init_forward_metadata(const ForwardBatch& batch, const TensorView& draft_loc) {
  plan(batch, draft_loc, false, 0);
}

void MultiStepDraftBackend::init_cuda_graph_state(int max_bs) {
  FLASHKV_CHECK(max_bs > 0, "init_cuda_graph_state: max_bs: expected > 0, got ", max_bs);
  FLASHKV_CHECK(graph_max_bs_ == 0, "init_cuda_graph_state: already initialized");
  graph_max_bs_ = max_bs;
  for (auto& s : steps_) s->init_cuda_graph_state(max_bs * topk_, max_bs * topk_);
}

void MultiStepDraftBackend::init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch,
                                                                     const TensorView& draft_loc) {
  plan(batch, draft_loc, true, 1);
}

void MultiStepDraftBackend::init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch,
                                                                    const TensorView& draft_loc) {
  plan(batch, draft_loc, true, 2);
}

const ForwardBatch& MultiStepDraftBackend::step_batch(int step) const {
  FLASHKV_CHECK(step >= 0 && step < num_steps_, "step: expected 0..", num_steps_ - 1, ", got ", step);
  return step_batches_[step];
}

TensorView MultiStepDraftBackend::forward(int step, const TensorView& q, const TensorView& k,
                                          const TensorView& v, const LayerSpec& layer,
                                          bool save_kv_cache, const TensorView& out) {
  const ForwardBatch& b = step_batch(step);
  return steps_[step]->forward(q, k, v, layer, b, save_kv_cache, out);
}

void MultiStepDraftBackend::plan(const ForwardBatch& batch, const TensorView& draft_loc, bool graph,
                                 int phase) {
  FLASHKV_CHECK(!graph || graph_max_bs_ > 0, "MultiStepDraftBackend: call init_cuda_graph_state first");
  const Device dev = options_.device;
  const int32_t bs = batch.batch_size;
  FLASHKV_CHECK(batch.req_to_token_pool && batch.token_to_kv_pool,
                "batch: expected req_to_token_pool and token_to_kv_pool");
  FLASHKV_CHECK_EQ("batch.seq_lens_cpu size", static_cast<int64_t>(batch.seq_lens_cpu.size()), int64_t{bs});
  Expect(batch.req_pool_indices, "batch.req_pool_indices").ndim(1).device(dev).dtype(DType::i32).dim(0, bs, "batch_size");
  Expect(draft_loc, "draft_loc").ndim(3).device(dev).dtype(DType::i32).contiguous()
      .dim(0, bs, "batch_size").dim(1, topk_, "topk").dim(2, num_steps_, "num_steps");
  const int64_t max_ctx = batch.req_to_token_pool->max_context_len();
  for (int32_t r = 0; r < bs; ++r)
    FLASHKV_CHECK(batch.seq_lens_cpu[r] >= 0 && batch.seq_lens_cpu[r] <= max_ctx, "batch.seq_lens_cpu[", r,
                  "] = ", batch.seq_lens_cpu[r], ": expected 0..", max_ctx);
  if (graph) FLASHKV_CHECK(bs <= graph_max_bs_, "batch_size ", bs, " exceeds the CUDA-graph capacity ", graph_max_bs_);
  Buffers& buf = graph ? *graph_ : *eager_;
  const bool fixed = phase == 2;
  const int64_t rows = int64_t{bs} * topk_;
  const int64_t cap_rows = graph ? int64_t{graph_max_bs_} * topk_ : rows;
  const int64_t cap_bs = graph ? graph_max_bs_ : bs;
  // Request rows repeated per branch, and the requests' cached lengths.
  std::vector<int32_t> seq(batch.seq_lens_cpu), row_ids(rows);
  ensure(buf.rows, cap_rows, dev, fixed);
  ensure(buf.seq_lens, cap_bs, dev, fixed);
  upload(buf.seq_lens, seq);
  // Rows of the step batches: a small gather (req_pool_indices may live on the device).
  {
    Tensor host_rpi = Tensor::empty({bs}, DType::i32);
    copy_bytes(host_rpi.data(), Device::cpu(), batch.req_pool_indices.data, dev, bs * sizeof(int32_t));
    for (int64_t i = 0; i < rows; ++i) row_ids[i] = host_rpi.ptr<int32_t>()[i / topk_];
    upload(buf.rows, row_ids);
  }
  const TensorView rpi = batch.req_pool_indices;
  const TensorView seq_d = buf.seq_lens.view().rows(0, bs);
  for (int step = 0; step < num_steps_; ++step) {
    std::vector<int32_t>& indptr = buf.indptr_cpu[step];
    indptr.assign(rows + 1, 0);
    std::vector<int32_t> lens(rows);
    for (int64_t i = 0; i < rows; ++i) {
      lens[i] = seq[i / topk_] + step + 1;
      indptr[i + 1] = indptr[i] + lens[i];
    }
    const int64_t cap_entries = graph ? cap_rows * (max_ctx + num_steps_) : indptr.back();
    ensure(buf.indptr[step], cap_rows + 1, dev, fixed);
    ensure(buf.indices[step], cap_entries, dev, fixed);
    ensure(buf.loc[step], cap_rows, dev, fixed);
    upload(buf.indptr[step], indptr);
    const TensorView indptr_d = buf.indptr[step].view().rows(0, rows + 1);
    const TensorView loc_d = buf.loc[step].view().rows(0, rows);
    build_draft_kv_indices(batch.req_to_token_pool->req_to_token(), rpi, seq_d, draft_loc, step,
                           indptr_d, buf.indices[step], loc_d);
    ForwardBatch& sb = step_batches_[step];
    sb = ForwardBatch();
    sb.mode = ForwardMode::DECODE;
    sb.batch_size = static_cast<int32_t>(rows);
    sb.req_pool_indices = buf.rows.view().rows(0, rows);
    sb.seq_lens_cpu = lens;
    sb.out_cache_loc = loc_d;
    sb.req_to_token_pool = batch.req_to_token_pool;
    sb.token_to_kv_pool = batch.token_to_kv_pool;
    sb.spec.kv_indptr = indptr_d;
    sb.spec.kv_indices = buf.indices[step];
    sb.spec.kv_indptr_cpu = indptr;
    if (!graph) steps_[step]->init_forward_metadata(sb);
    else if (phase == 1) steps_[step]->init_forward_metadata_capture_cuda_graph(sb);
    else steps_[step]->init_forward_metadata_replay_cuda_graph(sb);
  }
}

}  // namespace flashkv
