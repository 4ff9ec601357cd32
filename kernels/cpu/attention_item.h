// One task of CPU attention (compiled per ISA like attention_kernel.h): one work item of the plan
// for a group of consecutive KV heads.
//
// Rows of a head = the item's query tokens x the G query heads that share the KV head
// (row = token * G + head), at most kMaxRows at a time. KV is walked in blocks of kBlockKeys
// keys; per block the row indices are looked up once for all heads of the task, and each head
// loads its K and V of the block ONCE into the tiles, which all of its rows then use (GQA: the
// G query heads share every loaded K/V row). A task holding several heads reads each slot's
// heads back to back: for few rows per head (decode) that turns the per-head 256-byte pieces
// into contiguous streams, which the memory system serves much faster.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_item.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "attention_few_rows.h"
#include "attention_kernel.h"
#include "attention_loads.h"
#include "flashkv/core/visibility.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

constexpr int kMaxRows = 128;

inline size_t align64(size_t x) { return (x + 63) & ~size_t{63}; }

// Carves one 64-byte-aligned scratch area into arrays.
class ScratchLayout {
 public:
  template <class E>
  size_t add(size_t count) {
    const size_t offset = bytes_;
    bytes_ += align64(sizeof(E) * count);
    return offset;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// Where the running state of each head of a task lives (`chunk` rows per head).
template <class T>
struct HeadState {
  typename T::Step* q;
  float* o;
  float* lsum;
  float* m;
  float* corr;
  int chunk;
  Tile<T> tile(const Tile<T>& base, int h) const {
    Tile<T> t = base;
    const size_t r0 = size_t(h) * chunk;
    t.q = q + r0 * base.q_pitch;
    t.o = o + r0 * base.dv_pad;
    t.lsum = lsum + r0 * T::W;
    t.m = m + r0;
    t.corr = corr + r0;
    return t;
  }
};

// One task: setup (scratch, scales), then per chunk of rows: load the queries, walk the KV
// blocks (masks, prefetch, each head's block), store the outputs.
template <class T, class KvType>
class ItemTask {
 public:
  using Step = typename T::Step;
  static constexpr int W = T::W, P = T::kPack, BK = T::kBlockKeys;
  static constexpr int kPSteps = Tile<T>::kPSteps;
  // The few-rows path reads K rows in place when they are stored as its steps; else it converts
  // them once per block into `staged_` rows.
  static constexpr bool kConvertK = !std::is_same_v<KvType, typename T::Native>;

  ItemTask(const AttentionParams& p, const WorkItem& item, int32_t head0, int32_t heads,
           const TaskOptions& options)
      : p_(p),
        item_(item),
        head0_(head0),
        heads_(heads),
        tables_(fp8_tables()),
        group_(p.num_qo_heads / p.num_kv_heads),
        kv_rows_(p, item.request) {
    const int32_t req = item.request;
    q_first_ = p.qo_indptr ? p.qo_indptr[req] : req;
    q_len_ = p.qo_indptr ? p.qo_indptr[req + 1] - q_first_ : 1;
    kv_len_ = kv_len_of(p, req);
    kv_begin_ = clamp64(item.kv_begin, 0, kv_len_);
    kv_end_ = clamp64(item.kv_end, kv_begin_, kv_len_);
    total_rows_ = item.q_len * group_;
    chunk_ = imin(total_rows_, kMaxRows);
    few_ = chunk_ <= kFewRows;
    split_ = few_ && few_rows_split_applies<T, KvType>(chunk_, p.head_dim_qk, p.head_dim_v);
    prefetch_on_ = few_ && (!split_ || options.split_prefetch);
    vbmi_ = few_ && !split_ && kVbmiType && options.fp8_vbmi && p.head_dim_qk % 64 == 0 &&
            p.head_dim_v % 64 == 0;
    causal_ = p.causal && !p.custom_mask;
    mask_base_ = p.custom_mask ? p.custom_mask + p.mask_indptr[req] : nullptr;
    q_esz_ = static_cast<int64_t>(dtype_size(p.q_dtype));
    o_esz_ = static_cast<int64_t>(dtype_size(p.o_dtype));
    k_head0_ = static_cast<const char*>(p.k) + head0 * p.k_stride_h * kKvEsz;
    v_head0_ = static_cast<const char*>(p.v) + head0 * p.v_stride_h * kKvEsz;
    k_span_ = ((heads - 1) * p.k_stride_h + p.head_dim_qk) * kKvEsz;
    v_span_ = ((heads - 1) * p.v_stride_h + p.head_dim_v) * kKvEsz;
    prefetch_.init(k_head0_, p.k_stride_n * kKvEsz, k_span_, v_head0_, p.v_stride_n * kKvEsz,
                   v_span_);
    if (total_rows_ > 0) allocate();
  }

  void run() {
    for (int row0 = 0; row0 < total_rows_; row0 += kMaxRows) {
      const int rows = imin(kMaxRows, total_rows_ - row0);
      load_queries(row0, rows);
      int cur = 0;
      if (kv_begin_ < kv_end_) kv_rows_.get(kv_begin_, block_keys(kv_begin_), block_rows_[0]);
      for (int64_t j0 = kv_begin_; j0 < kv_end_; j0 += BK, cur ^= 1) {
        const int n = block_keys(j0), n_next = block_keys(j0 + BK);
        if (n_next > 0) kv_rows_.get(j0 + BK, n_next, block_rows_[cur ^ 1]);
        set_masks(row0, rows, j0, n);
        if (prefetch_on_) start_prefetch(j0, block_rows_[cur ^ 1], n_next);
        if (split_) {
          run_block_split(rows, n, block_rows_[cur]);
        } else {
          for (int h = 0; h < heads_; ++h)
            run_head_block(h, rows, n, block_rows_[cur], block_rows_[cur ^ 1], n_next);
        }
        if (prefetch_on_) prefetch_.finish();
      }
      if (split_ || vbmi_) outputs_in_natural_order(rows);
      store_outputs(row0, rows);
    }
  }

 private:
  static constexpr int64_t kKvEsz = sizeof(KvType);
  // fp8 KV that the few-rows path may stage with stage_fp8_vbmi (bf16 steps: T::kPack == 2).
  static constexpr bool kVbmiType =
      T::kPack == 2 && (std::is_same_v<KvType, fp8_e4m3_t> || std::is_same_v<KvType, fp8_e5m2_t>);

  int block_keys(int64_t j0) const { return static_cast<int>(clamp64(kv_end_ - j0, 0, BK)); }

  // Few rows: what to prefetch while block j0 is computed. Slots in a run (a fresh pool hands a
  // request consecutive slots): those of the block after the next one, spread over the block's
  // work (the next block first, in one burst, when it was not prefetched that way). Scattered
  // slots (a pool after churn): the next block, in one burst at the start. On consecutive slots
  // the spread prefetch two blocks ahead beats the burst; on shuffled slots it loses, because
  // random DRAM pages want many requests in flight at once (figures: docs/perf/cpu.md).
  FLASHKV_ALWAYS_INLINE void start_prefetch(int64_t j0, const int64_t* next_rows, int n_next) {
    const int n_ahead = block_keys(j0 + 2 * BK);
    if (n_ahead > 0) kv_rows_.get(j0 + 2 * BK, n_ahead, ahead_rows_);
    const bool spread = is_run(next_rows, n_next) && is_run(ahead_rows_, n_ahead);
    if (!spread || j0 == kv_begin_ || !spread_before_) {
      for (int i = 0; i < n_next; ++i) {
        prefetch_l2(k_head0_ + next_rows[i] * p_.k_stride_n * kKvEsz, k_span_);
        prefetch_l2(v_head0_ + next_rows[i] * p_.v_stride_n * kKvEsz, v_span_);
      }
    }
    spread_before_ = spread;
    prefetch_.start(ahead_rows_, spread ? n_ahead : 0);
  }
  static bool is_run(const int64_t* rows, int n) {
    for (int i = 1; i < n; ++i)
      if (rows[i] != rows[0] + i) return false;
    return true;
  }

  // Scratch: per head Q, O, m, l, corr (chunk_ rows each); shared P, tiles, masks, row indices,
  // few-rows scores (per head on the split path) and converted K rows.
  void allocate() {
    const int dqk = p_.head_dim_qk, dv = p_.head_dim_v;
    const int steps_qk = (dqk + P - 1) / P;
    const int q_pitch = round_up(steps_qk, W);
    const int dv_pad = round_up(dv, W);
    const size_t hr = static_cast<size_t>(heads_) * chunk_;
    ScratchLayout layout;
    const size_t q_at = layout.add<Step>(hr * q_pitch);
    const size_t o_at = layout.add<float>(hr * dv_pad);
    const size_t lsum_at = layout.add<float>(hr * W);
    const size_t m_at = layout.add<float>(hr);
    const size_t corr_at = layout.add<float>(hr);
    const size_t p_at = layout.add<Step>(size_t(chunk_) * kPSteps);
    const size_t kt_at = layout.add<Step>(size_t(q_pitch) * BK);
    const size_t vp_at = layout.add<Step>(size_t(kPSteps) * dv_pad);
    const size_t pos_at = layout.add<int>(size_t(chunk_) * 3);
    const size_t allowed_at = layout.add<uint8_t>(mask_base_ ? size_t(chunk_) * BK : 0);
    const size_t rows_at = layout.add<int64_t>(3 * BK);
    const size_t scores_at =
        layout.add<float>(few_ ? size_t(split_ ? heads_ : 1) * chunk_ * BK : 0);
    // The split path reads K in place: no staged copy.
    const size_t staged_at =
        layout.add<Step>(few_ && kConvertK && !split_ ? size_t(BK) * q_pitch : 0);
    const size_t staged_v_at = layout.add<Step>(vbmi_ ? size_t(BK) * (dv / 2) : 0);
    char* s = static_cast<char*>(thread_scratch(layout.bytes()));
    state_ = HeadState<T>{reinterpret_cast<Step*>(s + q_at),     reinterpret_cast<float*>(s + o_at),
                          reinterpret_cast<float*>(s + lsum_at), reinterpret_cast<float*>(s + m_at),
                          reinterpret_cast<float*>(s + corr_at), chunk_};
    pos_ = reinterpret_cast<int*>(s + pos_at);
    block_rows_[0] = reinterpret_cast<int64_t*>(s + rows_at);
    block_rows_[1] = block_rows_[0] + BK;
    ahead_rows_ = block_rows_[1] + BK;
    scores_ = reinterpret_cast<float*>(s + scores_at);
    staged_ = reinterpret_cast<Step*>(s + staged_at);
    staged_v_ = reinterpret_cast<Step*>(s + staged_v_at);
    Tile<T>& t = base_;
    t.q_pitch = q_pitch;
    t.steps_qk = steps_qk;
    t.kt = reinterpret_cast<Step*>(s + kt_at);
    t.vp = reinterpret_cast<Step*>(s + vp_at);
    t.dv_pad = dv_pad;
    t.p = reinterpret_cast<Step*>(s + p_at);
    t.lo = pos_ + chunk_;
    t.hi = pos_ + 2 * chunk_;
    t.allowed = mask_base_ ? reinterpret_cast<uint8_t*>(s + allowed_at) : nullptr;
    // fp8 K: the scale folds into the logits (and the split path's factor, see split()).
    const float dot_scale = p_.sm_scale * p_.k_scale * (split_ ? kSplitFactor<KvType> : 1.0f);
    if (p_.logits_soft_cap > 0) {
      t.qk_scale = dot_scale / p_.logits_soft_cap;
      t.cap_log2e = p_.logits_soft_cap * kLog2e;
    } else {
      t.qk_scale = dot_scale * kLog2e;
      t.cap_log2e = 0;
    }
  }

  // Q rows of every head into steps; fresh running state; each row's absolute position.
  void load_queries(int row0, int rows) {
    for (int r = 0; r < rows; ++r)
      pos_[r] = static_cast<int>(
          query_position(kv_len_, q_len_, item_.q_begin + (row0 + r) / group_ - q_first_));
    for (int h = 0; h < heads_; ++h) {
      const Tile<T> t = state_.tile(base_, h);
      for (int r = 0; r < rows; ++r) {
        const int qi = (row0 + r) / group_, g = (row0 + r) % group_;
        const char* src =
            static_cast<const char*>(p_.q) +
            ((item_.q_begin + qi) * p_.q_stride_n + ((head0_ + h) * group_ + g) * p_.q_stride_h) *
                q_esz_;
        Step* q = const_cast<Step*>(t.q) + r * t.q_pitch;
        load_q_row<T>(p_.q_dtype, src, p_.head_dim_qk, t.q_pitch, q, tables_);
        if constexpr (HasSplitKv<T>::value) {
          if (split_) split_order(q, p_.head_dim_qk);
        }
        if (vbmi_) vbmi_order(q, p_.head_dim_qk);
        t.m[r] = kNegInf;
      }
      std::memset(t.o, 0, sizeof(float) * rows * t.dv_pad);
      std::memset(t.lsum, 0, sizeof(float) * rows * W);
    }
  }

  // The block's masks, shared by the heads: none when every key is visible to every row. Row r
  // sees the keys [lo[r], hi[r]] of the block (core/visibility.h), and the custom mask's.
  void set_masks(int row0, int rows, int64_t j0, int n) {
    Tile<T>& t = base_;
    const int64_t j_last = j0 + n - 1, window = p_.window_left;
    t.j0 = static_cast<int>(j0);
    t.steps_pv = (n + P - 1) / P;
    t.masked = mask_base_ || n < BK ||
               !block_fully_visible<int64_t>(j0, j_last, pos_[0], pos_[rows - 1], causal_, window);
    if (!t.masked) return;
    int* lo = const_cast<int*>(t.lo);
    int* hi = const_cast<int*>(t.hi);
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = pos_[r], last = causal_last_key(pos);
      hi[r] = static_cast<int>(causal_ && last < j_last ? last : j_last);
      lo[r] = static_cast<int>(window >= 0 ? clamp64(window_first_key(pos, window), j0, j_last + 1)
                                           : j0);
    }
    if (!mask_base_) return;
    uint8_t* allowed = const_cast<uint8_t*>(t.allowed);
    for (int r = 0; r < rows; ++r) {
      const int64_t local_q = item_.q_begin + (row0 + r) / group_ - q_first_;
      std::memcpy(allowed + r * BK, mask_base_ + local_q * kv_len_ + j0, n);
      std::memset(allowed + r * BK + n, 0, BK - n);
    }
  }

  // Head h's K or V rows (strides in elements) of the current block, and of the next one.
  static HeadRows head_rows(const char* first_head, int64_t stride_h, int64_t stride_n, int dim,
                            int h, const int64_t* cur, const int64_t* next, int n_next) {
    return {first_head + h * stride_h * kKvEsz,
            stride_n * kKvEsz,
            static_cast<int>(dim * kKvEsz),
            cur,
            next,
            n_next};
  }

  // Head h's share of the block: few rows -> K/V rows read in place; else the K/V tiles.
  void run_head_block(int h, int rows, int n, const int64_t* cur, const int64_t* next, int n_next) {
    const int dqk = p_.head_dim_qk, dv = p_.head_dim_v;
    const HeadRows k = head_rows(k_head0_, p_.k_stride_h, p_.k_stride_n, dqk, h, cur, next, n_next);
    const HeadRows v = head_rows(v_head0_, p_.v_stride_h, p_.v_stride_n, dv, h, cur, next, n_next);
    const Tile<T> t = state_.tile(base_, h);
    if (!few_) {
      pack_k<T, KvType>(k, n, dqk, t.steps_qk, const_cast<Step*>(t.kt), tables_);
      pack_v<T, KvType>(v, n, dv, t.dv_pad, const_cast<Step*>(t.vp), tables_);
      qk_rows(t, rows);
      pv_rows(t, rows);
      return;
    }
    if constexpr (kVbmiType) {
      if (vbmi_) return run_head_block_vbmi(t, rows, n, k, v);
    }
    const char* key_rows[BK];
    const char* value_rows[BK];
    for (int i = 0; i < n; ++i) {
      key_rows[i] = k.row(i);
      value_rows[i] = v.row(i);
    }
    if constexpr (kConvertK) {
      for (int i = 0; i < n; ++i) {
        Step* dst = staged_ + i * t.q_pitch;
        load_row_steps<T, KvType>(key_rows[i], dqk, t.q_pitch, dst, tables_);
        key_rows[i] = reinterpret_cast<const char*>(dst);
      }
      few_rows_qk<T, typename T::Native>(t, rows, key_rows, n, dqk, scores_, tables_, prefetch_);
    } else {
      few_rows_qk<T, KvType>(t, rows, key_rows, n, dqk, scores_, tables_, prefetch_);
    }
    few_rows_softmax(t, rows, scores_);
    few_rows_pv<T, KvType>(t, rows, value_rows, n, dv, tables_, prefetch_);
  }

  // Few rows, fp8 KV staged 64 values at a time (stage_fp8_vbmi): the block's K and V rows as
  // bf16 steps in the order of fp8_vbmi_value, which Q (vbmi_order) and O (natural_order_vbmi)
  // follow too; then the bf16 products on the staged rows.
  void run_head_block_vbmi(const Tile<T>& t, int rows, int n, const HeadRows& k,
                           const HeadRows& v) {
    using Native = typename T::Native;
    const int dqk = p_.head_dim_qk, dv = p_.head_dim_v;
    const int format = std::is_same_v<KvType, fp8_e4m3_t> ? 0 : 1;
    const uint8_t* lo = tables_.bf16_lo[format];
    const uint8_t* hi = tables_.bf16_hi[format];
    stage_fp8_vbmi(k.base, k.row_bytes, k.rows, n, dqk, t.q_pitch,
                   reinterpret_cast<uint32_t*>(staged_), lo, hi);
    stage_fp8_vbmi(v.base, v.row_bytes, v.rows, n, dv, dv / 2,
                   reinterpret_cast<uint32_t*>(staged_v_), lo, hi);
    const char* key_rows[BK];
    const char* value_rows[BK];
    for (int i = 0; i < n; ++i) {
      key_rows[i] = reinterpret_cast<const char*>(staged_ + i * t.q_pitch);
      value_rows[i] = reinterpret_cast<const char*>(staged_v_ + i * (dv / 2));
    }
    few_rows_qk<T, Native>(t, rows, key_rows, n, dqk, scores_, tables_, prefetch_);
    few_rows_softmax(t, rows, scores_);
    few_rows_pv<T, Native>(t, rows, value_rows, n, dv, tables_, prefetch_);
  }
  // A Q row (bf16 steps) into the order of fp8_vbmi_value, and an O row (floats) back.
  static void vbmi_order(Step* q, int dim) {
    for (int g = 0; g < dim / 2; g += 32) {
      Step tmp[32];
      for (int j = 0; j < 32; ++j) tmp[j] = q[g + fp8_vbmi_value(2 * j) / 2];
      std::memcpy(q + g, tmp, sizeof(tmp));
    }
  }
  static void natural_order_vbmi(float* o, int dim) {
    for (int g = 0; g < dim; g += 64) {
      float tmp[64];
      for (int k = 0; k < 64; ++k) tmp[fp8_vbmi_value(k)] = o[g + k];
      std::memcpy(o + g, tmp, sizeof(tmp));
    }
  }

  // A block on the split path (AVX2): QK slot-major, 4 keys at a time for every head of the task
  // before the next 4, so each slot's K run (the task's heads side by side) is read in address
  // order, which hardware prefetchers can follow on a shuffled pool too; then each head's softmax
  // and PV. The few-rows path's software prefetch runs (a step per 4 keys and head) only where
  // split_prefetch() says: where the hardware prefetchers follow this order (AMD before Zen 4) it
  // needs no software prefetch and any (of V, of later blocks) slows it; elsewhere it does
  // (figures: docs/perf/cpu.md, "The AVX2 split path").
  void run_block_split(int rows, int n, const int64_t* cur) {
    if constexpr (HasSplitKv<T>::value && kSplitType<KvType>) {
      const int dqk = p_.head_dim_qk, dv = p_.head_dim_v;
      const int64_t k_head = p_.k_stride_h * kKvEsz, v_head = p_.v_stride_h * kKvEsz;
      const char* slot_k[BK];
      for (int i = 0; i < n; ++i) slot_k[i] = k_head0_ + cur[i] * p_.k_stride_n * kKvEsz;
      for (int k0 = 0; k0 < n; k0 += 4) {
        for (int h = 0; h < heads_; ++h) {
          if (prefetch_on_) prefetch_.step();
          const Tile<T> t = state_.tile(base_, h);
          const KvType* kr[4];
          for (int i = 0; i < 4; ++i)  // past n: a copy of the last key (scores masked off)
            kr[i] = reinterpret_cast<const KvType*>(slot_k[imin(k0 + i, n - 1)] + h * k_head);
          qk_split_rows<T>(t.q, t.q_pitch, rows, kr, dqk, head_scores(h) + k0, BK);
        }
      }
      const char* value_rows[BK];
      for (int h = 0; h < heads_; ++h) {
        const Tile<T> t = state_.tile(base_, h);
        for (int i = 0; i < n; ++i)
          value_rows[i] = v_head0_ + h * v_head + cur[i] * p_.v_stride_n * kKvEsz;
        few_rows_softmax(t, rows, head_scores(h));
        few_rows_pv_split<T, KvType>(t, rows, value_rows, n, dv);
      }
    }
  }
  // Few rows: head h's scores [chunk_, BK] (one buffer for every head off the split path).
  float* head_scores(int h) const { return scores_ + (split_ ? size_t(h) * chunk_ * BK : 0); }

  // The outputs of the split path and of the VBMI staging back in natural dim order.
  void outputs_in_natural_order(int rows) {
    for (int h = 0; h < heads_; ++h) {
      const Tile<T> t = state_.tile(base_, h);
      for (int r = 0; r < rows; ++r) {
        float* o = t.o + r * t.dv_pad;
        if constexpr (HasSplitKv<T>::value) {
          if (split_) natural_order(o, p_.head_dim_v, kSplitFactor<KvType>);
        }
        if (vbmi_) natural_order_vbmi(o, p_.head_dim_v);
      }
    }
  }

  // O / l (times the V scale) and LSE = m + log2(l); empty rows: O = 0, LSE = -inf; the sink
  // (if any) merged in here for unsplit rows. Split items write partial states instead (without
  // the sink: merge_partials adds it once, after the chunks' merge).
  void store_outputs(int row0, int rows) const {
    const int dv = p_.head_dim_v;
    for (int h = 0; h < heads_; ++h) {
      const Tile<T> t = state_.tile(base_, h);
      for (int r = 0; r < rows; ++r) {
        const int qi = (row0 + r) / group_;
        const int qo_head = (head0_ + h) * group_ + (row0 + r) % group_;
        const float l = T::reduce_add(T::load(t.lsum + r * W));
        // l == 0: nothing visible. A NaN l (a NaN score) makes O and LSE NaN.
        // A final row written here (no merge state) takes the sink in its normalisation.
        const bool sink_here = p_.sinks && item_.partial < 0 && !p_.merge_o;
        float scale, lse;
        if (sink_here) {
          finish_row_with_sink(l, t.m[r], p_.sinks[qo_head], p_.v_scale, scale, lse);
        } else {
          scale = l != 0 ? p_.v_scale / l : 0.0f;
          lse = l != 0 ? t.m[r] + std::log2(l) : kNegInf;
        }
        const float* o = t.o + r * t.dv_pad;
        if (item_.partial < 0) {
          const int64_t row = item_.q_begin + qi;
          if (p_.merge_o) {  // adds the sink too
            store_merged_row<T>(p_, row, qo_head, o, scale, lse);
            continue;
          }
          store_row<T>(
              p_.o_dtype, o, scale, dv,
              static_cast<char*>(p_.o) + (row * p_.o_stride_n + qo_head * p_.o_stride_h) * o_esz_);
          if (p_.lse) p_.lse[row * p_.num_qo_heads + qo_head] = lse;
        } else {
          const int64_t row = int64_t{item_.partial} + qi;
          store_row<T>(o, scale, dv, p_.partial_o + (row * p_.num_qo_heads + qo_head) * dv);
          p_.partial_lse[row * p_.num_qo_heads + qo_head] = lse;
        }
      }
    }
  }

  const AttentionParams& p_;
  const WorkItem& item_;
  const int32_t head0_, heads_;
  const Fp8Tables& tables_;
  const int group_;
  const KvRows kv_rows_;
  int64_t q_first_, q_len_, kv_len_, kv_begin_, kv_end_, q_esz_, o_esz_;
  int total_rows_, chunk_;
  bool few_, causal_;
  bool split_;        // few rows through the split path (attention_few_rows.h)
  bool vbmi_;         // few rows, fp8 KV staged by stage_fp8_vbmi (run_head_block_vbmi)
  bool prefetch_on_;  // few rows: prefetch_ runs (head-major path: always; split: see
                      // run_block_split)
  const uint8_t* mask_base_;
  const char* k_head0_;
  const char* v_head0_;
  int64_t k_span_, v_span_;  // bytes of a K / V row from the first head to the end of the last
  SlotPrefetcher prefetch_;  // few rows: the slots of a later block (start_prefetch)
  HeadState<T> state_{};
  Tile<T> base_{};
  int* pos_ = nullptr;                           // [chunk_] absolute position of each row's token
  int64_t* block_rows_[2] = {nullptr, nullptr};  // rows of the current / next block
  int64_t* ahead_rows_ = nullptr;                // few rows: of the block two ahead
  bool spread_before_ = false;  // few rows: the last block prefetched two blocks ahead
  float* scores_ = nullptr;
  Step* staged_ = nullptr;
  Step* staged_v_ = nullptr;  // vbmi_: the block's V rows
};

// T with the KV block of few-row tasks: smaller blocks suit the memory-bound decode, larger ones
// prefill (figures: docs/perf/cpu.md).
template <class T>
struct FewRowsBlocks : T {
  static constexpr int kBlockKeys = T::kFewRowsBlockKeys;
};

template <class T, class KvType>
void run_item(const AttentionParams& p, const WorkItem& item, int32_t head0, int32_t heads,
              const TaskOptions& options) {
  if constexpr (T::kFewRowsBlockKeys != T::kBlockKeys) {
    if (item.q_len * (p.num_qo_heads / p.num_kv_heads) <= kFewRows)
      return ItemTask<FewRowsBlocks<T>, KvType>(p, item, head0, heads, options).run();
  }
  ItemTask<T, KvType>(p, item, head0, heads, options).run();
}

// The item kernel of T for a KV dtype (null when T does not take it).
template <class T>
ItemKernel item_kernel_for(DType kv_dtype) {
  switch (kv_dtype) {
    case DType::bf16:
      return &run_item<T, bf16_t>;
    case DType::fp8_e4m3:
      return &run_item<T, fp8_e4m3_t>;
    case DType::fp8_e5m2:
      return &run_item<T, fp8_e5m2_t>;
    default:
      break;
  }
  // fp32 and fp16 KV: only the fp32-step units (kPack == 1) take them.
  if constexpr (T::kPack == 1) {
    if (kv_dtype == DType::f32) return &run_item<T, float>;
    if (kv_dtype == DType::f16) return &run_item<T, f16_t>;
  }
  return nullptr;
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
