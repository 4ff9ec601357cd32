#!/usr/bin/env python3
"""Writes copies of the flashkv tree whose Hopper prefill consumer (kernels/cuda/prefill/
sm90_ws_consumer.cuh) leaves one stage of the steady tile out, to be timed against the tree
itself with bench/compare_builds.py: what a stage costs is the time it takes away. The probes
compute wrong results; they exist to be timed.

  nosoftmax  P = S times the logit scale: no row maximum, exponentials, sums or O rescale
  nomask     no per-element mask (the test that decides it still runs)
  nostore    no epilogue store of the block's output
  nopv       no P.V products (half the tile's products); V is still loaded

One more probe computes right results and records where a tile's time goes:

  timeline   every consumer thread of CTA (0, 0) reads %clock at fixed points of its first 96
             tiles (into local memory, which costs a few percent of the time), on the fourth
             launch of each kernel file's warp-specialized kernels (a CUDA graph's replays
             count); at the process's exit each kernel file that launched prints its records to
             stderr, a `TIMELINE` line a tile and warpgroup (no synchronisation while it runs, so
             a graph capture is never disturbed)
  ctas       every CTA's start and end (%globaltimer, ns) and its blocks and K/V tiles, on each
             launch (the last launch of each case stays: its batch size, query heads, causal or
             not, paged or ragged); `CTAS` lines at exit, and the summary gives the launch's
             span against its CTAs' mean time (the imbalance the schedule leaves) and a
             least-squares fit of a CTA's time to its tiles and blocks (what a tile and a block
             cost, for the planner's cost model)
  blocks     the same for the row blocks: each consumer warpgroup's thread 0 of CTA (0, 0) reads
             %clock as a block starts, once its Q has landed, once S_0 is in, after the last
             P.V and after the store, and the producer's thread 0 as it starts the block's
             tiles, after the tiles that go ahead of Q, once the Q stage is free, after Q's
             copies and after the rest (16-bit K/V), for the first 64 blocks of the fourth
             launch; `BLOCKS` and `PRODUCER` lines at exit

Usage:
  python3 bench/stage_probes.py OUTDIR [PROBE ...]      # default: the four stage probes
  python3 bench/compare_builds.py run --variant base=. --variant nopv=OUTDIR/nopv ... \\
      --op prefill --op extend --cmake-arg=-DFLASHKV_HEAD_DIMS=64;128;256
  python3 bench/stage_probes.py OUTDIR timeline         # then build OUTDIR/timeline, and:
  OUTDIR/timeline/build/flashkv bench --device cuda --grid full --op prefill 2> timeline.txt
  python3 bench/stage_probes.py --summary timeline.txt  # each phase's median, in SM clocks
  (the same for `blocks` and `ctas`; --summary reads every kind of line)

Each edit is a literal replacement that must match exactly once: when the kernel changes so that
one no longer matches, the script stops and names it.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSUMER = "kernels/cuda/prefill/sm90_ws_consumer.cuh"
PRODUCER = "kernels/cuda/prefill/sm90_ws_producer.cuh"
LAUNCH = "kernels/cuda/prefill/kernel_sm90_ws.cuh"
FILES = (CONSUMER, PRODUCER, LAUNCH)
# A condition the compiler cannot fold that never holds at run time: the code it guards stays in
# the kernel (registers and scheduling as before) but does not run.
NEVER = "p.num_qo_heads < 0"

# What the recording probes share: the SM clock, the launch they record (each recording thread
# counts its kernel file's launches, so all of them pick the same one), and the printer that a
# kernel file registers on its first launch to print its records to stderr as the process exits.
_CLOCK = "asm volatile(\"mov.u32 %0, %%clock;\" : \"=r\"(c));"


def _fourth_launch(counter: str) -> str:
    return f"atomicAdd(&{counter}, 1u) == 3"


def _at_exit(name: str, printer: str) -> list[tuple[str, str, str]]:
    """The launch header's edits that run `printer` (statements) once at exit per kernel file."""
    return [
        (LAUNCH, "                maps);\n  return true;\n",
         "                maps);\n"
         f"  if (!g_{name}_hooked) {{  // one printer a kernel file (this header's translation unit)\n"
         f"    g_{name}_hooked = true;\n    std::atexit([] {{\n{printer}    }});\n  }}\n"
         "  return true;\n"),
        (LAUNCH, "#include <cstdint>\n", "#include <cstdint>\n#include <cstdio>\n#include <cstdlib>\n"),
        (LAUNCH, "// The driver's cuTensorMapEncodeTiled,",
         f"static bool g_{name}_hooked = false;\n\n// The driver's cuTensorMapEncodeTiled,"),
    ]


