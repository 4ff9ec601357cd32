"""BatchPrefillWithPagedKVCacheWrapper and BatchPrefillWithRaggedKVCacheWrapper against the
float64 reference, with NumPy arrays on the CPU and PyTorch tensors on CUDA (the `xp` fixture,
devices.py), including SGLang's extend pattern (ragged causal + paged prefix merged by LSE)."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

HQ, HKV, D = 4, 2, 64  # 64: the smallest head dim the CUDA kernels have


def qo_indptr_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def random_q(rng, n, dtype, hq=HQ, d=D):
    return rng.standard_normal((n, hq, d)).astype(dtype)


def page_table(xp, batch):
    """A batch's (indptr, indices, last_page_len) on xp's device."""
    return xp.put((batch.indptr, batch.indices, batch.last_page_len))


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_matches_reference(xp, rng, workspace, page_size, causal):
    kv_lens, qo_lens = [40, 7, 0, 65], [9, 7, 0, 1]
    batch = R.paged_batch(rng, kv_lens, HKV, D, page_size, dtype=xp.float)
    qo = qo_indptr_of(qo_lens)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(xp.put(qo), *page_table(xp, batch), HQ, HKV, D, page_size, causal=causal)
    q = random_q(rng, qo[-1], xp.float)
    out, lse = w.run(xp.put(q), xp.put((batch.k_cache, batch.v_cache)), return_lse=True)
    ks, vs = batch.all_kv()
    xp.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=causal))


def test_paged_run_time_options_and_causal(xp, rng, workspace):
    """SGLang's paged path: plan without causal, then forward(causal=True, sm_scale, soft cap,
    window_left) per layer; a plan with causal=True refuses a non-causal run."""
    kv_lens, qo_lens = [50, 20, 33], [10, 20, 1]
    batch = R.paged_batch(rng, kv_lens, HKV, D, dtype=xp.float)
    qo = xp.put(qo_indptr_of(qo_lens))
    dtype_name = np.dtype(xp.float).name
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.begin_forward(qo, *page_table(xp, batch), HQ, HKV, D, 1,
                    q_data_type=xp.float, kv_data_type=dtype_name, custom_mask=None, non_blocking=True,
                    fixed_split_size=None, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                    token_pos_in_items_len=0, max_item_len_ptr=None)
    q = random_q(rng, sum(qo_lens), xp.float)
    q_d, cache = xp.put(q), xp.put(batch.flat())
    ks, vs = batch.all_kv()
    for causal in (True, False):
        kw = dict(causal=causal, sm_scale=0.25, window_left=12, logits_soft_cap=3.0, k_scale=None, v_scale=None)
        out = w.forward(q_d, cache, **kw)
        ref = R.attention(q, ks, vs, qo_lens, causal=causal, sm_scale=0.25, window_left=12, logits_soft_cap=3.0)
        xp.assert_close(out, None, *ref)
        out, lse = w.forward_return_lse(q_d, cache, **kw)
        xp.assert_close(out, lse, *ref)
    assert set(w._plans) == {"causal", "full"}
    w.plan(qo, *page_table(xp, batch), HQ, HKV, D, 1, causal=True)
    with pytest.raises(flashkv.Error, match="causal"):
        w.forward(q_d, cache, causal=False)


def test_paged_custom_mask(xp, rng, workspace):
    """Tree masks of speculative verification: each request's [qo_len, kv_len] booleans."""
    kv_lens, qo_lens = [12, 30, 5], [4, 4, 4]
    batch = R.paged_batch(rng, kv_lens, HKV, D, dtype=xp.float)
    qo = xp.put(qo_indptr_of(qo_lens))
    masks = [rng.random((lq, lk)) < 0.6 for lq, lk in zip(qo_lens, kv_lens)]
    masks[2][1] = False  # a row that sees nothing
    flat = np.concatenate([m.reshape(-1) for m in masks])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(qo, *page_table(xp, batch), HQ, HKV, D, 1, custom_mask=xp.put(flat))
    q = random_q(rng, sum(qo_lens), xp.float)
    out, lse = xp.get(w.forward_return_lse(xp.put(q), xp.put(batch.flat()), causal=True))  # the mask replaces causal
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, ks, vs, qo_lens, masks=masks)
    R.assert_close(out, lse, ref_out, ref_lse)
    assert np.all(np.isneginf(lse[9])) and np.all(out[9] == 0)
    with pytest.raises(flashkv.Error, match="custom_mask"):
        w.plan(qo, *page_table(xp, batch), HQ, HKV, D, 1, custom_mask=xp.put(flat[:-1]))
    with pytest.raises(flashkv.Error, match="packed_custom_mask"):
        w.plan(qo, *page_table(xp, batch), HQ, HKV, D, 1,
               packed_custom_mask=xp.put(np.packbits(flat, bitorder="little")))


