#!/usr/bin/env python3
"""Times builds of flashkv against each other: each variant (a source tree) is built on its own,
then `flashkv bench` runs every variant in turn, round after round, so that a clock or a
neighbour's load that drifts during the run weighs on all of them alike. Per case it prints the
first variant's median time, TFLOP/s and fraction of the roofline, and for each other variant the
median over the rounds of its time over the first one's in the same round (below 1: faster),
with the smallest and largest round's ratio: the spread to read a change against.

A variant is NAME=SRC, SRC one of: a directory holding a flashkv tree (`.` is the working tree),
a .tar or .tar.gz of one (what `pack` writes: the GPU machine has the tree but no git history),
or git:REV (a revision of the repository this script is in; needs git).

Usage:
  python3 bench/compare_builds.py pack REV OUT.tar.gz
  python3 bench/compare_builds.py run --variant main=main.tar.gz --variant new=. \\
      [--op prefill --op extend] [--rounds 4] [--device cuda] [--grid full] [--work DIR] \\
      [--jobs N] [--cmake-arg=-DFLASHKV_HEAD_DIMS=64;128;256]
  python3 bench/compare_builds.py summary DIR NAME [NAME ...]   # the table of a run's CSVs

`run` writes each round's CSVs to DIR/csv/r<round>_<name>_<op>.csv (DIR: --work) and prints the
table of `summary`. Method and the measurements made with it: docs/perf/README.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CSV columns `flashkv bench` measures; the others name the case.
MEASURED = {"us", "gbps", "tflops", "roofline_fraction", "sustained_fraction", "runs", "vs_twin",
            "vs_twin_min", "vs_twin_max", "rounds"}
CSV_NAME = re.compile(r"r(\d+)_(.+)_([a-z]+)\.csv$")


def read_rounds(csv_dir: Path, names: list[str]) -> tuple[list[tuple], dict]:
    """Cases in order of first appearance, and {(name, round): {case: (us, tflops, roof)}}."""
    order: list[tuple] = []
    data: dict = {}
    for path in sorted(csv_dir.glob("r*_*.csv")):
        m = CSV_NAME.match(path.name)
        if not m or m.group(2) not in names:
            continue
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                key = tuple((k, v) for k, v in row.items() if k not in MEASURED)
                if key not in order:
                    order.append(key)
                data.setdefault((m.group(2), int(m.group(1))), {})[key] = (
                    float(row["us"]), float(row["tflops"] or 0), float(row["roofline_fraction"] or 0))
    return order, data


def case_label(key: tuple) -> str:
    c = dict(key)
    label = (f"{c.get('op', '?')} {c.get('batch', '?')}x{c.get('qo_len', '?')}"
             f" kv{c.get('kv_len', '?')} {c.get('num_qo_heads')}/{c.get('num_kv_heads')}/"
             f"{c.get('head_dim')} ps{c.get('page_size')} {c.get('dtype')}/{c.get('kv_dtype')}")
    for flag, text in (("one_paged_pass", "1pass"), ("mask", None)):
        v = c.get(flag, "")
        if v and v != "0":
            label += " " + (text or v)
    return label


def summary(csv_dir: Path, names: list[str]) -> list[str]:
    """The table: the first variant's median us / TFLOP/s / roof, then each other variant's median
    time ratio to it (same round), its smallest and largest round, and its median TFLOP/s."""
    order, data = read_rounds(csv_dir, names)
    rounds = sorted({r for (_, r) in data})
    lines = [f"rounds: {rounds}; time against {names[0]} in the same round (below 1: faster)",
             f"{'case':58s} {names[0]:>9s} {'TF/s':>6s} {'roof':>6s}"
             + "".join(f" {n:>26s}" for n in names[1:])]
    for key in order:
        base = {r: data[(names[0], r)][key] for r in rounds if key in data.get((names[0], r), {})}
        if not base:
            continue
        line = (f"{case_label(key)[:58]:58s} {statistics.median(b[0] for b in base.values()):9.1f}"
                f" {statistics.median(b[1] for b in base.values()):6.1f}"
                f" {statistics.median(b[2] for b in base.values()):6.3f}")
        for name in names[1:]:
            mine = {r: data[(name, r)][key] for r in rounds if key in data.get((name, r), {})}
            ratios = [mine[r][0] / base[r][0] for r in mine if r in base and base[r][0] > 0]
            if not ratios:
                line += f" {'-':>26s}"
                continue
            line += (f" {statistics.median(ratios):6.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
                     f" {statistics.median(m[1] for m in mine.values()):5.0f}")
        lines.append(line)
    return lines


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, src = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", name) or not src:
        raise argparse.ArgumentTypeError(
            f"expected NAME=SRC (NAME: letters, digits, '.', '-'), got '{text}'")
    return name, src


def materialize(name: str, src: str, work: Path) -> Path:
    """The variant's source tree: SRC itself if a directory, else extracted under WORK."""
    if os.path.isdir(src):
        return Path(src).resolve()
    dest = work / f"src_{name}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if src.startswith("git:"):
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", src[4:]],
                                 check=True, capture_output=True).stdout
        tar = dest.parent / f"src_{name}.tar"
        tar.write_bytes(archive)
        src = str(tar)
    if not os.path.isfile(src) or not tarfile.is_tarfile(src):
        raise SystemExit(f"compare_builds: {name}: '{src}' is not a directory, a tar file or git:REV")
    with tarfile.open(src) as t:
        try:
            t.extractall(dest, filter="data")
        except TypeError:  # Python before 3.12 (and its backports) has no filter
            t.extractall(dest)
    return dest


