#!/usr/bin/env python3
"""flashkv's prefill and extend against PyTorch's scaled_dot_product_attention backends (cuDNN,
FlashAttention-2, memory-efficient) and, where it can be imported, FlashInfer's prefill kernels
(its Hopper FA3 ones and its FA2 ones), on the shapes of `flashkv bench --grid full`, in one run.

Per case it prints flashkv's time, TFLOP/s and fraction of the bf16 GEMM ceiling (torch.matmul,
8192^3, measured in the same run), then each peer's time and TFLOP/s and flashkv's speed against
it (peer time / flashkv time: above 1, flashkv is faster), or why the peer could not run the case.
Every peer's output is checked against flashkv's before it is timed (the largest difference is
printed), so both time the same attention.

What runs: flashkv through its FlashInfer-style wrappers, as SGLang calls it: causal prefill by
BatchPrefillWithRaggedKVCacheWrapper ([tokens, heads, dim] with qo/kv indptr), extend by
BatchPrefillWithPagedKVCacheWrapper as one causal paged pass over prefix and new tokens (the
backend's default with a 16-bit pool), on a pool of page size 1 with shuffled slots. The peers
take dense [batch, heads, tokens, dim] tensors (the grid's requests are of equal length), with
grouped-query K/V as they are (enable_gqa) or, where a backend refuses that, repeated to the
query heads (same FLOPs; the case line says so); extend's prefix is dense too, with the causal
mask aligned to the bottom right (each new token sees the whole prefix), as flashkv's is: native
in FlashAttention, a dense boolean mask for the other backends (their line says so).

FlashInfer (peers fi-fa3 and fi-fa2: its wrappers with backend="fa3" or "fa2") takes exactly
flashkv's inputs, through the same wrappers: causal and non-causal prefill by
BatchPrefillWithRaggedKVCacheWrapper on the same [tokens, heads, dim] tensors, extend by
BatchPrefillWithPagedKVCacheWrapper on the same pool of page size 1 with the same shuffled slot
table (the pool's [slots, heads, dim] tensors seen as FlashInfer's NHD [pages, 1, heads, dim],
without a copy); plan() runs before timing, as flashkv's does. The FlashInfer peers join the
default peers on CUDA when `import flashinfer` succeeds (a FlashInfer without its kernels built
ahead of time compiles them at the first plan(), before timing); otherwise they are left out, and
reported as unavailable only where --peers names them.

FLOPs, as `flashkv bench` counts them: 4 * Hq * D * (new * prefix + new * (new + 1) / 2) per
request with causal masking, 4 * Hq * D * n * n without.

Timing: each case's runs alternate between flashkv and the peers in rounds; a round times each
one's back-to-back launches with CUDA events for at least --min-seconds (at least 5 launches);
the figure is the median of the rounds' medians.

Usage: PYTHONPATH=build/python python3 bench/peers.py [--grid full|quick] [--device cuda|cpu]
       [--peers cudnn,flash,efficient,math,fi-fa3,fi-fa2] [--rounds N] [--min-seconds S] [--json FILE]
       [--case TEXT ...] [--profile]
--case keeps the cases whose name contains TEXT; --profile times nothing, and after the output
check runs each library once more inside an NVTX range named after it, for a profiler:
`ncu --nvtx --nvtx-include "fi-fa3/" --set full python3 bench/peers.py --case 32/32/64 --profile`.
FlashInfer is found as any module is: installed, or on the path,
`PYTHONPATH=build/python:<dir holding flashinfer> python3 bench/peers.py ...`.
--device cpu (with --grid quick) runs flashkv's CPU kernels against the math backend: a check
that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import flashkv


@dataclass
class Case:
    name: str
    batch: int
    new: int  # query tokens a request
    prefix: int = 0  # cached tokens a request (extend)
    hq: int = 32
    hkv: int = 8
    dim: int = 128
    causal: bool = True

    @property
    def flops(self) -> float:
        if not self.causal:
            return 4.0 * self.hq * self.dim * self.new * (self.prefix + self.new) * self.batch
        return 4.0 * self.hq * self.dim * (self.new * self.prefix + self.new * (self.new + 1) / 2) * self.batch


def grid(name: str) -> List[Case]:
    if name == "quick":
        return [Case("prefill 2 x 96, 4/2/64", 2, 96, hq=4, hkv=2, dim=64),
                Case("extend 2 x (64 + 33), 4/2/64", 2, 33, prefix=64, hq=4, hkv=2, dim=64)]
    return [
        Case("prefill 1 x 8192", 1, 8192),
        Case("prefill 4 x 4096", 4, 4096),
        Case("prefill 1 x 16384", 1, 16384),
        Case("prefill 4 x 4096 non-causal", 4, 4096, causal=False),
        Case("prefill 4 x 4096, 32/32/64", 4, 4096, hq=32, hkv=32, dim=64),
        Case("prefill 4 x 4096, 16/16/256", 4, 4096, hq=16, hkv=16, dim=256),
        Case("extend 4 x (3072 + 1024)", 4, 1024, prefix=3072),
        Case("extend 16 x (4096 + 256)", 16, 256, prefix=4096),
    ]


@dataclass
class Result:
    us: Optional[float] = None
    note: str = ""
    max_diff: Optional[float] = None
    rounds: List[float] = field(default_factory=list)


class Timer:
    """fn's time, in us: back-to-back launches in batches of about 20 ms (so that the host's
    per-call work overlaps the device's), for at least min_seconds and 5 batches; the median of
    the batches' averages."""

    def __init__(self, device: str, min_seconds: float):
        self.cuda = device == "cuda"
        self.min_seconds = min_seconds

    def _batch(self, fn: Callable[[], object], n: int) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n

    def __call__(self, fn: Callable[[], object]) -> float:
        once = self._batch(fn, 1)  # warm (plans, caches, autotuning), and a first estimate
        n = max(1, min(1000, int(20e3 / max(once, 1.0))))
        times: List[float] = []
        start = time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < self.min_seconds:
            times.append(self._batch(fn, n))
        return statistics.median(times)


