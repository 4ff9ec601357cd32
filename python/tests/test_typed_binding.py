"""The compiled module's typed binding: BatchShape, PlanOptions and AttentionOptions built from
Python with keywords, misspelled keywords and positional lists refused, bad field values
raised as flashkv.Error naming the field, and a plan made through them checked against the
float64 reference (devices.py's `xp` fixture: NumPy on the CPU, PyTorch on CUDA)."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import _arrays as A
from flashkv import _flashkv as C

HQ, HKV, D = 8, 2, 64  # 64: the smallest head dim the CUDA kernels have


def test_structs_take_keywords_and_keep_fields():
    kv_len = np.array([5, 0, 9], np.int32)
    qo_indptr = np.array([0, 2, 2, 5], np.int32)
    b = C.BatchShape(kv_len=kv_len, qo_indptr=qo_indptr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                     head_dim_v=32, page_size=4, causal=True, window_left=7)
    assert (b.batch_size, b.num_qo_heads, b.num_kv_heads, b.head_dim_qk, b.head_dim_v) == (3, HQ, HKV, D, 32)
    assert (b.page_size, b.causal, b.window_left) == (4, True, 7)
    assert b.kv_len is kv_len and b.qo_indptr is qo_indptr
    b.causal, b.window_left, b.qo_indptr = False, -1, None
    assert (b.causal, b.window_left, b.qo_indptr) == (False, -1, None)
    b.kv_len = np.zeros(7, np.int32)
    assert b.batch_size == 7

    # Defaults are those of the C++ structs.
    d = C.BatchShape()
    assert (d.batch_size, d.kv_len, d.qo_indptr, d.page_size, d.causal, d.window_left) == (0, None, None, 1, False, -1)
    o = C.PlanOptions()
    assert (o.q_tile, o.enable_split_kv, o.fixed_split_size, o.kv_align, o.cuda_graph) == (0, True, 0, 0, False)
    assert (o.max_batch_size, o.max_num_tokens, o.max_kv_len, o.blocks_per_sm, o.min_split_size) == (0,) * 5
    o = C.PlanOptions(enable_split_kv=False, fixed_split_size=256, cuda_graph=True, max_batch_size=4,
                      max_num_tokens=64, max_kv_len=1024, q_tile=32, kv_align=32, blocks_per_sm=1, min_split_size=64)
    assert (o.enable_split_kv, o.fixed_split_size, o.cuda_graph, o.max_batch_size) == (False, 256, True, 4)
    assert (o.max_num_tokens, o.max_kv_len, o.q_tile, o.kv_align, o.blocks_per_sm, o.min_split_size) == (
        64, 1024, 32, 32, 1, 64)
    o.fixed_split_size = 0
    assert o.fixed_split_size == 0

    a = C.AttentionOptions()
    assert (a.causal, a.window_left, a.logits_soft_cap, a.sm_scale, a.custom_mask, a.mask_indptr) == (
        True, -1, 0.0, 0.0, None, None)
    mask = np.ones(6, np.bool_)
    a = C.AttentionOptions(causal=False, window_left=3, logits_soft_cap=2.5, sm_scale=0.125, custom_mask=mask,
                           mask_indptr=np.array([0, 6], np.int32))
    assert (a.causal, a.window_left, a.logits_soft_cap, a.sm_scale) == (False, 3, 2.5, 0.125)
    assert a.custom_mask is mask
    a.custom_mask = a.mask_indptr = None
    assert a.custom_mask is None and a.mask_indptr is None


def test_misspelled_or_positional_arguments_are_type_errors():
    with pytest.raises(TypeError):
        C.BatchShape(num_qo_head=HQ)
    with pytest.raises(TypeError):
        C.PlanOptions(fixed_split=16)
    with pytest.raises(TypeError):
        C.AttentionOptions(casual=True)
    with pytest.raises(TypeError):
        C.PlanOptions(0, True)  # keyword-only
    with pytest.raises(AttributeError):
        C.PlanOptions().fixed_split = 16  # no such field
    plan = C.Plan("cpu")
    batch = C.BatchShape(kv_len=np.array([3], np.int32), num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                         head_dim_v=D)
    with pytest.raises(TypeError):
        plan.plan(True, batch, C.PlanOptions(), 0)  # keyword-only
    with pytest.raises(TypeError):
        plan.plan(decode=True, batch=batch, option=C.PlanOptions(), stream=0)
    with pytest.raises(TypeError):
        plan.plan(decode=True, batch=C.PlanOptions(), options=C.PlanOptions(), stream=0)


def test_bad_field_values_raise_errors_naming_them():
    with pytest.raises(flashkv.Error, match="kv_len"):
        C.BatchShape(kv_len=np.zeros(3, np.float32))
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        C.BatchShape(qo_indptr=np.zeros((2, 2), np.int32))
    with pytest.raises(flashkv.Error, match="kv_len"):
        C.BatchShape(kv_len=[1, 2, 3])
    with pytest.raises(flashkv.Error, match="custom_mask"):
        C.AttentionOptions(custom_mask=np.zeros(4, np.float64))
    b = C.BatchShape(kv_len=np.array([4, 4], np.int32))
    with pytest.raises(flashkv.Error, match="kv_len"):
        b.kv_len = np.zeros(3, np.int64)
    assert b.batch_size == 2, "a failed set leaves the field as it was"

    def plan(decode=True, qo_indptr=None, options=None, **shape):
        fields = dict(kv_len=np.array([4, 9], np.int32), qo_indptr=qo_indptr, num_qo_heads=HQ, num_kv_heads=HKV,
                      head_dim_qk=D, head_dim_v=D)
        fields.update(shape)
        C.Plan("cpu").plan(decode=decode, batch=C.BatchShape(**fields), options=options or C.PlanOptions(),
                           stream=0)

    plan()
    with pytest.raises(flashkv.Error, match="num_kv_heads"):
        plan(num_kv_heads=0)
    with pytest.raises(flashkv.Error, match="page_size"):
        plan(page_size=0)
    with pytest.raises(flashkv.Error, match="head_dim_v"):
        plan(head_dim_v=0)
    with pytest.raises(flashkv.Error, match="kv_len"):
        plan(kv_len=np.array([4, -1], np.int32))
    with pytest.raises(flashkv.Error, match="fixed_split_size"):
        plan(options=C.PlanOptions(fixed_split_size=-1))
    with pytest.raises(flashkv.Error, match="max_batch_size"):
        plan(options=C.PlanOptions(cuda_graph=True))
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        plan(qo_indptr=np.array([0, 1, 2], np.int32))  # a decode batch has none
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        plan(decode=False, qo_indptr=np.array([0, 1], np.int32))  # batch_size + 1 entries
    with pytest.raises(flashkv.Error, match="qo_indptr"):
        plan(decode=False)


def test_typed_decode_plan_matches_reference(xp, rng, workspace):
    """A decode batch planned and run through the structs, split into fixed chunks so that the
    merge runs too; a bad run option is named."""
    batch = R.paged_batch(rng, [5, 0, 70, 17, 1], HKV, D, page_size=4, dtype=xp.float)
    plan = C.Plan(xp.device, A.dl(workspace))
    kv_len = np.array(batch.kv_lens, np.int32)
    shape = C.BatchShape(kv_len=kv_len, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, head_dim_v=D,
                         page_size=batch.page_size, window_left=40)
    plan.plan(decode=True, batch=shape, options=C.PlanOptions(fixed_split_size=16), stream=0)
    assert plan.decode and plan.batch_size == 5 and plan.kv_chunk == 16 and plan.num_merges > 0

    q = rng.standard_normal((len(kv_len), HQ, D)).astype(xp.float)
    q_d = xp.put(q)
    k, v, indptr, indices, last = xp.put((batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                          batch.last_page_len))
    out, lse = xp.put((np.empty_like(q), np.empty(q.shape[:2], np.float32)))

    def run(options):
        plan.run_paged(q=A.dl(q_d), k_cache=A.dl(k), v_cache=A.dl(v), paged_kv_indptr=A.dl(indptr),
                       paged_kv_indices=A.dl(indices), paged_kv_last_page_len=A.dl(last), qo_indptr=None,
                       page_size=batch.page_size, k_scale=1.0, v_scale=1.0, kv_dtype="", options=options,
                       out=A.dl(out), lse=A.dl(lse), stream=A.stream_of(q_d))

    run(C.AttentionOptions(causal=False, window_left=40, logits_soft_cap=4.0, sm_scale=0.1))
    ks, vs = batch.all_kv()
    xp.assert_close(out, lse, *R.attention(q, ks, vs, [1] * len(kv_len), window_left=40, logits_soft_cap=4.0,
                                           sm_scale=0.1))
    with pytest.raises(flashkv.Error, match="logits_soft_cap"):
        run(C.AttentionOptions(causal=False, window_left=40, logits_soft_cap=-1.0))
    with pytest.raises(flashkv.Error, match="window_left"):
        run(C.AttentionOptions(causal=False))  # wider than the planned window


def test_typed_ragged_plan_matches_reference(xp, rng, workspace):
    """One BatchShape planned twice (non-causal, then causal by setting its field) and run
    through AttentionOptions against the reference."""
    qo_lens, kv_lens = [9, 0, 3, 20], [40, 6, 3, 20]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]), HQ, D)).astype(xp.float)
    k = rng.standard_normal((int(kv[-1]), HKV, D)).astype(xp.float)
    v = rng.standard_normal((int(kv[-1]), HKV, D)).astype(xp.float)
    ks = [k[kv[i]:kv[i + 1]] for i in range(len(kv_lens))]
    vs = [v[kv[i]:kv[i + 1]] for i in range(len(kv_lens))]
    q_d, k_d, v_d, qo_d, kv_d = xp.put((q, k, v, qo, kv))
    out, lse = xp.put((np.empty_like(q), np.empty(q.shape[:2], np.float32)))

    shape = C.BatchShape(kv_len=np.diff(kv).astype(np.int32), qo_indptr=qo, num_qo_heads=HQ, num_kv_heads=HKV,
                         head_dim_qk=D, head_dim_v=D)
    for causal in (False, True):
        shape.causal = causal
        plan = C.Plan(xp.device, A.dl(workspace))
        plan.plan(decode=False, batch=shape, options=C.PlanOptions(), stream=0)
        assert not plan.decode and plan.num_qo_tokens == int(qo[-1])
        options = C.AttentionOptions(causal=causal, sm_scale=0.2)
        plan.run_ragged(q=A.dl(q_d), k=A.dl(k_d), v=A.dl(v_d), qo_indptr=A.dl(qo_d), kv_indptr=A.dl(kv_d),
                        options=options, out=A.dl(out), lse=A.dl(lse), stream=A.stream_of(q_d))
        xp.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=causal, sm_scale=0.2))