def build(name: str, tree: Path, work: Path, jobs: int, cmake_args: list[str]) -> subprocess.Popen:
    out = work / f"build_{name}"
    script = (f"cmake -S '{tree}' -B '{out}' -G Ninja -DCMAKE_BUILD_TYPE=Release "
              f"-DFLASHKV_BUILD_TESTS=OFF -DFLASHKV_BUILD_PYTHON=OFF "
              + " ".join(f"'{a}'" for a in cmake_args)
              + f" && cmake --build '{out}' -j {jobs} --target flashkv_cli")
    with open(work / f"build_{name}.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT)


def cmd_run(args: argparse.Namespace) -> int:
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names) or len(names) < 2:
        print("compare_builds: expected two or more variants with distinct names", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    (work / "csv").mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or max(1, (os.cpu_count() or 2) // len(names))
    builds = {n: build(n, materialize(n, s, work), work, jobs, args.cmake_arg)
              for n, s in args.variant}
    failed = [n for n, p in builds.items() if p.wait() != 0]
    if failed:
        for n in failed:
            print(f"compare_builds: {n} did not build; the end of {work}/build_{n}.log:",
                  file=sys.stderr)
            print("".join(open(work / f"build_{n}.log").readlines()[-20:]), file=sys.stderr)
        return 1
    ops = args.op or ["prefill", "extend"]
    for r in range(1, args.rounds + 1):
        for n in names:
            for op in ops:
                out = work / "csv" / f"r{r}_{n}_{op}.csv"
                cmd = [str(work / f"build_{n}" / "flashkv"), "bench", "--device", args.device,
                       "--grid", args.grid, "--op", op, "--csv", str(out)]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"compare_builds: {' '.join(cmd)} failed:\n{res.stderr[-2000:]}",
                          file=sys.stderr)
                    return 1
        print(f"round {r} of {args.rounds} done", flush=True)
    print("\n".join(summary(work / "csv", names)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write a revision's tree as a .tar.gz (git archive)")
    p.add_argument("rev")
    p.add_argument("out")
    r = sub.add_parser("run", help="build the variants, time them in alternating rounds")
    r.add_argument("--variant", type=parse_variant, action="append", required=True,
                   help="NAME=SRC (a directory, a .tar[.gz] or git:REV); the first is the baseline")
    r.add_argument("--op", action="append", choices=["decode", "prefill", "extend", "verify"],
                   help="operators to time (default: prefill and extend)")
    r.add_argument("--rounds", type=int, default=4)
    r.add_argument("--device", default="cuda")
    r.add_argument("--grid", default="full", choices=["quick", "full"])
    r.add_argument("--work", default="build-compare", help="builds, sources and CSVs go here")
    r.add_argument("--jobs", type=int, default=0, help="build jobs a variant (default: cores / variants)")
    r.add_argument("--cmake-arg", action="append", default=[],
                   help="a configure option for every variant, e.g. -DFLASHKV_HEAD_DIMS=64;128")
    s = sub.add_parser("summary", help="the table of a run's CSVs")
    s.add_argument("dir")
    s.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "pack":
        with open(args.out, "wb") as f:
            subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar.gz", args.rev],
                           stdout=f, check=True)
        return 0
    if args.command == "summary":
        csv_dir = Path(args.dir)
        if (csv_dir / "csv").is_dir():
            csv_dir = csv_dir / "csv"
        print("\n".join(summary(csv_dir, args.names)))
        return 0
    if args.rounds < 1:
        parser.error("--rounds: expected >= 1")
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