# The timeline's points, in the order a turn of the tile loop passes them (a name each, for the
# summary): the turn's start; after the late wait's finish of the tile before (kLateWait; else at
# once); after the K wait; after the turn; after issuing S_t and the V wait; after issuing
# P_{t-1}.V_{t-1} and passing the turn; after the wait for S_t; without kLateWait after the mask
# and the early wait for the own P.V (with it at once); after the softmax (with kLateWait the
# mask's too).
POINTS = ["start", "late finish", "K ready", "turn", "V ready", "issued", "S ready",
          "early finish", "softmax"]
TIMELINE_TILES = 96
# A tile's record: the clock at each point, then its block and tile (block << 16 | tile).
_WIDTH = len(POINTS) + 1
_ID = len(POINTS)
_REC = "        ev[ri][{}] = clk();\n"

TIMELINE = [
    (CONSUMER, "// The consumer warpgroups (threads 128..383;",
     f"constexpr int kTimelineTiles = {TIMELINE_TILES};\n"
     "__device__ unsigned int g_timeline_launch[2];\n"
     f"__device__ uint32_t g_timeline[2][kTimelineTiles][{_WIDTH}];\n"
     "__device__ int g_timeline_n[2];\n"
     "__device__ int g_timeline_paged;\n\n"
     "// The consumer warpgroups (threads 128..383;"),
    (CONSUMER, "  const uint32_t base = smem_addr(smem);\n",
     "  const uint32_t base = smem_addr(smem);\n"
     f"  uint32_t ev[kTimelineTiles][{_WIDTH}];\n  int nrec = 0;\n"
     "  bool rec = false;\n"
     "  if (blockIdx.x == 0 && blockIdx.y == 0 && (ctid & 127) == 0)\n"
     f"    rec = {_fourth_launch('g_timeline_launch[wg]')};\n"
     f"  const auto clk = [] {{\n    uint32_t c;\n    {_CLOCK}\n    return c;\n  }};\n"),
    (CONSUMER, "        const int n = tile_n + t;\n"
     "        if constexpr (kLateWait) finish_tile(t - 1, late_moved, late_corr);\n",
     "        const int n = tile_n + t;\n"
     "        const int ri = nrec < kTimelineTiles ? nrec : kTimelineTiles - 1;\n        ++nrec;\n"
     + _REC.format(0) +
     "        if constexpr (kLateWait) finish_tile(t - 1, late_moved, late_corr);\n"
     + _REC.format(1)),
    (CONSUMER, "        wait_landed(bars.k_full(Ring::stage(n)), n, t == num_tiles - 1);\n"
     "        take_turn(wg);\n        issue_qk(s_acc, n, q_tile);\n",
     "        wait_landed(bars.k_full(Ring::stage(n)), n, t == num_tiles - 1);\n"
     + _REC.format(POINTS.index("K ready")) +
     "        take_turn(wg);\n" + _REC.format(POINTS.index("turn")) +
     "        issue_qk(s_acc, n, q_tile);\n"),
    (CONSUMER, "        sm90::fence();  // P_{t-1}'s registers, across the wait's loop\n"
     "        issue_pv(n - 1);\n        pass_turn(wg);\n        sm90::wait<1>();  // S_t\n"
     "        sm90::pin(s_acc);\n",
     _REC.format(POINTS.index("V ready")) +
     "        sm90::fence();  // P_{t-1}'s registers, across the wait's loop\n"
     "        issue_pv(n - 1);\n        pass_turn(wg);\n" + _REC.format(POINTS.index("issued")) +
     "        sm90::wait<1>();  // S_t\n        sm90::pin(s_acc);\n"
     + _REC.format(POINTS.index("S ready")) +
     f"        ev[ri][{_ID}] = (block_n << 16) | t;\n"),
    (CONSUMER, "          late_moved = scores(t, late_corr);\n",
     "          ev[ri][7] = ev[ri][6];\n          late_moved = scores(t, late_corr);\n"
     + _REC.format(8)),
    (CONSUMER, "          wait_own_pv(t);\n          const bool ahead =\n",
     "          wait_own_pv(t);\n" + _REC.format(7) + "          const bool ahead =\n"),
    (CONSUMER, "            pack_p<Cfg, typename Cfg::Mma>(s, pf);\n          }\n",
     "            pack_p<Cfg, typename Cfg::Mma>(s, pf);\n          }\n" + _REC.format(8)),
    (CONSUMER, "  if (wg == 0) take_turn(0);\n",
     "  if (wg == 0) take_turn(0);\n  if (rec) {\n"
     "    for (int i = 0; i < (nrec < kTimelineTiles ? nrec : kTimelineTiles); ++i)\n"
     f"      for (int k = 0; k < {_WIDTH}; ++k) g_timeline[wg][i][k] = ev[i][k];\n"
     "    g_timeline_n[wg] = nrec;\n    g_timeline_paged = kPaged;\n  }\n"),
] + _at_exit("timeline",
             f"      static uint32_t h[2][kTimelineTiles][{_WIDTH}];\n"
             "      int n[2] = {0, 0}, paged = 0;\n"
             "      if (cudaMemcpyFromSymbol(h, g_timeline, sizeof h) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(n, g_timeline_n, sizeof n) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(&paged, g_timeline_paged, sizeof paged) != cudaSuccess)\n"
             "        return;\n"
             "      for (int w = 0; w < 2; ++w)\n"
             "        for (int i = 0; i < (n[w] < kTimelineTiles ? n[w] : kTimelineTiles); ++i) {\n"
             "          std::fprintf(stderr, \"TIMELINE D=%d paged=%d fp8=%d wg=%d block=%u tile=%u clk=\",\n"
             f"                       D, paged, int(Cfg::kFp8), w, h[w][i][{_ID}] >> 16,\n"
             f"                       h[w][i][{_ID}] & 0xffff);\n"
             f"          for (int k = 0; k < {_ID}; ++k) std::fprintf(stderr, \" %u\", h[w][i][k]);\n"
             "          std::fprintf(stderr, \"\\n\");\n        }\n")

