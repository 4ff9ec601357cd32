#!/usr/bin/env python3
"""A model of how the warp-specialized Hopper prefill kernel's warpgroups hand stages to each other
(kernels/cuda/prefill/sm90_ws_producer.cuh: `produce` for 16-bit ragged K/V with two Q stages;
sm90_ws_consumer.cuh: `consume` with and without kOverlap), checked over random row-block sequences and random
interleavings of the three warpgroups.

The producer and the two consumer warpgroups are generators that yield where they wait. Modelled:
the mbarriers (arrival counts, completed phases, waits on a phase's parity as the kernel issues
them: full barriers for use n of a two-stage ring on phase n / 2, empty barriers on the one
before), the two turn barriers (one bar.arrive by the warpgroup passing, one bar.sync by the one
taking), and each warpgroup's products in flight (wgmma groups, retired oldest first by
wait_group). Checked:
  - no deadlock;
  - every parity wait passes on exactly the phase it means (a parity tells apart only neighbouring
    phases: a wait that could pass two phases late would be a hang or a wrong pass on the GPU);
  - a real product reads a stage only after its data landed, and no stage is rewritten while a
    real product in flight reads it (the dummy S_0 of kOverlap reads a stage it never uses);
  - a turn barrier never holds two passes, and the turns balance at the end.
The model is kept next to the kernel by hand: change both together. Finally, the script checks
itself: each of a few seeded protocol bugs must be caught.

Usage: ws_prefill_protocol.py [sequences]   (exit status 1 on any failure)
"""
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


