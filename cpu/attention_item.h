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
#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_item.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

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

template <class T, class KvType>
void run_item(const AttentionParams& p, const WorkItem& item, int32_t head0, int32_t heads) {
  using Step = typename T::Step;
  constexpr int W = T::W, P = T::kPack, BK = T::kBlockKeys;
  constexpr int kPSteps = Tile<T>::kPSteps;
  const Fp8Tables& tables = fp8_tables();
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int32_t req = item.request;
  const int64_t q_first = p.qo_indptr ? p.qo_indptr[req] : req;
  const int64_t q_len = p.qo_indptr ? p.qo_indptr[req + 1] - q_first : 1;
  const int64_t kv_len = kv_len_of(p, req);
  const int64_t kv_begin = clamp64(item.kv_begin, 0, kv_len);
  const int64_t kv_end = clamp64(item.kv_end, kv_begin, kv_len);
  const int64_t q_esz = static_cast<int64_t>(dtype_size(p.q_dtype));
  const int64_t kv_esz = static_cast<int64_t>(sizeof(KvType));
  const int total_rows = item.q_len * group;  // per head
  if (total_rows <= 0) return;
  const int chunk = imin(total_rows, kMaxRows);

  // Scratch: per head Q, O, m, l, corr; shared P, tiles, masks and row indices.
  const int steps_qk = (dqk + P - 1) / P;
  const int q_pitch = round_up(steps_qk, W);
  const int dv_pad = round_up(dv, W);
  const size_t hr = static_cast<size_t>(heads) * chunk;  // rows of all heads
  ScratchLayout layout;
  const size_t q_at = layout.add<Step>(hr * q_pitch);
  const size_t o_at = layout.add<float>(hr * dv_pad);
  const size_t lsum_at = layout.add<float>(hr * W);
  const size_t m_at = layout.add<float>(hr);
  const size_t corr_at = layout.add<float>(hr);
  const size_t p_at = layout.add<Step>(size_t(chunk) * kPSteps);
  const size_t kt_at = layout.add<Step>(size_t(round_up(steps_qk, W)) * BK);
  const size_t vp_at = layout.add<Step>(size_t(kPSteps) * dv_pad);
  const size_t pos_at = layout.add<int>(size_t(chunk) * 3);
  const size_t allowed_at = layout.add<uint8_t>(p.custom_mask ? size_t(chunk) * BK : 0);
  const size_t rows_at = layout.add<int64_t>(2 * BK);
  // The few-rows path: scores, and K rows converted to steps when stored in another type.
  const bool few = chunk <= kFewRows;
  constexpr bool kConvertK = !std::is_same_v<KvType, typename T::Native>;
  const size_t scores_at = layout.add<float>(few ? size_t(chunk) * BK : 0);
  const size_t staged_at = layout.add<Step>(few && kConvertK ? size_t(BK) * q_pitch : 0);
  char* scratch = static_cast<char*>(thread_scratch(layout.bytes()));
  Step* q_buf = reinterpret_cast<Step*>(scratch + q_at);
  float* o_buf = reinterpret_cast<float*>(scratch + o_at);
  float* lsum_buf = reinterpret_cast<float*>(scratch + lsum_at);
  float* m_buf = reinterpret_cast<float*>(scratch + m_at);
  float* corr_buf = reinterpret_cast<float*>(scratch + corr_at);
  int* pos = reinterpret_cast<int*>(scratch + pos_at);
  int* lo = pos + chunk;
  int* hi = lo + chunk;
  uint8_t* allowed = p.custom_mask ? reinterpret_cast<uint8_t*>(scratch + allowed_at) : nullptr;
  int64_t* block_rows[2] = {reinterpret_cast<int64_t*>(scratch + rows_at),
                            reinterpret_cast<int64_t*>(scratch + rows_at) + BK};

  // Head h's state: rows h * chunk .. of the per-head arrays.
  HeadState<T> state{q_buf, o_buf, lsum_buf, m_buf, corr_buf, chunk};
  Tile<T> base;
  base.q_pitch = q_pitch;
  base.steps_qk = steps_qk;
  base.kt = reinterpret_cast<Step*>(scratch + kt_at);
  base.vp = reinterpret_cast<Step*>(scratch + vp_at);
  base.dv_pad = dv_pad;
  base.p = reinterpret_cast<Step*>(scratch + p_at);
  base.lo = lo;
  base.hi = hi;
  base.allowed = allowed;
  const float dot_scale = p.sm_scale * p.k_scale;  // fp8 K: the scale folds into the logits
  if (p.logits_soft_cap > 0) {
    base.qk_scale = dot_scale / p.logits_soft_cap;
    base.cap_log2e = p.logits_soft_cap * kLog2e;
  } else {
    base.qk_scale = dot_scale * kLog2e;
    base.cap_log2e = 0;
  }
  const bool causal = p.causal && !p.custom_mask;
  const int64_t window = p.window_left;
  const uint8_t* mask_base = p.custom_mask ? p.custom_mask + p.mask_indptr[req] : nullptr;
  const KvRows kv_rows(p, req);
  // Bytes of a K / V row from the task's first head to the end of its last one.
  const int64_t k_span = ((heads - 1) * p.k_stride_h + dqk) * kv_esz;
  const int64_t v_span = ((heads - 1) * p.v_stride_h + dv) * kv_esz;
  const char* k_base = static_cast<const char*>(p.k);
  const char* v_base = static_cast<const char*>(p.v);

  for (int row0 = 0; row0 < total_rows; row0 += kMaxRows) {
    const int rows = imin(kMaxRows, total_rows - row0);
    for (int r = 0; r < rows; ++r) {
      const int qi = (row0 + r) / group;
      pos[r] = static_cast<int>(kv_len - q_len + (item.q_begin + qi - q_first));
    }
    for (int h = 0; h < heads; ++h) {
      const Tile<T> t = state.tile(base, h);
      for (int r = 0; r < rows; ++r) {
        const int qi = (row0 + r) / group, g = (row0 + r) % group;
        const char* src = static_cast<const char*>(p.q) +
                          ((item.q_begin + qi) * p.q_stride_n +
                           ((head0 + h) * group + g) * p.q_stride_h) * q_esz;
        load_q_row<T>(p.q_dtype, src, dqk, q_pitch, const_cast<Step*>(t.q) + r * q_pitch,
                      tables);
        t.m[r] = kNegInf;
      }
      std::memset(t.o, 0, sizeof(float) * rows * dv_pad);
      std::memset(t.lsum, 0, sizeof(float) * rows * W);
    }
    const int pos_first = pos[0], pos_last = pos[rows - 1];

    int cur = 0;
    if (kv_begin < kv_end)
      kv_rows.get(kv_begin, static_cast<int>(clamp64(kv_end - kv_begin, 0, BK)), block_rows[0]);
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += BK, cur ^= 1) {
      const int n = static_cast<int>(clamp64(kv_end - j0, 0, BK));
      const int n_next = static_cast<int>(clamp64(kv_end - j0 - BK, 0, BK));
      if (n_next > 0) kv_rows.get(j0 + BK, n_next, block_rows[cur ^ 1]);

      // Masks: none when every key of the block is visible to every row.
      const int64_t j_last = j0 + n - 1;
      base.j0 = static_cast<int>(j0);
      base.masked = mask_base || n < BK || (causal && j_last > pos_first) ||
                    (window >= 0 && j0 < pos_last - window);
      base.steps_pv = (n + P - 1) / P;
      if (base.masked) {
        for (int r = 0; r < rows; ++r) {
          hi[r] = static_cast<int>(causal && pos[r] < j_last ? pos[r] : j_last);
          lo[r] = static_cast<int>(window >= 0 ? clamp64(pos[r] - window, j0, j_last + 1) : j0);
        }
        if (mask_base) {
          for (int r = 0; r < rows; ++r) {
            const int64_t local_q = item.q_begin + (row0 + r) / group - q_first;
            std::memcpy(allowed + r * BK, mask_base + local_q * kv_len + j0, n);
            std::memset(allowed + r * BK + n, 0, BK - n);
          }
        }
      }
      if (few && n_next > 0) {  // the next block's rows, all heads of the task, into L2
        const char* k_next = k_base + head0 * p.k_stride_h * kv_esz;
        const char* v_next = v_base + head0 * p.v_stride_h * kv_esz;
        for (int i = 0; i < n_next; ++i) {
          prefetch_l2(k_next + block_rows[cur ^ 1][i] * p.k_stride_n * kv_esz, k_span);
          prefetch_l2(v_next + block_rows[cur ^ 1][i] * p.v_stride_n * kv_esz, v_span);
        }
      }
      for (int h = 0; h < heads; ++h) {
        const int64_t kv_head = head0 + h;
        const HeadRows k{k_base + kv_head * p.k_stride_h * kv_esz, p.k_stride_n * kv_esz,
                         static_cast<int>(dqk * kv_esz), block_rows[cur], block_rows[cur ^ 1],
                         n_next};
        const HeadRows v{v_base + kv_head * p.v_stride_h * kv_esz, p.v_stride_n * kv_esz,
                         static_cast<int>(dv * kv_esz), block_rows[cur], block_rows[cur ^ 1],
                         n_next};
        const Tile<T> t = state.tile(base, h);
        if (few) {
          const char* key_rows[BK];
          const char* value_rows[BK];
          for (int i = 0; i < n; ++i) {
            key_rows[i] = k.row(i);
            value_rows[i] = v.row(i);
          }
          float* scores = reinterpret_cast<float*>(scratch + scores_at);
          if constexpr (kConvertK) {
            Step* staged = reinterpret_cast<Step*>(scratch + staged_at);
            for (int i = 0; i < n; ++i) {
              load_row_steps<T, KvType>(key_rows[i], dqk, q_pitch, staged + i * q_pitch, tables);
              key_rows[i] = reinterpret_cast<const char*>(staged + i * q_pitch);
            }
            few_rows_qk<T, typename T::Native>(t, rows, key_rows, n, dqk, scores, tables);
          } else {
            few_rows_qk<T, KvType>(t, rows, key_rows, n, dqk, scores, tables);
          }
          few_rows_softmax(t, rows, scores);
          few_rows_pv<T, KvType>(t, rows, value_rows, n, dv, tables);
        } else {
          pack_k<T, KvType>(k, n, dqk, steps_qk, const_cast<Step*>(base.kt), tables);
          pack_v<T, KvType>(v, n, dv, dv_pad, const_cast<Step*>(base.vp), tables);
          qk_rows(t, rows);
          pv_rows(t, rows);
        }
      }
    }

    // O / l (times the V scale) and LSE = m + log2(l); empty rows: O = 0, LSE = -inf.
    for (int h = 0; h < heads; ++h) {
      const Tile<T> t = state.tile(base, h);
      for (int r = 0; r < rows; ++r) {
        const int qi = (row0 + r) / group, qo_head = (head0 + h) * group + (row0 + r) % group;
        const float l = T::reduce_add(T::load(t.lsum + r * W));
        const float scale = l > 0 ? p.v_scale / l : 0.0f;
        const float lse = l > 0 ? t.m[r] + std::log2(l) : kNegInf;
        const float* o = t.o + r * dv_pad;
        if (item.partial < 0) {
          const int64_t row = item.q_begin + qi;
          store_row<T>(p.q_dtype, o, scale, dv,
                       static_cast<char*>(p.o) + (row * p.o_stride_n + qo_head * p.o_stride_h) * q_esz);
          if (p.lse) p.lse[row * p.num_qo_heads + qo_head] = lse;
        } else {
          const int64_t row = int64_t{item.partial} + qi;
          store_row<T>(o, scale, dv, p.partial_o + (row * p.num_qo_heads + qo_head) * dv);
          p.partial_lse[row * p.num_qo_heads + qo_head] = lse;
        }
      }
    }
  }
}

// The item kernel of T for a KV dtype (null when T does not take it).
template <class T>
ItemKernel item_kernel_for(DType kv_dtype) {
  switch (kv_dtype) {
    case DType::bf16: return &run_item<T, bf16_t>;
    case DType::fp8_e4m3: return &run_item<T, fp8_e4m3_t>;
    case DType::fp8_e5m2: return &run_item<T, fp8_e5m2_t>;
    case DType::f32:
      if constexpr (T::kPack == 1) return &run_item<T, float>;
      return nullptr;
    case DType::f16:
      if constexpr (T::kPack == 1) return &run_item<T, f16_t>;
      return nullptr;
    default: return nullptr;
  }
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
