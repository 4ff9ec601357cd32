"""A float64 NumPy reference of flashkv's attention semantics (shared/SEMANTICS.md), and helpers
that build random paged batches for the tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


def attention(q: np.ndarray, ks: Sequence[np.ndarray], vs: Sequence[np.ndarray], qo_lens: Sequence[int],
              causal: bool = False, window_left: int = -1, logits_soft_cap: float = 0.0,
              sm_scale: Optional[float] = None, masks: Optional[Sequence[np.ndarray]] = None,
              sinks: Optional[np.ndarray] = None):
    """out [T, Hq, Dv], lse [T, Hq] (base 2) of requests with query rows q (packed, qo_lens[i] rows
    each) and KV ks[i] [L_i, Hkv, D], vs[i] [L_i, Hkv, Dv]; masks[i] bool [qo_len, L_i]
    replaces causal. sinks [Hq] (natural-log logits, neither scaled nor capped): each joins its
    head's softmax denominator once, with no value; the LSE includes it."""
    q = np.asarray(q, np.float64)
    t, hq, d = q.shape
    dv = vs[0].shape[-1] if len(vs) else d
    out = np.zeros((t, hq, dv))
    lse = np.full((t, hq), -np.inf)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    row = 0
    for i, lq in enumerate(qo_lens):
        k = np.asarray(ks[i], np.float64)
        v = np.asarray(vs[i], np.float64)
        lkv = k.shape[0]
        hkv = k.shape[1] if lkv else 1
        g = hq // hkv
        qi = q[row:row + lq]
        if lkv and lq:
            kk = np.repeat(k, g, axis=1)  # [L, Hq, D]
            vv = np.repeat(v, g, axis=1)
            s = np.einsum("qhd,khd->hqk", qi, kk) * scale
            if logits_soft_cap > 0:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            pos = lkv - lq + np.arange(lq)[:, None]
            j = np.arange(lkv)[None, :]
            allowed = np.ones((lq, lkv), bool)
            if masks is not None:
                allowed &= np.asarray(masks[i], bool).reshape(lq, lkv)
            elif causal:
                allowed &= j <= pos
            if window_left >= 0:
                allowed &= j >= pos - window_left
            s = np.where(allowed[None], s, -np.inf)
            m = s.max(axis=2, keepdims=True)
            has = np.isfinite(m)
            p = np.where(has, np.exp(s - np.where(has, m, 0)), 0.0)
            z = p.sum(axis=2, keepdims=True)
            o = np.einsum("hqk,khd->qhd", p / np.where(z > 0, z, 1), vv)
            out[row:row + lq] = o
            l = np.where(has[..., 0], (m[..., 0] + np.log(np.where(z[..., 0] > 0, z[..., 0], 1))) / math.log(2),
                         -np.inf)
            lse[row:row + lq] = l.T
        row += lq
    if sinks is not None:
        # The sink is the state (O = 0, LSE = sink / ln 2) merged into every row.
        s2 = np.asarray(sinks, np.float64)[None, :] / math.log(2)
        new_lse = np.logaddexp2(lse, s2)
        with np.errstate(invalid="ignore"):
            w = np.where(np.isneginf(lse), 0.0, np.exp2(lse - new_lse))
        out = out * w[..., None]
        lse = new_lse
    return out, lse


def merge(o_a, s_a, o_b, s_b):
    """Merged state of two (O, base-2 LSE) states, in float64."""
    o_a, s_a, o_b, s_b = (np.asarray(x, np.float64) for x in (o_a, s_a, o_b, s_b))
    s = np.logaddexp2(s_a, s_b)
    w_a = np.where(np.isfinite(s_a), np.exp2(s_a - np.where(np.isfinite(s), s, 0)), 0.0)
    w_b = np.where(np.isfinite(s_b), np.exp2(s_b - np.where(np.isfinite(s), s, 0)), 0.0)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, s


def rel_error(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def bounds(dtype):
    """SEMANTICS.md's (relative output error, absolute LSE error) bounds for outputs of this
    dtype: float32 (or wider) computes in fp32; 16-bit inputs (f16, bf16) with fp32 accumulation."""
    return (1e-5, 1e-3) if np.dtype(dtype).itemsize >= 4 else (1e-2, 2e-2)


def assert_close(out, lse, ref_out, ref_lse, tol: Optional[float] = None, lse_tol: Optional[float] = None) -> None:
    """out/lse against the reference; bounds not given are those of out's dtype."""
    default_tol, default_lse_tol = bounds(np.asarray(out).dtype)
    tol = default_tol if tol is None else tol
    lse_tol = default_lse_tol if lse_tol is None else lse_tol
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "NaN in the output"
    err = rel_error(out, ref_out)
    assert err <= tol, f"relative error {err:.3g} > {tol}"
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        assert not np.isnan(lse).any(), "NaN in the LSE"
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), "LSE -inf pattern differs"
        fin = np.isfinite(ref_lse)
        if fin.any():
            e = np.abs(lse[fin] - ref_lse[fin]).max()
            assert e <= lse_tol, f"LSE error {e:.3g} > {lse_tol}"


@dataclass
class PagedBatch:
    """A random paged batch: caches with NaN in every slot no request uses."""
    k_cache: np.ndarray          # [num_pages, page_size, Hkv, D]
    v_cache: np.ndarray          # [num_pages, page_size, Hkv, Dv]
    indptr: np.ndarray           # int32 [B + 1] (pages)
    indices: np.ndarray          # int32 [indptr[-1]] (page ids)
    last_page_len: np.ndarray    # int32 [B]
    kv_lens: List[int]
    page_size: int

    def request_kv(self, i: int):
        pages = self.indices[self.indptr[i]:self.indptr[i + 1]]
        k = self.k_cache[pages].reshape(-1, *self.k_cache.shape[2:])[: self.kv_lens[i]]
        v = self.v_cache[pages].reshape(-1, *self.v_cache.shape[2:])[: self.kv_lens[i]]
        return k, v

    def all_kv(self):
        pairs = [self.request_kv(i) for i in range(len(self.kv_lens))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def flat(self):
        """(k, v) as [num_pages * page_size, Hkv, D] (page_size 1: [slots, Hkv, D])."""
        return (self.k_cache.reshape(-1, *self.k_cache.shape[2:]),
                self.v_cache.reshape(-1, *self.v_cache.shape[2:]))


def paged_batch(rng: np.random.Generator, kv_lens: Sequence[int], num_kv_heads: int, head_dim: int,
                page_size: int = 1, dtype=np.float32, spare_pages: int = 3, head_dim_v: Optional[int] = None) -> PagedBatch:
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    num_pages = sum(pages_per) + spare_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    indptr = np.zeros(len(kv_lens) + 1, np.int32)
    np.cumsum(pages_per, out=indptr[1:])
    indices = perm[: indptr[-1]].copy()
    last = np.array([(n - 1) % page_size + 1 if n else 1 for n in kv_lens], np.int32)
    k = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, dtype)
    v = np.full((num_pages, page_size, num_kv_heads, head_dim_v), np.nan, dtype)
    for i, n in enumerate(kv_lens):
        for p_i, page in enumerate(indices[indptr[i]:indptr[i + 1]]):
            used = min(page_size, n - p_i * page_size)
            k[page, :used] = rng.standard_normal((used, num_kv_heads, head_dim))
            v[page, :used] = rng.standard_normal((used, num_kv_heads, head_dim_v))
    return PagedBatch(k, v, indptr, indices, last, list(kv_lens), page_size)


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype)
