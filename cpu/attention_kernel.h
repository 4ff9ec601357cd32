// The CPU attention kernel, written once over a vector-helper type T (cpu/simd_*.h) and compiled
// once per ISA by cpu/attention_<isa>.cpp (inside namespace flashkv::cpu::<isa>, with that
// unit's target).
//
// One task = one work item for one KV head: rows = the item's query tokens x the G query heads
// of the KV head (row = token * G + head), at most kMaxRows at a time. KV is walked in blocks of
// kBlockKeys keys; each block is loaded from the cache ONCE (gathered through the page table,
// converted: bf16 pairs, or fp32) into two tiles that every row of the task then uses:
//   kt [steps_qk, kBlockKeys]  K transposed, so a vector holds W keys of one step (the QK
//                               product broadcasts a Q step and multiplies W keys at once);
//   vp [kBlockKeys / kPack, dv_pad]  V rows (bf16: interleaved pairs of rows), W dims a vector.
// Per block: S = Q K^T in a register tile (rows x all keys of the block), then, still in
// registers, scale / soft cap / masks, and the online softmax in base 2 (running max m, running
// sum l, probabilities P stored as steps); then O = O * 2^(m_old - m_new) + P V.
// A step is one fp32, or a pair of bf16 consumed by one `vdpbf16ps`.
#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_kernel.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

constexpr int kBlockKeys = 32;
constexpr int kMaxRows = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_inff();

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
inline size_t align64(size_t x) { return (x + 63) & ~size_t{63}; }

// KV length of request r (tokens).
inline int64_t kv_len_of(const AttentionParams& p, int32_t r) {
  const int64_t n = p.kv_indptr[r + 1] - p.kv_indptr[r];
  if (!p.paged || p.page_size == 1 || n == 0) return n;
  return (n - 1) * p.page_size + p.last_page_len[r];
}

// Where request r's K/V rows of one KV head live: ragged (contiguous rows from kv_indptr[r]) or
// paged (slots or pages listed in kv_indices; entries clamped into the pool).
struct KvSource {
  const char* k;  // row 0 of the KV head
  const char* v;
  int64_t k_row_bytes, v_row_bytes;
  bool paged;
  const int32_t* entries;  // paged: kv_indices + kv_indptr[r]
  int64_t first_row;       // ragged: kv_indptr[r]
  int32_t page_size;
  int64_t last_row;        // num_kv_rows - 1

  // Row pointers of positions j0 .. j0 + n - 1.
  void rows(int64_t j0, int n, const char** k_rows, const char** v_rows) const {
    if (!paged) {
      for (int i = 0; i < n; ++i) {
        k_rows[i] = k + (first_row + j0 + i) * k_row_bytes;
        v_rows[i] = v + (first_row + j0 + i) * v_row_bytes;
      }
      return;
    }
    int64_t page = j0 / page_size;
    int32_t offset = static_cast<int32_t>(j0 % page_size);
    for (int i = 0; i < n; ++i) {
      const int64_t row =
          clamp64(int64_t{entries[page]} * page_size + offset, 0, last_row);
      k_rows[i] = k + row * k_row_bytes;
      v_rows[i] = v + row * v_row_bytes;
      if (++offset == page_size) {
        offset = 0;
        ++page;
      }
    }
  }
};

inline void prefetch_rows(const char* const* rows, int n, int bytes) {
  for (int i = 0; i < n; ++i)
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(rows[i] + b, 0, 3);
}

// The state a task's micro-kernels share.
template <class T>
struct Tile {
  using Step = typename T::Step;
  static constexpr int kKeyVecs = kBlockKeys / T::W;       // vectors of keys in a score row
  static constexpr int kPSteps = kBlockKeys / T::kPack;     // steps of a probability row
  const Step* q;  // [rows, q_pitch]
  int q_pitch, steps_qk;
  const Step* kt;  // [steps_qk, kBlockKeys]
  const Step* vp;  // [kPSteps, dv_pad]
  int dv_pad;
  int steps_pv;  // steps of the current block's P / vp rows in use
  Step* p;       // [rows, kPSteps]
  float* o;      // [rows, dv_pad] running output (not yet divided by l)
  float* m;      // [rows] running max (base-2 logits)
  float* lsum;   // [rows, W] running sum, lane-wise
  float* corr;   // [rows] 2^(m_old - m_new) of the current block
  // Raw dot products times qk_scale give base-2 logits, or, with the soft cap on
  // (cap_log2e > 0), the tanh argument: logit = tanh(dot * qk_scale) * cap_log2e.
  float qk_scale, cap_log2e;
  // Masking of the current block (keys j0 .. j0 + kBlockKeys - 1, absolute positions):
  // when `masked`, row r keeps keys in [lo[r], hi[r]] whose byte in allowed[r] is set.
  int j0;
  bool masked;
  const int* lo;
  const int* hi;
  const uint8_t* allowed;  // [rows, kBlockKeys] or null
};

