"""BatchPrefillWithPagedKVCacheWrapper and BatchPrefillWithRaggedKVCacheWrapper on the CPU
(NumPy) against the float64 reference, including SGLang's extend pattern (ragged causal + paged
prefix merged by LSE)."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

HQ, HKV, D = 4, 2, 32


def qo_indptr_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def random_q(rng, n, dtype=np.float32, hq=HQ, d=D):
    return rng.standard_normal((n, hq, d)).astype(dtype)


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_matches_reference(rng, workspace, page_size, causal):
    kv_lens, qo_lens = [40, 7, 0, 65], [9, 7, 0, 1]
    batch = R.paged_batch(rng, kv_lens, HKV, D, page_size)
    qo = qo_indptr_of(qo_lens)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, page_size, causal=causal)
    q = random_q(rng, qo[-1])
    out, lse = w.run(q, (batch.k_cache, batch.v_cache), return_lse=True)
    ks, vs = batch.all_kv()
    R.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=causal))


def test_paged_run_time_options_and_causal(rng, workspace):
    """SGLang's paged path: plan without causal, then forward(causal=True, sm_scale, soft cap,
    window_left) per layer; a plan with causal=True refuses a non-causal run."""
    kv_lens, qo_lens = [50, 20, 33], [10, 20, 1]
    batch = R.paged_batch(rng, kv_lens, HKV, D)
    qo = qo_indptr_of(qo_lens)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.begin_forward(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1,
                    q_data_type=np.float32, kv_data_type="float32", custom_mask=None, non_blocking=True,
                    fixed_split_size=None, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                    token_pos_in_items_len=0, max_item_len_ptr=None)
    q = random_q(rng, qo[-1])
    ks, vs = batch.all_kv()
    for causal in (True, False):
        kw = dict(causal=causal, sm_scale=0.25, window_left=12, logits_soft_cap=3.0, k_scale=None, v_scale=None)
        out = w.forward(q, batch.flat(), **kw)
        ref = R.attention(q, ks, vs, qo_lens, causal=causal, sm_scale=0.25, window_left=12, logits_soft_cap=3.0)
        R.assert_close(out, None, *ref)
        out, lse = w.forward_return_lse(q, batch.flat(), **kw)
        R.assert_close(out, lse, *ref)
    assert set(w._plans) == {"causal", "full"}
    w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1, causal=True)
    with pytest.raises(flashkv.Error, match="causal"):
        w.forward(q, batch.flat(), causal=False)


def test_paged_custom_mask(rng, workspace):
    """Tree masks of speculative verification: each request's [qo_len, kv_len] booleans."""
    kv_lens, qo_lens = [12, 30, 5], [4, 4, 4]
    batch = R.paged_batch(rng, kv_lens, HKV, D)
    qo = qo_indptr_of(qo_lens)
    masks = [rng.random((lq, lk)) < 0.6 for lq, lk in zip(qo_lens, kv_lens)]
    masks[2][1] = False  # a row that sees nothing
    flat = np.concatenate([m.reshape(-1) for m in masks])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1, custom_mask=flat)
    q = random_q(rng, qo[-1])
    out, lse = w.forward_return_lse(q, batch.flat(), causal=True)  # the mask replaces causal
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, ks, vs, qo_lens, masks=masks)
    R.assert_close(out, lse, ref_out, ref_lse)
    assert np.all(np.isneginf(lse[9])) and np.all(out[9] == 0)
    with pytest.raises(flashkv.Error, match="custom_mask"):
        w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1, custom_mask=flat[:-1])
    with pytest.raises(flashkv.Error, match="packed_custom_mask"):
        w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1,
               packed_custom_mask=np.packbits(flat, bitorder="little"))


def test_paged_cuda_graph_buffers_with_mask(rng, workspace):
    bs = 2
    bufs = dict(qo_indptr_buf=np.zeros(bs + 1, np.int32), paged_kv_indptr_buf=np.zeros(bs + 1, np.int32),
                paged_kv_indices_buf=np.zeros(200, np.int32), paged_kv_last_page_len_buf=np.ones(bs, np.int32),
                custom_mask_buf=np.zeros(2000, np.uint8), mask_indptr_buf=np.zeros(bs + 1, np.int32))
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, **bufs)
    ptrs = None
    for kv_lens in ([20, 41], [33, 8]):
        qo_lens = [3, 3]
        batch = R.paged_batch(rng, kv_lens, HKV, D)
        masks = [rng.random((3, n)) < 0.7 for n in kv_lens]
        flat = np.concatenate([m.reshape(-1) for m in masks])
        w.plan(qo_indptr_of(qo_lens), batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1,
               custom_mask=flat)
        assert np.array_equal(bufs["custom_mask_buf"][: flat.size], flat.astype(np.uint8))
        assert np.array_equal(bufs["mask_indptr_buf"], qo_indptr_of([m.size for m in masks]))
        plan = w._plans["full"]
        ptrs = ptrs or (plan.workspace_ptr, plan.scratch_ptr)
        assert (plan.workspace_ptr, plan.scratch_ptr) == ptrs
        q = random_q(rng, 6)
        out, lse = w.run(q, batch.flat(), return_lse=True)
        ks, vs = batch.all_kv()
        R.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, masks=masks))
    with pytest.raises(flashkv.Error, match="custom_mask"):
        w.plan(qo_indptr_of([3, 3]), batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="query rows"):
        w.plan(qo_indptr_of([3, 4]), batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1,
               custom_mask=np.ones(7 * 41, bool))


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_matches_reference(rng, workspace, causal):
    qo_lens, kv_lens = [5, 0, 33, 17], [5, 3, 70, 17]
    qo, kvp = qo_indptr_of(qo_lens), qo_indptr_of(kv_lens)
    k = rng.standard_normal((kvp[-1], HKV, D)).astype(np.float32)
    v = rng.standard_normal((kvp[-1], HKV, 16)).astype(np.float32)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    w.plan(qo, kvp.astype(np.int64), HQ, HKV, D, head_dim_vo=16, causal=causal, logits_soft_cap=4.0)
    q = random_q(rng, qo[-1])
    out, lse = w.run_return_lse(q, k, v)
    assert out.shape == (qo[-1], HQ, 16)
    ks = [k[kvp[i]:kvp[i + 1]] for i in range(4)]
    vs = [v[kvp[i]:kvp[i + 1]] for i in range(4)]
    R.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=causal, logits_soft_cap=4.0))


