#include "model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "flashkv/reference/compare.h"
#include "flashkv/reference/layer_reference.h"
#include "invariants.h"

namespace flashkv::app {

LayerSpec ModelConfig::layer(int i) const {
  LayerSpec l;
  l.layer_id = i;
  l.num_qo_heads = num_qo_heads;
  l.num_kv_heads = num_kv_heads;
  l.head_dim_qk = head_dim;
  l.scaling = sm_scale;
  l.logit_cap = logit_cap;
  if (windowed(i)) l.sliding_window_size = sliding_window;
  if (encoder_decoder && i % 2 == 1) l.is_cross_attention = true;
  return l;
}

std::string ModelConfig::str() const {
  std::string s =
      str_cat(num_layers, " layers, ", num_qo_heads, "/", num_kv_heads, " heads, head dim ",
              head_dim, ", ", dtype_name(dtype), ", kv ", dtype_name(kv_dtype));
  if (sliding_window >= 0) {
    if (full_every == 0)
      s += str_cat(", window ", sliding_window, " on every layer");
    else if (full_every == 2)
      s += str_cat(", window ", sliding_window, " on even layers");
    else if (full_every == 1)
      s += str_cat(", window ", sliding_window, " on no layer");
    else
      s += str_cat(", window ", sliding_window, " on ", full_every - 1, " of ", full_every,
                   " layers");
  }
  if (logit_cap > 0) s += str_cat(", soft cap ", logit_cap);
  if (sm_scale > 0) s += str_cat(", scale ", sm_scale);
  if (sinks) s += ", attention sinks";
  if (encoder_decoder) s += ", cross attention on odd layers";
  return s;
}

Model::Model(const ModelConfig& config, Device device, int64_t kv_slots, uint64_t seed,
             const CpConfig& cp)
    : config_(config), device_(device), cp_(cp), gen_(seed) {
  FLASHKV_CHECK(config.full_every >= 0, "full_every: expected >= 0, got ", config.full_every);
  KVPoolConfig pc;
  pc.num_slots = kv_slots;
  pc.num_layers = config.num_layers;
  pc.num_kv_heads = config.num_kv_heads;
  pc.head_dim_qk = config.head_dim;
  pc.dtype = config.kv_dtype;
  pc.device = device;
  pool_ = std::make_unique<KVPool>(pc);
  if (is_fp8(config.kv_dtype))
    for (int l = 0; l < config.num_layers; ++l) pool_->set_scales(l, 0.5f, 2.0f);
  BackendOptions o;
  o.device = device;
  o.q_dtype = config.dtype;
  o.num_qo_heads = config.num_qo_heads;
  o.num_kv_heads = config.num_kv_heads;
  o.head_dim_qk = config.head_dim;
  o.sliding_window_size = config.sliding_window;
  o.is_encoder_decoder = config.encoder_decoder;
  o.cp_comm = cp.comm;
  o.cp = cp.options;
  backend_ = std::make_unique<FlashKVBackend>(o);
  // Learned sink logits stand-ins: a few units around 0, as trained sinks are, drawn per layer.
  if (config.sinks)
    for (int l = 0; l < config.num_layers; ++l) {
      Tensor host = Tensor::empty({config.num_qo_heads}, DType::f32);
      fill_normal(host, gen_(), 2.0);
      sinks_.push_back(host.to(device));
    }
}

LayerSpec Model::layer(int i) const {
  LayerSpec l = config_.layer(i);
  if (!sinks_.empty()) l.sinks = sinks_[static_cast<size_t>(i)].view();
  return l;
}

void Model::reserve_bank(int64_t elements) {
  // Twice the largest slice, so slices start anywhere in the first half.
  const int64_t want = 2 * elements + 4096;
  if (bank_.defined() && bank_.numel() >= want) return;
  const int64_t size = std::max<int64_t>(want, int64_t{1} << 20);
  Tensor host = Tensor::empty({size}, config_.dtype);
  fill_normal(host, gen_());
  bank_ = host.to(device_);
}

TensorView Model::activations(int64_t rows, int heads, int dim) {
  const int64_t n = rows * heads * dim;
  // 64-element aligned offsets keep every slice as aligned as a fresh allocation's rows.
  const int64_t slots = (bank_.numel() - n) / 64;
  const int64_t offset =
      std::uniform_int_distribution<int64_t>(0, std::max<int64_t>(slots - 1, 0))(gen_) * 64;
  return TensorView(static_cast<char*>(bank_.data()) + offset * dtype_size(config_.dtype),
                    config_.dtype, {rows, heads, dim}, device_);
}

namespace {

// Rows [begin, begin + n) of a [rows, ...] device or host tensor, copied to the host.
void copy_rows(const TensorView& src, int64_t begin, int64_t n, char* dst) {
  const size_t row_bytes = src.nbytes() / static_cast<size_t>(src.shape[0]);
  copy_bytes(dst, Device::cpu(), static_cast<const char*>(src.data) + begin * row_bytes, src.device,
             n * row_bytes);
}

}  // namespace

PassResult Model::forward(StepBatch& step, const CheckOptions& check) {
  ForwardBatch& b = step.batch();
  b.token_to_kv_pool = pool_.get();
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens(), E = step.num_encoder_tokens();
  const int64_t hd_out = int64_t{c.num_qo_heads} * c.head_dim;
  reserve_bank(std::max(T, E) * hd_out);

  // Which layers and requests to check, decided (and their buffers made) before timing.
  std::vector<int> check_layers;
  std::vector<size_t> check_entries;
  if (check.enabled && T > 0) {
    std::vector<int> layers(c.num_layers);
    std::iota(layers.begin(), layers.end(), 0);
    std::shuffle(layers.begin(), layers.end(), gen_);
    layers.resize(std::min<size_t>(layers.size(), static_cast<size_t>(std::max(check.layers, 0))));
    check_layers = layers;
    for (size_t i = 0; i < step.entries().size(); ++i)
      if (step.entries()[i].num_new > 0) check_entries.push_back(i);
    std::shuffle(check_entries.begin(), check_entries.end(), gen_);
    check_entries.resize(
        std::min<size_t>(check_entries.size(), static_cast<size_t>(std::max(check.requests, 0))));
    std::sort(check_entries.begin(), check_entries.end());
  }
  // Context parallelism: the rows this rank gives the backend (an extend's own rows), copied
  // out of the activations each layer; R of them.
  const bool cp_rows_only = cp_.enabled() && b.mode != ForwardMode::DECODE;
  RowRuns own;
  int64_t R = T;
  if (cp_rows_only) {
    own = cp_rows(step, cp_.comm->rank());
    R = 0;
    for (const auto& run : own) R += run.second;
    cp_q_ = Tensor::empty({std::max<int64_t>(R, 1), c.num_qo_heads, c.head_dim}, c.dtype, device_);
    cp_k_ = Tensor::empty({std::max<int64_t>(R, 1), c.num_kv_heads, c.head_dim}, c.dtype, device_);
    cp_v_ = Tensor::empty({std::max<int64_t>(R, 1), c.num_kv_heads, c.head_dim}, c.dtype, device_);
  }
  std::vector<Tensor> check_out;
  for (size_t k = 0; k < check_layers.size(); ++k) {
    // All-ones bytes are NaN in every float dtype: a row the layer does not write shows.
    check_out.push_back(Tensor::empty({std::max<int64_t>(R, 1), hd_out}, c.dtype, device_));
    fill_bytes(check_out.back().data(), device_, 0xFF, check_out.back().view().nbytes());
  }
  std::vector<LayerInputs> check_in(check_layers.size());

  PassResult r;
  synchronize(device_);
  const auto t0 = std::chrono::steady_clock::now();
  backend_->init_forward_metadata(b);
  TensorView last_out;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerSpec spec = layer(l);
    const TensorView q = activations(T, c.num_qo_heads, c.head_dim);
    TensorView k, v;
    const int64_t kv_rows = spec.is_cross_attention ? (step.write_encoder_kv() ? E : 0) : T;
    if (kv_rows > 0) {
      k = activations(kv_rows, c.num_kv_heads, c.head_dim);
      v = activations(kv_rows, c.num_kv_heads, c.head_dim);
    }
    const auto at = std::find(check_layers.begin(), check_layers.end(), l);
    TensorView out;
    if (at != check_layers.end()) {
      out = check_out[at - check_layers.begin()].view().rows(0, R);
      check_in[at - check_layers.begin()] = {q, k, v};
    }
    if (cp_rows_only) {
      gather_runs(q, own, cp_q_);
      gather_runs(k, own, cp_k_);
      gather_runs(v, own, cp_v_);
      last_out = backend_->forward(cp_q_.view().rows(0, R), cp_k_.view().rows(0, R),
                                   cp_v_.view().rows(0, R), spec, b, /*save_kv_cache=*/true, out);
    } else {
      last_out = backend_->forward(q, k, v, spec, b, /*save_kv_cache=*/true, out);
    }
    if (check.scan_every_layer && l + 1 < c.num_layers)
      scan_between_layers(last_out, R, str_cat("layer ", l), r);
  }
  synchronize(device_);
  const auto t1 = std::chrono::steady_clock::now();
  r.ms = std::chrono::duration<double, std::milli>(t1 - t0).count() - r.check_ms;
  verify_pass(step, check, check_layers, check_entries, check_in, check_out, last_out, r);
  r.check_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  return r;
}

