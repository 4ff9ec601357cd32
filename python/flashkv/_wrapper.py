"""What the FlashInfer-style wrappers share: argument checks, the KV-cache layouts, the plan
state (host copies, device index arrays, the compiled plans) and the paged run."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error

_UNSUPPORTED_PLAN_KEYWORDS = ("prefix_len_ptr", "token_pos_in_items_ptr", "max_item_len_ptr")


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout == "HND":
        raise Error("kv_layout: 'HND' is not supported by flashkv; store the KV cache as 'NHD' "
                    "([slots or pages, (page_size,) num_kv_heads, head_dim])")
    if kv_layout != "NHD":
        raise Error(f"kv_layout: expected 'NHD', got {kv_layout!r}")


def check_pos_encoding(pos_encoding_mode: str) -> None:
    if pos_encoding_mode != "NONE":
        raise Error(f"pos_encoding_mode: only 'NONE' is supported (apply RoPE before attention), "
                    f"got {pos_encoding_mode!r}")


def reject_multi_item_scoring(prefix_len_ptr: Any, token_pos_in_items_ptr: Any,
                              token_pos_in_items_len: int, max_item_len_ptr: Any) -> None:
    given = [name for name, value in zip(_UNSUPPORTED_PLAN_KEYWORDS,
                                         (prefix_len_ptr, token_pos_in_items_ptr, max_item_len_ptr))
             if value is not None]
    if token_pos_in_items_len:
        given.append("token_pos_in_items_len")
    if given:
        raise Error("multi-item scoring is not supported by flashkv (got " + ", ".join(given) + ")")


def unpack_kv_cache(paged_kv_cache: Any) -> Tuple[Any, Any]:
    """(k, v) from a (k, v) tuple of [slots, Hkv, D] or NHD [pages, page_size, Hkv, D] arrays,
    or from one NHD array [pages, 2, page_size, Hkv, D] (or [slots, 2, Hkv, D])."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise Error(f"paged_kv_cache: expected a (k_cache, v_cache) pair, got {len(paged_kv_cache)} items")
        return paged_kv_cache[0], paged_kv_cache[1]
    ndim = len(paged_kv_cache.shape)
    if ndim not in (4, 5) or paged_kv_cache.shape[1] != 2:
        raise Error("paged_kv_cache: expected a (k_cache, v_cache) tuple or one array "
                    f"[pages, 2, page_size, num_kv_heads, head_dim], got shape {tuple(paged_kv_cache.shape)}")
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


def _kv_layout_problem(x: Any) -> Optional[str]:
    """Why the compiled operators cannot address a K or V cache view in place (None: they can).
    They take [slots, Hkv, D] with any slot and head strides and a unit element stride; an NHD
    [pages, page_size, Hkv, D] view also needs its pages evenly spaced (page stride = page_size x
    token stride), so that slot page * page_size + offset sits at one stride."""
    shape, strides = tuple(int(n) for n in x.shape), A.strides_of(x)
    if shape[-1] > 1 and strides[-1] != 1:
        return f"head_dim elements are {strides[-1]} apart (expected adjacent)"
    if any(st < 0 for n, st in zip(shape, strides) if n > 1):
        return "negative strides"
    if len(shape) == 4 and shape[1] > 1 and strides[0] != shape[1] * strides[1]:
        return (f"pages are not evenly spaced (page stride {strides[0]}, token stride {strides[1]}, "
                f"page size {shape[1]})")
    return None


def kv_cache_views(paged_kv_cache: Any, copy: bool = True) -> Tuple[Any, Any]:
    """(k, v) of a paged KV cache in any layout FlashInfer's NHD caches take: a (k, v) pair or one
    [pages, 2, page_size, Hkv, D] array; each [slots, Hkv, D] or [pages, page_size, Hkv, D] with any
    strides (views such as key.transpose(1, 2) of a [B, Hkv, L, D] cache). Views the operators
    address in place pass through; the others are copied into contiguous arrays (copy=True: a
    read-only use) or rejected (copy=False: the cache is written, so a copy would lose the write)."""
    k, v = unpack_kv_cache(paged_kv_cache)
    out = []
    for name, x in (("k_cache", k), ("v_cache", v)):
        try:
            A.framework(x)
        except Error:
            raise Error(f"paged_kv_cache: {name}: expected a NumPy, PyTorch or CuPy array, got {type(x).__name__}")
        if len(x.shape) not in (3, 4):
            raise Error(f"paged_kv_cache: {name}: expected [slots, num_kv_heads, head_dim] or NHD [num_pages, "
                        f"page_size, num_kv_heads, head_dim] (any strides), got shape {tuple(x.shape)}")
        problem = _kv_layout_problem(x)
        if problem is not None:
            if not copy:
                raise Error(f"paged_kv_cache: {name} of shape {tuple(x.shape)} and strides {A.strides_of(x)} "
                            f"(elements): {problem}; this operation writes the cache in place, so it needs a "
                            "view whose pages sit at page_size x the token stride and whose head_dim elements "
                            "are adjacent, e.g. a contiguous [num_pages, page_size, num_kv_heads, head_dim] array")
            x = A.contiguous(x)
        out.append(x)
    return out[0], out[1]


