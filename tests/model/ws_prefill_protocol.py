#!/usr/bin/env python3
"""A model of how the warp-specialized Hopper prefill kernel's warpgroups hand stages to each other
(kernels/cuda/prefill/sm90_ws_producer.cuh: `produce`, for 16-bit K/V and for fp8 K/V through
the staging ring; sm90_ws_consumer.cuh: `consume`), checked over random row-block sequences
and random interleavings of the warpgroups and of the copies landing.

The producer and the two consumer warpgroups are generators that yield where they wait; a fourth
actor lands the producer's asynchronous copies (TMA or cp.async, counted on their barrier as
they land) one at a time, in order. Modelled: the mbarriers (arrival counts, completed phases,
waits on a phase's parity as the kernel issues them: full barriers of use n of a ring of S
stages on phase n / S, empty barriers on the one before), the two turn barriers (one bar.arrive
by the warpgroup passing, one bar.sync by the one taking), and each warpgroup's products in
flight (wgmma groups, retired oldest first by wait_group), and the row-block slots through which
the producer hands the consumers each block (written as the producer starts the block, published
by its arrival on the block's Q full barrier; an end mark after the last block), and, with paged
16-bit K/V, each tile's custom-mask verdict (a ring of twice the K stages; written by producer
thread 0 between the K stage's empty wait and its own arrival on the stage's full barrier, read by
the consumers at the tile's softmax, after they released the stage). The
configurations are the kernel's:
two Q stages, or one (the block's first K/V tiles go ahead of its Q), with 16-bit K/V or with an
fp8 staging ring of one or two stages (two Q stages and one staging stage at head dim 128), and
the consumers' wait for their own P.V before each tile's softmax (after its mask) or, with ragged
K/V at head dim 128 (`late`), at the top of the next turn.
Checked:
  - no deadlock;
  - every parity wait passes on exactly the phase it means (a parity tells apart only neighbouring
    phases: a wait that could pass two phases late would be a hang or a wrong pass on the GPU);
  - a product reads a stage only after its data landed, and no stage is rewritten while a
    product in flight reads it;
  - no staging stage is overwritten before the producer widened what it held;
  - every consumer reads each block's own slot, and the end mark after the last;
  - every consumer reads each K tile's own verdict;
  - a turn barrier never holds two passes, and the turns balance at the end.
The model is kept next to the kernel by hand: change both together. Finally, the script checks
itself: each of a few seeded protocol bugs must be caught.

Usage: ws_prefill_protocol.py [sequences]   (exit status 1 on any failure)
"""
import collections
import random
import sys


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.done = count, count, 0

    def arrive(self, k=1):
        self.pending -= k
        assert self.pending >= 0, "more arrivals than the barrier counts"
        if self.pending == 0:
            self.done, self.pending = self.done + 1, self.count


Config = collections.namedtuple("Config", "q_stages fp8_stages late", defaults=[False])
CONFIGS = [Config(2, 0), Config(1, 0), Config(1, 1), Config(2, 2), Config(2, 1),
           Config(2, 0, True), Config(2, 1, True)]