# The blocks probe's points: a consumer warpgroup's (the block's start, before its Q wait; Q
# landed and the block read; S_0 in, or as Q landed without keys; after the last P.V, likewise;
# after the store) and the producer's (before the block's tiles that go ahead of its Q; after
# them; the Q stage free; Q's copies issued; the rest of the tiles issued).
BLOCK_POINTS = ["start", "Q ready", "S_0 ready", "tiles done", "stored"]
PRODUCER_POINTS = ["start", "early tiles", "Q stage free", "Q issued", "tiles issued"]
BLOCKS_MAX = 64
_BW = len(BLOCK_POINTS) + 1  # the points, then the block's tiles

BLOCKS = [
    (CONSUMER, "namespace flashkv::cuda::prefill_detail {\n",
     "namespace flashkv::cuda::prefill_detail {\n\n"
     f"constexpr int kBlocksMax = {BLOCKS_MAX};\n"
     "__device__ unsigned int g_blocks_launch[3];  // consumer warpgroups 0, 1, the producer\n"
     f"__device__ uint32_t g_blocks[2][kBlocksMax][{_BW}];\n"
     f"__device__ uint32_t g_blocks_producer[kBlocksMax][{len(PRODUCER_POINTS)}];\n"
     "__device__ int g_blocks_n[2];\n"
     "__device__ int g_blocks_paged;\n"
     "__device__ bool g_blocks_producer_records;\n"
     "__device__ __forceinline__ uint32_t blocks_clock() {\n  uint32_t c;\n"
     f"  {_CLOCK}\n  return c;\n}}\n"),
    (CONSUMER, "  const uint32_t base = smem_addr(smem);\n",
     "  const uint32_t base = smem_addr(smem);\n"
     "  bool brec = false;\n"
     "  if (blockIdx.x == 0 && blockIdx.y == 0 && (ctid & 127) == 0)\n"
     f"    brec = {_fourth_launch('g_blocks_launch[wg]')};\n"),
    (CONSUMER, "    const int qs = QRing::stage(block_n);\n"
     "    sm90::mbar_wait(bars.q_full(qs), QRing::full_parity(block_n));\n"
     "    const RowBlock b = *block_slot<Cfg>(smem, block_n);\n"
     "    if (b.rows == 0) break;\n",
     "    const int qs = QRing::stage(block_n);\n"
     "    const uint32_t bt0 = blocks_clock();\n"
     "    sm90::mbar_wait(bars.q_full(qs), QRing::full_parity(block_n));\n"
     "    const RowBlock b = *block_slot<Cfg>(smem, block_n);\n"
     "    if (b.rows == 0) break;\n"
     "    const uint32_t bt1 = blocks_clock();\n"
     "    uint32_t bt2 = bt1, bt3 = bt1;\n"),
    (CONSUMER, "      if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(tile_n)));\n",
     "      if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(tile_n)));\n"
     "      bt2 = blocks_clock();\n"),
    (CONSUMER, "    float scale[1][2], lse[1][2];\n",
     "    if (num_tiles > 0) bt3 = blocks_clock();\n    float scale[1][2], lse[1][2];\n"),
    (CONSUMER, "    if (lane == 0) sm90::mbar_arrive(bars.q_empty(qs));\n    tile_n += num_tiles;\n",
     "    if (brec && block_n < kBlocksMax) {\n"
     "      const uint32_t bt4 = blocks_clock();\n"
     "      const uint32_t rec[] = {bt0, bt1, bt2, bt3, bt4, static_cast<uint32_t>(num_tiles)};\n"
     f"      for (int k = 0; k < {_BW}; ++k) g_blocks[wg][block_n][k] = rec[k];\n"
     "      g_blocks_n[wg] = block_n + 1;\n      g_blocks_paged = kPaged;\n    }\n"
     "    if (lane == 0) sm90::mbar_arrive(bars.q_empty(qs));\n    tile_n += num_tiles;\n"),
    (PRODUCER, "  sm90::mbar_wait(bars.q_empty(qs), QRing::empty_parity(block_n));\n",
     "  sm90::mbar_wait(bars.q_empty(qs), QRing::empty_parity(block_n));\n"
     "  if (blockIdx.x == 0 && blockIdx.y == 0 && tid == 0 && g_blocks_producer_records &&\n"
     "      block_n < kBlocksMax)\n"
     "    g_blocks_producer[block_n][2] = blocks_clock();\n"),
    (PRODUCER, "  int block_n = 0, tile_n = 0;\n",
     "  int block_n = 0, tile_n = 0;\n"
     "  const bool prec = blockIdx.x == 0 && blockIdx.y == 0 && tid == 0 &&\n"
     f"                    {_fourth_launch('g_blocks_launch[2]')};\n"
     "  if (blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) g_blocks_producer_records = prec;\n"),
    (PRODUCER, "    const int early = Cfg::tiles_before_q(num_tiles);  // then Q, then the rest\n"
     "    tiles(0, early);\n"
     "    fill_q_stage<Cfg>(p, maps, smem, bars, b, kv_head, group, block_n, num_tiles > 0, tid);\n"
     "    ++block_n;\n    tiles(early, num_tiles);\n",
     "    const uint32_t pt0 = blocks_clock();\n"
     "    const int early = Cfg::tiles_before_q(num_tiles);  // then Q, then the rest\n"
     "    tiles(0, early);\n"
     "    const uint32_t pt1 = blocks_clock();\n"
     "    fill_q_stage<Cfg>(p, maps, smem, bars, b, kv_head, group, block_n, num_tiles > 0, tid);\n"
     "    const uint32_t pt3 = blocks_clock();\n"
     "    ++block_n;\n    tiles(early, num_tiles);\n"
     "    if (prec && block_n - 1 < kBlocksMax) {\n"
     "      g_blocks_producer[block_n - 1][0] = pt0;\n"
     "      g_blocks_producer[block_n - 1][1] = pt1;\n"
     "      g_blocks_producer[block_n - 1][3] = pt3;\n"
     "      g_blocks_producer[block_n - 1][4] = blocks_clock();\n    }\n"),
] + _at_exit("blocks",
             f"      static uint32_t h[2][kBlocksMax][{_BW}];\n"
             f"      static uint32_t pr[kBlocksMax][{len(PRODUCER_POINTS)}];\n"
             "      int n[2] = {0, 0}, paged = 0;\n"
             "      if (cudaMemcpyFromSymbol(h, g_blocks, sizeof h) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(pr, g_blocks_producer, sizeof pr) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(n, g_blocks_n, sizeof n) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(&paged, g_blocks_paged, sizeof paged) != cudaSuccess)\n"
             "        return;\n"
             "      for (int w = 0; w < 2; ++w)\n"
             "        for (int i = 0; i < n[w]; ++i) {\n"
             "          std::fprintf(stderr, \"BLOCKS D=%d paged=%d fp8=%d wg=%d block=%d tiles=%u clk=\",\n"
             f"                       D, paged, int(Cfg::kFp8), w, i, h[w][i][{_BW - 1}]);\n"
             f"          for (int k = 0; k < {_BW - 1}; ++k) std::fprintf(stderr, \" %u\", h[w][i][k]);\n"
             "          std::fprintf(stderr, \"\\n\");\n        }\n"
             "      for (int i = 0; i < (n[0] > n[1] ? n[0] : n[1]); ++i) {\n"
             "        if (pr[i][0] == 0) continue;  // fp8 K/V: the producer's other points are not read\n"
             "        std::fprintf(stderr, \"PRODUCER D=%d paged=%d fp8=%d block=%d clk=\", D, paged,\n"
             "                     int(Cfg::kFp8), i);\n"
             f"        for (int k = 0; k < {len(PRODUCER_POINTS)}; ++k)\n"
             "          std::fprintf(stderr, \" %u\", pr[i][k]);\n"
             "        std::fprintf(stderr, \"\\n\");\n      }\n")