def test_paged_cuda_graph_buffers_with_mask(xp, rng, workspace):
    bs = 2
    bufs = dict(qo_indptr_buf=xp.zeros(bs + 1, np.int32), paged_kv_indptr_buf=xp.zeros(bs + 1, np.int32),
                paged_kv_indices_buf=xp.zeros(200, np.int32),
                paged_kv_last_page_len_buf=xp.put(np.ones(bs, np.int32)),
                custom_mask_buf=xp.zeros(2000, np.uint8), mask_indptr_buf=xp.zeros(bs + 1, np.int32))
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, **bufs)
    ptrs = None
    for kv_lens in ([20, 41], [33, 8]):
        qo_lens = [3, 3]
        batch = R.paged_batch(rng, kv_lens, HKV, D, dtype=xp.float)
        masks = [rng.random((3, n)) < 0.7 for n in kv_lens]
        flat = np.concatenate([m.reshape(-1) for m in masks])
        w.plan(xp.put(qo_indptr_of(qo_lens)), *page_table(xp, batch), HQ, HKV, D, 1, custom_mask=xp.put(flat))
        assert np.array_equal(xp.get(bufs["custom_mask_buf"])[: flat.size], flat.astype(np.uint8))
        assert np.array_equal(xp.get(bufs["mask_indptr_buf"]), qo_indptr_of([m.size for m in masks]))
        plan = w._plans["full"]
        ptrs = ptrs or (plan.workspace_ptr, plan.scratch_ptr)
        assert (plan.workspace_ptr, plan.scratch_ptr) == ptrs
        q = random_q(rng, 6, xp.float)
        out, lse = w.run(xp.put(q), xp.put(batch.flat()), return_lse=True)
        ks, vs = batch.all_kv()
        xp.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, masks=masks))
    with pytest.raises(flashkv.Error, match="custom_mask"):
        w.plan(xp.put(qo_indptr_of([3, 3])), *page_table(xp, batch), HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="query rows"):
        w.plan(xp.put(qo_indptr_of([3, 4])), *page_table(xp, batch), HQ, HKV, D, 1,
               custom_mask=xp.put(np.ones(7 * 41, bool)))


# V narrower than Q/K: 192/128 is the pair the CUDA prefill kernels have (DeepSeek's MLA shape).
RAGGED_DQK, RAGGED_DV = 192, 128


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_matches_reference(xp, rng, workspace, causal):
    qo_lens, kv_lens = [5, 0, 33, 17], [5, 3, 70, 17]
    qo, kvp = qo_indptr_of(qo_lens), qo_indptr_of(kv_lens)
    k = rng.standard_normal((kvp[-1], HKV, RAGGED_DQK)).astype(xp.float)
    v = rng.standard_normal((kvp[-1], HKV, RAGGED_DV)).astype(xp.float)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    w.plan(xp.put(qo), xp.put(kvp.astype(np.int64)), HQ, HKV, RAGGED_DQK, head_dim_vo=RAGGED_DV, causal=causal,
           logits_soft_cap=4.0)
    q = random_q(rng, qo[-1], xp.float, d=RAGGED_DQK)
    out, lse = w.run_return_lse(*xp.put((q, k, v)))
    assert tuple(out.shape) == (qo[-1], HQ, RAGGED_DV)
    ks = [k[kvp[i]:kvp[i + 1]] for i in range(4)]
    vs = [v[kvp[i]:kvp[i + 1]] for i in range(4)]
    xp.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=causal, logits_soft_cap=4.0))


