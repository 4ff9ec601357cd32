"""K/V cache views FlashInfer's NHD paged caches accept: strided and non-contiguous views
(key.transpose(1, 2) of a [B, Hkv, L, D] cache taken as one page per request, one
[pages, 2, page_size, Hkv, D] array, a slice of a wider cache), against the float64 reference,
with NumPy arrays and, when importable, PyTorch CPU tensors."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import _wrapper as W

HQ, HKV, D = 8, 2, 64

try:
    import torch
except ImportError:  # the torch cases skip
    torch = None

LIBS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="PyTorch is not installed"))]


def lib_of(lib):
    """(to the library, transpose(a, i, j)) for a library."""
    if lib == "numpy":
        return (lambda a: a), (lambda a, i, j: np.swapaxes(a, i, j))
    return torch.from_numpy, (lambda a, i, j: a.transpose(i, j))


def one_page_per_request(rng, lens, max_len):
    """A transformers-style cache [B, Hkv, L, D] (positions past each length are NaN)."""
    k = np.full((len(lens), HKV, max_len, D), np.nan, np.float32)
    v = np.full((len(lens), HKV, max_len, D), np.nan, np.float32)
    for i, n in enumerate(lens):
        k[i, :, :n] = rng.standard_normal((HKV, n, D))
        v[i, :, :n] = rng.standard_normal((HKV, n, D))
    table = (np.arange(len(lens) + 1, dtype=np.int32), np.arange(len(lens), dtype=np.int32),
             np.array(lens, np.int32))
    ks = [np.ascontiguousarray(k[i, :, :n].transpose(1, 0, 2)) for i, n in enumerate(lens)]
    vs = [np.ascontiguousarray(v[i, :, :n].transpose(1, 0, 2)) for i, n in enumerate(lens)]
    return k, v, table, ks, vs


@pytest.mark.parametrize("lib", LIBS)
def test_decode_over_transposed_bhld_cache(rng, lib):
    put, transpose = lib_of(lib)
    lens, max_len = [7, 16, 1, 11], 16
    k, v, table, ks, vs = one_page_per_request(rng, lens, max_len)
    kt, vt = transpose(put(k), 1, 2), transpose(put(v), 1, 2)  # [B, L, Hkv, D] views, not contiguous
    assert W._kv_layout_problem(kt) is not None  # the operators cannot read it in place
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(put(np.zeros(1 << 20, np.uint8)), "NHD")
    w.plan(*(put(a) for a in table), HQ, HKV, D, max_len)
    q = rng.standard_normal((len(lens), HQ, D)).astype(np.float32)
    out, lse = w.run(put(q), (kt, vt), return_lse=True)
    R.assert_close(np.asarray(out), np.asarray(lse), *R.attention(q, ks, vs, [1] * len(lens)))


@pytest.mark.parametrize("lib", LIBS)
def test_prefill_over_transposed_bhld_cache(rng, lib):
    put, transpose = lib_of(lib)
    lens, max_len = [9, 16, 3], 16
    qo_lens = [4, 16, 1]
    k, v, table, ks, vs = one_page_per_request(rng, lens, max_len)
    qo = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(qo_lens, out=qo[1:])
    w = flashkv.BatchPrefillWithPagedKVCacheWrapper(put(np.zeros(1 << 20, np.uint8)), "NHD")
    w.plan(put(qo), *(put(a) for a in table), HQ, HKV, D, max_len, causal=True)
    q = rng.standard_normal((int(qo[-1]), HQ, D)).astype(np.float32)
    out, lse = w.run(put(q), (transpose(put(k), 1, 2), transpose(put(v), 1, 2)), return_lse=True)
    R.assert_close(np.asarray(out), np.asarray(lse), *R.attention(q, ks, vs, qo_lens, causal=True))


@pytest.mark.parametrize("lib", LIBS)
def test_combined_and_sliced_caches(rng, lib):
    """One [pages, 2, page_size, Hkv, D] array (pages not evenly spaced for K alone: copied) and
    views the operators read in place (a head slice of a wider cache; passed through)."""
    put, _ = lib_of(lib)
    batch = R.paged_batch(rng, [9, 4, 13], HKV, D, page_size=4)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(put(np.zeros(1 << 20, np.uint8)), "NHD")
    w.plan(*(put(a) for a in (batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 4)
    q = rng.standard_normal((3, HQ, D)).astype(np.float32)
    ref = R.attention(q, *batch.all_kv(), [1, 1, 1])
    combined = put(np.stack([batch.k_cache, batch.v_cache], axis=1))
    R.assert_close(*(np.asarray(x) for x in w.run(put(q), combined, return_lse=True)), *ref)
    wide_k = np.concatenate([batch.k_cache, np.full_like(batch.k_cache, np.nan)], axis=2)
    wide_v = np.concatenate([np.full_like(batch.v_cache, np.nan), batch.v_cache], axis=2)
    k_view, v_view = put(wide_k)[:, :, :HKV], put(wide_v)[:, :, HKV:]
    got_k, got_v = W.kv_cache_views((k_view, v_view))
    assert got_k is k_view and got_v is v_view  # no copy
    R.assert_close(*(np.asarray(x) for x in w.run(put(q), (k_view, v_view), return_lse=True)), *ref)
    # head_dim elements not adjacent: copied.
    spread_k = np.zeros((*batch.k_cache.shape[:3], 2 * D), np.float32)
    spread_k[..., ::2] = batch.k_cache
    k_spread = put(spread_k)[..., ::2]
    assert W.kv_cache_views((k_spread, put(batch.v_cache)))[0] is not k_spread
    R.assert_close(*(np.asarray(x) for x in w.run(put(q), (k_spread, put(batch.v_cache)), return_lse=True)), *ref)


def test_unsupported_layouts_say_what_was_passed_and_what_is_expected(rng):
    batch = R.paged_batch(rng, [5, 3], HKV, D, page_size=4)
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
    w.plan(batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 4)
    q = np.zeros((2, HQ, D), np.float32)
    with pytest.raises(flashkv.Error, match=r"k_cache: expected \[slots, num_kv_heads, head_dim\] or NHD .*got shape "
                                            r"\(\d+, 128\)"):
        w.run(q, (batch.k_cache.reshape(-1, HKV * D), batch.v_cache))
    with pytest.raises(flashkv.Error, match="v_cache: expected a NumPy, PyTorch or CuPy array, got list"):
        w.run(q, (batch.k_cache, [1, 2]))
    # A write into a view the operators cannot address in place is refused (a copy would lose it).
    k_t = np.swapaxes(np.zeros((3, HKV, 4, D), np.float32), 1, 2)
    v_t = np.swapaxes(np.zeros((3, HKV, 4, D), np.float32), 1, 2)
    new = np.ones((1, HKV, D), np.float32)
    with pytest.raises(flashkv.Error, match=r"k_cache of shape \(3, 4, 2, 64\) and strides \(512, 64, 256, 1\).*"
                                            r"pages are not evenly spaced.*writes the cache in place"):
        flashkv.append_paged_kv_cache(new, new, np.array([0], np.int32), np.array([0], np.int32), (k_t, v_t),
                                      np.array([0], np.int32), np.array([0, 1], np.int32), np.array([1], np.int32))


def test_o_data_type_other_than_q_or_float32_is_refused_clearly():
    w = flashkv.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
    with pytest.raises(flashkv.Error, match=r"o_data_type: expected float32 or q's dtype \(f16\), got bf16"):
        w.plan(np.array([0, 1]), np.array([0]), np.array([1]), HQ, HKV, D, 1, q_data_type="float16",
               o_data_type="bfloat16")
    # An out array of another dtype than the planned one.
    rng = np.random.default_rng(3)
    batch = R.paged_batch(rng, [5], HKV, D, dtype=np.float16)
    w.plan(batch.indptr, batch.indices, batch.last_page_len, HQ, HKV, D, 1, q_data_type="float16",
           o_data_type="float32")
    q = rng.standard_normal((1, HQ, D)).astype(np.float16)
    with pytest.raises(flashkv.Error, match=r"out: dtype f16 differs from the planned output dtype f32"):
        w.run(q, (batch.k_cache, batch.v_cache), out=np.zeros((1, HQ, D), np.float16))