# The ctas probe: a CTA's record is its start and end on the global timer (consumer warpgroup 0's
# first thread as it starts, warpgroup 1's, which stores last, after its last block), its blocks
# and its K/V tiles. Each launch writes the slot of its case (batch size, query heads, causal,
# paged: one of kCtasSlots slots a kernel file, claimed by the first launch of the case), so each
# case's last launch stays.
_GLOBALTIMER = "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));"
CTAS = [
    (CONSUMER, "// The consumer warpgroups (threads 128..383;",
     "constexpr int kCtasSlots = 8, kCtasMax = 2048;\n"
     "__device__ unsigned long long g_ctas[kCtasSlots][kCtasMax][4];  // start, end (ns), blocks, tiles\n"
     "__device__ unsigned long long g_ctas_key[kCtasSlots];\n"
     "__device__ int g_ctas_n[kCtasSlots];\n"
     "__device__ __forceinline__ unsigned long long ctas_time() {\n"
     f"  unsigned long long t;\n  {_GLOBALTIMER}\n  return t;\n}}\n"
     "// The slot of the launch's case (-1: all taken by other cases).\n"
     "__device__ __forceinline__ int ctas_slot(const AttentionParams& p, bool paged) {\n"
     "  const unsigned long long key = 1ull << 63 | (unsigned long long)p.batch_size << 32 |\n"
     "                                 (unsigned long long)p.num_qo_heads << 2 |\n"
     "                                 (p.causal ? 2ull : 0ull) | (paged ? 1ull : 0ull);\n"
     "  for (int i = 0; i < kCtasSlots; ++i) {\n"
     "    const unsigned long long old = atomicCAS(&g_ctas_key[i], 0ull, key);\n"
     "    if (old == 0 || old == key) return i;\n  }\n  return -1;\n}\n\n"
     "// The consumer warpgroups (threads 128..383;"),
    (CONSUMER, "  const uint32_t base = smem_addr(smem);\n",
     "  const uint32_t base = smem_addr(smem);\n"
     "  const int cta = blockIdx.y * gridDim.x + blockIdx.x;\n"
     "  const int cslot = (ctid & 127) == 0 && cta < kCtasMax ? ctas_slot(p, kPaged) : -1;\n"
     "  if (ctid == 0 && cslot >= 0) g_ctas[cslot][cta][0] = ctas_time();\n"),
    (CONSUMER, "  if (wg == 0) take_turn(0);\n",
     "  if (wg == 0) take_turn(0);\n"
     "  if (ctid == 128 && cslot >= 0) {\n"
     "    g_ctas[cslot][cta][1] = ctas_time();\n    g_ctas[cslot][cta][2] = block_n;\n"
     "    g_ctas[cslot][cta][3] = tile_n;\n"
     "    if (cta == 0)\n"
     "      g_ctas_n[cslot] = gridDim.x * gridDim.y < kCtasMax ? gridDim.x * gridDim.y : kCtasMax;\n"
     "  }\n"),
] + _at_exit("ctas",
             "      static unsigned long long h[kCtasSlots][kCtasMax][4], key[kCtasSlots];\n"
             "      int n[kCtasSlots];\n"
             "      if (cudaMemcpyFromSymbol(h, g_ctas, sizeof h) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(key, g_ctas_key, sizeof key) != cudaSuccess ||\n"
             "          cudaMemcpyFromSymbol(n, g_ctas_n, sizeof n) != cudaSuccess)\n"
             "        return;\n"
             "      for (int s = 0; s < kCtasSlots; ++s)\n"
             "        for (int i = 0; key[s] != 0 && i < n[s]; ++i)\n"
             "          std::fprintf(stderr, \"CTAS D=%d paged=%d fp8=%d batch=%d heads=%d causal=%d cta=%d \"\n"
             "                       \"start=%llu end=%llu blocks=%llu tiles=%llu\\n\", D,\n"
             "                       int(key[s] & 1), int(Cfg::kFp8), int(key[s] >> 32 & 0x7fffffff),\n"
             "                       int(key[s] >> 2 & 0x3fffffff), int(key[s] >> 1 & 1), i, h[s][i][0],\n"
             "                       h[s][i][1], h[s][i][2], h[s][i][3]);\n")

