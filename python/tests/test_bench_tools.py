"""bench/compare_builds.py (builds timed against each other in alternating rounds) and
bench/stage_probes.py (the Hopper consumer with one stage of the steady tile left out, or with a
per-tile timeline) and bench/ncu_source.py (ncu's per-instruction source page summarised): the
parts that run without a GPU. The summary's ratios are per round, the sources a variant names
are found, every probe's edit still matches the kernel (the script refuses otherwise), the
timeline's phases are the differences of its points, and the source page's kernels, opcodes,
stretches and mbarrier retry loops are read as ncu writes them."""

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def load(name):
    spec = importlib.util.spec_from_file_location(f"flashkv_bench_{name}",
                                                  os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


FIELDS = ["op", "device", "batch", "qo_len", "kv_len", "prefix_len", "num_qo_heads",
          "num_kv_heads", "head_dim", "page_size", "kv_layout", "dtype", "kv_dtype", "us", "gbps",
          "tflops", "roofline_fraction", "sustained_fraction", "runs", "cuda_graph", "window_left",
          "logit_cap", "sinks", "one_paged_pass", "mask", "env", "vs_twin", "vs_twin_min",
          "vs_twin_max", "rounds"]


def write_csv(path, rows):
    """rows: (batch, us, runs); everything else fixed. `runs` is measured: not part of the case."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for batch, us, runs in rows:
            w.writerow({"op": "prefill", "device": "cuda:0", "batch": batch, "qo_len": 4096,
                        "kv_len": 4096, "prefix_len": 0, "num_qo_heads": 32, "num_kv_heads": 8,
                        "head_dim": 128, "page_size": 1, "kv_layout": "none", "dtype": "bf16",
                        "kv_dtype": "bf16", "us": us, "gbps": 1.0, "tflops": 1000.0 / us,
                        "roofline_fraction": 0.5, "runs": runs, "cuda_graph": 1,
                        "window_left": -1, "logit_cap": 0, "sinks": 0, "one_paged_pass": 0,
                        "mask": "causal"})


def test_summary_takes_each_round_against_its_own_baseline(tmp_path):
    cb = load("compare_builds")
    # Round 2 runs everything 10% slower: per-round ratios cancel that, a ratio of medians would not.
    write_csv(tmp_path / "r1_main_prefill.csv", [(1, 100.0, 50), (4, 200.0, 50)])
    write_csv(tmp_path / "r1_new_prefill.csv", [(1, 90.0, 55), (4, 210.0, 40)])
    write_csv(tmp_path / "r2_main_prefill.csv", [(1, 110.0, 45), (4, 220.0, 45)])
    write_csv(tmp_path / "r2_new_prefill.csv", [(1, 99.0, 51), (4, 220.0, 47)])
    write_csv(tmp_path / "r1_other_prefill.csv", [(1, 1.0, 1)])  # not asked for: ignored
    lines = cb.summary(tmp_path, ["main", "new"])
    assert lines[0].startswith("rounds: [1, 2]")
    rows = lines[2:]
    assert len(rows) == 2, lines  # `runs` differs between files: still one case each
    assert rows[0].split()[:2] == ["prefill", "1x4096"]
    assert "105.0" in rows[0] and "0.900 (0.900..0.900)" in rows[0]
    assert "1.025 (1.000..1.050)" in rows[1]


def test_variants_are_named_sources(tmp_path):
    cb = load("compare_builds")
    assert cb.parse_variant("main=build/x.tar.gz") == ("main", "build/x.tar.gz")
    assert cb.parse_variant("a.b-c=git:HEAD~1") == ("a.b-c", "git:HEAD~1")
    for bad in ("main", "=x", "main=", "a/b=x"):
        with pytest.raises(Exception, match="NAME=SRC"):
            cb.parse_variant(bad)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    assert cb.materialize("here", str(tree), tmp_path / "work") == tree.resolve()
    packed = tmp_path / "tree.tar.gz"
    with tarfile.open(packed, "w:gz") as t:
        t.add(tree / "CMakeLists.txt", arcname="CMakeLists.txt")
    got = cb.materialize("packed", str(packed), tmp_path / "work")
    assert (got / "CMakeLists.txt").read_text() == "project(x)\n"
    with pytest.raises(SystemExit, match="not a directory, a tar file or git:REV"):
        cb.materialize("nothing", str(tmp_path / "missing.tgz"), tmp_path / "work")


def test_run_refuses_a_single_variant(capsys):
    assert load("compare_builds").main(["run", "--variant", "a=."]) == 2
    assert "two or more variants" in capsys.readouterr().err


def kernel_sources(sp):
    return {path: open(os.path.join(BENCH, "..", path)).read() for path in sp.FILES}


def test_every_probe_matches_the_kernel():
    sp = load("stage_probes")
    sources = kernel_sources(sp)
    for probe in sp.PROBES:
        edited = sp.patched(sources, probe)
        assert edited and all(text != sources[path] for path, text in edited.items())
        for path, old, new in sp.PROBES[probe]:
            assert old not in edited[path].replace(new, "")
    assert set(sp.patched(sources, "timeline")) == {sp.CONSUMER, sp.LAUNCH}
    assert set(sp.patched(sources, "blocks")) == set(sp.FILES)
    assert set(sp.patched(sources, "ctas")) == {sp.CONSUMER, sp.LAUNCH}


def test_a_probe_that_no_longer_matches_stops_the_script():
    sp = load("stage_probes")
    with pytest.raises(SystemExit, match="nopv: expected one match"):
        sp.patched({sp.CONSUMER: "// a consumer without the P.V loop\n"}, "nopv")


def test_probe_trees_differ_from_the_tree_in_the_probes_files_only(tmp_path):
    sp = load("stage_probes")
    root = tmp_path / "root"
    sources = kernel_sources(sp)
    (root / os.path.dirname(sp.CONSUMER)).mkdir(parents=True)
    for path, text in sources.items():
        (root / path).write_text(text)
    (root / "CMakeLists.txt").write_text("project(x)\n")
    (root / "build").mkdir()
    (root / "build" / "big.o").write_text("not copied")
    trees = sp.write(tmp_path / "out", ["nomask", "nostore", "timeline", "blocks"], root=root)
    assert [t.name for t in trees] == ["nomask", "nostore", "timeline", "blocks"]
    for t in trees:
        assert (t / "CMakeLists.txt").read_text() == "project(x)\n"
        assert not (t / "build").exists()
        edited = sp.patched(sources, t.name)
        for path, text in sources.items():
            assert (t / path).read_text() == edited.get(path, text)
    assert sp.main([str(tmp_path / "out"), "nosuch"]) == 2


def test_a_copy_in_an_ignored_folder_of_a_work_tree_is_listed_from_its_files(tmp_path):
    sp = load("stage_probes")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/copy/\n")
    root = tmp_path / "copy"
    (root / "kernels").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("project(x)\n")
    (root / "kernels" / "a.cuh").write_text("// a\n")
    (root / "build").mkdir()
    (root / "build" / "big.o").write_text("not listed")
    assert sorted(sp.source_files(root)) == ["CMakeLists.txt", os.path.join("kernels", "a.cuh")]


def test_timeline_summary_takes_each_phase_and_the_period_within_a_block(tmp_path, capsys):
    sp = load("stage_probes")
    lines = ["noise\n"]
    # Warpgroup 0: two tiles of block 0 (a period of 1000), one of block 1 five periods after the
    # last of block 0; the clock wraps in block 0's second tile. Each phase is 10 * its point's
    # index, but "softmax", 300.
    starts = [(0, 1, 2**32 - 1300), (0, 2, 2**32 - 300), (1, 1, 4700)]
    for block, tile, t0 in starts:
        points = [t0]
        for k in range(1, 9):
            points.append(points[-1] + (300 if sp.POINTS[k] == "softmax" else 10 * k))
        clk = " ".join(str(p % 2**32) for p in points)
        lines.append(f"TIMELINE D=128 paged=0 fp8=0 wg=0 block={block} tile={tile} clk= {clk}\n")
    out = sp.summary(lines)
    assert len(out) == 1 and out[0].startswith("D=128 paged=0 fp8=0 wg=0 tiles=3:")
    assert ("late finish 10 K ready 20 turn 30 V ready 40 issued 50 S ready 60 "
            "early finish 70") in out[0]
    assert out[0].endswith("softmax 300 period 1000 boundary 5000 (5.0 periods)")
    path = tmp_path / "timeline.txt"
    path.write_text("".join(lines))
    assert sp.main(["--summary", str(path)]) == 0
    assert capsys.readouterr().out.strip() == out[0]
    assert sp.main(["--summary"]) == 2


def test_blocks_summary_takes_each_block_phase_and_the_q_copies_landing():
    sp = load("stage_probes")
    lines = [
        "BLOCKS D=256 paged=0 fp8=0 wg=0 block=0 tiles=3 clk= 0 100 300 2300 2800\n",
        "BLOCKS D=256 paged=0 fp8=0 wg=0 block=1 tiles=1 clk= 2900 3000 3200 3200 3500\n",
        "BLOCKS D=256 paged=0 fp8=0 wg=1 block=0 tiles=3 clk= 10 120 330 2330 2830\n",
        "BLOCKS D=256 paged=0 fp8=0 wg=1 block=1 tiles=0 clk= 2951 3051 3051 3051 3301\n",
        "PRODUCER D=256 paged=0 fp8=0 block=0 clk= 5 6 8 50 60\n",
        "PRODUCER D=256 paged=0 fp8=0 block=1 clk= 2000 2101 2851 2901 2951\n",
    ]
    out = sp.summary(lines)
    assert out == [
        "D=256 paged=0 fp8=0 wg=0 blocks=2: Q wait 100 tile 0 200 a loop tile 1000 "
        "finish and store 400 to the next block 100",
        "D=256 paged=0 fp8=0 wg=1 blocks=2: Q wait 105 tile 0 210 a loop tile 1000 "
        "finish and store 375 to the next block 121",
        "D=256 paged=0 fp8=0 producer blocks=2: early tiles 51 Q stage free 376 Q issued 46 "
        "tiles issued 30 Q landed 110",
    ]


def test_ctas_summary_takes_the_span_the_imbalance_and_the_cost_fit():
    sp = load("stage_probes")
    # Three CTAs whose times (ns) are exactly 2000 a tile + 5000 a block, started 1 us apart.
    rows = [(0, 3, 10), (1000, 2, 20), (2000, 4, 5)]
    lines = [f"CTAS D=128 paged=0 fp8=0 batch=4 heads=32 causal=1 cta={i} start={s} "
             f"end={s + 2000 * t + 5000 * b} blocks={b} tiles={t}\n"
             for i, (s, b, t) in enumerate(rows)]
    lines.append("an unrelated line\n")
    out = sp.summary(lines)
    # Times 35, 50 and 30 us (mean 38.3); ends at 35, 51 and 32 us after the first start.
    assert out == [
        "D=128 paged=0 fp8=0 batch=4 heads=32 causal=1 ctas=3: span 51.0 us, a CTA's mean "
        "38.3 us (span / mean 1.330), ends from 32.0 to 51.0 us (median 35.0); "
        "fit: 2000 ns a tile, 5000 ns a block"
    ]


def source_page(kernels):
    """ncu's source page as CSV: per kernel its name row, the header, one row per instruction
    (address, SASS, samples, executed, two stall reasons)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
              "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_wait",
              "stall_barrier", "stall_wait (Not Issued)"]
    lines = []
    for name, base, rows in kernels:
        lines.append(f'"Kernel Name","{name}",\n')
        lines.append(",".join(f'"{h}"' for h in header) + "\n")
        for offset, sass, samples, executed, wait, barrier in rows:
            lines.append(",".join(f'"{v}"' for v in [hex(base + offset), sass, samples, samples,
                                                      executed, wait, barrier, 0]) + "\n")
    return lines