// Scores of one row (a register row of the QK tile) -> online softmax update, P row.
template <class T>
inline void softmax_row(const Tile<T>& t, int r, typename T::F (&s)[Tile<T>::kKeyVecs]) {
  using F = typename T::F;
  constexpr int NC = Tile<T>::kKeyVecs;
  const F scale = T::set1(t.qk_scale);
  for (int c = 0; c < NC; ++c) s[c] = T::mul(s[c], scale);
  if (t.cap_log2e > 0) {
    const F cap = T::set1(t.cap_log2e);
    for (int c = 0; c < NC; ++c) s[c] = T::mul(T::tanh(s[c]), cap);
  }
  if (t.masked) {
    for (int c = 0; c < NC; ++c) s[c] = T::keep_range(s[c], t.j0 + c * T::W, t.lo[r], t.hi[r]);
    if (t.allowed)
      for (int c = 0; c < NC; ++c) s[c] = T::keep_bytes(s[c], t.allowed + r * kBlockKeys + c * T::W);
  }
  F mx = s[0];
  for (int c = 1; c < NC; ++c) mx = T::max(mx, s[c]);
  const float m_old = t.m[r];
  const float block_max = T::reduce_max(mx);
  const float m_new = block_max > m_old ? block_max : m_old;
  typename T::Step* prow = t.p + r * Tile<T>::kPSteps;
  if (m_new == kNegInf) {  // nothing visible to this row yet
    t.corr[r] = 1.0f;
    std::memset(prow, 0, sizeof(typename T::Step) * Tile<T>::kPSteps);
    return;
  }
  const float corr = std::exp2(m_old - m_new);
  const F mv = T::set1(m_new);
  F sum = T::zero();
  for (int c = 0; c < NC; ++c) {
    s[c] = T::exp2(T::sub(s[c], mv));
    sum = T::add(sum, s[c]);
  }
  float* l = t.lsum + r * T::W;
  T::store(l, T::fmadd(T::load(l), T::set1(corr), sum));
  T::store_probs(prow, s);
  t.m[r] = m_new;
  t.corr[r] = corr;
}

// S = Q K^T for rows r0 .. r0 + RB - 1 and every key of the block, then their softmax.
template <class T, int RB>
struct QkTile {
  static void run(const Tile<T>& t, int r0) {
    using F = typename T::F;
    constexpr int NC = Tile<T>::kKeyVecs;
    F acc[RB][NC];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = T::zero();
    const typename T::Step* q = t.q + r0 * t.q_pitch;
    const typename T::Step* kt = t.kt;
    for (int s = 0; s < t.steps_qk; ++s, kt += kBlockKeys) {
      typename T::Vec k[NC];
      for (int c = 0; c < NC; ++c) k[c] = T::vload(kt + c * T::W);
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = T::madd(acc[r][c], q + r * t.q_pitch + s, k[c]);
    }
    for (int r = 0; r < RB; ++r) softmax_row(t, r0 + r, acc[r]);
  }
};