PROBES: dict[str, list[tuple[str, str, str]]] = {
    "nosoftmax": [(CONSUMER, "return softmax.update_scores(s, c_blk, corr);",
                   "(void)corr;\n#pragma unroll\n"
                   "for (int i = 0; i < kNTiles * 4; ++i) s_acc[i] *= c_blk;\nreturn false;")],
    "nomask": [(CONSUMER, "if (!full) apply_mask", f"if (!full && {NEVER}) apply_mask")],
    "nostore": [(CONSUMER, "    if (staged)\n      store_block_staged",
                 f"    if ({NEVER} && staged)\n      store_block_staged"),
                (CONSUMER, "    else\n      store_block<Cfg>",
                 f"    else if ({NEVER})\n      store_block<Cfg>")],
    "nopv": [(CONSUMER,
              "for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)\n#pragma unroll\n          for (int part",
              f"for (int kk = 0; kk < ({NEVER} ? Cfg::kKvTile / 16 : 0); ++kk)\n#pragma unroll\n"
              "          for (int part")],
    "timeline": TIMELINE,
    "blocks": BLOCKS,
    "ctas": CTAS,
}
STAGE_PROBES = ["nosoftmax", "nomask", "nostore", "nopv"]


def patched(texts: dict[str, str], probe: str) -> dict[str, str]:
    """texts: the files' texts by path; returns the probe's (only the files it edits)."""
    out = {}
    for path, old, new in PROBES[probe]:
        text = out.get(path, texts[path])
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"stage_probes: {probe}: expected one match of {old!r} in {path}, "
                             f"found {count}")
        out[path] = text.replace(old, new)
    return out


