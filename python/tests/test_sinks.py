"""Attention sinks through the FlashInfer-shaped wrappers (`sinks=` on run, FlashInfer's name:
float32 [num_qo_heads]) and the backend (`sinks=` on forward, or a layer's `sinks` attribute),
against the float64 reference, on every device; bad sinks raise flashkv.Error naming them."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                     BatchPrefillWithRaggedKVCacheWrapper)

HQ, HKV, D = 8, 2, 64


def sinks_of(rng):
    # Wide enough that a sink sometimes dominates a row and sometimes vanishes.
    return (3.0 * rng.standard_normal(HQ)).astype(np.float32)


@pytest.mark.parametrize("split", [0, 4])
def test_decode_with_sinks(xp, rng, workspace, split):
    batch = R.paged_batch(rng, [5, 0, 170, 17, 1], HKV, D, 4, dtype=xp.float)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(*xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, batch.page_size,
           logits_soft_cap=5.0, window_left=60, fixed_split_size=split or None)
    q = rng.standard_normal((5, HQ, D)).astype(xp.float)
    sinks = sinks_of(rng)
    out, lse = xp.get(w.run(xp.put(q), xp.put(batch.flat()), return_lse=True, sinks=xp.put(sinks)))
    ks, vs = batch.all_kv()
    ref_out, ref_lse = R.attention(q, ks, vs, [1] * 5, logits_soft_cap=5.0, window_left=60, sinks=sinks)
    R.assert_close(out, lse, ref_out, ref_lse)
    # The empty request: O = 0, LSE = the sink in base 2.
    assert np.all(out[1] == 0)
    np.testing.assert_allclose(lse[1], sinks / np.log(2), rtol=1e-5)


def test_paged_and_ragged_prefill_with_sinks(xp, rng, workspace):
    qo_lens, kv_lens = [5, 0, 33, 3], [5, 3, 70, 17]
    qo = np.zeros(5, np.int32)
    np.cumsum(qo_lens, out=qo[1:])
    sinks = sinks_of(rng)
    q = rng.standard_normal((qo[-1], HQ, D)).astype(xp.float)
    batch = R.paged_batch(rng, kv_lens, HKV, D, 1, dtype=xp.float)
    paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    paged.plan(xp.put(qo), *xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 1,
               causal=True)
    out, lse = xp.get(paged.run(xp.put(q), xp.put(batch.flat()), return_lse=True,
                                sinks=xp.put(sinks)))
    ks, vs = batch.all_kv()
    R.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=True, sinks=sinks))

    kvp = np.zeros(5, np.int32)
    np.cumsum(kv_lens, out=kvp[1:])
    k = np.concatenate(ks).astype(xp.float)
    v = np.concatenate(vs).astype(xp.float)
    ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    ragged.plan(xp.put(qo), xp.put(kvp), HQ, HKV, D, causal=False)
    out, lse = xp.get(ragged.run(*xp.put((q, k, v)), return_lse=True, sinks=xp.put(sinks)))
    R.assert_close(out, lse, *R.attention(q, ks, vs, qo_lens, causal=False, sinks=sinks))


def test_bad_sinks_raise(xp, rng, workspace):
    batch = R.paged_batch(rng, [5, 9], HKV, D, 1, dtype=xp.float)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(*xp.put((batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 1)
    q = xp.put(rng.standard_normal((2, HQ, D)).astype(xp.float))
    cache = xp.put(batch.flat())
    with pytest.raises(flashkv.Error, match="sinks: expected size 8"):
        w.run(q, cache, sinks=xp.put(np.zeros(HQ + 1, np.float32)))
    with pytest.raises(flashkv.Error, match="sinks: expected dtype f32"):
        w.run(q, cache, sinks=xp.put(np.zeros(HQ, np.float16)))
    with pytest.raises(flashkv.Error, match="sinks"):
        w.run(q, cache, sinks=xp.put(np.zeros((1, HQ), np.float32)))
