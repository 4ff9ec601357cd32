// The warp-specialized Hopper prefill kernel (kernel_sm90_ws.cuh), part 3: the two consumer
// warpgroups, which issue the products, run the masks and the online softmax, and store the
// output.
//
// Included by kernel_sm90_ws.cuh.
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "flashkv/kernels/params.h"
#include "prefill/epilogue.cuh"
#include "prefill/mainloop.cuh"
#include "prefill/mask.cuh"
#include "prefill/sm90_ws_config.cuh"
#include "prefill/softmax.cuh"
#include "prefill/wgmma.cuh"

namespace flashkv::cuda::prefill_detail {

// fp8 K/V with bf16 Q: consumer warp w of a warpgroup rewrites its 16 rows of the warpgroup's
// [64, D] Q tile from bf16 to f16, each value times 2^e, one e for the warp's rows, chosen from
// their largest finite |q|, m, so that m lands in [2^14, 2^15) (f16's top binade is [2^15,
// 65504]). Every value from 2^-32 m up converts exactly (down to there f16 holds bf16's 8
// significant bits), smaller ones to within 2^-39 m, so a logit's error is at most 2^-39 of the
// largest any of the rows could make with that key (m times the sum of its |k|); inf and NaN stay
// as they are. Returns 2^-e. Lane l takes row l % 16 and half the row's 16-byte chunks, so that
// the 8 lanes of a shared-memory phase hit 8 rows (8 different swizzled bank groups).
template <typename Cfg>
__device__ __forceinline__ float q_rows_to_f16(unsigned char* wg_q_tile, int warp_in_wg, int lane) {
  constexpr int kMine = Cfg::kDqk / 16;  // a lane's chunks of 8 values: half a row
  const int row = 16 * warp_in_wg + (lane & 15), first = (lane >> 4) * kMine;
  const auto chunk = [&](int i) {
    return reinterpret_cast<uint4*>(wg_q_tile + sm90::tile_offset(64, row, first + i));
  };
  const auto finite_abs = [](float x) {
    const float a = fabsf(x);
    return a < __int_as_float(0x7f800000) ? a : 0.0f;  // NaN compares false
  };
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const uint4 raw = *chunk(i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack2<__nv_bfloat16>(words[w]);
      m = fmaxf(m, fmaxf(finite_abs(f.x), finite_abs(f.y)));
    }
  }
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  // e = 14 - floor(log2 m), kept where both 2^e and 2^-e are normal floats; m = 0: e = 0.
  const int e = m > 0.0f ? max(-126, min(126, 14 - (((__float_as_int(m) >> 23) & 0xff) - 127))) : 0;
  const float up = __int_as_float((127 + e) << 23);
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const uint4 raw = *chunk(i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack2<__nv_bfloat16>(words[w]);
      out[w] = pack2<__half>(f.x * up, f.y * up);
    }
    *chunk(i) = make_uint4(out[0], out[1], out[2], out[3]);
  }
  return __int_as_float((127 - e) << 23);
}

// A consumer warpgroup's turn to issue its products: wait for it, then (after issuing) pass it.
__device__ __forceinline__ void take_turn(int wg) {
  sm90::barrier_sync(ws::kTurnBarrier0 + wg, 256);
}
__device__ __forceinline__ void pass_turn(int wg) {
  sm90::barrier_arrive(ws::kTurnBarrier0 + (wg ^ 1), 256);
}