// O[rows r0.., dims d0 .. d0 + NV * W) = O * corr + P V.
template <class T, int RB, int NV>
struct PvTile {
  static void run(const Tile<T>& t, int r0, int d0) {
    using F = typename T::F;
    F acc[RB][NV];
    for (int r = 0; r < RB; ++r) {
      const F c = T::set1(t.corr[r0 + r]);
      const float* o = t.o + (r0 + r) * t.dv_pad + d0;
      for (int v = 0; v < NV; ++v) acc[r][v] = T::mul(T::load(o + v * T::W), c);
    }
    const typename T::Step* p = t.p + r0 * Tile<T>::kPSteps;
    const typename T::Step* vp = t.vp + d0;
    for (int s = 0; s < t.steps_pv; ++s, vp += t.dv_pad) {
      typename T::Vec v[NV];
      for (int i = 0; i < NV; ++i) v[i] = T::vload(vp + i * T::W);
      for (int r = 0; r < RB; ++r)
        for (int i = 0; i < NV; ++i)
          acc[r][i] = T::madd(acc[r][i], p + r * Tile<T>::kPSteps + s, v[i]);
    }
    for (int r = 0; r < RB; ++r) {
      float* o = t.o + (r0 + r) * t.dv_pad + d0;
      for (int v = 0; v < NV; ++v) T::store(o + v * T::W, acc[r][v]);
    }
  }
};

// Runs QkTile over `rows` rows: full tiles of RB, then one smaller tile for the rest.
template <class T, int RB>
void qk_tail(const Tile<T>& t, int r0, int rem) {
  if constexpr (RB >= 1) {
    if (rem == RB) return QkTile<T, RB>::run(t, r0);
    qk_tail<T, RB - 1>(t, r0, rem);
  }
}
template <class T>
void qk_rows(const Tile<T>& t, int rows) {
  constexpr int RB = T::kQkRows;
  int r = 0;
  for (; r + RB <= rows; r += RB) QkTile<T, RB>::run(t, r);
  if (r < rows) qk_tail<T, RB - 1>(t, r, rows - r);
}

template <class T, int RB, int NV>
void pv_tail(const Tile<T>& t, int r0, int rem, int d0) {
  if constexpr (RB >= 1) {
    if (rem == RB) return PvTile<T, RB, NV>::run(t, r0, d0);
    pv_tail<T, RB - 1, NV>(t, r0, rem, d0);
  }
}
template <class T, int NV>
void pv_cols(const Tile<T>& t, int rows, int d0) {
  constexpr int RB = T::kPvRows;
  int r = 0;
  for (; r + RB <= rows; r += RB) PvTile<T, RB, NV>::run(t, r, d0);
  if (r < rows) pv_tail<T, RB - 1, NV>(t, r, rows - r, d0);
}
template <class T, int NV>
void pv_vec_tail(const Tile<T>& t, int rows, int d0, int vecs) {
  if constexpr (NV >= 1) {
    if (vecs == NV) return pv_cols<T, NV>(t, rows, d0);
    pv_vec_tail<T, NV - 1>(t, rows, d0, vecs);
  }
}
template <class T>
void pv_rows(const Tile<T>& t, int rows) {
  constexpr int NV = T::kPvVecs;
  const int vecs = t.dv_pad / T::W;
  int v = 0;
  for (; v + NV <= vecs; v += NV) pv_cols<T, NV>(t, rows, v * T::W);
  if (v < vecs) pv_vec_tail<T, NV - 1>(t, rows, v * T::W, vecs - v);
}

// Loads `n` keys (row pointers; n <= kBlockKeys) of K into kt: W keys x W steps per transpose.
template <class T, class Src>
void pack_k(const char* const* rows, int n, int dim, int steps, typename T::Step* kt,
            const Fp8Tables& tables) {
  constexpr int W = T::W, P = T::kPack;
  for (int k0 = 0; k0 < n; k0 += W) {
    for (int s0 = 0; s0 < steps; s0 += W) {
      typename T::Vec v[W];
      const int elems = imin(W * P, dim - s0 * P);
      for (int i = 0; i < W; ++i)
        v[i] = k0 + i < n
                   ? T::load_steps(reinterpret_cast<const Src*>(rows[k0 + i]) + s0 * P, elems, tables)
                   : T::vzero();
      T::transpose_store(v, kt + s0 * kBlockKeys + k0, kBlockKeys, imin(W, steps - s0));
    }
  }
}