def test_extend_ragged_plus_paged_prefix_merged(rng, workspace):
    """SGLang's extend with a cached prefix: ragged causal over the new tokens, paged
    non-causal over the prefix, merged by LSE, equals causal attention over everything."""
    prefix, new = [30, 0, 12], [6, 9, 1]
    full = [p + n for p, n in zip(prefix, new)]
    qo = qo_indptr_of(new)
    batch = R.paged_batch(rng, prefix, HKV, D)
    k_new = rng.standard_normal((qo[-1], HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((qo[-1], HKV, D)).astype(np.float32)
    q = random_q(rng, qo[-1])
    ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")  # the same shared workspace
    ragged.begin_forward(qo, qo, HQ, HKV, D, q_data_type="float32")
    paged.begin_forward(qo, batch.indptr, np.concatenate([batch.indices, np.zeros(256, np.int32)]),
                        batch.last_page_len, HQ, HKV, D, 1, q_data_type="float32")
    o1, s1 = ragged.forward_return_lse(q, k_new, v_new, causal=True, sm_scale=0.2, logits_soft_cap=2.0)
    o2, s2 = paged.forward_return_lse(q, batch.flat(), causal=False, sm_scale=0.2, logits_soft_cap=2.0)
    o, s = flashkv.merge_state(o1, s1, o2, s2)
    ks_p, vs_p = batch.all_kv()
    ks = [np.concatenate([ks_p[i], k_new[qo[i]:qo[i + 1]]]) for i in range(3)]
    vs = [np.concatenate([vs_p[i], v_new[qo[i]:qo[i + 1]]]) for i in range(3)]
    assert [len(x) for x in ks] == full
    R.assert_close(o, s, *R.attention(q, ks, vs, new, causal=True, sm_scale=0.2, logits_soft_cap=2.0))


def test_ragged_cuda_graph_buffers(rng, workspace):
    bs = 2
    qo_buf, kv_buf = np.zeros(bs + 1, np.int32), np.zeros(bs + 1, np.int32)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf,
                                             kv_indptr_buf=kv_buf)
    for lens in ([7, 9], [12, 4]):
        qo = qo_indptr_of(lens)
        w.plan(qo, qo, HQ, HKV, D, causal=True)
        assert np.array_equal(qo_buf, qo) and np.array_equal(kv_buf, qo)
        k = rng.standard_normal((16, HKV, D)).astype(np.float32)
        v = rng.standard_normal((16, HKV, D)).astype(np.float32)
        q = random_q(rng, 16)
        out = w.run(q, k, v)
        ks = [k[qo[i]:qo[i + 1]] for i in range(2)]
        vs = [v[qo[i]:qo[i + 1]] for i in range(2)]
        R.assert_close(out, None, *R.attention(q, ks, vs, lens, causal=True))


def test_prefill_errors(rng, workspace):
    batch = R.paged_batch(rng, [8, 8], HKV, D)
    qo = qo_indptr_of([2, 2])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    for kw in (dict(prefix_len_ptr=np.zeros(2, np.uint32)), dict(token_pos_in_items_ptr=np.zeros(4, np.uint16)),
               dict(token_pos_in_items_len=4), dict(max_item_len_ptr=np.zeros(2, np.uint16))):
        with pytest.raises(flashkv.Error, match="multi-item scoring"):
            w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1, **kw)
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        w.plan(np.array([0, 3, 1], np.int32), batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="paged_kv_indptr"):
        w.plan(qo, batch.indptr[:2], batch.indices, batch.last_page_len, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="num_qo_heads"):
        w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, 3, HKV, D, 1)
    w.plan(qo, batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1)
    with pytest.raises(flashkv.Error, match="num_qo_tokens"):
        w.run(random_q(rng, 5), batch.flat())
    with pytest.raises(flashkv.Error, match="kv.k: expected size 32"):
        w.run(random_q(rng, 4), (batch.flat()[0][:, :, :16].copy(), batch.flat()[1]))
    r = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    with pytest.raises(flashkv.Error, match="kv_indptr_buf"):
        BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo)
    r.plan(qo, qo, HQ, HKV, D)
    with pytest.raises(flashkv.Error, match="kv_indptr"):
        r.run(random_q(rng, 4), np.zeros((3, HKV, D), np.float32), np.zeros((3, HKV, D), np.float32))