void Model::scan_for_nonfinite(const TensorView& out, int64_t rows, const std::string& what,
                               PassResult& r) {
  if (rows == 0 || !out.defined() || r.nonfinite) return;
  const int64_t width = int64_t{config_.num_qo_heads} * config_.head_dim;
  Tensor host = Tensor::empty({rows, width}, config_.dtype);
  copy_rows(out, 0, rows, static_cast<char*>(host.data()));
  const int64_t at = first_nonfinite(host);
  if (at < 0) return;
  r.nonfinite = true;
  r.nonfinite_where =
      str_cat(what, ", output row ", at / width, ", head ", at % width / config_.head_dim, ": ",
              load_as_double(host.data(), config_.dtype, at));
}

void Model::scan_between_layers(const TensorView& out, int64_t rows, const std::string& what,
                                PassResult& r) {
  synchronize(device_);
  const auto t0 = std::chrono::steady_clock::now();
  scan_for_nonfinite(out, rows, what, r);
  r.check_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void Model::compare_layer(const LayerSpec& layer, const CheckedRows& rows, const LayerInputs& in,
                          const TensorView& out_all, const char* what, PassResult& r,
                          const KVPool* ref_pool) {
  const ModelConfig& c = config_;
  int64_t total = 0;
  for (const auto& range : rows.ranges) total += range.second;
  Tensor q = Tensor::empty({total, c.num_qo_heads, c.head_dim}, c.dtype);
  Tensor out = Tensor::empty({total, c.num_qo_heads, c.head_dim}, c.dtype);
  const size_t row_bytes = q.view().nbytes() / static_cast<size_t>(total);
  int64_t at = 0;
  for (const auto& [first, n] : rows.ranges) {
    copy_rows(in.q, first, n, static_cast<char*>(q.data()) + at * row_bytes);
    copy_rows(out_all, first, n, static_cast<char*>(out.data()) + at * row_bytes);
    at += n;
  }
  // The ragged extend reads the new tokens' K/V as given, not rounded to an fp8 pool's dtype.
  const bool fresh_new = in.k.defined() && backend_->reads_new_kv_from_input(layer);
  // In the pass that writes the encoder K/V, a cross-attention layer's reference takes them as
  // given, so that K/V written anywhere but the slots the requests' rows list fail the check.
  // A pool of the activations' dtype holds them exactly; an fp8 pool rounds them, so with one
  // the reference reads the pool as the layer did.
  const bool fresh_encoder = in.k.defined() && layer.is_cross_attention && !is_fp8(c.kv_dtype) &&
                             rows.encoder_rows.size() == rows.reqs.size();
  std::vector<ReferenceRequest> reqs = rows.reqs;
  if (fresh_encoder)
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].new_len = reqs[i].encoder_len;
      reqs[i].new_row = rows.encoder_rows[i];
    }
  const bool fresh = fresh_new || fresh_encoder;
  LayerSpec ref_layer = layer;
  if (ref_pool != nullptr) ref_layer.layer_id = 0;  // a one-layer pool of this layer's K/V
  const reference::Result ref =
      layer_reference(ref_layer, reqs, q, ref_pool != nullptr ? *ref_pool : *pool_, nullptr,
                      nullptr, fresh ? in.k : TensorView(), fresh ? in.v : TensorView());
  const Errors err = compare(out, TensorView(), ref);
  const Tolerance tol = tolerance_for(c.dtype, is_fp8(c.kv_dtype));
  ++r.checked;
  r.worst_rel = std::max(r.worst_rel, err.rel);
  if (err.nan && !r.nonfinite) {
    r.nonfinite = true;
    r.nonfinite_where = str_cat(what, ", layer ", layer.layer_id, ": NaN in a checked output");
  }
  if (!err.within(tol) && r.failures++ == 0)
    r.failure = str_cat(what, ", layer ", layer.layer_id, ": errors ", err.str(), " past rel ",
                        tol.rel, ", max_abs ", tol.max_abs);
}

