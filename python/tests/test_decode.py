"""BatchDecodeWithPagedKVCacheWrapper against the float64 reference, with NumPy arrays on the
CPU and PyTorch tensors on CUDA (the `xp` fixture, devices.py)."""

import functools

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan

HQ, HKV, D = 8, 2, 64  # 64: the smallest head dim the CUDA kernels have


def make_wrapper(workspace, **kw):
    return BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kw)


def plan(w, xp, batch, **kw):
    """w.plan of a batch's page table, moved to xp's device."""
    w.plan(*xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, batch.page_size, **kw)


def check(w, xp, rng, batch, run_kw=None, ref_kw=None, cache=None):
    """Runs w on a random q over the batch's cache (or `cache`, NumPy) and compares with the
    reference; returns q, out, lse as NumPy arrays."""
    q = rng.standard_normal((len(batch.kv_lens), HQ, D)).astype(batch.k_cache.dtype)
    out, lse = xp.get(w.run(xp.put(q), xp.put(batch.flat() if cache is None else cache), return_lse=True,
                            **(run_kw or {})))
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, ks, vs, [1] * len(batch.kv_lens), **(ref_kw or {}))
    R.assert_close(out, lse, ref_out, ref_lse)
    return q, out, lse


@pytest.mark.parametrize("page_size", [1, 4])
def test_matches_reference(xp, rng, workspace, page_size):
    batch = R.paged_batch(rng, [5, 0, 70, 17, 1], HKV, D, page_size, dtype=xp.float)
    w = make_wrapper(workspace)
    plan(w, xp, batch)
    _, out, lse = check(w, xp, rng, batch)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1])), "an empty request gives O = 0, LSE = -inf"


def test_cache_layouts(xp, rng, workspace):
    """NHD 4-D (k, v) tuples, the flattened 3-D view and one 5-D array [pages, 2, page_size,
    Hkv, D] read the same, at page sizes 4 and 1."""
    batch = R.paged_batch(rng, [9, 4, 13], HKV, D, page_size=4, dtype=xp.float)
    w = make_wrapper(workspace)
    plan(w, xp, batch)
    check(w, xp, rng, batch, cache=(batch.k_cache, batch.v_cache))
    check(w, xp, rng, batch, cache=batch.flat())
    check(w, xp, rng, batch, cache=np.stack([batch.k_cache, batch.v_cache], axis=1))
    batch1 = R.paged_batch(rng, [9, 4, 13], HKV, D, page_size=1, dtype=xp.float)
    plan(w, xp, batch1)
    check(w, xp, rng, batch1, cache=np.stack([batch1.k_cache, batch1.v_cache], axis=1))
    check(w, xp, rng, batch1, cache=[batch1.k_cache, batch1.v_cache])


def test_float16_and_int64_indices(xp, rng, workspace):
    batch = R.paged_batch(rng, [40, 3, 1], HKV, D, dtype=np.float16)
    w = make_wrapper(workspace)
    w.plan(*xp.put((batch.indptr.astype(np.int64), batch.indices.astype(np.int64),
                    batch.last_page_len.astype(np.int64))),
           HQ, HKV, D, 1, q_data_type="float16", data_type=np.float16)
    check(w, xp, rng, batch)


def test_indices_longer_than_indptr(xp, rng, workspace):
    batch = R.paged_batch(rng, [6, 11], HKV, D, dtype=xp.float)
    spare = np.concatenate([batch.indices, np.full(256, 10 ** 6, np.int32)])  # never read
    w = make_wrapper(workspace)
    w.plan(*xp.put((batch.indptr, spare, batch.last_page_len)), HQ, HKV, D, 1)
    check(w, xp, rng, batch)


def test_soft_cap_scale_window_at_plan(xp, rng, workspace):
    batch = R.paged_batch(rng, [30, 7, 64], HKV, D, dtype=xp.float)
    w = make_wrapper(workspace)
    plan(w, xp, batch, window_left=5, logits_soft_cap=2.5, sm_scale=0.3)
    check(w, xp, rng, batch, ref_kw=dict(window_left=5, logits_soft_cap=2.5, sm_scale=0.3))