// Loads `n` rows of V into vp: fp32 rows, or (bf16) steps pairing rows 2i and 2i + 1.
template <class T, class Src>
void pack_v(const char* const* rows, int n, int dim, int dv_pad, typename T::Step* vp,
            const Fp8Tables& tables) {
  constexpr int W = T::W;
  if constexpr (T::kPack == 1) {
    for (int j = 0; j < n; ++j)
      for (int d = 0; d < dim; d += W)
        T::vstore(vp + j * dv_pad + d,
                  T::load_steps(reinterpret_cast<const Src*>(rows[j]) + d, dim - d, tables));
  } else {
    for (int j = 0; j < n; j += 2) {
      const Src* a = reinterpret_cast<const Src*>(rows[j]);
      const Src* b = j + 1 < n ? reinterpret_cast<const Src*>(rows[j + 1]) : nullptr;
      typename T::Step* dst = vp + (j / 2) * dv_pad;
      for (int d = 0; d < dim; d += 2 * W) {
        typename T::Vec lo, hi;
        T::interleave(T::load_steps(a + d, dim - d, tables),
                      b ? T::load_steps(b + d, dim - d, tables) : T::vzero(), &lo, &hi);
        T::vstore(dst + d, lo);
        if (d + W < dim) T::vstore(dst + d + W, hi);
      }
    }
  }
}

// One row of `dim` elements of type Src -> steps (zero-padded to `pitch` steps).
template <class T, class Src>
void load_row_steps(const void* src, int dim, int pitch, typename T::Step* dst,
                    const Fp8Tables& tables) {
  constexpr int W = T::W, P = T::kPack;
  for (int s = 0; s < pitch; s += W)
    T::vstore(dst + s, s * P < dim ? T::load_steps(static_cast<const Src*>(src) + s * P,
                                                   dim - s * P, tables)
                                   : T::vzero());
}
template <class T>
void load_q_row(DType dtype, const void* src, int dim, int pitch, typename T::Step* dst,
                const Fp8Tables& tables) {
  switch (dtype) {
    case DType::f32: return load_row_steps<T, float>(src, dim, pitch, dst, tables);
    case DType::f16: return load_row_steps<T, f16_t>(src, dim, pitch, dst, tables);
    default: return load_row_steps<T, bf16_t>(src, dim, pitch, dst, tables);
  }
}

// `dim` floats times `scale` -> a row of type Dst.
template <class T, class Dst>
void store_row(const float* src, float scale, int dim, Dst* dst) {
  const typename T::F s = T::set1(scale);
  for (int d = 0; d < dim; d += T::W) T::store_float(dst + d, T::mul(T::load(src + d), s), dim - d);
}
template <class T>
void store_row(DType dtype, const float* src, float scale, int dim, void* dst) {
  switch (dtype) {
    case DType::f32: return store_row<T>(src, scale, dim, static_cast<float*>(dst));
    case DType::f16: return store_row<T>(src, scale, dim, static_cast<f16_t*>(dst));
    default: return store_row<T>(src, scale, dim, static_cast<bf16_t*>(dst));
  }
}