class Kernel:
    """One CTA's walk over `blocks` (each block's number of K/V tiles). `bug` seeds a protocol bug
    for the self-check."""

    def __init__(self, blocks, overlap, seed, bug=None):
        self.blocks, self.overlap, self.rng, self.bug = blocks, overlap, random.Random(seed), bug
        full = lambda: [Barrier(1) for _ in range(2)]  # the producer's one arrival (and its bytes)
        empty = lambda: [Barrier(8) for _ in range(2)]  # lane 0 of each of the 8 consumer warps
        self.q_full, self.q_empty = full(), empty()
        self.k_full, self.k_empty = full(), empty()
        self.v_full, self.v_empty = full(), empty()
        self.turns = [0, 0]
        self.in_flight = [[], []]  # per warpgroup: the stages each product group reads

    # Waits for use n of a two-stage ring: full, phase n // 2 complete; empty, the use before.
    def wait_full(self, bar, n):
        while bar.done < n // 2 + 1:
            yield
        assert bar.done == n // 2 + 1, "a full wait passed a phase late"

    def wait_empty(self, bar, n):
        while bar.done < n // 2:
            yield
        assert bar.done == n // 2, "an empty wait passed a phase late"

    def take_turn(self, wg):
        while self.turns[wg] == 0:
            yield
        self.turns[wg] -= 1

    def pass_turn(self, wg):
        self.turns[wg ^ 1] += 1
        assert self.turns[wg ^ 1] <= 1, "two passes pending on one turn barrier"

    def issue(self, wg, reads):
        """One product group; reads: (kind, stage, use) for a real read, (kind, stage, None) for
        the dummy's."""
        rings = {"Q": self.q_full, "K": self.k_full, "V": self.v_full}
        for kind, stage, use in reads:
            if use is not None:
                assert rings[kind][stage].done >= use // 2 + 1, f"{kind} read before it landed"
        self.in_flight[wg].append(reads)

    def wait_group(self, wg, keep):
        del self.in_flight[wg][: max(0, len(self.in_flight[wg]) - keep)]

    def write(self, kind, stage):
        for groups in self.in_flight:
            for reads in groups:
                for k, s, use in reads:
                    assert not (k == kind and s == stage and use is not None), (
                        f"{kind} stage {stage} rewritten under a product in flight")

    def producer(self):
        tile_n = 0
        for b, tiles in enumerate(self.blocks):
            yield from self.wait_empty(self.q_empty[b % 2], b)
            self.write("Q", b % 2)
            self.q_full[b % 2].arrive()
            for n in range(tile_n, tile_n + tiles):
                yield from self.wait_empty(self.k_empty[n % 2], n)
                self.write("K", n % 2)
                self.k_full[n % 2].arrive()
                yield from self.wait_empty(self.v_empty[n % 2], n)
                self.write("V", n % 2)
                self.v_full[n % 2].arrive()
            tile_n += tiles

    def consumer(self, wg):
        blocks, overlap, bug = self.blocks, self.overlap, self.bug

        def s0_reads(real, block_n, n, own):  # consume's s0_operands
            if not real:
                return [("Q", own, None)]
            yield from self.wait_full(self.q_full[block_n % 2], block_n)
            yield from self.wait_full(self.k_full[n % 2], n)
            return [("Q", block_n % 2, block_n), ("K", n % 2, n)]

        if wg == 1:
            self.pass_turn(1)
        block_n = tile_n = 0
        if overlap:
            reads = yield from s0_reads(len(blocks) > 0 and blocks[0] > 0, 0, 0, 0)
            yield from self.take_turn(wg)
            self.issue(wg, reads)
            self.pass_turn(wg)
        for b, tiles in enumerate(blocks):
            if overlap and bug != "no wait at the block's start":
                self.wait_group(wg, 0)
            qs = block_n % 2
            yield from self.wait_full(self.q_full[qs], block_n)
            next_tiles = blocks[b + 1] if b + 1 < len(blocks) else -1
            if tiles > 0:
                if not overlap:
                    yield from self.take_turn(wg)
                    yield from self.wait_full(self.k_full[tile_n % 2], tile_n)
                    self.issue(wg, [("Q", qs, block_n), ("K", tile_n % 2, tile_n)])
                    self.pass_turn(wg)
                    self.wait_group(wg, 0)
                self.k_empty[tile_n % 2].arrive(4)
                for n in range(tile_n + 1, tile_n + tiles):
                    yield from self.wait_full(self.v_full[(n - 1) % 2], n - 1)
                    yield from self.take_turn(wg)
                    yield from self.wait_full(self.k_full[n % 2], n)
                    self.issue(wg, [("Q", qs, block_n), ("K", n % 2, n)])
                    self.issue(wg, [("V", (n - 1) % 2, n - 1)])
                    self.pass_turn(wg)
                    self.wait_group(wg, 1)  # S_t
                    self.k_empty[n % 2].arrive(4)
                    yield  # the softmax
                    self.wait_group(wg, 0)  # P_{t-1}.V_{t-1}
                    self.v_empty[(n - 1) % 2].arrive(4)
                n = tile_n + tiles - 1
                yield from self.wait_full(self.v_full[n % 2], n)
                if overlap:
                    ahead = n + 2 if bug == "the next S_0 on the wrong tile" else n + 1
                    reads = yield from s0_reads(next_tiles > 0, block_n + 1, ahead, qs)
                yield from self.take_turn(wg)
                self.issue(wg, [("V", n % 2, n)])
                if overlap:
                    self.issue(wg, reads)
                self.pass_turn(wg)
                keep = 1 if overlap else 0
                self.wait_group(wg, keep + (bug == "P.V left in flight"))
                self.v_empty[n % 2].arrive(4)
            elif overlap:
                reads = yield from s0_reads(next_tiles > 0, block_n + 1, tile_n, qs)
                yield from self.take_turn(wg)
                self.issue(wg, reads)
                self.pass_turn(wg)
            yield  # the epilogue
            self.q_empty[qs].arrive(4)
            block_n, tile_n = block_n + 1, tile_n + tiles
        if overlap:
            self.wait_group(wg, 0)
        if wg == 0:
            yield from self.take_turn(0)

    def run(self):
        actors = [self.producer(), self.consumer(0), self.consumer(1)]
        alive, steps = [0, 1, 2], 0
        while alive:
            i = self.rng.choice(alive)
            try:
                next(actors[i])
            except StopIteration:
                alive.remove(i)
            steps += 1
            assert steps < 100000, "deadlock"
        assert self.turns == [0, 0], "the turns do not balance"


def failures(sequences, bug=None):
    """Runs `sequences` random block sequences on both consumers; returns the first failure."""
    for seed in range(sequences):
        r = random.Random(seed)
        blocks = [r.choice([0, 0, 1, 1, 2, 3, 5, 9]) for _ in range(r.randint(0, 7))]
        for overlap in (False, True):
            try:
                Kernel(blocks, overlap, seed, bug).run()
            except AssertionError as e:
                return f"{'kOverlap' if overlap else 'default'} consumer, blocks {blocks}: {e}"
    return None


def main():
    sequences = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    failure = failures(sequences)
    print(f"{2 * sequences} walks:", failure or "no failure")
    ok = failure is None
    for bug in ("no wait at the block's start", "the next S_0 on the wrong tile",
                "P.V left in flight"):
        caught = failures(sequences, bug)
        print(f"seeded bug '{bug}':", f"caught ({caught})" if caught else "NOT caught")
        ok &= caught is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