def test_old_api_run_time_options(xp, rng, workspace):
    """begin_forward + forward/forward_return_lse with soft cap and sm_scale given only at run."""
    batch = R.paged_batch(rng, [12, 30], HKV, D, dtype=xp.float)
    w = make_wrapper(workspace)
    w.begin_forward(*xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 1)
    q = rng.standard_normal((2, HQ, D)).astype(xp.float)
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, ks, vs, [1, 1], logits_soft_cap=1.5, sm_scale=0.2)
    q_d, cache = xp.put(q), xp.put(batch.flat())
    out = w.forward(q_d, cache, sm_scale=0.2, logits_soft_cap=1.5)
    xp.assert_close(out, None, ref_out, ref_lse)
    out, lse = w.forward_return_lse(q_d, cache, sm_scale=0.2, logits_soft_cap=1.5)
    xp.assert_close(out, lse, ref_out, ref_lse)
    # run() after forward() keeps forward's options, as FlashInfer's does.
    xp.assert_close(w.run(q_d, cache), None, ref_out, ref_lse)
    w.end_forward()


def test_split_kv_options(xp, rng, workspace):
    batch = R.paged_batch(rng, [700, 5, 300], HKV, D, dtype=xp.float)
    w = make_wrapper(workspace)
    plan(w, xp, batch, fixed_split_size=64)
    assert w._plans["decode"].num_merges > 0 and w._plans["decode"].uses_caller_scratch
    check(w, xp, rng, batch)
    plan(w, xp, batch, disable_split_kv=True)
    assert w._plans["decode"].num_merges == 0
    check(w, xp, rng, batch)


def test_fixed_split_is_batch_invariant(xp, rng, workspace):
    """With fixed_split_size a request's output does not depend on the rest of the batch."""
    batch = R.paged_batch(rng, [900, 40, 333], HKV, D, dtype=xp.float)
    q = xp.put(rng.standard_normal((3, HQ, D)).astype(xp.float))
    cache = xp.put(batch.flat())
    w = make_wrapper(workspace)
    plan(w, xp, batch, fixed_split_size=128)
    full = xp.get(w.run(q, cache))
    alone_indptr = np.array([0, batch.indptr[1]], np.int32)
    w.plan(*xp.put((alone_indptr, batch.indices, batch.last_page_len[:1])), HQ, HKV, D, 1, fixed_split_size=128)
    alone = xp.get(w.run(q[:1], cache))
    assert np.array_equal(full[0], alone[0])


def test_small_workspace_falls_back_to_own_scratch(xp, rng):
    batch = R.paged_batch(rng, [800, 900], HKV, D, dtype=xp.float)
    w = make_wrapper(xp.zeros(64, np.uint8))
    plan(w, xp, batch, fixed_split_size=64)
    assert not w._plans["decode"].uses_caller_scratch
    check(w, xp, rng, batch)


def test_k_v_scales_fold_for_float_cache(xp, rng, workspace):
    batch = R.paged_batch(rng, [20, 9], HKV, D, dtype=xp.float)
    w = make_wrapper(workspace)
    plan(w, xp, batch)
    q = rng.standard_normal((2, HQ, D)).astype(xp.float)
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, [k * 0.5 for k in ks], [v * 3.0 for v in vs], [1, 1])
    out, lse = w.run(xp.put(q), xp.put(batch.flat()), k_scale=0.5, v_scale=3.0, return_lse=True)
    xp.assert_close(out, lse, ref_out, ref_lse)


def e4m3_to_float(bits: np.ndarray) -> np.ndarray:
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = bits & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return sign * val


