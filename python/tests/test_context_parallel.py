"""Context parallelism from Python (flashkv.parallel): 2 and 3 ranks spawned with
torch.multiprocessing over a gloo process group on the CPU. Every rank builds the same global
batch from one seed and runs its share: the communicator's collectives (uneven ones and a ring
step included), CpDecode and CpExtend (with prefixes, a window, sinks, a tree mask) on both
layouts, both exchanges and both passings of the new K/V, with NumPy float32 and PyTorch bfloat16 arrays, and FlashKVBackend given the process
group. Each rank checks its output against the float64 reference and against the one-rank result
(the same operator over all of the KV with a one-rank communicator), that a bad argument raises
flashkv.Error naming it, and that a rank left alone in a collective gets flashkv.Error at the
timeout and a broken communicator. The ranks of one world run every case in one spawn (each case
records its failure, the test of that case reports it). The CUDA variant (an NCCL group of one)
skips without a GPU."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
import torch.multiprocessing as mp  # noqa: E402

import flashkv  # noqa: E402
import reference as R  # noqa: E402
from flashkv import parallel as P  # noqa: E402

HQ, HKV, D = 4, 2, 64
SEED = 2029
# (layout, block, exchange, passing of the new K/V, page size, array library): both layouts, both
# exchanges, both passings (extend).
SWEEP = [("interleaved", 1, "all_gather", "all_gather", 1, "numpy"),
         ("interleaved", 3, "all_to_all", "ring", 1, "torch"),
         ("contiguous", 24, "all_gather", "all_gather", 16, "torch"),
         ("contiguous", 24, "all_to_all", "ring", 16, "numpy")]


# --- helpers the ranks use ---------------------------------------------------------------------

def rounded(x: np.ndarray, lib: str) -> np.ndarray:
    """x as the rank's arrays hold it (bfloat16 for torch, float32 for NumPy), in float64."""
    if lib == "torch":
        return torch.from_numpy(x).to(torch.bfloat16).double().numpy()
    return x.astype(np.float32).astype(np.float64)


def to_lib(x: np.ndarray, lib: str):
    if lib == "torch":
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
    return np.ascontiguousarray(x, dtype=np.float32)


