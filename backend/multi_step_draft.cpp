#include "flashkv/backend/multi_step_draft.h"

#include <algorithm>

#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/ops/draft_ops.h"
#include "index_buffer.h"

namespace flashkv {

// Device buffers of one planning mode (eager, or fixed for CUDA graphs).
struct MultiStepDraftBackend::Buffers {
  Tensor rows, seq_lens;  // i32 [bs * topk] request rows repeated per branch; i32 [bs]
  std::vector<Tensor> indptr, indices, loc;  // per step
  std::vector<std::vector<int32_t>> indptr_cpu;
};

MultiStepDraftBackend::MultiStepDraftBackend(const BackendOptions& options, int topk, int num_steps)
    : options_(options),
      topk_(topk),
      num_steps_(num_steps),
      eager_(std::make_unique<Buffers>()),
      graph_(std::make_unique<Buffers>()) {
  FLASHKV_CHECK(topk >= 1, "MultiStepDraftBackend: topk: expected >= 1, got ", topk);
  FLASHKV_CHECK(num_steps >= 1, "MultiStepDraftBackend: num_steps: expected >= 1, got ", num_steps);
  FLASHKV_CHECK(options.sliding_window_size < 0 && !options.is_encoder_decoder,
                "MultiStepDraftBackend: draft models with sliding-window or cross-attention layers "
                "are not supported");
  FLASHKV_CHECK(options.cp_comm == nullptr,
                "MultiStepDraftBackend: context parallelism (BackendOptions::cp_comm) is not "
                "supported");
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

void MultiStepDraftBackend::init_forward_metadata(const ForwardBatch& batch,
                                                  const TensorView& draft_loc) {
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
  FLASHKV_CHECK(step >= 0 && step < num_steps_, "step: expected 0..", num_steps_ - 1, ", got ",
                step);
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
  using backend_detail::upload_indices;
  using backend_detail::with_index_room;
  // --- validation and host planning of every step; nothing in use changes until all pass ---
  FLASHKV_CHECK(!graph || graph_max_bs_ > 0,
                "MultiStepDraftBackend: call init_cuda_graph_state first");
  const Device dev = options_.device;
  const int32_t bs = batch.batch_size;
  FLASHKV_CHECK(bs >= 0, "batch.batch_size: expected >= 0, got ", bs);
  FLASHKV_CHECK(batch.req_to_token_pool && batch.token_to_kv_pool,
                "batch: expected req_to_token_pool and token_to_kv_pool");
  FLASHKV_CHECK(batch.req_to_token_pool->device() == dev,
                "batch.req_to_token_pool: expected device ", dev.str(), ", got ",
                batch.req_to_token_pool->device().str());
  FLASHKV_CHECK_EQ("batch.seq_lens_cpu size", static_cast<int64_t>(batch.seq_lens_cpu.size()),
                   int64_t{bs});
  Expect(batch.req_pool_indices, "batch.req_pool_indices")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, bs, "batch_size");
  Expect(draft_loc, "draft_loc")
      .ndim(3)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, bs, "batch_size")
      .dim(1, topk_, "topk")
      .dim(2, num_steps_, "num_steps");
  const int64_t max_ctx = batch.req_to_token_pool->max_context_len();
  const int64_t max_reqs = batch.req_to_token_pool->max_reqs();
  for (int32_t r = 0; r < bs; ++r)
    FLASHKV_CHECK(batch.seq_lens_cpu[r] >= 0 && batch.seq_lens_cpu[r] + num_steps_ <= max_ctx,
                  "batch.seq_lens_cpu[", r, "] = ", batch.seq_lens_cpu[r], ": expected 0..",
                  max_ctx - num_steps_, " (the draft tokens of ", num_steps_,
                  " steps must fit max_context_len ", max_ctx, ")");
  if (graph)
    FLASHKV_CHECK(bs <= graph_max_bs_, "batch_size ", bs, " exceeds the CUDA-graph capacity ",
                  graph_max_bs_);
  // The request rows, on the host (req_pool_indices may live on the device).
  Tensor host_rpi = Tensor::empty({std::max(bs, 1)}, DType::i32);
  copy_bytes(host_rpi.data(), Device::cpu(), batch.req_pool_indices.data, dev, bs * sizeof(int32_t),
             options_.stream);
  for (int32_t r = 0; r < bs; ++r) {
    const int32_t row = host_rpi.ptr<int32_t>()[r];
    FLASHKV_CHECK(row >= 0 && row < max_reqs, "batch.req_pool_indices[", r, "] = ", row,
                  ": expected a row of req_to_token in [0, ", max_reqs, ")");
  }
  if (dev.is_cpu()) {
    const auto* loc = static_cast<const int32_t*>(draft_loc.data);
    const int64_t slots = batch.token_to_kv_pool->num_rows();
    for (int64_t i = 0; i < draft_loc.numel(); ++i)
      FLASHKV_CHECK(loc[i] >= 0 && loc[i] < slots, "draft_loc: entry ", i, " = ", loc[i],
                    ": expected a slot of the pool in [0, ", slots, ")");
  }
  const Buffers& cur = graph ? *graph_ : *eager_;
  const bool fixed = phase == 2;
  const int64_t rows = int64_t{bs} * topk_;
  const int64_t cap_rows = graph ? int64_t{graph_max_bs_} * topk_ : rows;
  const int64_t cap_bs = graph ? graph_max_bs_ : bs;
  // The buffers this batch uses: the current ones, or larger ones installed below.
  Buffers next = cur;
  next.rows = with_index_room(cur.rows, cap_rows, dev, fixed, "MultiStepDraftBackend rows");
  next.seq_lens =
      with_index_room(cur.seq_lens, cap_bs, dev, fixed, "MultiStepDraftBackend seq_lens");
  std::vector<int32_t> row_ids(rows);
  for (int64_t i = 0; i < rows; ++i) row_ids[i] = host_rpi.ptr<int32_t>()[i / topk_];
  std::vector<ForwardBatch> step_batches(num_steps_);
  for (int step = 0; step < num_steps_; ++step) {
    std::vector<int32_t>& indptr = next.indptr_cpu[step];
    indptr.assign(rows + 1, 0);
    std::vector<int32_t> lens(rows);
    for (int64_t i = 0; i < rows; ++i) {
      lens[i] = batch.seq_lens_cpu[i / topk_] + step + 1;
      FLASHKV_CHECK(int64_t{indptr[i]} + lens[i] <= INT32_MAX,
                    "MultiStepDraftBackend: the step's KV entries exceed int32");
      indptr[i + 1] = indptr[i] + lens[i];
    }
    const int64_t cap_entries = graph ? cap_rows * (max_ctx + num_steps_) : indptr.back();
    next.indptr[step] =
        with_index_room(cur.indptr[step], cap_rows + 1, dev, fixed, "MultiStepDraftBackend indptr");
    next.indices[step] = with_index_room(cur.indices[step], cap_entries, dev, fixed,
                                         "MultiStepDraftBackend indices");
    next.loc[step] =
        with_index_room(cur.loc[step], cap_rows, dev, fixed, "MultiStepDraftBackend loc");
    ForwardBatch& sb = step_batches[step];
    sb.mode = ForwardMode::DECODE;
    sb.batch_size = static_cast<int32_t>(rows);
    sb.req_pool_indices = next.rows.view().rows(0, rows);
    sb.seq_lens_cpu = lens;
    sb.out_cache_loc = next.loc[step].view().rows(0, rows);
    sb.req_to_token_pool = batch.req_to_token_pool;
    sb.token_to_kv_pool = batch.token_to_kv_pool;
    sb.spec.kv_indptr = next.indptr[step].view().rows(0, rows + 1);
    sb.spec.kv_indices = next.indices[step];
    sb.spec.kv_indptr_cpu = indptr;
    // The step's rows and slots are filled at commit, from the rows and draft_loc checked above.
    steps_[step]->prepare(sb, graph, /*check_index_contents=*/false);
  }

  // --- commit: install the buffers, fill them, and commit every step's plan ---
  Buffers& buf = graph ? *graph_ : *eager_;
  buf = std::move(next);
  upload_indices(buf.seq_lens, batch.seq_lens_cpu, options_.stream);
  upload_indices(buf.rows, row_ids, options_.stream);
  const TensorView seq_d = buf.seq_lens.view().rows(0, bs);
  for (int step = 0; step < num_steps_; ++step) {
    const ForwardBatch& sb = step_batches[step];
    upload_indices(buf.indptr[step], buf.indptr_cpu[step], options_.stream);
    build_draft_kv_indices(batch.req_to_token_pool->req_to_token(), batch.req_pool_indices, seq_d,
                           draft_loc, step, sb.spec.kv_indptr, sb.spec.kv_indices, sb.out_cache_loc,
                           options_.stream);
    steps_[step]->commit(sb, graph);
  }
  step_batches_ = std::move(step_batches);
}

}  // namespace flashkv