def test_fp8_cache_as_uint8(xp, rng, workspace):
    """An fp8 (e4m3) cache stored as uint8, read through kv_data_type, with k/v scales."""
    kv_lens = [25, 3, 48]
    slots = sum(kv_lens) + 5
    bits_k = rng.integers(0, 255, size=(slots, HKV, D)).astype(np.uint8)
    bits_v = rng.integers(0, 255, size=(slots, HKV, D)).astype(np.uint8)
    bits_k[(bits_k & 0x7F) == 0x7F] = 0x10  # no NaN encodings
    bits_v[(bits_v & 0x7F) == 0x7F] = 0x22
    perm = rng.permutation(slots).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    indices = perm[: indptr[-1]]
    w = make_wrapper(workspace)
    w.plan(*xp.put((indptr, indices, np.ones(3, np.int32))), HQ, HKV, D, 1, q_data_type=np.dtype(xp.float).name,
           kv_data_type="float8_e4m3fn")
    q = rng.standard_normal((3, HQ, D)).astype(xp.float)
    kf, vf = e4m3_to_float(bits_k) / 64, e4m3_to_float(bits_v) / 64
    # Raw e4m3 bits reach +-448: a small k_scale keeps the logits in the range real caches have.
    k_scale = 1.0 / 128
    ks = [kf[indices[indptr[i]:indptr[i + 1]]] * k_scale for i in range(3)]
    vs = [vf[indices[indptr[i]:indptr[i + 1]]] * 2.0 for i in range(3)]
    ref_out, ref_lse = R.attention(q, [k * 64 for k in ks], [v * 64 for v in vs], [1, 1, 1])
    out, lse = w.run(xp.put(q), xp.put((bits_k, bits_v)), k_scale=k_scale, v_scale=2.0, return_lse=True)
    # SEMANTICS.md bounds fp8 KV at 5e-2 against the dequantized reference; the kernels compute
    # fp8 KV through 16-bit dot products (bf16 on the CPU), so f32's 1e-5 does not apply: the
    # 16-bit bounds do.
    xp.assert_close(out, lse, ref_out, ref_lse, tol=1e-2, lse_tol=2e-2)


def test_cuda_graph_mode_fixed_buffers(xp, rng, workspace):
    """use_cuda_graph: plan copies the page table into the caller's buffers, runs read only
    them, and a re-plan of another batch of the same size keeps every address."""
    bs, cap = 3, 400
    indptr_buf = xp.zeros(bs + 1, np.int32)
    indices_buf = xp.zeros(cap, np.int32)
    lpl_buf = xp.zeros(bs, np.int32)
    w = make_wrapper(workspace, use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
                     paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=lpl_buf)
    assert w.is_cuda_graph_enabled
    ptrs = None
    for lens in ([50, 1, 120], [7, 200, 33]):
        batch = R.paged_batch(rng, lens, HKV, D, dtype=xp.float)
        w.plan(*xp.put((batch.indptr, batch.indices.astype(np.int64), batch.last_page_len)), HQ, HKV, D, 1)
        assert np.array_equal(xp.get(indptr_buf), batch.indptr)
        assert np.array_equal(xp.get(indices_buf)[: batch.indptr[-1]], batch.indices)
        compiled = w._plans["decode"]
        assert compiled.cuda_graph
        if ptrs is None:
            ptrs = (compiled.workspace_ptr, compiled.scratch_ptr)
        assert (compiled.workspace_ptr, compiled.scratch_ptr) == ptrs
        check(w, xp, rng, batch)
    # The buffers are what runs read: changing them in place changes the result.
    batch2 = R.paged_batch(rng, [10, 10, 10], HKV, D, dtype=xp.float)
    w.plan(*xp.put((batch2.indptr, batch2.indices, batch2.last_page_len)), HQ, HKV, D, 1)
    indices_buf[: batch2.indptr[-1]] = xp.put(batch2.indices[::-1].copy())
    q = rng.standard_normal((3, HQ, D)).astype(xp.float)
    out = xp.get(w.run(xp.put(q), xp.put(batch2.flat())))
    ks, vs = batch2.all_kv()
    ref_out, _ = R.attention(q, ks, vs, [1, 1, 1])
    assert R.rel_error(out, ref_out) > 0.1
    with pytest.raises(flashkv.Error, match="CUDA-graph batch size"):
        w.plan(*xp.put((batch2.indptr[:3], batch2.indices, batch2.last_page_len[:2])), HQ, HKV, D, 1)


