"""What is specific to PyTorch: torch dtypes as plan arguments, bf16 and float8 tensors, capture
into a CUDA graph with torch.cuda.graph, and runs on a side stream (on the CPU when torch is
installed, on CUDA when a GPU is visible). Every wrapper test also runs on PyTorch tensors, CPU
and CUDA, through the `xp` fixture (devices.py)."""

import functools

import numpy as np
import pytest

import flashkv
import reference as R

torch = pytest.importorskip("torch")

HQ, HKV, D = 8, 2, 64
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flashkv.cuda_available()),
                          reason="needs a CUDA GPU and a CUDA build of flashkv")


def to_np(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def decode_case(rng, kv_lens, device, dtype, spare=0):
    batch = R.paged_batch(rng, kv_lens, HKV, D)
    k, v = batch.flat()
    kc = torch.from_numpy(np.nan_to_num(k, nan=0.0)).to(device=device, dtype=dtype)
    vc = torch.from_numpy(np.nan_to_num(v, nan=0.0)).to(device=device, dtype=dtype)
    ks = [to_np(kc[torch.from_numpy(batch.indices[batch.indptr[i]:batch.indptr[i + 1]]).long().to(device)])
          for i in range(len(kv_lens))]
    vs = [to_np(vc[torch.from_numpy(batch.indices[batch.indptr[i]:batch.indptr[i + 1]]).long().to(device)])
          for i in range(len(kv_lens))]
    indices = torch.from_numpy(np.concatenate([batch.indices, np.zeros(spare, np.int32)])).to(device)
    return batch, (kc, vc), ks, vs, torch.from_numpy(batch.indptr).to(device), indices


@pytest.mark.parametrize("dtype,tol,lse_tol", [(torch.float32, 1e-5, 1e-3), (torch.bfloat16, 1e-2, 2e-2)])
def test_decode_cpu_tensors(rng, dtype, tol, lse_tol):
    batch, cache, ks, vs, indptr, indices = decode_case(rng, [33, 0, 7, 90], "cpu", dtype, spare=16)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr.long(), indices.long(), torch.ones(4, dtype=torch.int32), HQ, HKV, D, 1,
           data_type=dtype, q_data_type=dtype)
    q = torch.randn(4, HQ, D, dtype=dtype)
    out, lse = w.run(q, cache, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    R.assert_close(to_np(out), to_np(lse), *R.attention(to_np(q), ks, vs, [1] * 4), tol=tol, lse_tol=lse_tol)


def test_fp8_cache_cpu_tensors(rng):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    batch, cache, _, _, indptr, indices = decode_case(rng, [20, 41], "cpu", torch.float32)
    k8, v8 = (c.to(torch.float8_e4m3fn) for c in cache)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indices, torch.ones(2, dtype=torch.int32), HQ, HKV, D, 1, kv_data_type=torch.float8_e4m3fn,
           q_data_type=torch.float32)
    q = torch.randn(2, HQ, D)
    out = w.forward(q, (k8, v8), k_scale=0.5, v_scale=2.0)
    ks = [to_np(k8.float()[indices[indptr[i]:indptr[i + 1]].long()]) * 0.5 for i in range(2)]
    vs = [to_np(v8.float()[indices[indptr[i]:indptr[i + 1]].long()]) * 2.0 for i in range(2)]
    # fp8 KV is computed through bf16 dot products (as in test_decode.py's fp8 case): bf16's bound
    # applies, well inside SEMANTICS.md's 5e-2 for fp8 KV.
    R.assert_close(to_np(out), None, *R.attention(to_np(q), ks, vs, [1, 1]), tol=1e-2)


def test_prefill_and_merge_cpu_tensors(rng):
    qo = torch.tensor([0, 5, 9], dtype=torch.int64)
    k = torch.randn(9, HKV, D)
    v = torch.randn(9, HKV, D)
    q = torch.randn(9, HQ, D)
    w = flashkv.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8))
    w.begin_forward(qo, qo, HQ, HKV, D)
    o, s = w.forward_return_lse(q, k, v, causal=True)
    ref = R.attention(to_np(q), [to_np(k[:5]), to_np(k[5:])], [to_np(v[:5]), to_np(v[5:])], [5, 4], causal=True)
    R.assert_close(to_np(o), to_np(s), *ref)
    o2, s2 = flashkv.merge_state(o, s, o, torch.full_like(s, -float("inf")))
    R.assert_close(to_np(o2), to_np(s2), *ref)