def _signed(d: int) -> int:
    """A difference of two 32-bit clocks, as a signed number (the clock wraps)."""
    return (d + 2**31) % 2**32 - 2**31


def _medians(phases: dict[str, list[int]]) -> str:
    return " ".join(f"{name} {statistics.median(v):.0f}" for name, v in phases.items() if v)


def summary(lines) -> list[str]:
    """Each kernel's and warpgroup's median time of each phase, in SM clocks, from the timeline
    and blocks probes' lines. Timeline: each phase of a tile; `period`, from one tile's start to
    the next's in the same block; `boundary`, from a block's last recorded tile's start to the
    next block's first (two periods if a block cost nothing beyond its tiles). Blocks: each
    consumer phase of a block (`a loop tile` is the tiles after tile 0, a tile), `to the next
    block` from the store to the next block's start; the producer's phases, and `Q landed` from
    its last copy of a block's Q to the later warpgroup's Q ready."""
    tiles: dict[tuple[str, str], list[tuple[int, int, list[int]]]] = {}
    blocks: dict[tuple[str, str], dict[int, tuple[int, list[int]]]] = {}
    producer: dict[str, dict[int, list[int]]] = {}
    pattern = re.compile(r"TIMELINE (D=\d+ paged=\d fp8=\d) wg=(\d) block=(\d+) tile=(\d+) "
                         rf"clk=((?: \d+){{{len(POINTS)}}})")
    block_pattern = re.compile(r"BLOCKS (D=\d+ paged=\d fp8=\d) wg=(\d) block=(\d+) "
                               rf"tiles=(\d+) clk=((?: \d+){{{len(BLOCK_POINTS)}}})")
    producer_pattern = re.compile(r"PRODUCER (D=\d+ paged=\d fp8=\d) block=(\d+) "
                                  rf"clk=((?: \d+){{{len(PRODUCER_POINTS)}}})")
    cta_pattern = re.compile(r"CTAS (D=\d+ paged=\d fp8=\d batch=\d+ heads=\d+ causal=\d) "
                             r"cta=(\d+) start=(\d+) end=(\d+) blocks=(\d+) tiles=(\d+)")
    ctas: dict[str, list[tuple[int, int, int, int]]] = {}
    for line in lines:
        if m := pattern.search(line):
            clocks = [int(c) for c in m.group(5).split()]
            tiles.setdefault((m.group(1), m.group(2)), []).append(
                (int(m.group(3)), int(m.group(4)), clocks))
        elif m := block_pattern.search(line):
            blocks.setdefault((m.group(1), m.group(2)), {})[int(m.group(3))] = (
                int(m.group(4)), [int(c) for c in m.group(5).split()])
        elif m := cta_pattern.search(line):
            ctas.setdefault(m.group(1), []).append(tuple(int(m.group(k)) for k in range(3, 7)))
        elif m := producer_pattern.search(line):
            producer.setdefault(m.group(1), {})[int(m.group(2))] = [
                int(c) for c in m.group(3).split()]
    out = []
    for (kernel, wg), rows in tiles.items():
        phases: dict[str, list[int]] = {}
        boundary = []
        for i, (block, _, c) in enumerate(rows):
            for k in range(1, len(POINTS)):
                phases.setdefault(POINTS[k], []).append((c[k] - c[k - 1]) % 2**32)
            if i + 1 < len(rows) and rows[i + 1][0] == block:
                phases.setdefault("period", []).append((rows[i + 1][2][0] - c[0]) % 2**32)
            elif i + 1 < len(rows) and rows[i + 1][0] == block + 1:
                boundary.append((rows[i + 1][2][0] - c[0]) % 2**32)
        line = f"{kernel} wg={wg} tiles={len(rows)}: {_medians(phases)}"
        if boundary and phases.get("period"):
            b = statistics.median(boundary)
            line += f" boundary {b:.0f} ({b / statistics.median(phases['period']):.1f} periods)"
        out.append(line)
    for (kernel, wg), by_block in blocks.items():
        phases = {"Q wait": [], "tile 0": [], "a loop tile": [], "finish and store": [],
                  "to the next block": []}
        for n, (count, c) in by_block.items():
            phases["Q wait"].append((c[1] - c[0]) % 2**32)
            if count > 0:
                phases["tile 0"].append((c[2] - c[1]) % 2**32)
            if count > 1:
                phases["a loop tile"].append((c[3] - c[2]) % 2**32 / (count - 1))
            phases["finish and store"].append((c[4] - c[3]) % 2**32)
            if n + 1 in by_block:
                phases["to the next block"].append((by_block[n + 1][1][0] - c[4]) % 2**32)
        out.append(f"{kernel} wg={wg} blocks={len(by_block)}: {_medians(phases)}")
    for kernel, by_block in producer.items():
        phases = {name: [] for name in PRODUCER_POINTS[1:]}
        phases["Q landed"] = []
        for n, c in by_block.items():
            for k in range(1, len(PRODUCER_POINTS)):
                phases[PRODUCER_POINTS[k]].append((c[k] - c[k - 1]) % 2**32)
            ready = [blocks[(kernel, w)][n][1][1] for w in "01"
                     if n in blocks.get((kernel, w), {})]
            if len(ready) == 2:
                phases["Q landed"].append(max(_signed(r - c[3]) for r in ready))
        out.append(f"{kernel} producer blocks={len(by_block)}: {_medians(phases)}")
    for kernel, rows in ctas.items():
        out.append(f"{kernel} {_ctas_line(rows)}")
    return out