void Model::verify_pass(const StepBatch& step, const CheckOptions& check,
                        const std::vector<int>& check_layers,
                        const std::vector<size_t>& check_entries,
                        const std::vector<LayerInputs>& check_in,
                        const std::vector<Tensor>& check_out, const TensorView& last_out,
                        PassResult& r) {
  const ModelConfig& c = config_;
  const ForwardBatch& b = step.batch();
  // Rows of the outputs: an extend with context parallelism returns this rank's own.
  const int64_t rows_out = cp_.enabled() && b.mode != ForwardMode::DECODE
                               ? backend_->cp_query_rows()
                               : step.num_tokens();
  scan_for_nonfinite(last_out, rows_out, str_cat("layer ", c.num_layers - 1), r);
  if (check_layers.empty() || check_entries.empty()) return;
  CheckedRows rows = checked_rows(step, check, check_entries);
  const std::string what = str_cat(mode_name(b.mode), " pass of ", b.batch_size, " requests");
  if (!cp_.enabled()) {
    for (size_t k = 0; k < check_layers.size(); ++k)
      compare_layer(layer(check_layers[k]), rows, check_in[k], check_out[k], what.c_str(), r);
    return;
  }
  // Context parallelism: the reference reads the checked requests' K/V gathered from every rank,
  // and an extend's outputs are put together from every rank's rows, so that each rank checks
  // every checked row (every rank takes part in the same gathers).
  for (size_t k = 0; k < check_layers.size(); ++k) {
    std::vector<std::vector<int32_t>> slots;
    const std::unique_ptr<KVPool> gathered =
        cp_gather_kv(check_layers[k], step, check_entries, slots);
    for (size_t j = 0; j < rows.reqs.size(); ++j) rows.reqs[j].slots = slots[j].data();
    const Tensor all_out =
        b.mode == ForwardMode::DECODE ? check_out[k] : cp_all_outputs(step, check_out[k]);
    compare_layer(layer(check_layers[k]), rows, check_in[k], all_out, what.c_str(), r,
                  gathered.get());
  }
}