def kv_lens_of(indptr: np.ndarray, last_page_len: Optional[np.ndarray], page_size: int) -> np.ndarray:
    """Tokens of each request from a host page table (int32)."""
    if indptr.size == 0:
        raise Error("indptr: expected batch_size + 1 entries, got 0")
    pages = np.diff(indptr.astype(np.int64))
    if (pages < 0).any():
        i = int(np.argmax(pages < 0))
        raise Error(f"indptr: expected non-decreasing values, got indptr[{i}] = {indptr[i]} > "
                    f"indptr[{i + 1}] = {indptr[i + 1]}")
    if page_size == 1:
        return pages.astype(np.int32)
    if last_page_len is None or last_page_len.size != pages.size:
        raise Error(f"last_page_len: expected {pages.size} entries (batch_size)")
    bad = (pages > 0) & ((last_page_len < 1) | (last_page_len > page_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise Error(f"last_page_len: request {i}: expected 1..{page_size}, got {last_page_len[i]}")
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0).astype(np.int32)


def attention_options(*, causal: bool, window_left: int, logits_soft_cap: Optional[float], sm_scale: float,
                      custom_mask: Any, mask_indptr: Any, sinks: Any = None) -> Any:
    """The compiled run's AttentionOptions (a soft cap of None or 0 is off; sm_scale is the one
    the run applies; sinks: float32 [num_qo_heads] or None, checked by the compiled run)."""
    return _C.AttentionOptions(causal=causal, window_left=window_left,
                               logits_soft_cap=float(logits_soft_cap or 0.0), sm_scale=sm_scale,
                               custom_mask=A.dl(custom_mask), mask_indptr=A.dl(mask_indptr),
                               sinks=A.dl(sinks))


def as_tokens(split_size_in_pages: Optional[int], page_size: int) -> int:
    """FlashInfer counts fixed_split_size in pages; the planner in tokens (0: none)."""
    if split_size_in_pages is None or split_size_in_pages <= 0:
        return 0
    return int(split_size_in_pages) * page_size


def plan_dtypes(q_data_type: Any, kv_data_type: Any, data_type: Any,
                o_data_type: Any) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """plan()'s dtypes as flashkv names: (q, kv, o). data_type sets q and kv where they are not
    given. The output is q's dtype or float32 (unrounded partial outputs for merge_state); o None
    or equal to q's becomes None (outputs in q's dtype)."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q_dt, kv_dt, o_dt = (A.canonical_dtype(t) for t in (q_data_type, kv_data_type, o_data_type))
    if o_dt is not None and o_dt not in (A.F32, q_dt):
        raise Error(f"o_data_type: expected float32 or q's dtype ({q_dt}), got {o_dt}"
                    if q_dt is not None else f"o_data_type: expected float32 when q_data_type is not given, "
                    f"got {o_dt}")
    return q_dt, kv_dt, (None if o_dt == q_dt else o_dt)


class PlannedWrapper:
    """State every wrapper keeps: the workspace, CUDA-graph buffers, and its plans."""

    def __init__(self, float_workspace_buffer: Any, kv_layout: str, use_cuda_graph: bool,
                 backend: str, jit_args: Any) -> None:
        check_kv_layout(kv_layout)
        if jit_args is not None:
            raise Error("jit_args: custom JIT kernels are not supported by flashkv")
        self._kv_layout = kv_layout
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        self._set_workspace(float_workspace_buffer)
        # FlashInfer's integer workspaces (device and page-locked host): flashkv's plans keep
        # their own index memory, so these only record what reset_workspace_buffer was given.
        self._int_workspace_buffer: Any = None
        self._pin_memory_int_workspace_buffer: Any = None
        self._plans: Dict[str, Any] = {}
        self._planned = False
        # The planned output dtype (plan's o_data_type): None for q's, or A.F32.
        self._o_data_type: Optional[str] = None

    def _set_workspace(self, float_workspace_buffer: Any) -> None:
        if float_workspace_buffer is None:
            raise Error("float_workspace_buffer: expected a uint8 array on the device the wrapper runs on")
        self._float_workspace_buffer = float_workspace_buffer
        self._device_name = A.device_of(float_workspace_buffer)
        self.device = getattr(float_workspace_buffer, "device", self._device_name)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: Any, int_workspace_buffer: Any = None) -> None:
        """Uses another float workspace buffer (the int workspace is not needed: plans keep their
        own). Plan again before the next run."""
        self._set_workspace(float_workspace_buffer)
        self._int_workspace_buffer = int_workspace_buffer
        self._plans = {}
        self._planned = False

    def end_forward(self) -> None:
        """Nothing to release (kept for the old FlashInfer API)."""

    def _plan_object(self, key: str) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            plan = _C.Plan(self._device_name, A.dl(self._float_workspace_buffer))
            self._plans[key] = plan
        return plan

    def _require_planned(self) -> None:
        if not self._planned:
            raise Error(f"{type(self).__name__}: call plan() (or begin_forward()) before run()")

    def _check_q(self, q: Any) -> None:
        if len(q.shape) != 3:
            raise Error(f"q: expected [num_tokens, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
        if self._q_data_type is not None and A.dtype_of(q) != self._q_data_type:
            raise Error(f"q: dtype {A.dtype_of(q)} differs from the planned q_data_type {self._q_data_type}")

    def _kv_dtype_override(self, k: Any) -> str:
        """The dtype the compiled run reads the KV cache as ('' for its own)."""
        actual = A.dtype_of(k)
        planned = self._kv_data_type
        if actual in A.FP8:
            if planned is not None and planned != actual:
                raise Error(f"paged_kv_cache: dtype {actual} differs from the planned kv_data_type {planned}")
            return actual
        if actual == A.U8 and planned in A.FP8:
            return planned  # fp8 stored as uint8
        if planned is not None and planned != actual:
            raise Error(f"paged_kv_cache: dtype {actual} differs from the planned kv_data_type {planned}")
        return ""

    def _scales(self, head_dim: int, sm_scale: Optional[float], q_scale: Optional[float],
                k_scale: Optional[float], v_scale: Optional[float], fp8_kv: bool) -> Tuple[float, float, float, float]:
        """(sm_scale, kernel k_scale, kernel v_scale, output multiplier). fp8 caches dequantize
        in the kernel; for others k_scale folds into sm_scale and v_scale scales the output."""
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        if q_scale is not None:
            scale *= float(q_scale)
        ks = 1.0 if k_scale is None else float(k_scale)
        vs = 1.0 if v_scale is None else float(v_scale)
        if fp8_kv:
            return scale, ks, vs, 1.0
        return scale * ks, 1.0, 1.0, vs

    def _outputs(self, q: Any, head_dim_v: int, out: Any, lse: Any, want_lse: bool) -> Tuple[Any, Any]:
        o_dt = self._o_data_type
        if out is None:
            out = A.empty(q, (q.shape[0], q.shape[1], head_dim_v), o_dt)
        elif A.dtype_of(out) != (A.dtype_of(q) if o_dt is None else o_dt):
            raise Error(f"out: dtype {A.dtype_of(out)} differs from the planned output dtype "
                        f"{A.dtype_of(q) if o_dt is None else o_dt} (plan's o_data_type)")
        if lse is None and want_lse:
            lse = A.empty(q, (q.shape[0], q.shape[1]), A.F32)
        return out, lse


class PagedWrapper(PlannedWrapper):
    """Plan/run of attention over a paged KV cache (decode and prefill)."""

    def _plan_page_table(self, indptr: Any, indices: Any, last_page_len: Any, indptr_host: np.ndarray,
                         seq_lens: Any, batch_size: int, page_size: int, non_blocking: bool,
                         prefix: str) -> np.ndarray:
        """Checks a page table (argument names start with `prefix`) against its host indptr,
        stores the run's index arrays, and returns each request's KV tokens (host int32)."""
        if indptr_host.size != batch_size + 1:
            raise Error(f"{prefix}indptr: expected batch_size + 1 = {batch_size + 1} entries, got {indptr_host.size}")
        if seq_lens is not None:
            kv_len = A.to_host_i32(seq_lens, "seq_lens")
        else:
            lpl = A.to_host_i32(last_page_len, f"{prefix}last_page_len") if page_size > 1 else None
            kv_len = kv_lens_of(indptr_host, lpl, page_size)
        if int(indptr_host[-1]) > len(indices):
            raise Error(f"{prefix}indices: expected at least {prefix}indptr[-1] = {int(indptr_host[-1])} entries, "
                        f"got {len(indices)}")
        self._store_paged_indices(indptr, indices, last_page_len, batch_size, non_blocking)
        return kv_len

    def _store_paged_indices(self, indptr: Any, indices: Any, last_page_len: Any, batch_size: int,
                             non_blocking: bool) -> None:
        """Device (or host, on the CPU) int32 index arrays the runs read: copies into the fixed
        buffers in CUDA-graph mode, else int32 copies on the workspace's device."""
        ws = self._float_workspace_buffer
        if self._use_cuda_graph:
            if len(indices) > int(self._paged_kv_indices_buf.shape[0]):
                raise Error(f"indices: {len(indices)} entries do not fit paged_kv_indices_buffer "
                            f"({int(self._paged_kv_indices_buf.shape[0])})")
            A.copy_into(self._paged_kv_indptr_buf, indptr, "indptr", non_blocking)
            A.copy_into(self._paged_kv_last_page_len_buf, last_page_len, "last_page_len", non_blocking)
            A.copy_into(self._paged_kv_indices_buf, indices, "indices", non_blocking)
            self._indptr_run = self._paged_kv_indptr_buf[: batch_size + 1]
            self._last_page_len_run = self._paged_kv_last_page_len_buf[:batch_size]
            self._indices_run = self._paged_kv_indices_buf
        else:
            self._paged_kv_indptr_buf = A.to_device_i32(indptr, ws, non_blocking)
            self._paged_kv_indices_buf = A.to_device_i32(indices, ws, non_blocking)
            self._paged_kv_last_page_len_buf = A.to_device_i32(last_page_len, ws, non_blocking)
            self._indptr_run = self._paged_kv_indptr_buf
            self._indices_run = self._paged_kv_indices_buf
            self._last_page_len_run = self._paged_kv_last_page_len_buf

    def _check_graph_buffers(self, indptr_buf: Any, indices_buf: Any, last_page_len_buf: Any) -> None:
        if not self._use_cuda_graph:
            return
        for name, buf in (("paged_kv_indptr_buffer", indptr_buf), ("paged_kv_indices_buffer", indices_buf),
                          ("paged_kv_last_page_len_buffer", last_page_len_buf)):
            if buf is None:
                raise Error(f"{name}: required in CUDA-graph mode (use_cuda_graph=True)")
            if A.dtype_of(buf) != A.I32 or len(buf.shape) != 1:
                raise Error(f"{name}: expected a 1-D int32 array, got {A.dtype_of(buf)} of shape {tuple(buf.shape)}")

    def _run_paged(self, plan: Any, q: Any, paged_kv_cache: Any, qo_indptr: Any, causal: bool,
                   window_left: int, logits_soft_cap: Optional[float], sm_scale: Optional[float],
                   q_scale: Optional[float], k_scale: Optional[float], v_scale: Optional[float],
                   custom_mask: Any, mask_indptr: Any, out: Any, lse: Any, return_lse: bool,
                   sinks: Any = None) -> Any:
        self._check_q(q)
        k, v = kv_cache_views(paged_kv_cache)
        kv_dtype = self._kv_dtype_override(k)
        fp8 = kv_dtype in A.FP8
        scale, ks, vs, out_scale = self._scales(int(q.shape[2]), sm_scale, q_scale, k_scale, v_scale, fp8)
        out, lse = self._outputs(q, int(v.shape[-1]), out, lse, return_lse)
        options = attention_options(causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap,
                                    sm_scale=scale, custom_mask=custom_mask, mask_indptr=mask_indptr,
                                    sinks=sinks)
        plan.run_paged(q=A.dl(q), k_cache=A.dl(k), v_cache=A.dl(v), paged_kv_indptr=A.dl(self._indptr_run),
                       paged_kv_indices=A.dl(self._indices_run),
                       paged_kv_last_page_len=A.dl(self._last_page_len_run) if self._page_size > 1 else None,
                       qo_indptr=A.dl(qo_indptr), page_size=self._page_size, k_scale=ks, v_scale=vs,
                       kv_dtype=kv_dtype, options=options, out=A.dl(out), lse=A.dl(lse), stream=A.stream_of(q))
        if out_scale != 1.0:
            out *= out_scale
        return (out, lse) if return_lse else out