def gemm_tflops(device: str, timer: Timer) -> float:
    """The matrix ceiling: a bf16 GEMM of 8192^3 on CUDA (float32 1024^3 on the CPU)."""
    n, dt = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    us = timer(lambda: torch.matmul(a, b))
    return 2.0 * n ** 3 / (us * 1e-6) / 1e12


class Inputs:
    """One case's tensors: flashkv's ragged / paged views and the peers' dense ones."""

    def __init__(self, c: Case, device: str, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        kv = c.prefix + c.new
        q = torch.randn(c.batch, c.new, c.hq, c.dim, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(c.batch, kv, c.hkv, c.dim, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(c.batch, kv, c.hkv, c.dim, generator=g).to(device=device, dtype=dtype)
        self.q_tokens = q.reshape(c.batch * c.new, c.hq, c.dim)
        self.k_tokens = k.reshape(c.batch * kv, c.hkv, c.dim)
        self.v_tokens = v.reshape(c.batch * kv, c.hkv, c.dim)
        # The peers' [batch, heads, tokens, dim].
        self.q = q.transpose(1, 2).contiguous()
        self.k = k.transpose(1, 2).contiguous()
        self.v = v.transpose(1, 2).contiguous()
        self.qo_indptr = torch.arange(0, c.batch + 1, dtype=torch.int32) * c.new
        self.kv_indptr = torch.arange(0, c.batch + 1, dtype=torch.int32) * kv
        if c.prefix:
            # A pool of page size 1: request r's token t in slot perm[r * kv + t] (shuffled, as
            # slots are after a server has run a while).
            perm = torch.randperm(c.batch * kv, generator=g)
            slots = perm.to(device)
            self.k_pool = torch.empty_like(self.k_tokens)
            self.v_pool = torch.empty_like(self.v_tokens)
            self.k_pool[slots] = self.k_tokens
            self.v_pool[slots] = self.v_tokens
            self.kv_indices = perm.to(torch.int32)
            self.last_page_len = torch.ones(c.batch, dtype=torch.int32)


def flashkv_runner(c: Case, x: Inputs, device: str) -> Callable[[], torch.Tensor]:
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    put = (lambda t: t.to(device)) if device == "cuda" else (lambda t: t)
    if c.prefix:
        w = flashkv.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(put(x.qo_indptr), put(x.kv_indptr), put(x.kv_indices), put(x.last_page_len), c.hq, c.hkv, c.dim, 1,
               causal=c.causal, q_data_type=x.q.dtype)
        out = torch.empty_like(x.q_tokens)
        return lambda: w.run(x.q_tokens, (x.k_pool, x.v_pool), out=out)
    w = flashkv.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    w.plan(put(x.qo_indptr), put(x.kv_indptr), c.hq, c.hkv, c.dim, causal=c.causal, q_data_type=x.q.dtype)
    out = torch.empty_like(x.q_tokens)
    return lambda: w.run(x.q_tokens, x.k_tokens, x.v_tokens, out=out)


BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
            "math": "MATH"}


def lower_right_mask(c: Case, device: torch.device) -> torch.Tensor:
    """extend's mask for a dense prefix: new token i (at position prefix + i) sees keys 0..prefix + i."""
    rows = torch.arange(c.new, device=device).unsqueeze(1)
    keys = torch.arange(c.prefix + c.new, device=device).unsqueeze(0)
    return keys <= rows + c.prefix


def peer_runner(c: Case, x: Inputs, backend: str) -> Callable[[], torch.Tensor]:
    """SDPA under one backend; raises where the backend cannot run the case. Tries grouped K/V
    as they are, then repeated to the query heads. extend (causal over a prefix) needs the mask
    aligned to the bottom right, which SDPA's is_causal is not (it aligns top left): FlashAttention
    takes it natively (its causal flag means bottom right; called directly, as CausalBias does,
    since CausalBias would pick FlashAttention whatever backend was asked for), the others get it
    as a dense boolean mask (the note says so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = getattr(SDPBackend, BACKENDS[backend])
    extend = c.causal and c.prefix > 0
    mask = lower_right_mask(c, x.q.device) if extend and backend != "flash" else None
    notes = ["dense mask"] if mask is not None else []

    def make(k: torch.Tensor, v: torch.Tensor, gqa: bool) -> Callable[[], torch.Tensor]:
        if extend and backend == "flash":
            def run() -> torch.Tensor:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    x.q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=c.dim ** -0.5)[0]
        else:
            def run() -> torch.Tensor:
                with sdpa_kernel(kind):
                    return F.scaled_dot_product_attention(x.q, k, v, attn_mask=mask,
                                                          is_causal=c.causal and not extend, enable_gqa=gqa)
        run()
        run.notes = list(notes)  # type: ignore[attr-defined]
        return run

    if c.hkv == c.hq:
        return make(x.k, x.v, False)
    try:
        return make(x.k, x.v, True)
    except Exception:  # the backend takes no grouped K/V
        pass
    group = c.hq // c.hkv
    run = make(x.k.repeat_interleave(group, dim=1), x.v.repeat_interleave(group, dim=1), False)
    run.notes.append("K/V repeated to the query heads")  # type: ignore[attr-defined]
    return run


# FlashInfer's peers: the backend its wrappers are asked for.
FLASHINFER = {"fi-fa3": "fa3", "fi-fa2": "fa2"}
_flashinfer: Dict[str, object] = {}


def flashinfer_module():
    """FlashInfer, imported once; raises, saying why, where it cannot be."""
    if "module" not in _flashinfer:
        try:
            import flashinfer
            if flashinfer is flashkv:  # flashkv.as_flashinfer's alias: it would time flashkv twice
                raise ImportError("`flashinfer` is flashkv under that name (flashkv.as_flashinfer)")
            _flashinfer["module"] = flashinfer
        except Exception as e:  # not installed, or a dependency missing
            _flashinfer["module"] = None
            _flashinfer["why"] = f"flashinfer not importable ({type(e).__name__}: {e})"
    if _flashinfer["module"] is None:
        raise RuntimeError(_flashinfer["why"])
    return _flashinfer["module"]


def flashinfer_runner(c: Case, x: Inputs, backend: str) -> Callable[[], torch.Tensor]:
    """FlashInfer's wrapper under one backend, planned here (outside the timed function) and
    called on flashkv's own tensors: the ragged ones for prefill, the pool of page size 1 with
    its shuffled slot table for extend. Returns [tokens, heads, dim], as flashkv does."""
    fi = flashinfer_module()
    dev = x.q.device
    if dev.type != "cuda":
        raise RuntimeError("FlashInfer runs on CUDA only")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty_like(x.q_tokens)
    if c.prefix:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        w.plan(x.qo_indptr.to(dev), x.kv_indptr.to(dev), x.kv_indices.to(dev), x.last_page_len.to(dev),
               c.hq, c.hkv, c.dim, 1, causal=c.causal, q_data_type=x.q.dtype, kv_data_type=x.k_pool.dtype)
        cache = (x.k_pool.unsqueeze(1), x.v_pool.unsqueeze(1))  # NHD pages of one token: views

        def run() -> torch.Tensor:
            return w.run(x.q_tokens, cache, out=out)
    else:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
        w.plan(x.qo_indptr.to(dev), x.kv_indptr.to(dev), c.hq, c.hkv, c.dim, causal=c.causal,
               q_data_type=x.q.dtype, kv_data_type=x.k_tokens.dtype)

        def run() -> torch.Tensor:
            return w.run(x.q_tokens, x.k_tokens, x.v_tokens, out=out)
    run()
    run.tokens = True  # type: ignore[attr-defined]
    return run


# The largest difference between two outputs taken as the same attention: bf16 outputs of
# magnitude up to about 1 round at 2^-8.
MISMATCH = 0.05


def rate(tflops: float) -> str:
    return f"{tflops:7.1f}" if tflops >= 10 else f"{tflops:7.3f}"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def profile_once(runners: Dict[str, Callable[[], torch.Tensor]], device: str) -> None:
    """Each library's launches once more, alone, inside an NVTX range named after it (a profiler's
    filter: `ncu --nvtx --nvtx-include "fi-fa3/"`, or the ranges of an nsys timeline). Every
    runner has already run once, for the output check, so none of them plans or warms up here."""
    for name, fn in runners.items():
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


def run_case(c: Case, device: str, dtype: torch.dtype, peers: List[str], timer: Timer, rounds: int,
             profile: bool = False) -> Dict[str, Result]:
    x = Inputs(c, device, dtype)
    results: Dict[str, Result] = {"flashkv": Result()}
    runners: Dict[str, Callable[[], torch.Tensor]] = {"flashkv": flashkv_runner(c, x, device)}

    def dense(out: torch.Tensor) -> torch.Tensor:  # [tokens, heads, dim] as [batch, heads, tokens, dim]
        return out.reshape(c.batch, c.new, c.hq, c.dim).transpose(1, 2)

    ours = dense(runners["flashkv"]())
    for p in peers:
        r = results[p] = Result()
        try:
            runners[p] = flashinfer_runner(c, x, FLASHINFER[p]) if p in FLASHINFER else peer_runner(c, x, p)
        except Exception as e:  # the backend cannot run the case: say why
            r.note = "n/a: " + ((str(e).strip().splitlines() or [type(e).__name__])[0])[:110]
            continue
        theirs = runners[p]()
        r.max_diff = max_diff(dense(theirs) if getattr(runners[p], "tokens", False) else theirs, ours)
        notes = list(getattr(runners[p], "notes", []))
        if r.max_diff > MISMATCH:
            notes.append(f"MISMATCH: outputs differ by more than {MISMATCH}")
        r.note = "; ".join(notes)
    if profile:
        profile_once(runners, device)
        return results
    for _ in range(rounds):
        for name, fn in runners.items():
            results[name].rounds.append(timer(fn))
    for r in results.values():
        if r.rounds:
            r.us = statistics.median(r.rounds)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=["quick", "full"], default="full")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peers", default=None, help="comma-separated SDPA backends and FlashInfer backends "
                    "(fi-fa3, fi-fa2) (default: cudnn,flash,efficient on CUDA, and fi-fa3,fi-fa2 where "
                    "flashinfer imports; math on the CPU)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.25)
    ap.add_argument("--json", default=None, help="write the machine and every case as JSON")
    ap.add_argument("--case", action="append", default=None,
                    help="only the grid's cases whose name contains this (repeatable)")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: after the check, each library runs once more inside an NVTX range "
                    "named after it, for a profiler")
    a = ap.parse_args(argv)
    # SDPA warns at each call that a backend pinned by sdpa_kernel does not take the case; the
    # case line already says why the peer could not run it.
    for message in (".*kernel not used because", ".*has been runtime disabled",
                    ".*both fused kernels require"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("peers: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    if a.peers:
        peers = a.peers.split(",")
    elif a.device == "cuda":
        peers = ["cudnn", "flash", "efficient"]
        try:
            flashinfer_module()
            peers += list(FLASHINFER)
        except RuntimeError:  # no FlashInfer here: the SDPA peers only
            pass
    else:
        peers = ["math"]
    for p in peers:
        if p not in BACKENDS and p not in FLASHINFER:
            print(f"peers: --peers: unknown backend '{p}' (expected {', '.join([*BACKENDS, *FLASHINFER])})",
                  file=sys.stderr)
            return 2
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    timer = Timer(a.device, a.min_seconds)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    gemm = gemm_tflops(a.device, timer)
    fi_version = None
    if any(p in FLASHINFER for p in peers):
        try:
            fi_version = getattr(flashinfer_module(), "__version__", "?")
        except RuntimeError:  # each case's line says why
            pass
    print(f"machine: {name}; torch {torch.__version__}; "
          + (f"flashinfer {fi_version}; " if fi_version else "")
          + f"GEMM ceiling {gemm:.1f} TFLOP/s ({'bf16 8192^3' if a.device == 'cuda' else 'f32 1024^3'}, this run)")
    report = {"machine": name, "torch": torch.__version__, "gemm_tflops": gemm, "cases": []}
    if fi_version:
        report["flashinfer"] = fi_version
    cases = [c for c in grid(a.grid) if not a.case or any(part in c.name for part in a.case)]
    if not cases:
        print(f"peers: --case: no case of the {a.grid} grid matches {a.case}", file=sys.stderr)
        return 2
    for c in cases:
        res = run_case(c, a.device, dtype, peers, timer, a.rounds, a.profile)
        if a.profile:
            ran = [name for name in res if not res[name].note.startswith("n/a")]
            print(f"{c.name}: profiled once each: {', '.join(ran)}")
            continue
        ours = res["flashkv"]
        tf = c.flops / (ours.us * 1e-6) / 1e12
        spread = (max(ours.rounds) - min(ours.rounds)) / ours.us * 100
        print(f"{c.name}: flashkv {ours.us:9.1f} us {rate(tf)} TFLOP/s {100 * tf / gemm:5.1f}% of GEMM "
              f"(rounds +-{spread / 2:.1f}%)")
        row = {"case": c.name, "flops": c.flops, "flashkv_us": ours.us, "flashkv_tflops": tf,
               "of_gemm": tf / gemm, "peers": {}}
        for p in peers:
            r = res[p]
            if r.us is None:
                print(f"    {p:9s} {r.note}")
                row["peers"][p] = {"note": r.note}
                continue
            ptf = c.flops / (r.us * 1e-6) / 1e12
            note = f"; {r.note}" if r.note else ""
            print(f"    {p:9s} {r.us:9.1f} us {rate(ptf)} TFLOP/s {100 * ptf / gemm:5.1f}% of GEMM  "
                  f"flashkv x{r.us / ours.us:.2f}  (max |diff| {r.max_diff:.2e}{note})")
            row["peers"][p] = {"us": r.us, "tflops": ptf, "flashkv_speedup": r.us / ours.us,
                               "max_diff": r.max_diff, "note": r.note}
        report["cases"].append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