def test_begin_forward_reassigned_to_fast_decode_plan(xp, rng, workspace):
    """SGLang swaps a CUDA-graph wrapper's begin_forward for fast_decode_plan and passes the
    indptr it already has on the host."""
    bs = 2
    w = make_wrapper(workspace, use_cuda_graph=True, paged_kv_indptr_buffer=xp.zeros(bs + 1, np.int32),
                     paged_kv_indices_buffer=xp.zeros(100, np.int32),
                     paged_kv_last_page_len_buffer=xp.put(np.ones(bs, np.int32)))
    w.begin_forward = functools.partial(fast_decode_plan, w)
    assert w.begin_forward.func is fast_decode_plan
    batch = R.paged_batch(rng, [30, 12], HKV, D, dtype=xp.float)
    host_indptr = np.concatenate([batch.indptr, [999, 999]])  # longer than batch_size + 1
    dtype_name = np.dtype(xp.float).name
    w.begin_forward(*xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 1,
                    data_type=dtype_name, q_data_type=dtype_name, non_blocking=True, fixed_split_size=None,
                    disable_split_kv=False, global_override_indptr_cpu=host_indptr)
    check(w, xp, rng, batch)


def test_errors(xp, rng, workspace):
    batch = R.paged_batch(rng, [5, 6], HKV, D, dtype=xp.float)
    with pytest.raises(flashkv.Error, match="HND"):
        BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    with pytest.raises(flashkv.Error, match="jit_args"):
        BatchDecodeWithPagedKVCacheWrapper(workspace, jit_args=[1])
    with pytest.raises(flashkv.Error, match="paged_kv_indices_buffer"):
        BatchDecodeWithPagedKVCacheWrapper(workspace, use_cuda_graph=True,
                                           paged_kv_indptr_buffer=xp.zeros(3, np.int32),
                                           paged_kv_last_page_len_buffer=xp.zeros(2, np.int32))
    w = make_wrapper(workspace)
    q = xp.put(rng.standard_normal((2, HQ, D)).astype(xp.float))
    cache = xp.put(batch.flat())
    indptr, indices, lpl = xp.put((batch.indptr, batch.indices, batch.last_page_len))
    with pytest.raises(flashkv.Error, match="plan"):
        w.run(q, cache)
    with pytest.raises(flashkv.Error, match="pos_encoding_mode"):
        w.plan(indptr, indices, lpl, HQ, HKV, D, 1, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(flashkv.Error, match="non-decreasing"):
        w.plan(xp.put(np.array([0, 5, 3], np.int32)), indices, lpl, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="indices"):
        w.plan(indptr, indices[:3], lpl, HQ, HKV, D, 1)
    bad = batch.indices.copy()
    bad[0] = 10 ** 6
    w.plan(indptr, xp.put(bad), lpl, HQ, HKV, D, 1)
    if xp.is_cuda:
        # Index values live on the device: the CUDA kernels clamp them into the pool instead of
        # checking them on the host (a check would synchronize every run), so the run reads
        # some slot of the pool, never outside it.
        assert np.isfinite(xp.get(w.run(q, cache)).astype(np.float64)).all()
    else:
        with pytest.raises(flashkv.Error, match="kv.indices: entry 0 = 1000000 outside the pool"):
            w.run(q, cache)
    other = "bfloat16" if xp.float == np.float16 else "float16"  # a dtype q and the cache are not
    w.plan(indptr, indices, lpl, HQ, HKV, D, 1, q_data_type=other)
    with pytest.raises(flashkv.Error, match="q_data_type"):
        w.run(q, cache)
    w.plan(indptr, indices, lpl, HQ, HKV, D, 1, window_left=4)
    with pytest.raises(flashkv.Error, match="window_left"):
        w.run(q, cache, window_left=-1)
    w.plan(indptr, indices, lpl, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="rows"):
        w.run(q[:1], cache)
    with pytest.raises(flashkv.Error, match="head_dim"):
        w.run(xp.put(xp.get(q)[:, :, :16].copy()), cache)
    with pytest.raises(flashkv.Error, match="sinks"):
        w.run(q, cache, sinks=xp.zeros(HQ + 1, np.float32))
    with pytest.raises(flashkv.Error, match="kv_data_type"):
        w.plan(indptr, indices, lpl, HQ, HKV, D, 1, kv_data_type=other)
        w.run(q, cache)
    # A flashkv.Error is both a ValueError and a RuntimeError.
    assert issubclass(flashkv.Error, ValueError) and issubclass(flashkv.Error, RuntimeError)