def _ctas_line(rows: list[tuple[int, int, int, int]]) -> str:
    """One launch's CTAs (start, end in ns, blocks, tiles): the span from the first start to the
    last end against the CTAs' mean time, the spread of their ends, and the least-squares fit of
    a CTA's time to a * tiles + b * blocks (microseconds)."""
    us = [(end - start) / 1e3 for start, end, _, _ in rows]
    first = min(r[0] for r in rows)
    ends = sorted((r[1] - first) / 1e3 for r in rows)
    span = ends[-1]
    mean = max(statistics.fmean(us), 1e-9)  # a launch of empty CTAs still prints
    line = (f"ctas={len(rows)}: span {span:.1f} us, a CTA's mean {mean:.1f} us "
            f"(span / mean {span / mean:.3f}), ends from {ends[0]:.1f} to {ends[-1]:.1f} us "
            f"(median {statistics.median(ends):.1f})")
    # Normal equations of us ~ a * tiles + b * blocks.
    tt = sum(r[3] * r[3] for r in rows)
    tb = sum(r[3] * r[2] for r in rows)
    bb = sum(r[2] * r[2] for r in rows)
    ty = sum(r[3] * y for r, y in zip(rows, us))
    by = sum(r[2] * y for r, y in zip(rows, us))
    det = tt * bb - tb * tb
    if det > 0:
        a, b = (ty * bb - by * tb) / det, (tt * by - tb * ty) / det
        line += f"; fit: {a * 1e3:.0f} ns a tile, {b * 1e3:.0f} ns a block"
    return line