// Runs one work item for one KV head (see the top of this file).
template <class T, class KvType>
void run_item(const AttentionParams& p, const WorkItem& item, int32_t kv_head) {
  using Step = typename T::Step;
  constexpr int W = T::W, P = T::kPack;
  const Fp8Tables& tables = fp8_tables();
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int32_t req = item.request;
  const int64_t q_first = p.qo_indptr ? p.qo_indptr[req] : req;
  const int64_t q_len = p.qo_indptr ? p.qo_indptr[req + 1] - q_first : 1;
  const int64_t kv_len = kv_len_of(p, req);
  const int64_t kv_begin = clamp64(item.kv_begin, 0, kv_len);
  const int64_t kv_end = clamp64(item.kv_end, kv_begin, kv_len);
  const size_t q_esz = dtype_size(p.q_dtype), kv_esz = sizeof(KvType);

  KvSource kv;
  kv.k = static_cast<const char*>(p.k) + kv_head * p.k_stride_h * kv_esz;
  kv.v = static_cast<const char*>(p.v) + kv_head * p.v_stride_h * kv_esz;
  kv.k_row_bytes = p.k_stride_n * static_cast<int64_t>(kv_esz);
  kv.v_row_bytes = p.v_stride_n * static_cast<int64_t>(kv_esz);
  kv.paged = p.paged;
  kv.entries = p.paged ? p.kv_indices + p.kv_indptr[req] : nullptr;
  kv.first_row = p.kv_indptr[req];
  kv.page_size = p.page_size;
  kv.last_row = p.num_kv_rows - 1;

  // Scratch layout.
  const int steps_qk = (dqk + P - 1) / P;
  const int q_pitch = round_up(steps_qk, W);
  const int dv_pad = round_up(dv, W);
  constexpr int kPSteps = Tile<T>::kPSteps;
  size_t at = 0;
  auto reserve = [&at](size_t bytes) {
    const size_t offset = at;
    at += align64(bytes);
    return offset;
  };
  const size_t q_at = reserve(sizeof(Step) * kMaxRows * q_pitch);
  const size_t o_at = reserve(sizeof(float) * kMaxRows * dv_pad);
  const size_t lsum_at = reserve(sizeof(float) * kMaxRows * W);
  const size_t m_at = reserve(sizeof(float) * kMaxRows);
  const size_t corr_at = reserve(sizeof(float) * kMaxRows);
  const size_t p_at = reserve(sizeof(Step) * kMaxRows * kPSteps);
  const size_t kt_at = reserve(sizeof(Step) * round_up(steps_qk, W) * kBlockKeys);
  const size_t vp_at = reserve(sizeof(Step) * kPSteps * dv_pad);
  const size_t pos_at = reserve(sizeof(int) * kMaxRows * 3);
  const size_t allowed_at = reserve(p.custom_mask ? kMaxRows * kBlockKeys : 0);
  char* scratch = static_cast<char*>(thread_scratch(at));
  Step* q_buf = reinterpret_cast<Step*>(scratch + q_at);
  int* pos = reinterpret_cast<int*>(scratch + pos_at);
  int* lo = pos + kMaxRows;
  int* hi = lo + kMaxRows;
  uint8_t* allowed = p.custom_mask ? reinterpret_cast<uint8_t*>(scratch + allowed_at) : nullptr;

  Tile<T> t;
  t.q = q_buf;
  t.q_pitch = q_pitch;
  t.steps_qk = steps_qk;
  t.kt = reinterpret_cast<Step*>(scratch + kt_at);
  t.vp = reinterpret_cast<Step*>(scratch + vp_at);
  t.dv_pad = dv_pad;
  t.p = reinterpret_cast<Step*>(scratch + p_at);
  t.o = reinterpret_cast<float*>(scratch + o_at);
  t.m = reinterpret_cast<float*>(scratch + m_at);
  t.lsum = reinterpret_cast<float*>(scratch + lsum_at);
  t.corr = reinterpret_cast<float*>(scratch + corr_at);
  t.lo = lo;
  t.hi = hi;
  t.allowed = allowed;
  const float dot_scale = p.sm_scale * p.k_scale;
  if (p.logits_soft_cap > 0) {
    t.qk_scale = dot_scale / p.logits_soft_cap;
    t.cap_log2e = p.logits_soft_cap * kLog2e;
  } else {
    t.qk_scale = dot_scale * kLog2e;
    t.cap_log2e = 0;
  }
  const bool causal = p.causal && !p.custom_mask;
  const int64_t window = p.window_left;
  const uint8_t* mask_base = p.custom_mask ? p.custom_mask + p.mask_indptr[req] : nullptr;

  const char* k_rows[2][kBlockKeys];
  const char* v_rows[2][kBlockKeys];
  const int total_rows = item.q_len * group;
  for (int row0 = 0; row0 < total_rows; row0 += kMaxRows) {
    const int rows = imin(kMaxRows, total_rows - row0);
    for (int r = 0; r < rows; ++r) {
      const int qi = (row0 + r) / group, g = (row0 + r) % group;
      const char* src = static_cast<const char*>(p.q) +
                        ((item.q_begin + qi) * p.q_stride_n + (kv_head * group + g) * p.q_stride_h) *
                            static_cast<int64_t>(q_esz);
      load_q_row<T>(p.q_dtype, src, dqk, q_pitch, q_buf + r * q_pitch, tables);
      pos[r] = static_cast<int>(kv_len - q_len + (item.q_begin + qi - q_first));
      t.m[r] = kNegInf;
    }
    std::memset(t.o, 0, sizeof(float) * rows * dv_pad);
    std::memset(t.lsum, 0, sizeof(float) * rows * W);
    const int pos_first = pos[0], pos_last = pos[rows - 1];

    int cur = 0;
    if (kv_begin < kv_end)
      kv.rows(kv_begin, static_cast<int>(kv_end - kv_begin < kBlockKeys ? kv_end - kv_begin : kBlockKeys),
              k_rows[0], v_rows[0]);
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += kBlockKeys) {
      const int n = static_cast<int>(kv_end - j0 < kBlockKeys ? kv_end - j0 : kBlockKeys);
      const int64_t next = j0 + kBlockKeys;
      if (next < kv_end) {  // start the next block's loads now
        const int n_next = static_cast<int>(kv_end - next < kBlockKeys ? kv_end - next : kBlockKeys);
        kv.rows(next, n_next, k_rows[cur ^ 1], v_rows[cur ^ 1]);
        prefetch_rows(k_rows[cur ^ 1], n_next, static_cast<int>(dqk * kv_esz));
        prefetch_rows(v_rows[cur ^ 1], n_next, static_cast<int>(dv * kv_esz));
      }
      pack_k<T, KvType>(k_rows[cur], n, dqk, steps_qk, const_cast<Step*>(t.kt), tables);
      pack_v<T, KvType>(v_rows[cur], n, dv, dv_pad, const_cast<Step*>(t.vp), tables);
      cur ^= 1;

      // Masks: none when every key of the block is visible to every row.
      const int64_t j_last = j0 + n - 1;
      t.j0 = static_cast<int>(j0);
      t.masked = mask_base || n < kBlockKeys || (causal && j_last > pos_first) ||
                 (window >= 0 && j0 < pos_last - window);
      if (t.masked) {
        for (int r = 0; r < rows; ++r) {
          hi[r] = static_cast<int>(causal && pos[r] < j_last ? pos[r] : j_last);
          lo[r] = static_cast<int>(window >= 0 ? clamp64(pos[r] - window, j0, j_last + 1) : j0);
        }
        if (mask_base) {
          for (int r = 0; r < rows; ++r) {
            const int64_t local_q = item.q_begin + (row0 + r) / group - q_first;
            std::memcpy(allowed + r * kBlockKeys, mask_base + local_q * kv_len + j0, n);
            std::memset(allowed + r * kBlockKeys + n, 0, kBlockKeys - n);
          }
        }
      }
      t.steps_pv = (n + P - 1) / P;
      qk_rows(t, rows);
      pv_rows(t, rows);
    }

    // O / l (times the V scale) and LSE = m + log2(l); empty rows: O = 0, LSE = -inf.
    for (int r = 0; r < rows; ++r) {
      const int qi = (row0 + r) / group, h = kv_head * group + (row0 + r) % group;
      const float l = T::reduce_add(T::load(t.lsum + r * W));
      const float scale = l > 0 ? p.v_scale / l : 0.0f;
      const float lse = l > 0 ? t.m[r] + std::log2(l) : kNegInf;
      const float* o = t.o + r * dv_pad;
      if (item.partial < 0) {
        const int64_t row = item.q_begin + qi;
        store_row<T>(p.q_dtype, o, scale, dv,
                     static_cast<char*>(p.o) +
                         (row * p.o_stride_n + h * p.o_stride_h) * static_cast<int64_t>(q_esz));
        if (p.lse) p.lse[row * p.num_qo_heads + h] = lse;
      } else {
        const int64_t row = int64_t{item.partial} + qi;
        store_row<T>(o, scale, dv, p.partial_o + (row * p.num_qo_heads + h) * dv);
        p.partial_lse[row * p.num_qo_heads + h] = lse;
      }
    }
  }
}