Model::CheckedRows Model::checked_rows(const StepBatch& step, const CheckOptions& check,
                                       const std::vector<size_t>& check_entries) const {
  const ModelConfig& c = config_;
  // The checked rows: the last `rows` new tokens of each sampled request. The float64 reference
  // runs on one host thread: with check.rows > 0, rows are cut so that one layer's check costs
  // about 2^25 multiply-adds (a long GPU-sized context gets fewer rows).
  constexpr double kCheckWork = double(1 << 25);
  CheckedRows rows;
  std::vector<int64_t> encoder_begin(1, 0);  // entry i's encoder tokens: rows from [i] of k / v
  for (const BatchEntry& e : step.entries())
    encoder_begin.push_back(encoder_begin.back() + e.seq->encoder_len);
  for (size_t i : check_entries) {
    const BatchEntry& e = step.entries()[i];
    int32_t n = e.num_new;
    if (check.rows > 0) {
      const double per_row =
          double(e.seq->encoder_len + e.seq_len) * c.num_qo_heads * 2 * c.head_dim;
      const double fit = kCheckWork / (per_row * static_cast<double>(check_entries.size()));
      n = std::max(1, std::min({e.num_new, check.rows, static_cast<int32_t>(std::min(fit, 1e9))}));
    }
    ReferenceRequest rr;
    rr.slots = e.seq->slots.data();
    rr.encoder_len = e.seq->encoder_len;
    rr.seq_len = e.seq_len;
    rr.qo_len = n;
    rr.new_len = e.num_new;
    rr.new_row = step.qo_begin(i);
    if (const uint8_t* m = step.mask(i)) rr.mask = m + int64_t{e.num_new - n} * e.seq_len;
    rows.reqs.push_back(rr);
    rows.ranges.emplace_back(step.qo_begin(i) + e.num_new - n, n);
    if (step.write_encoder_kv()) rows.encoder_rows.push_back(encoder_begin[i]);
  }
  return rows;
}