def test_extend_ragged_plus_paged_prefix_merged(xp, rng, workspace):
    """SGLang's extend with a cached prefix: ragged causal over the new tokens, paged
    non-causal over the prefix, merged by LSE, equals causal attention over everything."""
    prefix, new = [30, 0, 12], [6, 9, 1]
    full = [p + n for p, n in zip(prefix, new)]
    qo = qo_indptr_of(new)
    batch = R.paged_batch(rng, prefix, HKV, D, dtype=xp.float)
    k_new = rng.standard_normal((qo[-1], HKV, D)).astype(xp.float)
    v_new = rng.standard_normal((qo[-1], HKV, D)).astype(xp.float)
    q = random_q(rng, qo[-1], xp.float)
    dtype_name = np.dtype(xp.float).name
    ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")  # the same shared workspace
    qo_d = xp.put(qo)
    ragged.begin_forward(qo_d, qo_d, HQ, HKV, D, q_data_type=dtype_name)
    paged.begin_forward(qo_d, *xp.put((batch.indptr, np.concatenate([batch.indices, np.zeros(256, np.int32)]),
                                       batch.last_page_len)), HQ, HKV, D, 1, q_data_type=dtype_name)
    q_d = xp.put(q)
    o1, s1 = ragged.forward_return_lse(q_d, *xp.put((k_new, v_new)), causal=True, sm_scale=0.2, logits_soft_cap=2.0)
    o2, s2 = paged.forward_return_lse(q_d, xp.put(batch.flat()), causal=False, sm_scale=0.2, logits_soft_cap=2.0)
    o, s = flashkv.merge_state(o1, s1, o2, s2)
    ks_p, vs_p = batch.all_kv()
    ks = [np.concatenate([ks_p[i], k_new[qo[i]:qo[i + 1]]]) for i in range(3)]
    vs = [np.concatenate([vs_p[i], v_new[qo[i]:qo[i + 1]]]) for i in range(3)]
    assert [len(x) for x in ks] == full
    xp.assert_close(o, s, *R.attention(q, ks, vs, new, causal=True, sm_scale=0.2, logits_soft_cap=2.0))


def test_extend_with_float32_partial_outputs(xp, rng, workspace):
    """o_data_type=float32 on 16-bit inputs: the ragged and paged halves of an extend write fp32
    outputs, merge_state combines them unrounded, and the result is closer to the reference than
    the same extend with 16-bit partial outputs; decode writes fp32 too."""
    prefix, new = [40, 3, 0, 77], [9, 5, 4, 1]
    qo = qo_indptr_of(new)
    f16 = np.float16
    batch = R.paged_batch(rng, prefix, HKV, D, dtype=f16)
    k_new = rng.standard_normal((qo[-1], HKV, D)).astype(f16)
    v_new = rng.standard_normal((qo[-1], HKV, D)).astype(f16)
    q = random_q(rng, qo[-1], f16)
    ks_p, vs_p = batch.all_kv()
    ks = [np.concatenate([ks_p[i], k_new[qo[i]:qo[i + 1]]]) for i in range(4)]
    vs = [np.concatenate([vs_p[i], v_new[qo[i]:qo[i + 1]]]) for i in range(4)]
    ref_o, ref_s = R.attention(q, ks, vs, new, causal=True)
    qo_d, q_d = xp.put(qo), xp.put(q)
    errors = {}
    for o_dt in (None, "float32"):
        ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        ragged.plan(qo_d, qo_d, HQ, HKV, D, q_data_type="float16", o_data_type=o_dt, causal=True)
        paged.plan(qo_d, *page_table(xp, batch), HQ, HKV, D, 1, q_data_type="float16", o_data_type=o_dt)
        o1, s1 = ragged.run(q_d, *xp.put((k_new, v_new)), return_lse=True)
        o2, s2 = paged.run(q_d, xp.put((batch.k_cache, batch.v_cache)), return_lse=True)
        want = np.float32 if o_dt else f16
        assert xp.get(o1).dtype == want and xp.get(o2).dtype == want
        o, s = flashkv.merge_state(o1, s1, o2, s2)
        assert xp.get(o).dtype == want
        R.assert_close(xp.get(o), xp.get(s), ref_o, ref_s, *R.bounds(f16))
        errors[o_dt] = R.rel_error(xp.get(o), ref_o)
    assert errors["float32"] < 0.8 * errors[None], errors

    dec = flashkv.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    dec.plan(*page_table(xp, batch), HQ, HKV, D, 1, q_data_type="float16", o_data_type="float32")
    q1 = random_q(rng, len(prefix), f16)
    o, s = dec.run(xp.put(q1), xp.put((batch.k_cache, batch.v_cache)), return_lse=True)
    assert xp.get(o).dtype == np.float32
    R.assert_close(xp.get(o), xp.get(s), *R.attention(q1, ks_p, vs_p, [1] * len(prefix)), *R.bounds(f16))