class Kernel:
    """One CTA's walk over `blocks` (each block's number of K/V tiles). `bug` seeds a protocol bug
    for the self-check."""

    def __init__(self, blocks, config, seed, bug=None):
        self.blocks, self.cfg, self.rng, self.bug = blocks, config, random.Random(seed), bug
        qs, fs = config.q_stages, config.fp8_stages
        # Full: the producer's arrival (its bytes, or one per thread, as one); empty: lane 0 of
        # each of the 8 consumer warps.
        # Q full: the copies' arrival (one per thread, as one) and thread 0's after the slot.
        self.q_full, self.q_empty = [Barrier(2) for _ in range(qs)], [Barrier(8) for _ in range(qs)]
        # K full: the copies' arrival (one per thread, as one), and with 16-bit K/V (modelled as
        # paged) thread 0's after the stage's verdict.
        self.verdicts = not fs
        self.k_full = [Barrier(2 if self.verdicts else 1) for _ in range(2)]
        self.k_empty = [Barrier(8) for _ in range(2)]
        # The tile whose verdict each word holds (Sm90WsConfig::kTileFlags, twice the K stages).
        self.verdict = [None] * (2 if bug == "verdict ring too short" else 4)
        self.v_full, self.v_empty = [Barrier(1) for _ in range(2)], [Barrier(8) for _ in range(2)]
        self.staged = {"K": [Barrier(1) for _ in range(fs)], "V": [Barrier(1) for _ in range(fs)]}
        self.staging_use = {"K": [None] * fs, "V": [None] * fs}  # [use held, widened]
        self.turns = [0, 0]
        self.in_flight = [[], []]  # per warpgroup: the stages each product group reads
        self.copies = collections.deque()  # the producer's copies in flight, landing in order
        # Row-block slots (Sm90WsConfig::kBlockSlots, twice the Q stages): (block, its tiles), or
        # (block, None) for the end mark.
        self.slots = [None] * (qs if bug == "slot ring too short" else 2 * qs)
        self.producing = True

    # Waits for use n of a ring of `stages` stages: full, phase n // stages complete; empty, the
    # use before.
    def wait_full(self, bar, n, stages=2):
        while bar.done < n // stages + 1:
            yield
        assert bar.done == n // stages + 1, "a full wait passed a phase late"

    def wait_empty(self, bar, n, stages=2):
        while bar.done < n // stages:
            yield
        assert bar.done == n // stages, "an empty wait passed a phase late"

    def take_turn(self, wg):
        while self.turns[wg] == 0:
            yield
        self.turns[wg] -= 1

    def pass_turn(self, wg):
        self.turns[wg ^ 1] += 1
        assert self.turns[wg ^ 1] <= 1, "two passes pending on one turn barrier"

    def issue(self, wg, reads):
        """One product group; reads: the (kind, stage, use) it reads."""
        for kind, stage, use in reads:
            ring = {"Q": (self.q_full, self.cfg.q_stages), "K": (self.k_full, 2),
                    "V": (self.v_full, 2)}[kind]
            assert ring[0][stage].done >= use // ring[1] + 1, f"{kind} read before it landed"
        self.in_flight[wg].append(reads)

    def wait_group(self, wg, keep):
        del self.in_flight[wg][: max(0, len(self.in_flight[wg]) - keep)]

    def write(self, kind, stage):
        for groups in self.in_flight:
            for reads in groups:
                for k, s, _ in reads:
                    assert not (k == kind and s == stage), (
                        f"{kind} stage {stage} rewritten under a product in flight")

    def copy(self, kind, stage, bar):
        """An asynchronous copy into a stage, arriving on `bar` as it lands."""
        def land():
            self.write(kind, stage)
            bar.arrive()
        self.copies.append(land)

    def memory(self):
        while self.producing or self.copies:
            if self.copies:
                self.copies.popleft()()
            yield

    # --- the producer ------------------------------------------------------------------------
    def producer(self):
        cfg, tile_n = self.cfg, 0
        for b, tiles in enumerate(self.blocks):
            self.write_slot(b, tiles)
            if cfg.fp8_stages:
                yield from self.produce_fp8_block(b, tiles, tile_n)
            else:
                early = min(tiles, 2) if cfg.q_stages == 1 else 0  # Cfg::tiles_before_q
                for n in range(tile_n, tile_n + early):
                    yield from self.produce_tile(n)
                yield from self.produce_q(b)
                for n in range(tile_n + early, tile_n + tiles):
                    yield from self.produce_tile(n)
            tile_n += tiles
        self.write_slot(len(self.blocks), None)  # the end mark
        yield from self.produce_q(len(self.blocks))
        self.producing = False

    def write_slot(self, b, tiles):
        self.slots[b % len(self.slots)] = (b, tiles)

    def produce_q(self, b):
        qs = b % self.cfg.q_stages
        yield from self.wait_empty(self.q_empty[qs], b, self.cfg.q_stages)
        self.q_full[qs].arrive()  # thread 0, after the block's slot
        self.copy("Q", qs, self.q_full[qs])

    def produce_tile(self, n):  # produce_ragged_tiles / produce_paged_tiles
        yield from self.wait_empty(self.k_empty[n % 2], n)
        self.copy("K", n % 2, self.k_full[n % 2])
        if self.verdicts and self.bug == "verdict after the arrival":
            self.k_full[n % 2].arrive()
            yield
            self.verdict[n % len(self.verdict)] = n
        elif self.verdicts:  # thread 0: the verdict, then its arrival
            self.verdict[n % len(self.verdict)] = n
            self.k_full[n % 2].arrive()
        yield from self.wait_empty(self.v_empty[n % 2], n)
        self.copy("V", n % 2, self.v_full[n % 2])

    def produce_fp8_block(self, b, tiles, tile_n):
        stages = self.cfg.fp8_stages

        def stage_copy(kind, n):  # issue_k / issue_v: fp8 rows into staging stage n % stages
            s = n % stages
            held = self.staging_use[kind][s]
            assert held is None or held[1], f"staging {kind} stage {s} overwritten before widened"
            self.staging_use[kind][s] = [n, False]
            self.copies.append(lambda: self.staged[kind][s].arrive())

        def widen(n):
            s = n % stages
            for kind, empty, full in (("K", self.k_empty, self.k_full),
                                      ("V", self.v_empty, self.v_full)):
                yield from self.wait_full(self.staged[kind][s], n, stages)
                yield from self.wait_empty(empty[n % 2], n)
                assert self.staging_use[kind][s][0] == n, (
                    f"staging {kind} stage {s} holds tile {self.staging_use[kind][s][0]}, not {n}")
                self.staging_use[kind][s][1] = True
                self.write(kind, n % 2)  # the widened tile, written by the producer's threads
                full[n % 2].arrive()
                if n + stages < tile_n + tiles and self.bug != "staging reused early":
                    stage_copy(kind, n + stages)
                if self.bug == "staging reused early" and n + stages + 1 < tile_n + tiles:
                    stage_copy(kind, n + stages + 1)

        for n in range(tile_n, tile_n + min(tiles, stages)):
            stage_copy("K", n)
            stage_copy("V", n)
        early = min(tiles, 2) if self.cfg.q_stages == 1 else 0
        for n in range(tile_n, tile_n + early):
            yield from widen(n)
        yield from self.produce_q(b)
        for n in range(tile_n + early, tile_n + tiles):
            yield from widen(n)

    # --- the consumers -----------------------------------------------------------------------
    def read_verdict(self, n):
        if self.verdicts:
            held = self.verdict[n % len(self.verdict)]
            assert held == n, f"tile {n} read tile {held}'s verdict"

    def consumer(self, wg):
        blocks, cfg, bug = self.blocks, self.cfg, self.bug
        q_stages = cfg.q_stages
        if wg == 1:
            self.pass_turn(1)
        block_n = tile_n = 0
        while True:
            qs = block_n % q_stages
            yield from self.wait_full(self.q_full[qs], block_n, q_stages)
            slot_block, tiles = self.slots[block_n % len(self.slots)] or (None, None)
            assert slot_block == block_n, f"block {block_n} read block {slot_block}'s slot"
            if tiles is None:
                assert block_n == len(blocks), "an end mark before the last block"
                break
            assert tiles == blocks[block_n]
            if tiles > 0:
                yield from self.wait_full(self.k_full[tile_n % 2], tile_n)
                yield from self.take_turn(wg)
                self.issue(wg, [("Q", qs, block_n), ("K", tile_n % 2, tile_n)])
                self.pass_turn(wg)
                self.wait_group(wg, 0)
                self.k_empty[tile_n % 2].arrive(4)
                yield
                self.read_verdict(tile_n)  # the softmax of tile 0
                for n in range(tile_n + 1, tile_n + tiles):
                    if cfg.late:  # P_{t-2}.V_{t-2}, waited for at the top of the turn
                        self.wait_group(wg, 1 if bug == "late wait skipped" else 0)
                        if n - 1 > tile_n:
                            self.v_empty[(n - 2) % 2].arrive(4)
                    # K_t before the turn, V_{t-1} inside it, once S_t is issued.
                    yield from self.wait_full(self.k_full[n % 2], n)
                    yield from self.take_turn(wg)
                    self.issue(wg, [("Q", qs, block_n), ("K", n % 2, n)])
                    yield from self.wait_full(self.v_full[(n - 1) % 2], n - 1)
                    self.issue(wg, [("V", (n - 1) % 2, n - 1)])
                    self.pass_turn(wg)
                    self.wait_group(wg, 1)  # S_t
                    self.k_empty[n % 2].arrive(4)
                    if cfg.late:
                        yield  # the softmax
                    self.read_verdict(n)  # the mask
                    if not cfg.late:
                        # P_{t-1}.V_{t-1} before the softmax, whose exponentials go into P_t's
                        # fragments at once.
                        self.wait_group(wg, 0)
                        self.v_empty[(n - 1) % 2].arrive(4)
                        yield  # the softmax
                if cfg.late:
                    self.wait_group(wg, 0)
                    if tiles >= 2:
                        self.v_empty[(tile_n + tiles - 2) % 2].arrive(4)
                n = tile_n + tiles - 1
                yield from self.wait_full(self.v_full[n % 2], n)
                yield from self.take_turn(wg)
                self.issue(wg, [("V", n % 2, n)])
                self.pass_turn(wg)
                self.wait_group(wg, 1 if bug == "P.V left in flight" else 0)
                self.v_empty[n % 2].arrive(4)
            yield  # the epilogue
            self.q_empty[qs].arrive(4)
            block_n, tile_n = block_n + 1, tile_n + tiles
        if wg == 0:
            yield from self.take_turn(0)

    def run(self):
        actors = [self.producer(), self.consumer(0), self.consumer(1), self.memory()]
        alive, steps = [0, 1, 2, 3], 0
        while alive:
            i = self.rng.choice(alive)
            try:
                next(actors[i])
            except StopIteration:
                alive.remove(i)
            steps += 1
            assert steps < 200000, "deadlock"
        assert self.turns == [0, 0], "the turns do not balance"


def failures(sequences, bug=None):
    """Runs `sequences` random block sequences on every configuration; returns the first failure."""
    for seed in range(sequences):
        r = random.Random(seed)
        blocks = [r.choice([0, 0, 1, 1, 2, 3, 5, 9]) for _ in range(r.randint(0, 10))]
        for config in CONFIGS:
            try:
                Kernel(blocks, config, seed, bug).run()
            except AssertionError as e:
                return f"{config}, blocks {blocks}: {e}"
    return None


def main():
    sequences = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    failure = failures(sequences)
    print(f"{len(CONFIGS) * sequences} walks:", failure or "no failure")
    ok = failure is None
    for bug in ("P.V left in flight", "staging reused early", "slot ring too short",
                "verdict after the arrival", "verdict ring too short", "late wait skipped"):
        caught = failures(sequences, bug)
        print(f"seeded bug '{bug}':", f"caught ({caught})" if caught else "NOT caught")
        ok &= caught is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
