"""merge_state(s), append_paged_kv_cache and the page helpers on the CPU (NumPy)."""

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


def test_merge_state(rng):
    v_a, s_a = random_state(rng, 9, 4, 32, empty_rows=[2, 5])
    v_b, s_b = random_state(rng, 9, 4, 32, empty_rows=[5, 7])
    v, s = flashkv.merge_state(v_a, s_a, v_b, s_b)
    ref_v, ref_s = R.merge(v_a, s_a, v_b, s_b)
    R.assert_close(v[~np.isin(np.arange(9), [5])], s, ref_v[~np.isin(np.arange(9), [5])], ref_s)
    assert np.all(np.isneginf(s[5])) and not np.isnan(v[5]).any()


def test_merge_state_in_place_with_mask(rng):
    v, s = random_state(rng, 6, 2, 16)
    v_o, s_o = random_state(rng, 6, 2, 16)
    ref_v, ref_s = R.merge(v, s, v_o, s_o)
    mask = np.array([True, False, True, True, False, True])
    keep_v, keep_s = v.copy(), s.copy()
    flashkv.merge_state_in_place(v, s, v_o, s_o, mask=mask)
    R.assert_close(v[mask], s[mask], ref_v[mask], ref_s[mask])
    assert np.array_equal(v[~mask], keep_v[~mask]) and np.array_equal(s[~mask], keep_s[~mask])
    v2, s2 = keep_v.copy(), keep_s.copy()
    flashkv.merge_state_in_place(v2, s2, v_o, s_o)
    R.assert_close(v2, s2, ref_v, ref_s)


def test_merge_states(rng):
    t, n, h, d = 5, 3, 4, 16
    v = rng.standard_normal((t, n, h, d)).astype(np.float32)
    s = (rng.standard_normal((t, n, h)) * 2).astype(np.float32)
    s[1, 1] = -np.inf
    out_v, out_s = flashkv.merge_states(v, s)
    ref_v, ref_s = v[:, 0], s[:, 0]
    for i in range(1, n):
        ref_v, ref_s = R.merge(ref_v, ref_s, v[:, i], s[:, i])
    R.assert_close(out_v, out_s, ref_v, ref_s)
    with pytest.raises(flashkv.Error):
        flashkv.merge_states(v[:, 0], s)
    with pytest.raises(flashkv.Error, match="lse_b: expected size 4"):
        flashkv.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1, :2])


def test_get_batch_indices_positions_and_seq_lens():
    append_indptr = np.array([0, 2, 2, 5], np.int32)
    seq_lens = np.array([4, 7, 3], np.int32)
    b, p = flashkv.get_batch_indices_positions(append_indptr, seq_lens, 5)
    assert b.tolist() == [0, 0, 2, 2, 2] and p.tolist() == [2, 3, 0, 1, 2]
    assert flashkv.get_seq_lens(np.array([0, 2, 2, 5]), np.array([3, 1, 4]), 4).tolist() == [7, 0, 12]


@pytest.mark.parametrize("page_size", [1, 4])
def test_append_paged_kv_cache(rng, page_size):
    hkv, d, num_pages = 2, 16, 12
    seq_lens = np.array([5, 9, 2], np.int32)
    append_lens = np.array([2, 9, 1], np.int32)
    pages_per = (seq_lens + page_size - 1) // page_size
    kv_indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    kv_indices = rng.permutation(num_pages * 4 // page_size if page_size == 1 else num_pages)[: kv_indptr[-1]]
    kv_indices = kv_indices.astype(np.int64)
    last = ((seq_lens - 1) % page_size + 1).astype(np.int32)
    k_cache = np.zeros((max(num_pages, kv_indices.max() + 1), page_size, hkv, d), np.float32)
    v_cache = np.zeros_like(k_cache)
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    k_new = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((nnz, hkv, d)).astype(np.float32)
    b, p = flashkv.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    flashkv.append_paged_kv_cache(k_new, v_new, b, p, (k_cache, v_cache), kv_indices, kv_indptr, last)
    for t in range(nnz):
        page = kv_indices[kv_indptr[b[t]] + p[t] // page_size]
        assert np.array_equal(k_cache[page, p[t] % page_size], k_new[t])
        assert np.array_equal(v_cache[page, p[t] % page_size], v_new[t])
    assert np.count_nonzero(k_cache.any(axis=(2, 3))) == nnz
    with pytest.raises(flashkv.Error, match="HND"):
        flashkv.append_paged_kv_cache(k_new, v_new, b, p, (k_cache, v_cache), kv_indices, kv_indptr, last, "HND")
