"""bench/peers.py (flashkv against PyTorch's SDPA backends) on its quick grid on the CPU: every
case runs on both sides, the peer's output agrees with flashkv's (the script checks that before
timing), and the report has the rates the benchmark standard asks for (time, TFLOP/s, fraction
of the GEMM ceiling measured in the same run, speed against the peer)."""

import importlib.util
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

PEERS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "peers.py")


def load_peers():
    spec = importlib.util.spec_from_file_location("flashkv_bench_peers", PEERS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_grid_on_the_cpu(tmp_path, capsys):
    peers = load_peers()
    out = tmp_path / "peers.json"
    assert peers.main(["--device", "cpu", "--grid", "quick", "--rounds", "1", "--min-seconds", "0",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["gemm_tflops"] > 0
    cases = report["cases"]
    assert [c["case"] for c in cases] == [c.name for c in peers.grid("quick")]
    for c in cases:
        assert c["flashkv_us"] > 0 and c["flashkv_tflops"] > 0 and c["of_gemm"] > 0
        math = c["peers"]["math"]
        assert math["us"] > 0 and math["flashkv_speedup"] > 0
        assert math["max_diff"] < 1e-4, c  # float32 on both sides
        assert "MISMATCH" not in math["note"]
    printed = capsys.readouterr().out
    assert "GEMM ceiling" in printed and "flashkv x" in printed


def test_flops_follow_the_bench():
    """The FLOPs `flashkv bench` counts: causal 4 Hq D (new prefix + new (new + 1) / 2) a request,
    non-causal 4 Hq D n n."""
    peers = load_peers()
    causal = peers.Case("c", batch=2, new=10, prefix=6, hq=4, hkv=2, dim=8)
    assert causal.flops == 4 * 4 * 8 * (10 * 6 + 10 * 11 / 2) * 2
    full = peers.Case("f", batch=3, new=7, hq=4, hkv=2, dim=8, causal=False)
    assert full.flops == 4 * 4 * 8 * 7 * 7 * 3


def test_unknown_peer_is_refused(capsys):
    assert load_peers().main(["--device", "cpu", "--grid", "quick", "--peers", "fa9"]) == 2
    assert "unknown backend 'fa9'" in capsys.readouterr().err


def test_flashinfer_peer_says_why_it_cannot_run(tmp_path):
    """A FlashInfer peer named on the CPU (or where FlashInfer is not importable) is reported as
    not run, with the reason, and the other peers still run."""
    peers = load_peers()
    out = tmp_path / "peers.json"
    assert peers.main(["--device", "cpu", "--grid", "quick", "--rounds", "1", "--min-seconds", "0",
                       "--peers", "math,fi-fa3", "--json", str(out)]) == 0
    for c in json.loads(out.read_text())["cases"]:
        fi = c["peers"]["fi-fa3"]
        assert fi["note"].startswith("n/a: "), fi
        assert "CUDA only" in fi["note"] or "not importable" in fi["note"], fi
        assert c["peers"]["math"]["us"] > 0


def test_profile_runs_the_chosen_cases_once_and_times_nothing(tmp_path, capsys):
    """--case keeps the cases whose name holds the text; --profile runs each library once after
    the check and prints no timing; a --case that matches nothing is refused."""
    peers = load_peers()
    assert peers.main(["--device", "cpu", "--grid", "quick", "--case", "extend", "--profile"]) == 0
    printed = capsys.readouterr().out
    assert "extend 2 x (64 + 33), 4/2/64: profiled once each: flashkv, math" in printed
    assert "prefill" not in printed and "flashkv x" not in printed
    assert peers.main(["--device", "cpu", "--grid", "quick", "--case", "decode"]) == 2
    assert "--case: no case" in capsys.readouterr().err