def source_files(root: Path) -> list[str]:
    """The tree's files: git's list where there is one, else every file outside build trees and
    hidden directories (a copy of the tree without its history, which git lists as empty where
    the copy lies in an ignored folder of another work tree)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    return files or [str(p.relative_to(root)) for p in root.rglob("*")
                     if p.is_file() and not any(part.startswith((".", "build"))
                                                for part in p.relative_to(root).parts)]


def write(out: Path, probes: list[str], root: Path = ROOT) -> list[Path]:
    sources = {path: (root / path).read_text() for path in FILES if (root / path).exists()}
    edits = {probe: patched(sources, probe) for probe in probes}  # all match, or none written
    files = source_files(root)
    trees = []
    for probe in probes:
        dest = out / probe
        shutil.rmtree(dest, ignore_errors=True)
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
        for path, text in edits[probe].items():
            (dest / path).write_text(text)
        trees.append(dest)
    return trees


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--summary":
        if len(argv) != 2:
            print("stage_probes: --summary takes one file of TIMELINE or BLOCKS lines",
                  file=sys.stderr)
            return 2
        with open(argv[1]) as f:
            for line in summary(f):
                print(line)
        return 0
    probes = argv[1:] or STAGE_PROBES
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        print(f"stage_probes: unknown probe '{unknown[0]}' (known: {', '.join(PROBES)})",
              file=sys.stderr)
        return 2
    for tree in write(Path(argv[0]), probes):
        print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