def sglang_style_graph_decode(rng, device, steps):
    """The decode path of SGLang's backend under CUDA graphs: one wrapper per captured batch
    size over fixed buffers, begin_forward swapped for fast_decode_plan, capture once, then
    re-plan + replay per step."""
    bs, max_ctx = 4, 256
    dtype = torch.bfloat16
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indices = torch.zeros(bs * max_ctx, dtype=torch.int32, device=device)
    last_page_len = torch.ones(bs, dtype=torch.int32, device=device)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                   paged_kv_indptr_buffer=kv_indptr,
                                                   paged_kv_indices_buffer=kv_indices,
                                                   paged_kv_last_page_len_buffer=last_page_len)
    slots = bs * max_ctx + 1
    k_cache = torch.randn(slots, HKV, D, dtype=dtype, device=device)
    v_cache = torch.randn(slots, HKV, D, dtype=dtype, device=device)
    q = torch.randn(bs, HQ, D, dtype=dtype, device=device)

    def plan(lens):
        lens_t = torch.tensor(lens, dtype=torch.int32)
        indptr_cpu = torch.zeros(bs + 1, dtype=torch.int32)
        indptr_cpu[1:] = torch.cumsum(lens_t, 0)
        perm = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))[
            : int(indptr_cpu[-1])] + 1
        kv_indptr.copy_(indptr_cpu)
        kv_indices[: perm.numel()].copy_(perm.to(torch.int32))
        w.begin_forward(kv_indptr, kv_indices, last_page_len, HQ, HKV, D, 1, data_type=dtype, q_data_type=dtype,
                        non_blocking=True, fixed_split_size=None, disable_split_kv=False,
                        **({"global_override_indptr_cpu": indptr_cpu} if hasattr(w.begin_forward, "func") else {}))
        return indptr_cpu, perm

    def reference(indptr_cpu, perm):
        kk, vv = to_np(k_cache), to_np(v_cache)
        idx = perm.numpy()
        ks = [kk[idx[indptr_cpu[i]:indptr_cpu[i + 1]]] for i in range(bs)]
        vs = [vv[idx[indptr_cpu[i]:indptr_cpu[i + 1]]] for i in range(bs)]
        return R.attention(to_np(q), ks, vs, [1] * bs, sm_scale=0.1, logits_soft_cap=30.0)

    plan([200, 3, 77, 1])
    w.begin_forward = functools.partial(flashkv.fast_decode_plan, w)
    out = torch.empty(bs, HQ, D, dtype=dtype, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture, as SGLang does
            w.forward(q, (k_cache, v_cache), sm_scale=0.1, logits_soft_cap=30.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(w.forward(q, (k_cache, v_cache), sm_scale=0.1, logits_soft_cap=30.0))
    for lens in steps:
        state = plan(lens)
        q.copy_(torch.randn(bs, HQ, D, dtype=dtype, device=device))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, _ = reference(*state)
        R.assert_close(to_np(out), None, ref_out, None, tol=1e-2)


@cuda
def test_cuda_graph_capture_decode(rng):
    sglang_style_graph_decode(rng, "cuda", steps=[[5, 250, 9, 64], [256, 256, 1, 2]])


@cuda
def test_cuda_wrappers_on_side_stream(rng):
    """Runs on a non-default stream are ordered on it (the caller's stream)."""
    batch, cache, ks, vs, indptr, indices = decode_case(rng, [300, 12, 1], "cuda", torch.float16)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, torch.ones(3, dtype=torch.int32, device="cuda"), HQ, HKV, D, 1)
    q = torch.randn(3, HQ, D, dtype=torch.float16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    R.assert_close(to_np(out), to_np(lse), *R.attention(to_np(q), ks, vs, [1, 1, 1]), tol=1e-2, lse_tol=2e-2)


@cuda
def test_cuda_prefill_paged_ragged_merge(rng):
    prefix, new = [40, 0, 300], [8, 17, 1]
    qo = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32, device="cuda")
    batch, cache, ks_p, vs_p, indptr, indices = decode_case(rng, prefix, "cuda", torch.bfloat16, spare=256)
    t = int(qo[-1])
    q = torch.randn(t, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(t, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(t, HKV, D, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    ragged = flashkv.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    paged = flashkv.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    ragged.begin_forward(qo, qo, HQ, HKV, D, q_data_type=torch.bfloat16)
    paged.begin_forward(qo, indptr, indices, torch.ones(3, dtype=torch.int32, device="cuda"), HQ, HKV, D, 1,
                        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, custom_mask=None, non_blocking=True)
    o1, s1 = ragged.forward_return_lse(q, k, v, causal=True, sm_scale=0.125)
    o2, s2 = paged.forward_return_lse(q, cache, causal=False, sm_scale=0.125)
    o, s = flashkv.merge_state(o1, s1, o2, s2)
    qo_h = qo.cpu().numpy()
    ks = [np.concatenate([ks_p[i], to_np(k[qo_h[i]:qo_h[i + 1]])]) for i in range(3)]
    vs = [np.concatenate([vs_p[i], to_np(v[qo_h[i]:qo_h[i + 1]])]) for i in range(3)]
    R.assert_close(to_np(o), to_np(s), *R.attention(to_np(q), ks, vs, new, causal=True, sm_scale=0.125),
                   tol=1e-2, lse_tol=2e-2)