// The consumer warpgroups (threads 128..383; `ctid` is the thread's index among them).
template <typename Cfg, bool kPaged>
__device__ __forceinline__ void consume(const AttentionParams& p, unsigned char* smem,
                                        const WsBarriers<Cfg>& bars, int ctid) {
  using QT = typename Cfg::Q;
  using QRing = ws::Ring<Cfg::kQStages>;
  using Ring = ws::Ring<Cfg::kKvStages>;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  // The warp and warpgroup indices broadcast from lane 0, so that the compiler knows them
  // uniform across the warp and keeps what derives from them (the Q tile's descriptors) in
  // uniform registers.
  const int lane = ctid & 31, cwarp = __shfl_sync(0xffffffffu, ctid >> 5, 0), wg = cwarp >> 2;
  const int warp_row0 = cwarp * Cfg::kRowsPerWarp;
  const uint32_t base = smem_addr(smem);

  // Logit scale (fp8 K's scale folds in here) and the softmax's base-2 factor.
  const float logit_scale = p.sm_scale * (Cfg::kFp8 ? p.k_scale : 1.0f);
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  const float c = soft_cap ? kLog2e : logit_scale * kLog2e;
  const float scale_over_cap = soft_cap ? logit_scale / p.logits_soft_cap : 0.0f;

  const bool merging = p.merge_o != nullptr, o_chunks = o_chunks_aligned(p);
  // Warpgroup 1 lets warpgroup 0 go first.
  if (wg == 1) pass_turn(1);
  int block_n = 0, tile_n = 0;
  using Scores = float[1][kNTiles][4];
  using ScoresAcc = float[kNTiles * 4];
  // Q, paged and fp8 K/V tiles, and a ragged block's last tile where it runs past the block's
  // keys were written by the producer's threads (the generic proxy); wgmma reads through the
  // async proxy, so the consumers fence them once they have landed. (TMA writes through the async
  // proxy itself.)
  constexpr bool kGenericWrites = kPaged || Cfg::kFp8;
  // With a custom mask, where the producer hands over a verdict on each tile (tile_hides_none):
  // whether the mask hides none of its keys from the block's rows.
  constexpr bool kMaskVerdicts = kPaged && Cfg::kPagedMaskVerdicts;
  // Waits for use n of the K or V ring to land (`full`: its stage's full barrier; `last`: the
  // block's last tile, which the producer's threads copy where it runs past the block's keys).
  const auto wait_landed = [&](uint32_t full, int n, bool last) {
    sm90::mbar_wait(full, Ring::full_parity(n));
    if (kGenericWrites || last) sm90::fence_async_shared();
  };
  // S_t = Q.K_t^T into s_acc (K stage n, landed; Q: the warpgroup's tile at q_tile).
  const auto issue_qk = [&](ScoresAcc& s_acc, int n, uint32_t q_tile) {
    const uint32_t k_tile = base + Cfg::kKOffset + Ring::stage(n) * Cfg::kKTileBytes;
    const uint64_t q_desc = sm90::k_major(q_tile, Cfg::kWgRows, 0, 0);
    const uint64_t k_desc = sm90::k_major(k_tile, Cfg::kKvTile, 0, 0);
    sm90::fence();
#pragma unroll
    for (int k = 0; k < Cfg::kDqk / 16; ++k)
      sm90::mma_ss<typename Cfg::Mma>(
          s_acc, sm90::advance(q_desc, sm90::k_major_step(Cfg::kWgRows, k)),
          sm90::advance(k_desc, sm90::k_major_step(Cfg::kKvTile, k)), k > 0);
    sm90::commit();
  };
  const int kv_head = blockIdx.y, group = p.num_qo_heads / p.num_kv_heads;
  // The row blocks as the producer publishes them with their Q (fill_q_stage), up to its end mark.
  for (;; ++block_n) {
    const int qs = QRing::stage(block_n);
    sm90::mbar_wait(bars.q_full(qs), QRing::full_parity(block_n));
    const RowBlock b = *block_slot<Cfg>(smem, block_n);
    if (b.rows == 0) break;
    sm90::fence_async_shared();
    unsigned char* q_stage = smem + qs * Cfg::kQTileBytes;
    const int num_tiles = num_kv_tiles<Cfg>(b);
    float o[1][Cfg::kDv / 8][4];
    zero_output(o);
    float(&o_acc)[Cfg::kDv / 2] = reinterpret_cast<float(&)[Cfg::kDv / 2]>(o);
    OnlineSoftmax<1> softmax;
    softmax.init();
    // The softmax's factors for this block: the kernel's, or with Q rewritten in f16 scaled by
    // 2^e, times 2^-e (the warp's logits come out 2^e too large).
    float c_blk = c, scale_over_cap_blk = scale_over_cap;
    if (num_tiles > 0) {
      const uint32_t q_tile = base + qs * Cfg::kQTileBytes + wg * (Cfg::kQTileBytes / 2);
      Scores s;
      ScoresAcc& s_acc = reinterpret_cast<ScoresAcc&>(s);
      if constexpr (Cfg::kQToF16) {
        const float unscale =
            q_rows_to_f16<Cfg>(q_stage + wg * (Cfg::kQTileBytes / 2), cwarp & 3, lane);
        (soft_cap ? scale_over_cap_blk : c_blk) *= unscale;
        sm90::fence_async_shared();  // this thread's f16 rows -> the warpgroup's wgmma reads
        sm90::barrier_sync(ws::kConsumerBarrier0 + wg, 128);
      }
      PFragments<Cfg> pf;  // P of the previous tile, the A operand of its P.V
      // O += P_{n}.V_{n} (pf, V stage n). N is 64 dims at head dim 64; else O goes in parts of
      // 128 dims (two 64-dim halves of the V tile each), two parts at head dim 256.
      constexpr int kParts = Cfg::kDv >= 128 ? Cfg::kDv / 128 : 1;
      constexpr int kPartAcc = Cfg::kDv / 2 / kParts;
      float(&o_parts)[kParts][kPartAcc] = reinterpret_cast<float(&)[kParts][kPartAcc]>(o);
      const auto issue_pv = [&](int n) {
        const uint64_t v_desc = sm90::n_major(
            base + Cfg::kVOffset + Ring::stage(n) * Cfg::kVTileBytes, Cfg::kKvTile, 0);
#pragma unroll
        for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)
#pragma unroll
          for (int part = 0; part < kParts; ++part)
            sm90::mma_rs<typename Cfg::Mma>(
                o_parts[part], pf[0][kk],
                sm90::advance(v_desc, part * 2 * Cfg::kKvTile * 128 + sm90::n_major_step(kk)));
        sm90::commit();
      };
      // The soft cap and the mask of tile t.
      const auto cap_and_mask = [&](int t) {
        const int j0 = b.kv_lo + t * Cfg::kKvTile;
        if (soft_cap) apply_soft_cap<Cfg>(s, p.logits_soft_cap, scale_over_cap_blk);
        const bool full = kMaskVerdicts && p.custom_mask
                              ? *tile_hides_none<Cfg>(smem, tile_n + t) != 0 &&
                                    tile_is_full_unmasked(b, j0, Cfg::kKvTile)
                              : tile_is_full(p, b, j0, Cfg::kKvTile);
        if (!full) apply_mask<1, kNTiles>(s, p, b, group, warp_row0, j0, lane);
      };
      // The soft cap, the mask and the online softmax of tile t: s becomes P (in place).
      const auto scores = [&](int t, float(&corr)[1][2]) {
        cap_and_mask(t);
        return softmax.update_scores(s, c_blk, corr);
      };

      // When a warpgroup waits for its own P_{t-1}.V_{t-1}. By default before tile t's softmax
      // (after its mask): P_t's fragments are then free, and the softmax takes its exponentials
      // into them at once, against the running reference (update_scores_ahead in the loop). With
      // kLateWait the wait (with the V stage's release, O's rescale and the packing of P_t) comes
      // at the top of the next turn instead, a block of its own after the softmax, which then
      // runs under the P.V. That is faster with ragged K/V at head dim 128, and slower with paged
      // K/V, whose gather needs the V stage back a softmax sooner (docs/perf/prefill.md, History,
      // "The own P.V wait").
      constexpr bool kLateWait = !kPaged && Cfg::kDqk == 128;
      // Waits for P_{t-1}.V_{t-1} (nothing is in flight at t = 0) and frees its V stage.
      const auto wait_own_pv = [&](int t) {
        sm90::wait<0>();
        sm90::pin(o_acc);
        if (t >= 1 && lane == 0) sm90::mbar_arrive(bars.v_empty(Ring::stage(tile_n + t - 1)));
      };
      // After tile t's softmax (its row maxima moved: `moved`, by `corr`): waits for
      // P_{t-1}.V_{t-1}, frees its V stage, rescales O and packs P_t.
      const auto finish_tile = [&](int t, bool moved, const float(&corr)[1][2]) {
        wait_own_pv(t);
        if (moved) softmax.rescale(o, corr);
        pack_p<Cfg, typename Cfg::Mma>(s, pf);
      };
      // kLateWait: the softmax result of the tile last read, for its finish_tile at the next turn.
      float late_corr[1][2];
      bool late_moved = false;

      // Tile 0: S_0 alone.
      // K is waited for before the turn, so that a warpgroup holds the turn only to issue.
      wait_landed(bars.k_full(Ring::stage(tile_n)), tile_n, num_tiles == 1);
      take_turn(wg);
      issue_qk(s_acc, tile_n, q_tile);
      pass_turn(wg);
      sm90::wait<0>();
      sm90::pin(s_acc);
      if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(tile_n)));
      {
        float corr[1][2];
        scores(0, kLateWait ? late_corr : corr);  // O is still 0: nothing to rescale
        if constexpr (!kLateWait) pack_p<Cfg, typename Cfg::Mma>(s, pf);
      }
      // Tile t: S_t, then P_{t-1}.V_{t-1} behind it, which runs while S_t is read, and under
      // the other warpgroup's softmax. V_{t-1} is waited for once S_t is issued, so that its wait
      // runs under S_t rather than before it.
      for (int t = 1; t < num_tiles; ++t) {
        const int n = tile_n + t;
        if constexpr (kLateWait) finish_tile(t - 1, late_moved, late_corr);
        wait_landed(bars.k_full(Ring::stage(n)), n, t == num_tiles - 1);
        take_turn(wg);
        issue_qk(s_acc, n, q_tile);
        wait_landed(bars.v_full(Ring::stage(n - 1)), n - 1, false);
        sm90::fence();  // P_{t-1}'s registers, across the wait's loop
        issue_pv(n - 1);
        pass_turn(wg);
        sm90::wait<1>();  // S_t
        sm90::pin(s_acc);
        if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(n)));
        if constexpr (kLateWait) {
          late_moved = scores(t, late_corr);
        } else {
          // The own P_{t-1}.V_{t-1} first, so that P_t's fragments are free and the exponentials
          // can go into them against the running reference without the tile's row maxima
          // (update_scores_ahead); where that does not stand, the exact update from s.
          cap_and_mask(t);
          wait_own_pv(t);
          const bool ahead =
              softmax.update_scores_ahead(s, c_blk, [&](int nt, int h, float p0, float p1) {
                p_word<Cfg>(pf, 0, nt, h) = pack2<typename Cfg::Mma>(p0, p1);
              });
          if (!ahead) {
            float corr[1][2];
            if (softmax.update_scores(s, c_blk, corr)) softmax.rescale(o, corr);
            pack_p<Cfg, typename Cfg::Mma>(s, pf);
          }
        }
      }
      if constexpr (kLateWait) finish_tile(num_tiles - 1, late_moved, late_corr);
      // The last tile's P.V.
      const int n = tile_n + num_tiles - 1;
      wait_landed(bars.v_full(Ring::stage(n)), n, true);
      take_turn(wg);
      sm90::fence();
      issue_pv(n);
      pass_turn(wg);
      sm90::wait<0>();
      sm90::pin(o_acc);
      if (lane == 0) sm90::mbar_arrive(bars.v_empty(Ring::stage(n)));
    }
    float scale[1][2], lse[1][2];
    softmax.finish(c_blk, scale, lse, Cfg::kFp8 ? p.v_scale : 1.0f);
    // A merged store stages the state, and a final 16-bit one its output, in the warp's slice of
    // the Q stage, which holds other warps' rows of the same warpgroup: the warpgroup must be
    // past its last Q.K^T first.
    const bool final_block = b.partial < 0, staged = final_block && !merging && o_chunks;
    if (final_block && (merging || o_chunks)) sm90::barrier_sync(ws::kConsumerBarrier0 + wg, 128);
    if (staged)
      store_block_staged<Cfg>(p, b, kv_head, group, warp_row0, lane, q_stage, o, scale, lse);
    else
      store_block<Cfg>(p, b, kv_head, group, warp_row0, lane, q_stage, o, scale, lse);
    // The stage's next Q may come by TMA (the async proxy), after the epilogue's and
    // q_rows_to_f16's stores into it (the generic proxy): each lane orders its own before its
    // warp's release of the stage.
    sm90::fence_async_shared();
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bars.q_empty(qs));
    tile_n += num_tiles;
  }
  // Balance the turns: warpgroup 1 passed one more than warpgroup 0 took.
  if (wg == 0) take_turn(0);
}

}  // namespace flashkv::cuda::prefill_detail
