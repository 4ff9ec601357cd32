// Stores of one finished row block: normalised O in Q's dtype plus LSE to the outputs, or (split
// items) fp32 O and LSE to the partial buffers at rows item.partial + token (layout of plan.h).
// Output bytes are small next to the block's arithmetic, so each thread writes its fragment
// pairs straight from registers.
#pragma once

#include "flashkv/ops/params.h"
#include "prefill/mask.cuh"
#include "prefill/tile_config.cuh"

namespace flashkv::cuda::prefill_detail {

template <typename Cfg>
__device__ __forceinline__ void store_block(const AttentionParams& p, const RowBlock& b,
                                            int kv_head, int group, int warp_row0, int lane,
                                            const float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4],
                                            const float (&scale)[Cfg::kMTiles][2],
                                            const float (&lse)[Cfg::kMTiles][2]) {
  using QT = typename Cfg::Q;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int x = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
      if (x >= b.rows) continue;
      const int item_row = b.row0 + x;
      const int tok = item_row / group;
      const int head = kv_head * group + (item_row - tok * group);
      const int col0 = (lane & 3) * 2;
      const float sc = scale[mt][h];
      if (b.partial < 0) {
        const int64_t row = static_cast<int64_t>(b.q_begin) + tok;
        QT* dst = static_cast<QT*>(p.o) + row * p.o_stride_n + head * p.o_stride_h + col0;
#pragma unroll
        for (int dt = 0; dt < Cfg::kDv / 8; ++dt)
          *reinterpret_cast<uint32_t*>(dst + dt * 8) =
              Pack2<QT>::from_floats(o[mt][dt][2 * h] * sc, o[mt][dt][2 * h + 1] * sc);
        if (p.lse && (lane & 3) == 0) p.lse[row * p.num_qo_heads + head] = lse[mt][h];
      } else {
        const int64_t prow = static_cast<int64_t>(b.partial) + tok;
        float* dst = p.partial_o + (prow * p.num_qo_heads + head) * Cfg::kDv + col0;
#pragma unroll
        for (int dt = 0; dt < Cfg::kDv / 8; ++dt)
          *reinterpret_cast<float2*>(dst + dt * 8) =
              make_float2(o[mt][dt][2 * h] * sc, o[mt][dt][2 * h + 1] * sc);
        if ((lane & 3) == 0) p.partial_lse[prow * p.num_qo_heads + head] = lse[mt][h];
      }
    }
}

}  // namespace flashkv::cuda::prefill_detail