void Model::enable_multi_step_draft(int topk, int num_steps) {
  multi_step_ = std::make_unique<MultiStepDraftBackend>(backend_->options(), topk, num_steps);
}

PassResult Model::forward_draft_steps(const std::vector<Sequence*>& seqs,
                                      const std::vector<int32_t>& seq_lens,
                                      const std::vector<int32_t>& draft_slots,
                                      ReqToTokenPool& req_to_token, const CheckOptions& check) {
  FLASHKV_CHECK(multi_step_ != nullptr, "forward_draft_steps: call enable_multi_step_draft first");
  const ModelConfig& c = config_;
  const int topk = multi_step_->topk(), steps = multi_step_->num_steps();
  const int64_t bs = static_cast<int64_t>(seqs.size()), rows = bs * topk;
  FLASHKV_CHECK(
      seq_lens.size() == seqs.size() && static_cast<int64_t>(draft_slots.size()) == rows * steps,
      "forward_draft_steps: ", seqs.size(), " requests need as many seq_lens and ", rows * steps,
      " draft slots, got ", seq_lens.size(), " and ", draft_slots.size());
  const int64_t hd_out = int64_t{c.num_qo_heads} * c.head_dim;
  reserve_bank(rows * hd_out);
  ForwardBatch batch;
  batch.mode = ForwardMode::DECODE;
  batch.batch_size = static_cast<int32_t>(bs);
  batch.req_to_token_pool = &req_to_token;
  batch.token_to_kv_pool = pool_.get();
  batch.seq_lens_cpu = seq_lens;
  std::vector<int32_t> seq_rows;
  seq_rows.reserve(seqs.size());
  for (const Sequence* s : seqs) seq_rows.push_back(s->row);
  const Tensor req_pool_indices = Tensor::from_i32(seq_rows, device_);
  batch.req_pool_indices = req_pool_indices;
  Tensor loc = Tensor::from_i32(draft_slots, device_);
  TensorView loc3 = loc.view();
  loc3.ndim = 3;
  loc3.shape[0] = bs;
  loc3.shape[1] = topk;
  loc3.shape[2] = steps;
  loc3.stride[0] = int64_t{topk} * steps;
  loc3.stride[1] = steps;
  loc3.stride[2] = 1;

  // check.layers random (step, layer) pairs are checked, each for up to check.requests random
  // rows (request, branch).
  std::vector<std::pair<int, int>> checks;
  std::vector<int64_t> check_rows;
  std::vector<Tensor> check_out;
  if (check.enabled && rows > 0) {
    for (int st = 0; st < steps; ++st)
      for (int l = 0; l < c.num_layers; ++l) checks.emplace_back(st, l);
    std::shuffle(checks.begin(), checks.end(), gen_);
    checks.resize(std::min<size_t>(checks.size(), static_cast<size_t>(std::max(check.layers, 1))));
    for (int64_t i = 0; i < rows; ++i) check_rows.push_back(i);
    std::shuffle(check_rows.begin(), check_rows.end(), gen_);
    check_rows.resize(
        std::min<size_t>(check_rows.size(), static_cast<size_t>(std::max(check.requests, 1))));
    std::sort(check_rows.begin(), check_rows.end());
    for (size_t k = 0; k < checks.size(); ++k) {
      check_out.push_back(Tensor::empty({rows, hd_out}, c.dtype, device_));
      fill_bytes(check_out.back().data(), device_, 0xFF, check_out.back().view().nbytes());
    }
  }
  std::vector<LayerInputs> check_in(checks.size());  // q alone: decode reads K/V from the pool
  TensorView last_out;

  PassResult r;
  synchronize(device_);
  const auto t0 = std::chrono::steady_clock::now();
  multi_step_->init_forward_metadata(batch, loc3);
  for (int st = 0; st < steps; ++st)
    for (int l = 0; l < c.num_layers; ++l) {
      const TensorView q = activations(rows, c.num_qo_heads, c.head_dim);
      const TensorView k = activations(rows, c.num_kv_heads, c.head_dim);
      const TensorView v = activations(rows, c.num_kv_heads, c.head_dim);
      const auto at = std::find(checks.begin(), checks.end(), std::make_pair(st, l));
      TensorView out;
      if (at != checks.end()) {
        out = check_out[at - checks.begin()];
        check_in[at - checks.begin()].q = q;
      }
      last_out = multi_step_->forward(st, q, k, v, layer(l), true, out);
      if (check.scan_every_layer && (st + 1 < steps || l + 1 < c.num_layers))
        scan_between_layers(last_out, rows, str_cat("step ", st, ", layer ", l), r);
    }
  synchronize(device_);
  const auto t1 = std::chrono::steady_clock::now();
  r.ms = std::chrono::duration<double, std::milli>(t1 - t0).count() - r.check_ms;

  scan_for_nonfinite(last_out, rows, str_cat("step ", steps - 1, ", layer ", c.num_layers - 1), r);
  for (size_t k = 0; k < checks.size(); ++k) {
    const int step = checks[k].first;
    // Row (request i, branch b) sees the request's cached tokens, then its branch's draft tokens
    // up to this step.
    std::vector<std::vector<int32_t>> row_slots;
    CheckedRows checked;
    for (int64_t row : check_rows) {
      const int64_t i = row / topk;  // rows are (request, branch), branch fastest
      std::vector<int32_t> slots(seqs[i]->slots.begin() + seqs[i]->encoder_len,
                                 seqs[i]->slots.begin() + seqs[i]->encoder_len + seq_lens[i]);
      for (int st = 0; st <= step; ++st) slots.push_back(draft_slots[row * steps + st]);
      row_slots.push_back(std::move(slots));
    }
    for (size_t j = 0; j < check_rows.size(); ++j) {
      ReferenceRequest rr;
      rr.slots = row_slots[j].data();
      rr.seq_len = static_cast<int32_t>(row_slots[j].size());
      rr.qo_len = 1;
      checked.reqs.push_back(rr);
      checked.ranges.emplace_back(check_rows[j], 1);
    }
    const std::string what =
        str_cat("draft step ", step, " of ", bs, " requests x ", topk, " branches");
    compare_layer(layer(checks[k].second), checked, check_in[k], check_out[k], what.c_str(), r);
  }
  r.check_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  return r;
}

}  // namespace flashkv::app
