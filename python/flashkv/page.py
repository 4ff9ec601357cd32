"""Writing new tokens into a paged KV cache (FlashInfer's page functions)."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error
from ._wrapper import check_kv_layout, kv_cache_views


def get_seq_lens(kv_indptr: Any, kv_last_page_len: Any, page_size: int) -> np.ndarray:
    """Tokens per request of a page table: (pages - 1) * page_size + last_page_len (0 for a
    request without pages), as a host int32 array."""
    indptr = A.to_host_i32(kv_indptr, "kv_indptr")
    last = A.to_host_i32(kv_last_page_len, "kv_last_page_len")
    pages = np.diff(indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * int(page_size) + last, 0).astype(np.int32)


def get_batch_indices_positions(append_indptr: Any, seq_lens: Any, nnz: int) -> Tuple[Any, Any]:
    """For each of the nnz appended tokens: its request (batch_indices) and its position in the
    request (positions), where request i appends append_indptr[i+1] - append_indptr[i] tokens
    that end its seq_lens[i] tokens. Returns int32 arrays on append_indptr's device."""
    indptr = A.to_host_i32(append_indptr, "append_indptr").astype(np.int64)
    lens = A.to_host_i32(seq_lens, "seq_lens").astype(np.int64)
    counts = np.diff(indptr)
    if counts.size != lens.size or (counts < 0).any() or (counts > lens).any():
        raise Error("append_indptr/seq_lens: expected batch_size + 1 / batch_size entries with "
                    "0 <= appended tokens <= seq_len per request")
    batch = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    token = np.arange(batch.size, dtype=np.int64)
    positions = lens[batch] - counts[batch] + (token - indptr[batch])
    out_b = np.zeros(int(nnz), np.int32)
    out_p = np.zeros(int(nnz), np.int32)
    n = min(int(nnz), batch.size)
    out_b[:n], out_p[:n] = batch[:n], positions[:n]
    return A.to_device_i32(out_b, append_indptr), A.to_device_i32(out_p, append_indptr)


def append_paged_kv_cache(append_key: Any, append_value: Any, batch_indices: Any, positions: Any,
                          paged_kv_cache: Any, kv_indices: Any, kv_indptr: Any, kv_last_page_len: Any,
                          kv_layout: str = "NHD") -> None:
    """Writes append_key/append_value [nnz, num_kv_heads, head_dim] into the cache: token t goes
    to position positions[t] of request batch_indices[t], i.e. page
    kv_indices[kv_indptr[b] + p // page_size] at offset p % page_size. The cache as for the
    wrappers ((k, v) of [slots, Hkv, D] or NHD [pages, page_size, Hkv, D], or one 5-D array);
    fp8 caches are written with saturation."""
    check_kv_layout(kv_layout)
    k_cache, v_cache = kv_cache_views(paged_kv_cache, copy=False)
    page_size = int(k_cache.shape[1]) if len(k_cache.shape) == 4 else 1
    # Slot of every token, computed with the caller's array library on its device.
    page = kv_indices[kv_indptr[batch_indices] + positions // page_size]
    slots = page * page_size + positions % page_size
    kv_dtype = A.dtype_of(k_cache)
    _C.append_kv(k_new=A.dl(append_key), v_new=A.dl(append_value), cache_loc=A.dl(slots), k_cache=A.dl(k_cache),
                 v_cache=A.dl(v_cache), k_scale=1.0, v_scale=1.0, kv_dtype=kv_dtype if kv_dtype in A.FP8 else "",
                 stream=A.stream_of(append_key))
