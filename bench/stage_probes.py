#!/usr/bin/env python3
"""Writes copies of the flashkv tree whose Hopper prefill consumer (kernels/cuda/prefill/
sm90_ws_consumer.cuh) leaves one stage of the steady tile out, to be timed against the tree
itself with bench/compare_builds.py: what a stage costs is the time it takes away. The probes
compute wrong results; they exist to be timed.

  nosoftmax  P = S times the logit scale: no row maximum, exponentials, sums or O rescale
  nomask     no per-element mask (the test that decides it still runs)
  nostore    no epilogue store of the block's output
  nopv       no P.V products (half the tile's products); V is still loaded

Usage:
  python3 bench/stage_probes.py OUTDIR [PROBE ...]      # default: every probe
  python3 bench/compare_builds.py run --variant base=. --variant nopv=OUTDIR/nopv ... \\
      --op prefill --op extend --cmake-arg=-DFLASHKV_HEAD_DIMS=64;128;256

Each edit is a literal replacement that must match exactly once: when the consumer changes so
that one no longer matches, the script stops and names it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSUMER = "kernels/cuda/prefill/sm90_ws_consumer.cuh"
# A condition the compiler cannot fold that never holds at run time: the code it guards stays in
# the kernel (registers and scheduling as before) but does not run.
NEVER = "p.num_qo_heads < 0"

PROBES: dict[str, list[tuple[str, str]]] = {
    "nosoftmax": [("return softmax.update_scores(s, c_blk, corr);",
                   "(void)corr;\n#pragma unroll\n"
                   "for (int i = 0; i < kNTiles * 4; ++i) s_acc[i] *= c_blk;\nreturn false;")],
    "nomask": [("if (!full) apply_mask", f"if (!full && {NEVER}) apply_mask")],
    "nostore": [("    if (staged)\n      store_block_staged",
                 f"    if ({NEVER} && staged)\n      store_block_staged"),
                ("    else\n      store_block<Cfg>", f"    else if ({NEVER})\n      store_block<Cfg>")],
    "nopv": [("for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)\n#pragma unroll\n          for (int part",
              f"for (int kk = 0; kk < ({NEVER} ? Cfg::kKvTile / 16 : 0); ++kk)\n#pragma unroll\n"
              "          for (int part")],
}


def patched(text: str, probe: str) -> str:
    for old, new in PROBES[probe]:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"stage_probes: {probe}: expected one match of {old!r} in {CONSUMER}, "
                             f"found {count}")
        text = text.replace(old, new)
    return text


def source_files(root: Path) -> list[str]:
    """The tree's files: git's list where there is one, else every file outside build trees and
    hidden directories (a copy of the tree without its history)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(root)) for p in root.rglob("*")
                if p.is_file() and not any(part.startswith((".", "build"))
                                           for part in p.relative_to(root).parts)]


def write(out: Path, probes: list[str], root: Path = ROOT) -> list[Path]:
    consumer = (root / CONSUMER).read_text()
    texts = {probe: patched(consumer, probe) for probe in probes}  # all match, or none written
    files = source_files(root)
    trees = []
    for probe in probes:
        dest = out / probe
        shutil.rmtree(dest, ignore_errors=True)
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
        (dest / CONSUMER).write_text(texts[probe])
        trees.append(dest)
    return trees


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    probes = argv[1:] or list(PROBES)
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