def test_ragged_cuda_graph_buffers(xp, rng, workspace):
    bs = 2
    qo_buf, kv_buf = xp.zeros(bs + 1, np.int32), xp.zeros(bs + 1, np.int32)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf,
                                             kv_indptr_buf=kv_buf)
    for lens in ([7, 9], [12, 4]):
        qo = qo_indptr_of(lens)
        w.plan(xp.put(qo), xp.put(qo), HQ, HKV, D, causal=True)
        assert np.array_equal(xp.get(qo_buf), qo) and np.array_equal(xp.get(kv_buf), qo)
        k = rng.standard_normal((16, HKV, D)).astype(xp.float)
        v = rng.standard_normal((16, HKV, D)).astype(xp.float)
        q = random_q(rng, 16, xp.float)
        out = w.run(*xp.put((q, k, v)))
        ks = [k[qo[i]:qo[i + 1]] for i in range(2)]
        vs = [v[qo[i]:qo[i + 1]] for i in range(2)]
        xp.assert_close(out, None, *R.attention(q, ks, vs, lens, causal=True))


def test_prefill_errors(xp, rng, workspace):
    batch = R.paged_batch(rng, [8, 8], HKV, D, dtype=xp.float)
    qo = xp.put(qo_indptr_of([2, 2]))
    table = page_table(xp, batch)
    cache = xp.put(batch.flat())
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    for kw in (dict(prefix_len_ptr=xp.put(np.zeros(2, np.int32))),
               dict(token_pos_in_items_ptr=xp.put(np.zeros(4, np.int32))),
               dict(token_pos_in_items_len=4), dict(max_item_len_ptr=xp.put(np.zeros(2, np.int32)))):
        with pytest.raises(flashkv.Error, match="multi-item scoring"):
            w.plan(qo, *table, HQ, HKV, D, 1, **kw)
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        w.plan(xp.put(np.array([0, 3, 1], np.int32)), *table, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="paged_kv_indptr"):
        w.plan(qo, table[0][:2], *table[1:], HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="num_qo_heads"):
        w.plan(qo, *table, 3, HKV, D, 1)
    w.plan(qo, *table, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="num_qo_tokens"):
        w.run(xp.put(random_q(rng, 5, xp.float)), cache)
    with pytest.raises(flashkv.Error, match=f"kv.k: expected size {D}"):
        w.run(xp.put(random_q(rng, 4, xp.float)), (xp.put(batch.flat()[0][:, :, :D // 2].copy()), cache[1]))
    r = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    with pytest.raises(flashkv.Error, match="kv_indptr_buf"):
        BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo)
    r.plan(qo, qo, HQ, HKV, D)
    with pytest.raises(flashkv.Error, match="kv_indptr"):
        r.run(xp.put(random_q(rng, 4, xp.float)), xp.zeros((3, HKV, D), xp.float), xp.zeros((3, HKV, D), xp.float))
