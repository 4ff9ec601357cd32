#!/usr/bin/env python3
"""Summarises ncu's per-instruction source page (`ncu -i REPORT --page source --csv --print-source
sass`, plain or gzipped) of one or more kernels: per kernel, the warp instructions executed, the
stall samples and their reasons, then the same by opcode, by stretches of the SASS named on the
command line, and how often each mbarrier wait's retry loop ran (a wait that retries many times
spins, taking issue slots from the warps that share its scheduler).

Addresses are offsets from the kernel's first instruction, as `cuobjdump -sass` prints them, so
stretches can be read off a local disassembly of the same build.

Usage:
  python3 bench/ncu_source.py SRC.csv[.gz] [--kernel TEXT] [--top N]
      [--region NAME=LO-HI ...]     # hex offsets, LO inclusive, HI exclusive
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instr:
    offset: int
    source: str
    samples: int
    executed: int
    stalls: Dict[str, int]

    @property
    def opcode(self) -> str:
        text = self.source.strip()
        if text.startswith("@"):  # a guard predicate
            text = text.split(None, 1)[1] if " " in text else ""
        return text.split(" ", 1)[0].split(".", 1)[0] if text else "?"


@dataclass
class Kernel:
    name: str
    base: int = 0  # the address of its first instruction
    instrs: List[Instr] = field(default_factory=list)


def _int(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(text) if text and text != "-" else 0


def read(lines: Iterable[str]) -> List[Kernel]:
    """The kernels of a source-page CSV: each a "Kernel Name" row, a header row, instruction rows."""
    kernels: List[Kernel] = []
    header: List[str] = []
    base = None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1] if len(row) > 1 else ""))
            header, base = [], None
        elif row[0] == "Address":
            header = row
        elif header and kernels and len(row) >= len(header):
            col = dict(zip(header, row))
            address = int(col["Address"], 16)
            if base is None:
                base = kernels[-1].base = address
            stalls = {h[len("stall_"):]: _int(col[h]) for h in header
                      if h.startswith("stall_") and "(Not Issued)" not in h}
            kernels[-1].instrs.append(Instr(address - base, col["Source"], _int(col[SAMPLES]),
                                            _int(col.get(EXECUTED, "0")), stalls))
    return kernels


def _reasons(instrs: List[Instr], most: int) -> str:
    total = sum(i.samples for i in instrs)
    agg: collections.Counter = collections.Counter()
    for i in instrs:
        agg.update(i.stalls)
    return ", ".join(f"{k} {v / total * 100:.0f}%" for k, v in agg.most_common(most) if v) if total else ""


def _branch_target(instr: Instr, base: int):
    """The offset a `BRA` jumps to, or None."""
    if instr.opcode != "BRA":
        return None
    for word in instr.source.replace(",", " ").split():
        if word.startswith("0x"):
            return int(word, 16) - base
    return None


def retries(kernel: Kernel) -> List[Tuple[Instr, int]]:
    """The mbarrier waits (`TRYWAIT`) that sit in a retry loop (within the next four instructions a
    branch back to them, or to the `YIELD` or `NANOSLEEP` just before them), with how often the
    loop ran: each run is a retry of a wait that did not pass at once. Most retried first."""
    out = []
    instrs = kernel.instrs
    for k, i in enumerate(instrs):
        if "TRYWAIT" not in i.source or i.executed == 0:
            continue
        for nxt in instrs[k + 1:k + 5]:
            target = _branch_target(nxt, kernel.base)
            if target is not None and i.offset - 32 <= target <= i.offset:
                out.append((i, i.executed))
                break
    return sorted(out, key=lambda r: -r[1])


def summary(kernels: List[Kernel], regions: List[Tuple[str, int, int]], top: int) -> List[str]:
    out: List[str] = []
    for k in kernels:
        total = sum(i.samples for i in k.instrs)
        executed = sum(i.executed for i in k.instrs)
        out.append(f"{k.name}")
        out.append(f"  {executed} warp instructions, {total} samples: {_reasons(k.instrs, 8)}")
        ops: Dict[str, List[Instr]] = collections.defaultdict(list)
        for i in k.instrs:
            ops[i.opcode].append(i)
        ranked = sorted(ops.items(), key=lambda kv: -sum(i.samples for i in kv[1]))
        for op, instrs in ranked[:top]:
            s = sum(i.samples for i in instrs)
            out.append(f"  {op:12s} {s / max(total, 1) * 100:5.1f}% of samples, "
                       f"{sum(i.executed for i in instrs):11d} executed: {_reasons(instrs, 3)}")
        for name, lo, hi in regions:
            instrs = [i for i in k.instrs if lo <= i.offset < hi]
            s = sum(i.samples for i in instrs)
            out.append(f"  [{name}] {lo:x}-{hi:x}: {s / max(total, 1) * 100:5.1f}% of samples, "
                       f"{sum(i.executed for i in instrs)} executed: {_reasons(instrs, 4)}")
        for wait, runs in retries(k)[:top]:
            out.append(f"  retry loop at {wait.offset:x}: {runs} runs ({wait.source.strip()})")
    return out


def parse_region(text: str) -> Tuple[str, int, int]:
    name, span = text.split("=", 1)
    lo, hi = span.split("-", 1)
    return name, int(lo, 16), int(hi, 16)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu's source page as CSV, or .csv.gz")
    ap.add_argument("--kernel", default="", help="only kernels whose name holds this text")
    ap.add_argument("--region", action="append", default=[], type=parse_region,
                    help="NAME=LO-HI, hex offsets from the kernel's first instruction")
    ap.add_argument("--top", type=int, default=16, help="opcodes and retried waits to list")
    args = ap.parse_args(argv)
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt", newline="") as f:
        kernels = [k for k in read(f) if args.kernel in k.name]
    if not kernels:
        print(f"ncu_source: no kernel in {args.csv}" + (f" holds '{args.kernel}'" if args.kernel else ""),
              file=sys.stderr)
        return 1
    print("\n".join(summary(kernels, args.region, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
