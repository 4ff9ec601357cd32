"""merge_state(s), append_paged_kv_cache and the page helpers, with NumPy arrays on the CPU and
PyTorch tensors on CUDA (the `xp` fixture, devices.py). float32 on both: the CUDA merge and
KV-write kernels take it."""

import numpy as np
import pytest

import flashkv
import reference as R


def random_state(rng, t, h, d, empty_rows=()):
    v = rng.standard_normal((t, h, d)).astype(np.float32)
    s = (rng.standard_normal((t, h)) * 3).astype(np.float32)
    for r in empty_rows:
        s[r] = -np.inf
        v[r] = 0
    return v, s


def test_merge_state(xp, rng):
    v_a, s_a = random_state(rng, 9, 4, 32, empty_rows=[2, 5])
    v_b, s_b = random_state(rng, 9, 4, 32, empty_rows=[5, 7])
    v, s = xp.get(flashkv.merge_state(*xp.put((v_a, s_a, v_b, s_b))))
    ref_v, ref_s = R.merge(v_a, s_a, v_b, s_b)
    R.assert_close(v[~np.isin(np.arange(9), [5])], s, ref_v[~np.isin(np.arange(9), [5])], ref_s)
    assert np.all(np.isneginf(s[5])) and not np.isnan(v[5]).any()


def test_merge_state_in_place_with_mask(xp, rng):
    v, s = random_state(rng, 6, 2, 16)
    v_o, s_o = random_state(rng, 6, 2, 16)
    ref_v, ref_s = R.merge(v, s, v_o, s_o)
    mask = np.array([True, False, True, True, False, True])
    v_d, s_d = xp.put((v.copy(), s.copy()))
    flashkv.merge_state_in_place(v_d, s_d, *xp.put((v_o, s_o)), mask=xp.put(mask))
    got_v, got_s = xp.get((v_d, s_d))
    R.assert_close(got_v[mask], got_s[mask], ref_v[mask], ref_s[mask])
    assert np.array_equal(got_v[~mask], v[~mask]) and np.array_equal(got_s[~mask], s[~mask])
    v2, s2 = xp.put((v.copy(), s.copy()))
    flashkv.merge_state_in_place(v2, s2, *xp.put((v_o, s_o)))
    xp.assert_close(v2, s2, ref_v, ref_s)


def test_merge_states(xp, rng):
    t, n, h, d = 5, 3, 4, 16
    v = rng.standard_normal((t, n, h, d)).astype(np.float32)
    s = (rng.standard_normal((t, n, h)) * 2).astype(np.float32)
    s[1, 1] = -np.inf
    v_d, s_d = xp.put((v, s))
    out_v, out_s = flashkv.merge_states(v_d, s_d)
    ref_v, ref_s = v[:, 0], s[:, 0]
    for i in range(1, n):
        ref_v, ref_s = R.merge(ref_v, ref_s, v[:, i], s[:, i])
    xp.assert_close(out_v, out_s, ref_v, ref_s)
    with pytest.raises(flashkv.Error):
        flashkv.merge_states(v_d[:, 0], s_d)
    with pytest.raises(flashkv.Error, match="lse_b: expected size 4"):
        flashkv.merge_state(v_d[:, 0], s_d[:, 0], v_d[:, 1], s_d[:, 1, :2])


def test_get_batch_indices_positions_and_seq_lens(xp):
    append_indptr = np.array([0, 2, 2, 5], np.int32)
    seq_lens = np.array([4, 7, 3], np.int32)
    b, p = xp.get(flashkv.get_batch_indices_positions(*xp.put((append_indptr, seq_lens)), 5))
    assert b.tolist() == [0, 0, 2, 2, 2] and p.tolist() == [2, 3, 0, 1, 2]
    lens = flashkv.get_seq_lens(*xp.put((np.array([0, 2, 2, 5]), np.array([3, 1, 4]))), 4)
    assert xp.get(lens).tolist() == [7, 0, 12]


@pytest.mark.parametrize("page_size", [1, 4])
def test_append_paged_kv_cache(xp, rng, page_size):
    hkv, d, num_pages = 2, 16, 12
    seq_lens = np.array([5, 9, 2], np.int32)
    append_lens = np.array([2, 9, 1], np.int32)
    pages_per = (seq_lens + page_size - 1) // page_size
    kv_indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    kv_indices = rng.permutation(num_pages * 4 // page_size if page_size == 1 else num_pages)[: kv_indptr[-1]]
    kv_indices = kv_indices.astype(np.int64)
    last = ((seq_lens - 1) % page_size + 1).astype(np.int32)
    cache_shape = (max(num_pages, kv_indices.max() + 1), page_size, hkv, d)
    k_cache, v_cache = xp.zeros(cache_shape, np.float32), xp.zeros(cache_shape, np.float32)
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    k_new = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    b, p = flashkv.get_batch_indices_positions(*xp.put((append_indptr, seq_lens)), nnz)
    table = xp.put((kv_indices, kv_indptr, last))
    flashkv.append_paged_kv_cache(*xp.put((k_new, v_new)), b, p, (k_cache, v_cache), *table)
    k_host, v_host, b, p = xp.get((k_cache, v_cache, b, p))
    for t in range(nnz):
        page = kv_indices[kv_indptr[b[t]] + p[t] // page_size]
        assert np.array_equal(k_host[page, p[t] % page_size], k_new[t])
        assert np.array_equal(v_host[page, p[t] % page_size], v_new[t])
    assert np.count_nonzero(k_host.any(axis=(2, 3))) == nnz
    with pytest.raises(flashkv.Error, match="HND"):
        flashkv.append_paged_kv_cache(*xp.put((k_new, v_new)), b, p, (k_cache, v_cache), *table, "HND")