// Merges n states of one (row, head): O = sum_s 2^(lse_s - lse) O_s, lse = log2 sum 2^lse_s,
// states folded in order. A state with lse = -inf contributes nothing.
template <class T, class Src, class States>
void merge_one(const States& states, int n, int dim, DType out_dtype, void* out, float* lse_out) {
  float mx = kNegInf;
  for (int s = 0; s < n; ++s) mx = states.lse(s) > mx ? states.lse(s) : mx;
  float sum = 0;
  if (mx != kNegInf)
    for (int s = 0; s < n; ++s) sum += std::exp2(states.lse(s) - mx);
  const float inv = sum > 0 ? 1.0f / sum : 0.0f;
  float buf[T::W];
  for (int d = 0; d < dim; d += T::W) {
    typename T::F acc = T::zero();
    if (mx != kNegInf)
      for (int s = 0; s < n; ++s) {
        const float w = std::exp2(states.lse(s) - mx);
        if (w == 0) continue;
        acc = T::fmadd(T::set1(w), T::load_float(static_cast<const Src*>(states.o(s)) + d, dim - d), acc);
      }
    T::store(buf, acc);
    store_row<T>(out_dtype, buf, inv, imin(T::W, dim - d),
                 static_cast<char*>(out) + d * static_cast<int64_t>(dtype_size(out_dtype)));
  }
  if (lse_out) *lse_out = sum > 0 ? mx + std::log2(sum) : kNegInf;
}