def to_np(x) -> np.ndarray:
    return x.float().numpy().astype(np.float64) if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def paged(ks: List[np.ndarray], vs: List[np.ndarray], page_size: int, lib: str, rng: np.random.Generator):
    """A paged cache holding request i's ks[i] / vs[i] on shuffled pages, NaN elsewhere:
    ((k_cache, v_cache), indptr, indices, last_page_len)."""
    pages = [(len(k) + page_size - 1) // page_size for k in ks]
    num_pages = sum(pages) + 2
    perm = rng.permutation(num_pages).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kc = np.full((num_pages, page_size, HKV, D), np.nan)
    vc = np.full((num_pages, page_size, HKV, D), np.nan)
    for i, (k, v) in enumerate(zip(ks, vs)):
        for j, page in enumerate(perm[indptr[i]:indptr[i + 1]]):
            rows = slice(j * page_size, min((j + 1) * page_size, len(k)))
            n = rows.stop - rows.start
            kc[page, :n], vc[page, :n] = k[rows], v[rows]
    last = np.array([(len(k) - 1) % page_size + 1 if len(k) else 1 for k in ks], np.int32)
    return (to_lib(kc, lib), to_lib(vc, lib)), indptr, perm[:indptr[-1]].copy(), last


def close(out, ref: np.ndarray, lib: str, what: str, tol: Optional[float] = None) -> None:
    tol = (1e-2 if lib == "torch" else 1e-5) if tol is None else tol
    err = R.rel_error(to_np(out), ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def own_rows(extend_len: List[int], world: int, rank: int) -> List[int]:
    """The global new-token rows this rank owns, in the order CpExtend packs them."""
    rows, at = [], 0
    for n in extend_len:
        for begin, length in P.zigzag_rows(n, world, rank):
            rows += list(range(at + begin, at + begin + length))
        at += n
    return rows


# --- the cases (every rank runs each, in the same order) -----------------------------------------

def case_collectives(comm, group, rank: int, world: int) -> None:
    """The communicator's contract: even and uneven all-gathers, all-to-all with gaps between
    the regions, broadcast from the last rank, barrier; NumPy and torch buffers."""
    send = np.full(3, rank + 1, np.uint8)
    recv = np.zeros(3 * world, np.uint8)
    comm.all_gather(send, recv)
    assert recv.tolist() == [r + 1 for r in range(world) for _ in range(3)]
    # Uneven, with a gap before each region and rank 0 sending nothing.
    counts = [r * 2 for r in range(world)]
    displs = [sum(counts[:r]) + 3 * r + 1 for r in range(world)]
    recv = torch.full((displs[-1] + counts[-1] + 2,), 255, dtype=torch.uint8)
    comm.all_gather_v(torch.full((counts[rank],), 10 + rank, dtype=torch.uint8), recv, counts, displs)
    want = np.full(recv.shape[0], 255, np.uint8)
    for r in range(world):
        want[displs[r]:displs[r] + counts[r]] = 10 + r
    assert recv.numpy().tolist() == want.tolist()
    # Rank r sends (r + 1) * (s + 1) bytes of value 16 r + s to rank s, at spaced offsets.
    sc = [(rank + 1) * (s + 1) for s in range(world)]
    sd = [sum(sc[:s]) + 2 * s for s in range(world)]
    send = np.zeros(sd[-1] + sc[-1], np.uint8)
    for s in range(world):
        send[sd[s]:sd[s] + sc[s]] = 16 * rank + s
    rc = [(r + 1) * (rank + 1) for r in range(world)]
    rd = [sum(rc[r + 1:]) + 2 * (world - r) for r in range(world)]  # in reverse order, spaced
    recv = np.full(max(d + c for d, c in zip(rd, rc)) + 1, 255, np.uint8)
    comm.all_to_all_v(send, sc, sd, recv, rc, rd)
    for r in range(world):
        assert (recv[rd[r]:rd[r] + rc[r]] == 16 * r + rank).all(), f"bytes from rank {r}"
    # One ring step: rank r sends r + 2 bytes of value 100 + r to rank r + 1.
    prev = (rank - 1) % world
    recv = np.zeros(prev + 2, np.uint8)
    comm.send_recv(np.full(rank + 2, 100 + rank, np.uint8), (rank + 1) % world, recv, prev)
    assert (recv == 100 + prev).all(), recv
    data = np.full(5, rank, np.int32)
    comm.broadcast(data, world - 1)
    assert (data == world - 1).all()
    comm.barrier()
    comm.synchronize()
    with pytest.raises(flashkv.Error, match="recv"):
        comm.all_gather(np.zeros(4, np.uint8), np.zeros(4 * world - 1, np.uint8))
    with pytest.raises(flashkv.Error, match="counts"):
        comm.all_gather_v(np.zeros(1, np.uint8), np.zeros(8, np.uint8), [1] * (world + 1), [0] * (world + 1))


def case_decode(comm, group, rank: int, world: int) -> None:
    kv_len = [1, 37, 70]  # request 0 lives on rank 0 alone
    for n, (layout, block, exchange, kv_pass, page_size, lib) in enumerate(SWEEP):
        what = f"decode {layout}/{block}/{exchange}/page {page_size}/{lib}"
        rng = np.random.default_rng(SEED + n)  # the same on every rank
        options = P.CpOptions(layout=layout, block=block, exchange=exchange)
        shard = P.CpShard(options, world)
        q = rounded(rng.standard_normal((len(kv_len), HQ, D)), lib)
        ks = [rounded(rng.standard_normal((n_, HKV, D)), lib) for n_ in kv_len]
        vs = [rounded(rng.standard_normal((n_, HKV, D)), lib) for n_ in kv_len]
        # Sinks and a soft cap on the all-to-all layouts, a window on the contiguous all-gather.
        sinks = rng.standard_normal(HQ).astype(np.float32) if exchange == "all_to_all" else None
        cap = 8.0 if exchange == "all_to_all" else 0.0
        window = 20 if layout == "contiguous" and exchange == "all_gather" else -1
        ref, ref_lse = R.attention(q, ks, vs, [1] * len(kv_len), window_left=window, logits_soft_cap=cap,
                                   sinks=sinks)
        sinks_arr = None if sinks is None else (torch.from_numpy(sinks) if lib == "torch" else sinks)
        dtype = "bf16" if lib == "torch" else "f32"
        outs = {}
        for name, c, who in (("sharded", comm, rank), ("one rank", P.OneRankCommunicator(), 0)):
            size = world if name == "sharded" else 1
            pos = [np.asarray(P.CpShard(options, size).positions(who, n_), np.int64) for n_ in kv_len]
            cache, indptr, indices, last = paged([k[p] for k, p in zip(ks, pos)], [v[p] for v, p in zip(vs, pos)],
                                                 page_size, lib, rng)
            dec = P.CpDecode(c if name == "one rank" else group, options)
            dec.plan(kv_len, HQ, HKV, D, page_size=page_size, q_data_type=dtype, window_left=window)
            assert dec.local_kv_len.tolist() == [len(p) for p in pos]
            outs[name] = dec.run(to_lib(q, lib), cache, indptr, indices, last, logits_soft_cap=cap, sinks=sinks_arr,
                                 return_lse=True)
        assert [len(np.asarray(shard.positions(rank, n_))) for n_ in kv_len] == [shard.local_len(rank, n_)
                                                                               for n_ in kv_len]
        out, lse = outs["sharded"]
        close(out, ref, lib, what + " vs the reference")
        close(out, to_np(outs["one rank"][0]), lib, what + " vs one rank")
        R.assert_close(to_np(out), to_np(lse), ref, ref_lse, tol=1e-2 if lib == "torch" else 1e-5)


def case_extend(comm, group, rank: int, world: int) -> None:
    prefix_len, extend_len = [0, 30, 45], [6, 13, 1]  # one new token: some ranks own no row of it
    total = sum(extend_len)
    mine = own_rows(extend_len, world, rank)
    for n, (layout, block, exchange, kv_pass, page_size, lib) in enumerate(SWEEP):
        what = f"extend {layout}/{block}/{exchange}/{kv_pass}/page {page_size}/{lib}"
        rng = np.random.default_rng(SEED + 10 + n)
        options = P.CpOptions(layout=layout, block=block, exchange=exchange, kv_pass=kv_pass)
        assert options.kv_pass == kv_pass
        q = rounded(rng.standard_normal((total, HQ, D)), lib)
        ks = [rounded(rng.standard_normal((p + e, HKV, D)), lib) for p, e in zip(prefix_len, extend_len)]
        vs = [rounded(rng.standard_normal((p + e, HKV, D)), lib) for p, e in zip(prefix_len, extend_len)]
        k_new = np.concatenate([k[p:] for k, p in zip(ks, prefix_len)])
        v_new = np.concatenate([v[p:] for v, p in zip(vs, prefix_len)])
        window = 9 if n == 1 else -1
        # A tree mask (target verify) on the last sweep entry: random, each row sees itself.
        masks = None
        if n == 3:
            masks = []
            for p, e in zip(prefix_len, extend_len):
                m = rng.random((e, p + e)) < 0.6
                m[np.arange(e), p + np.arange(e)] = True
                masks.append(m)
        ref, ref_lse = R.attention(q, ks, vs, extend_len, causal=masks is None, window_left=window, masks=masks)
        flat_mask = None if masks is None else np.concatenate([m.reshape(-1) for m in masks])
        dtype = "bf16" if lib == "torch" else "f32"
        outs = {}
        for name, c, who, size, rows in (("sharded", comm, rank, world, mine),
                                         ("one rank", P.OneRankCommunicator(), 0, 1, list(range(total)))):
            pos = [np.asarray(P.CpShard(options, size).positions(who, p), np.int64) for p in prefix_len]
            cache, indptr, indices, last = paged([k[p] for k, p in zip(ks, pos)], [v[p] for v, p in zip(vs, pos)],
                                                 page_size, lib, rng)
            ext = P.CpExtend(c, options)
            ext.plan(prefix_len, extend_len, HQ, HKV, D, page_size=page_size, q_data_type=dtype, causal=masks is None,
                     window_left=window, custom_mask=flat_mask)
            assert ext.num_own_rows == len(rows) and ext.local_prefix_len.tolist() == [len(p) for p in pos]
            k_own, v_own = to_lib(k_new[rows], lib), to_lib(v_new[rows], lib)
            outs[name] = ext.run(to_lib(q[rows], lib), k_own, v_own, cache, indptr, indices, last, return_lse=True)
            if name == "sharded":
                # The new tokens this rank keeps: those at the positions it holds, in order.
                shard = P.CpShard(options, world)
                keep = [(i, p + t) for i, (p, e) in enumerate(zip(prefix_len, extend_len)) for t in range(e)
                        if shard.owner(p + t) == rank]
                assert ext.num_local_new == len(keep)
                pool_k = to_lib(np.zeros((len(keep) + 1, HKV, D)), lib)
                pool_v = to_lib(np.zeros((len(keep) + 1, HKV, D)), lib)
                ext.append_local_kv(k_own, v_own, np.arange(1, len(keep) + 1, dtype=np.int32), pool_k, pool_v)
                for j, (i, p) in enumerate(keep):
                    assert np.array_equal(to_np(pool_k[j + 1]), ks[i][p]), f"{what}: kept K of request {i}, position {p}"
                    assert np.array_equal(to_np(pool_v[j + 1]), vs[i][p]), f"{what}: kept V of request {i}, position {p}"
        out, lse = outs["sharded"]
        close(out, ref[mine], lib, what + " vs the reference")
        close(out, to_np(outs["one rank"][0])[mine], lib, what + " vs one rank")
        R.assert_close(to_np(out), to_np(lse), ref[mine], ref_lse[mine], tol=1e-2 if lib == "torch" else 1e-5)


def case_errors(comm, group, rank: int, world: int) -> None:
    """Bad arguments given on every rank raise flashkv.Error naming them before any collective,
    so the communicator stays usable."""
    with pytest.raises(flashkv.Error, match="exchange: expected 'all_gather' or 'all_to_all', got 'ring2'"):
        P.CpOptions(exchange="ring2")
    with pytest.raises(flashkv.Error, match="layout"):
        P.CpOptions(layout="striped")
    with pytest.raises(flashkv.Error, match="comm: expected a flashkv.parallel.Communicator"):
        P.CpDecode("world")
    dec = P.CpDecode(comm, P.CpOptions())
    with pytest.raises(flashkv.Error, match="CpDecode: call plan"):
        dec.run(np.zeros((1, HQ, D), np.float32), (np.zeros((4, HKV, D), np.float32),) * 2, [0, 0], [])
    with pytest.raises(flashkv.Error, match=r"kv_len\[0\] = -3"):
        dec.plan([-3], HQ, HKV, D, q_data_type="f32")
    kv_len = [2 * world + 1]
    dec.plan(kv_len, HQ, HKV, D, q_data_type="f32")
    n = int(dec.local_kv_len[0])
    cache = (np.zeros((n + 1, HKV, D), np.float32), np.zeros((n + 1, HKV, D), np.float32))
    with pytest.raises(flashkv.Error, match="q"):
        dec.run(np.zeros((1, HQ + 1, D), np.float32), cache, [0, n], np.arange(n))
    with pytest.raises(flashkv.Error, match="q: .*f32"):
        dec.run(np.zeros((1, HQ, D), np.float16), cache, [0, n], np.arange(n))
    with pytest.raises(flashkv.Error, match=f"kv: request 0 holds {n + 1} tokens on rank {rank}: expected {n}"):
        dec.run(np.zeros((1, HQ, D), np.float32), cache, [0, n + 1], np.arange(n + 1))
    out = dec.run(np.ones((1, HQ, D), np.float32), cache, [0, n], np.arange(n))  # still usable
    assert np.isfinite(out).all() and not getattr(comm, "broken", False)


def case_backend(comm, group, rank: int, world: int) -> None:
    """FlashKVBackend given the process group: an extend on a prefix, then a decode step; each
    rank's rows equal the ordinary backend's over all of the KV, and its pool holds the new
    tokens of its positions."""
    for n, (layout, block, exchange, kv_pass) in enumerate((("interleaved", 2, "all_to_all", "all_gather"),
                                                             ("contiguous", 16, "all_gather", "ring"))):
        rng = np.random.default_rng(SEED + 20 + n)
        options = P.CpOptions(layout=layout, block=block, exchange=exchange, kv_pass=kv_pass)
        shard = P.CpShard(options, world)
        kw = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, q_dtype="f32", device="cpu")
        plain = flashkv.FlashKVBackend(**kw)
        # The first backend gets the process group, the second a GroupCoordinator-like object
        # (SGLang's and vLLM's: device_group, cpu_group, device).
        coordinator = type("GroupCoordinator", (), dict(device_group=dist.group.WORLD, cpu_group=dist.group.WORLD,
                                                        device=torch.device("cpu")))()
        sharded = flashkv.FlashKVBackend(**kw, cp_comm=dist.group.WORLD if n == 0 else coordinator, cp=options)
        assert sharded.cp_comm.size == world and sharded.cp_comm.device == "cpu"
        pools = [flashkv.KVPool(160, num_layers=1, num_kv_heads=HKV, head_dim_qk=D, dtype="float32", framework="torch")
                 for _ in range(2)]
        r2ts = [flashkv.ReqToTokenPool(2, 64) for _ in range(2)]
        layer = flashkv.LayerSpec(layer_id=0, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, scaling=0.125)
        prefix, new = [20, 7], [9, 4]
        lens = [p + e + 1 for p, e in zip(prefix, new)]  # + one decode step
        slots = rng.permutation(np.arange(1, 150))
        seq_slots = [slots[60 * i:60 * i + lens[i]].astype(np.int32) for i in range(2)]
        ka, va = pools[0].get_kv_buffer(0)
        kb, vb = pools[1].get_kv_buffer(0)
        rows = []
        for i in range(2):
            rows.append(r2ts[0].alloc(1)[0])
            assert r2ts[1].alloc(1)[0] == rows[i]
            r2ts[0].write(rows[i], 0, seq_slots[i].tolist())
            r2ts[1].write(rows[i], 0, [int(s) for p, s in enumerate(seq_slots[i]) if shard.owner(p) == rank])
            s = torch.from_numpy(seq_slots[i][:prefix[i]].astype(np.int64))
            ka[s] = torch.from_numpy(rng.standard_normal((prefix[i], HKV, D)).astype(np.float32))
            va[s] = torch.from_numpy(rng.standard_normal((prefix[i], HKV, D)).astype(np.float32))
            mine = torch.from_numpy(np.array([seq_slots[i][p] for p in range(prefix[i]) if shard.owner(p) == rank],
                                             np.int64))
            kb[mine], vb[mine] = ka[mine], va[mine]
        for mode, first, count in ((flashkv.ForwardMode.EXTEND, prefix, new),
                                   (flashkv.ForwardMode.DECODE, [p + e for p, e in zip(prefix, new)], [1, 1])):
            batches = []
            for b in range(2):
                fb = flashkv.ForwardBatch()
                fb.forward_mode = mode
                fb.batch_size = 2
                fb.seq_lens_cpu = [f + c for f, c in zip(first, count)]
                if mode == flashkv.ForwardMode.EXTEND:
                    fb.extend_prefix_lens_cpu = list(first)
                    fb.extend_seq_lens_cpu = list(count)
                fb.req_pool_indices = np.array(rows, np.int32)
                fb.out_cache_loc = np.array([seq_slots[i][p] if b == 0 or shard.owner(p) == rank else 0
                                             for i in range(2) for p in range(first[i], first[i] + count[i])], np.int32)
                fb.req_to_token_pool, fb.token_to_kv_pool = r2ts[b], pools[b]
                batches.append(fb)
            t = sum(count)
            q, k, v = (torch.from_numpy(rng.standard_normal((t, h, D)).astype(np.float32)) for h in (HQ, HKV, HKV))
            plain.init_forward_metadata(batches[0])
            want = plain.forward(q, k, v, layer, batches[0])
            sharded.init_forward_metadata(batches[1])
            if mode == flashkv.ForwardMode.EXTEND:
                own = torch.tensor(own_rows(count, world, rank), dtype=torch.int64)
                got = sharded.forward(q[own], k[own], v[own], layer, batches[1])
                want = want[own]
            else:
                got = sharded.forward(q, k, v, layer, batches[1])
            close(got, want.double().numpy(), "numpy", f"backend {layout}/{block}/{exchange}/{kv_pass} {mode}",
                  tol=1e-4)
            for i in range(2):
                for p in range(first[i], first[i] + count[i]):
                    if shard.owner(p) == rank:
                        s = int(seq_slots[i][p])
                        assert torch.equal(kb[s], ka[s]) and torch.equal(vb[s], va[s]), f"request {i} position {p}"
    with pytest.raises(flashkv.Error, match="cp: given without cp_comm"):
        flashkv.FlashKVBackend(**kw, cp=options)


def case_failing_rank(comm, group, rank: int, world: int) -> None:
    """The last rank fails on a bad argument before its first collective; the others wait in
    theirs until the timeout, get flashkv.Error naming it, and their communicator is broken.
    Last: the group it uses is left with an unfinished collective."""
    sub = dist.new_group(list(range(world)), backend="gloo")
    c = P.from_process_group(sub, timeout_s=1.0)
    assert not c.broken and c.name == "torch.distributed (gloo)"
    dec = P.CpDecode(c, P.CpOptions())
    dec.plan([4 * world], HQ, HKV, D, q_data_type="f32")
    n = int(dec.local_kv_len[0])
    cache = (np.zeros((n, HKV, D), np.float32), np.zeros((n, HKV, D), np.float32))
    q = np.ones((1, HQ, D), np.float16 if rank == world - 1 else np.float32)
    if rank == world - 1:
        with pytest.raises(flashkv.Error, match="q: "):
            dec.run(q, cache, [0, n], np.arange(n))
    else:
        start = time.monotonic()
        with pytest.raises(flashkv.Error, match=r"torch.distributed \(gloo\) all_gather: rank \d of \d failed: .*"
                           r"the communicator is unusable from now on"):
            dec.run(q, cache, [0, n], np.arange(n))
        assert time.monotonic() - start < 30
        assert c.broken
        with pytest.raises(flashkv.Error, match="unusable after an earlier failure"):
            c.barrier()
    dist.barrier()  # on the default group: the last rank stays until the others timed out


CASES: List[Tuple[str, Callable]] = [("collectives", case_collectives), ("decode", case_decode),
                                     ("extend", case_extend), ("errors", case_errors), ("backend", case_backend),
                                     ("failing_rank", case_failing_rank)]


def _worker(rank: int, world: int, init_file: str, out_dir: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    if backend == "nccl":
        _cuda_cases(rank)
        dist.destroy_process_group()
        return
    comm = P.from_process_group(timeout_s=15)
    failures = {}
    for name, case in CASES:
        try:
            case(comm, dist.group.WORLD, rank, world)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            failures[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        for name, _ in CASES:
            f.write(f"=== {name}\n{failures.get(name, 'ok')}\n")
    # The failing-rank case leaves a collective of its group unfinished: exit without tearing
    # the groups down.
    os._exit(0)


def _spawn(world: int, backend: str = "gloo", timeout_s: float = 120.0) -> str:
    """Runs _worker on `world` spawned processes; returns the folder of their reports."""
    out_dir = tempfile.mkdtemp(prefix="flashkv_cp_")
    init_file = os.path.join(out_dir, "init")
    ctx = mp.start_processes(_worker, args=(world, init_file, out_dir, backend), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {world} ranks did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return out_dir


_RESULTS: Dict[int, Dict[int, Dict[str, str]]] = {}


def _results(world: int) -> Dict[int, Dict[str, str]]:
    if world not in _RESULTS:
        out_dir = _spawn(world)
        per_rank = {}
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.txt")) as f:
                text = f.read()
            per_rank[rank] = {block.split("\n", 1)[0]: block.split("\n", 1)[1].strip()
                              for block in text.split("=== ")[1:]}
        _RESULTS[world] = per_rank
    return _RESULTS[world]


@pytest.mark.parametrize("case", [name for name, _ in CASES])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_on_gloo(world: int, case: str) -> None:
    results = _results(world)
    failed = {rank: r[case] for rank, r in results.items() if r[case] != "ok"}
    assert not failed, "\n".join(f"rank {rank} of {world}:\n{tb}" for rank, tb in failed.items())


def test_communicator_arguments() -> None:
    """What the factories refuse, in this process (no group needed)."""
    with pytest.raises(flashkv.Error, match="comm: expected a flashkv.parallel.Communicator, a torch"):
        P.as_communicator(3)
    c = P.OneRankCommunicator()
    assert P.as_communicator(c) is c and (c.rank, c.size, c.device) == (0, 1, "cpu")
    with pytest.raises(flashkv.Error, match="comm: expected an mpi4py communicator or its Fortran handle"):
        P.mpi_communicator("world")
    if not P.built_with_nccl():
        with pytest.raises(flashkv.Error, match="built without NCCL"):
            P.nccl_communicator(1, "cuda:0")
    with pytest.raises(flashkv.Error, match="block"):
        P.CpOptions(block=0)
    with pytest.raises(flashkv.Error, match="kv_pass: expected 'all_gather' or 'ring', got 'tree'"):
        P.CpOptions(kv_pass="tree")
    assert repr(P.CpOptions(layout="contiguous", block=8, exchange="all_to_all", kv_pass="ring")) == (
        "CpOptions(layout='contiguous', block=8, exchange='all_to_all', kv_pass='ring')")
    with pytest.raises(flashkv.Error, match="rank: expected 0 <= rank < size"):
        P.CallbackCommunicator(object(), 2, 2, "cpu", "test")
    if not dist.is_initialized():
        with pytest.raises(flashkv.Error, match="not initialised"):
            P.from_process_group()


# --- MPI: the raw communicator from mpi4py, under mpirun --------------------------------------------

def _mpi_main() -> None:
    """Under mpirun: the cases that need no torch.distributed group, over
    flashkv.parallel.mpi_communicator(MPI.COMM_WORLD); prints one line a rank, exits 1 on a
    failure."""
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = P.mpi_communicator(MPI.COMM_WORLD, timeout_s=30)
    assert comm.name == "MPI" and comm.size == MPI.COMM_WORLD.Get_size()
    failures = []
    for name, case in CASES[:4]:  # collectives, decode, extend, errors
        try:
            case(comm, comm, comm.rank, comm.size)
        except Exception:  # noqa: BLE001 - printed for the test
            failures.append(f"{name}:\n{traceback.format_exc()}")
    print(f"rank {comm.rank}: " + ("ok" if not failures else "FAILED\n" + "\n".join(failures)), flush=True)
    sys.exit(1 if failures else 0)


def test_mpi4py_communicator() -> None:
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun")
    if not P.built_with_mpi() or mpirun is None:
        pytest.skip("needs flashkv built with MPI and mpirun")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    flags = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) if "Open MPI" in version else []
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_context_parallel as T; T._mpi_main()"
    r = subprocess.run([mpirun, *flags, "-np", "2", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.count(": ok") == 2, r.stdout + r.stderr


# --- CUDA: an NCCL group of one ------------------------------------------------------------------

def _cuda_cases(rank: int) -> None:
    """Decode and extend on the GPU through an NCCL process group of one, against the reference
    (raises on a mismatch, which fails the spawn)."""
    comm = P.from_process_group()
    assert comm.device == "cuda:0" and comm.size == 1
    rng = np.random.default_rng(SEED)
    dev = torch.device("cuda:0")
    # The transport's collectives on the caller's stream.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        send = torch.arange(1, 9, dtype=torch.uint8, device=dev)
        recv = torch.zeros(12, dtype=torch.uint8, device=dev)
        comm.all_gather(send, recv[:8], stream.cuda_stream)
        comm.all_gather_v(send[:3], recv, [3], [9], stream.cuda_stream)
        comm.all_to_all_v(send, [4], [2], recv, [4], [0], stream.cuda_stream)
        comm.broadcast(recv, 0, stream.cuda_stream)
        comm.synchronize(stream.cuda_stream)
    assert recv.cpu().tolist() == [3, 4, 5, 6, 5, 6, 7, 8, 0, 1, 2, 3], recv.cpu().tolist()
    comm.barrier()
    kv_len = [5, 130]
    q = rounded(rng.standard_normal((2, HQ, D)), "torch")
    ks = [rounded(rng.standard_normal((n, HKV, D)), "torch") for n in kv_len]
    vs = [rounded(rng.standard_normal((n, HKV, D)), "torch") for n in kv_len]
    ref, _ = R.attention(q, ks, vs, [1, 1])
    cache, indptr, indices, last = paged(ks, vs, 16, "torch", rng)
    dec = P.CpDecode(comm, P.CpOptions())
    dec.plan(kv_len, HQ, HKV, D, page_size=16)
    out = dec.run(to_lib(q, "torch").to(dev), tuple(c.to(dev) for c in cache), indptr, indices, last)
    torch.cuda.synchronize()
    close(out.cpu(), ref, "torch", "CUDA decode")
    prefix, new = [0, 40], [7, 3]
    q = rounded(rng.standard_normal((10, HQ, D)), "torch")
    ks = [rounded(rng.standard_normal((p + e, HKV, D)), "torch") for p, e in zip(prefix, new)]
    vs = [rounded(rng.standard_normal((p + e, HKV, D)), "torch") for p, e in zip(prefix, new)]
    ref, _ = R.attention(q, ks, vs, new, causal=True)
    cache, indptr, indices, last = paged([k[:p] for k, p in zip(ks, prefix)], [v[:p] for v, p in zip(vs, prefix)],
                                         16, "torch", rng)
    ext = P.CpExtend(comm, P.CpOptions())
    ext.plan(prefix, new, HQ, HKV, D, page_size=16)
    k_new = np.concatenate([k[p:] for k, p in zip(ks, prefix)])
    v_new = np.concatenate([v[p:] for v, p in zip(vs, prefix)])
    out = ext.run(to_lib(q, "torch").to(dev), to_lib(k_new, "torch").to(dev), to_lib(v_new, "torch").to(dev),
                  tuple(c.to(dev) for c in cache), indptr, indices, last)
    torch.cuda.synchronize()
    close(out.cpu(), ref, "torch", "CUDA extend")


def test_cuda_nccl_group_of_one() -> None:
    if not (torch.cuda.is_available() and flashkv.cuda_available() and dist.is_nccl_available()):
        pytest.skip("needs a GPU, a CUDA build of flashkv and torch.distributed with NCCL")
    _spawn(1, backend="nccl")