def test_ncu_source_reads_kernels_opcodes_regions_and_retry_loops(tmp_path):
    ns = load("ncu_source")
    base = 0x7F0000001000
    spin = [(0x00, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 30, 100, 10, 0),
            (0x10, "@!P0  BRA 0x%x" % (base + 0x100), 0, 100, 0, 0),
            (0x20, "MUFU.EX2 R1, R1", 50, 6400, 40, 0),
            (0xF0, "YIELD", 5, 900, 0, 5),
            (0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x50], R2", 10, 900, 0, 10),
            (0x110, "@!P0  BRA 0x%x" % (base + 0xF0), 5, 900, 0, 5),
            (0x120, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x30], R2", 1, 7, 0, 1),
            (0x130, "@!P0  BRA 0x%x" % (base + 0x200), 0, 7, 0, 0)]  # forward: not a retry loop
    sleep = [(0x00, "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R14+URZ+0x28020], R19", 2, 40, 0, 2),
             (0x10, "@!P2  NANOSLEEP.SYNCS 0x989680", 8, 40, 0, 8),
             (0x20, "@!P2  SYNCS.PHASECHK.TRANS64 P2, [R14+URZ+0x28020], R19", 0, 40, 0, 0),
             (0x30, "@!P2  BRA 0x%x" % (base + 0x5000), 0, 40, 0, 0)]
    kernels = ns.read(source_page([("spinner", base, spin), ("sleeper", base + 0x5000, sleep)]))
    assert [k.name for k in kernels] == ["spinner", "sleeper"]
    spinner, sleeper = kernels
    assert [i.offset for i in spinner.instrs] == [r[0] for r in spin]
    assert spinner.instrs[1].opcode == "BRA" and spinner.instrs[0].opcode == "HGMMA"
    assert spinner.instrs[2].stalls == {"wait": 40, "barrier": 0}
    assert [(w.offset, runs) for w, runs in ns.retries(spinner)] == [(0x100, 900)]
    assert [(w.offset, runs) for w, runs in ns.retries(sleeper)] == [(0x00, 40)]
    out = ns.summary([spinner], [("loop", 0x0, 0x30)], top=3)
    assert out[0] == "spinner"
    assert out[1].startswith("  9314 warp instructions, 101 samples: wait 50%, barrier 21%")
    assert any(line.startswith("  MUFU") and "49.5% of samples" in line for line in out)
    assert "  [loop] 0-30:  79.2% of samples, 6600 executed: wait 62%" in out
    assert out[-1].startswith("  retry loop at 100: 900 runs")
    path = tmp_path / "src.csv"
    path.write_text("".join(source_page([("spinner", base, spin)])))
    assert ns.main([str(path), "--kernel", "sleeper"]) == 1
    assert ns.main([str(path), "--region", "loop=0-30"]) == 0