// The split chunks of a plan's merge item: chunk c of row i at partial row partial + c*q_len + i.
struct PartialStates {
  const float* o_base;
  const float* lse_base;
  int64_t row_stride_o, row_stride_lse;  // per chunk
  const void* o(int s) const { return o_base + s * row_stride_o; }
  float lse(int s) const { return lse_base[s * row_stride_lse]; }
};

template <class T>
void merge_partials_impl(const AttentionParams& p, const MergeItem& m, int32_t i) {
  const int64_t heads = p.num_qo_heads, dv = p.head_dim_v;
  const int64_t out_row = int64_t{m.q_begin} + i;
  const size_t esz = dtype_size(p.q_dtype);
  for (int h = 0; h < heads; ++h) {
    const int64_t first = (int64_t{m.partial} + i) * heads + h;
    PartialStates states{p.partial_o + first * dv, p.partial_lse + first, m.q_len * heads * dv,
                         m.q_len * heads};
    merge_one<T, float>(states, m.num_chunks, static_cast<int>(dv), p.q_dtype,
                        static_cast<char*>(p.o) + (out_row * p.o_stride_n + h * p.o_stride_h) * static_cast<int64_t>(esz),
                        p.lse ? p.lse + out_row * heads + h : nullptr);
  }
}

// merge_state (two separate tensors) / merge_states (stacked) of one (row, head).
struct InputStates {
  const char* o0;
  const char* o1;  // null when stacked
  const float* lse0;
  const float* lse1;
  int64_t o_stride_s, lse_stride_s;  // stacked: bytes / floats between states
  const void* o(int s) const { return o1 ? (s ? o1 : o0) : o0 + s * o_stride_s; }
  float lse(int s) const { return lse1 ? (s ? *lse1 : *lse0) : lse0[s * lse_stride_s]; }
};

template <class T, class Src>
void merge_row_typed(const MergeParams& p, int64_t row) {
  const int64_t esz = static_cast<int64_t>(sizeof(Src));
  for (int h = 0; h < p.heads; ++h) {
    const int64_t o_off = (row * p.in_stride_n + h * p.in_stride_h) * esz;
    const int64_t lse_off = row * p.lse_stride_n + h;
    InputStates states;
    states.o0 = static_cast<const char*>(p.o_in[0]) + o_off;
    states.o1 = p.stacked ? nullptr : static_cast<const char*>(p.o_in[1]) + o_off;
    states.lse0 = p.lse_in[0] + lse_off;
    states.lse1 = p.stacked ? nullptr : p.lse_in[1] + lse_off;
    states.o_stride_s = p.in_stride_s * esz;
    states.lse_stride_s = p.lse_stride_s;
    merge_one<T, Src>(states, p.num_states, p.head_dim, p.dtype,
                      static_cast<char*>(p.o_out) + (row * p.out_stride_n + h * p.out_stride_h) * esz,
                      p.lse_out ? p.lse_out + row * p.heads + h : nullptr);
  }
}

template <class T>
void merge_row_impl(const MergeParams& p, int64_t row) {
  switch (p.dtype) {
    case DType::f32: return merge_row_typed<T, float>(p, row);
    case DType::f16: return merge_row_typed<T, f16_t>(p, row);
    default: return merge_row_typed<T, bf16_t>(p, row);
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
