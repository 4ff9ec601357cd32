"""Batch prefill (extend) attention, shaped like FlashInfer's BatchPrefillWithPagedKVCacheWrapper
and BatchPrefillWithRaggedKVCacheWrapper. Query rows of request i are the last qo_len_i
positions of its kv_len_i tokens (a causal mask aligns them to the end)."""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error
from ._wrapper import (PagedWrapper, PlannedWrapper, as_tokens, attention_options, check_pos_encoding,
                       kv_lens_of, plan_dtypes, reject_multi_item_scoring)


def _mask_plan(custom_mask: Any, packed_custom_mask: Any, qo_len: np.ndarray, kv_len: np.ndarray) -> Optional[np.ndarray]:
    """Host mask_indptr (element offsets of each request's [qo_len, kv_len] matrix) for a
    custom mask, or None without one."""
    if packed_custom_mask is not None:
        raise Error("packed_custom_mask: bit-packed masks are not supported by flashkv; pass custom_mask "
                    "(booleans, each request's [qo_len, kv_len] matrix flattened, back to back)")
    if custom_mask is None:
        return None
    sizes = qo_len.astype(np.int64) * kv_len.astype(np.int64)
    mask_indptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=mask_indptr[1:])
    n = int(custom_mask.shape[0]) if len(custom_mask.shape) == 1 else None
    if n is None:
        raise Error(f"custom_mask: expected a flattened 1-D mask, got shape {tuple(custom_mask.shape)}")
    if n < mask_indptr[-1]:
        raise Error(f"custom_mask: expected at least sum(qo_len * kv_len) = {int(mask_indptr[-1])} entries, got {n}")
    if mask_indptr[-1] > np.iinfo(np.int32).max:
        raise Error("custom_mask: more than 2^31 entries")
    return mask_indptr.astype(np.int32)


class _PrefillState:
    """What both prefill wrappers do with qo_indptr, masks, CUDA-graph buffers and the pair of
    plans (a causal plan skips KV past each query; a run may switch causal on, so a batch
    planned non-causal also gets the causal plan)."""

    def _init_prefill(self, qo_indptr_buf: Any, custom_mask_buf: Any, mask_indptr_buf: Any) -> None:
        if self._use_cuda_graph:
            if qo_indptr_buf is None:
                raise Error("qo_indptr_buf: required in CUDA-graph mode (use_cuda_graph=True)")
            self._fixed_batch_size = int(qo_indptr_buf.shape[0]) - 1
        else:
            self._fixed_batch_size = 0
        if (custom_mask_buf is None) != (mask_indptr_buf is None):
            raise Error("custom_mask_buf and mask_indptr_buf go together")
        self._qo_indptr_buf = qo_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._max_total_num_rows: Optional[int] = None

    def _plan_queries(self, qo_indptr: Any, batch_size: int, non_blocking: bool) -> np.ndarray:
        """Host qo_indptr; stores the run's device copy (the fixed buffer in CUDA-graph mode)."""
        qo_host = A.to_host_i32(qo_indptr, "qo_indptr")
        if qo_host.size != batch_size + 1:
            raise Error(f"qo_indptr: expected batch_size + 1 = {batch_size + 1} entries, got {qo_host.size}")
        if (np.diff(qo_host.astype(np.int64)) < 0).any() or qo_host[0] < 0:
            raise Error("qo_indptr: expected non-decreasing values from >= 0")
        total = int(qo_host[-1])
        if self._use_cuda_graph:
            if batch_size != self._fixed_batch_size:
                raise Error(f"batch size {batch_size} differs from the CUDA-graph batch size {self._fixed_batch_size} "
                            "fixed by qo_indptr_buf")
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total
            elif total > self._max_total_num_rows:
                raise Error(f"qo_indptr: {total} query rows exceed the {self._max_total_num_rows} of the first "
                            "CUDA-graph plan")
            A.copy_into(self._qo_indptr_buf, qo_indptr, "qo_indptr", non_blocking)
            self._qo_indptr_run = self._qo_indptr_buf[: batch_size + 1]
        else:
            self._qo_indptr_buf = A.to_device_i32(qo_indptr, self._float_workspace_buffer, non_blocking)
            self._qo_indptr_run = self._qo_indptr_buf
        return qo_host

    def _plan_mask(self, custom_mask: Any, packed_custom_mask: Any, qo_host: np.ndarray, kv_len: np.ndarray,
                   non_blocking: bool) -> bool:
        mask_indptr = _mask_plan(custom_mask, packed_custom_mask, np.diff(qo_host), kv_len)
        if mask_indptr is None:
            if self._use_cuda_graph and self._custom_mask_buf is not None:
                raise Error("custom_mask: this CUDA-graph wrapper was built with custom_mask_buf, so every plan needs a mask")
            self._mask_run = self._mask_indptr_run = None
            return False
        ws = self._float_workspace_buffer
        if self._use_cuda_graph:
            if self._custom_mask_buf is None:
                raise Error("custom_mask: a CUDA-graph wrapper needs custom_mask_buf and mask_indptr_buf for masks")
            n = int(mask_indptr[-1])
            A.copy_into(self._custom_mask_buf, A.to_device_u8(custom_mask[:n], self._custom_mask_buf, non_blocking),
                        "custom_mask", non_blocking)
            A.copy_into(self._mask_indptr_buf, A.to_device_i32(mask_indptr, self._mask_indptr_buf, non_blocking),
                        "mask_indptr", non_blocking)
            self._mask_run = self._custom_mask_buf
            self._mask_indptr_run = self._mask_indptr_buf[: mask_indptr.size]
        else:
            self._mask_run = A.to_device_u8(custom_mask, ws, non_blocking)
            self._mask_indptr_run = A.to_device_i32(mask_indptr, ws, non_blocking)
        return True

    def _plan_both(self, qo_host: np.ndarray, kv_len: np.ndarray, num_qo_heads: int, num_kv_heads: int,
                   head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool, has_mask: bool,
                   window_left: int, fixed_split_size: int, disable_split_kv: bool, max_kv_len: int) -> None:
        graph = self._use_cuda_graph
        batch_size = int(qo_host.size - 1)
        batch = _C.BatchShape(kv_len=kv_len, qo_indptr=qo_host, num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_v=head_dim_vo,
                              page_size=page_size, window_left=window_left)
        options = _C.PlanOptions(enable_split_kv=not disable_split_kv, fixed_split_size=fixed_split_size,
                                 cuda_graph=graph, max_batch_size=batch_size if graph else 0,
                                 max_num_tokens=self._max_total_num_rows if graph else 0, max_kv_len=max_kv_len)
        variants = [False] if has_mask else ([True] if causal else [False, True])
        for variant in variants:
            batch.causal = variant
            self._plan_object("causal" if variant else "full").plan(
                decode=False, batch=batch, options=options, stream=A.stream_of(self._float_workspace_buffer))
        self._has_mask = has_mask
        self._causal = causal
        self._plan_variants = variants

    def _plan_for(self, causal: bool) -> Tuple[Any, bool]:
        """The plan a run with this causal flag uses, and the flag the kernel gets (a custom mask
        replaces causal)."""
        self._require_planned()
        if self._has_mask:
            return self._plans["full"], False
        if causal and True in self._plan_variants:
            return self._plans["causal"], True
        if not causal and False in self._plan_variants:
            return self._plans["full"], False
        raise Error("run: causal=False, but the batch was planned with causal=True (the plan skips KV past "
                    "each query); plan with causal=False")

    def _set_common(self, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, window_left, logits_soft_cap,
                    sm_scale, q_dt, kv_dt, o_dt) -> None:
        self._num_qo_heads, self._num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self._head_dim_qk, self._head_dim_vo = int(head_dim_qk), int(head_dim_vo)
        self._window_left = int(window_left)
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale
        self._q_data_type, self._kv_data_type, self._o_data_type = q_dt, kv_dt, o_dt
        self._planned = True

    def _set_run_options(self, causal, window_left, logits_soft_cap, sm_scale) -> None:
        self._require_planned()
        self._causal = bool(causal)
        if window_left is not None:
            self._window_left = int(window_left)
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale


class BatchPrefillWithPagedKVCacheWrapper(_PrefillState, PagedWrapper):
    """Prefill attention of new query rows against a paged KV cache.

    Shapes: q [qo_indptr[-1], num_qo_heads, head_dim_qk]; the KV cache as for the decode wrapper
    ((k, v) tuple of [num_slots, num_kv_heads, head_dim] arrays, NHD 4-D pages, or one 5-D
    array); output [qo_indptr[-1], num_qo_heads, head_dim_vo] in q's dtype (or float32, plan's
    o_data_type); LSE
    [qo_indptr[-1], num_qo_heads] float32, base 2 (-inf for rows that see no KV).

    CUDA-graph mode: qo_indptr_buf [batch_size + 1], paged_kv_indptr_buf [batch_size + 1],
    paged_kv_indices_buf, paged_kv_last_page_len_buf [batch_size] (int32), and for tree masks
    custom_mask_buf (uint8, >= the mask's entries) with mask_indptr_buf [batch_size + 1]. The
    first plan fixes the number of query rows later plans may use.
    """

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Any = None, paged_kv_indptr_buf: Any = None, paged_kv_indices_buf: Any = None,
                 paged_kv_last_page_len_buf: Any = None, custom_mask_buf: Any = None, mask_indptr_buf: Any = None,
                 backend: str = "auto", jit_args: Any = None) -> None:
        PagedWrapper.__init__(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._check_graph_buffers(paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        self._init_prefill(qo_indptr_buf, custom_mask_buf, mask_indptr_buf)
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf

    def plan(self, qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: Optional[int] = None, custom_mask: Any = None, packed_custom_mask: Any = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type: Any = None,
             kv_data_type: Any = None, non_blocking: bool = True, prefix_len_ptr: Any = None,
             token_pos_in_items_ptr: Any = None, token_pos_in_items_len: int = 0, max_item_len_ptr: Any = None,
             seq_lens: Any = None, seq_lens_q: Any = None, block_tables: Any = None,
             max_token_per_sequence: Optional[int] = None, max_sequence_kv: Optional[int] = None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, o_data_type: Any = None,
             data_type: Any = None) -> None:
        """Plans a prefill batch (on the host; not capturable into a CUDA graph).

        Args:
            qo_indptr: [batch_size + 1]: request i owns query rows qo_indptr[i]:qo_indptr[i+1].
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len: the page table, as for
                decode (indices may be longer than paged_kv_indptr[-1]; int32 or int64).
            head_dim_vo: V's head dim (default head_dim_qk).
            custom_mask: bool/uint8, each request's [qo_len, kv_len] matrix flattened, back to
                back; replaces causal (tree masks of speculative decoding).
            causal: causal mask (runs may also set it: forward(causal=...)).
            window_left, logits_soft_cap, sm_scale, data types (o_data_type too), fixed_split_size (pages),
            disable_split_kv, seq_lens: as for decode. Multi-item scoring arguments
            (prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
            are rejected.
        """
        check_pos_encoding(pos_encoding_mode)
        reject_multi_item_scoring(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        if block_tables is not None or seq_lens_q is not None:
            raise Error("block_tables / seq_lens_q: not supported by flashkv; pass qo_indptr and the page table")
        q_dt, kv_dt, o_dt = plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type)
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        page_size = int(page_size)
        if page_size < 1:
            raise Error(f"page_size: expected >= 1, got {page_size}")
        batch_size = len(qo_indptr) - 1
        qo_host = self._plan_queries(qo_indptr, batch_size, non_blocking)
        indptr_host = A.to_host_i32(paged_kv_indptr, "paged_kv_indptr")
        kv_len = self._plan_page_table(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, indptr_host, seq_lens,
                                       batch_size, page_size, non_blocking, "paged_kv_")
        has_mask = self._plan_mask(custom_mask, packed_custom_mask, qo_host, kv_len, non_blocking)
        max_kv_len = int(self._paged_kv_indices_buf.shape[0]) * page_size if self._use_cuda_graph else 0
        self._page_size = page_size
        self._plan_both(qo_host, kv_len, int(num_qo_heads), int(num_kv_heads), int(head_dim_qk), int(head_dim_vo),
                        page_size, bool(causal), has_mask, int(window_left), as_tokens(fixed_split_size, page_size),
                        disable_split_kv, max_kv_len)
        self._set_common(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, window_left, logits_soft_cap,
                         sm_scale, q_dt, kv_dt, o_dt)

    begin_forward = plan

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Any = None) -> Any:
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim_qk] over the planned batch.
        Returns out, or (out, lse) when return_lse. Allocates nothing beyond out/lse and never
        synchronizes (CUDA-graph capturable). sinks: float32 [num_qo_heads] attention sinks, or
        None."""
        if args:
            raise Error("run: extra positional arguments (custom kernel arguments) are not supported")
        plan, causal = self._plan_for(self._causal)
        window = self._window_left if window_left is None else int(window_left)
        return self._run_paged(plan, q, paged_kv_cache, self._qo_indptr_run, causal, window, self._logits_soft_cap,
                               self._sm_scale, q_scale, k_scale, v_scale, self._mask_run, self._mask_indptr_run,
                               out, lse, return_lse, sinks)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: Any, paged_kv_cache: Any, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, k_scale: Optional[float] = None,
                v_scale: Optional[float] = None, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """The old API: sets causal, logits_soft_cap, sm_scale (and window_left when given) for
        this and later runs, then run()."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(causal, window_left, logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: Any, paged_kv_cache: Any, causal: bool = False,
                           pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                           k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                           window_left: Optional[int] = None, logits_soft_cap: Optional[float] = None,
                           sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                           rope_theta: Optional[float] = None) -> Any:
        """forward() returning (out, lse)."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(causal, window_left, logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillState, PlannedWrapper):
    """Prefill attention of new query rows against contiguous ("ragged") K/V rows.

    Shapes: q [qo_indptr[-1], num_qo_heads, head_dim_qk], k [kv_indptr[-1], num_kv_heads,
    head_dim_qk], v [kv_indptr[-1], num_kv_heads, head_dim_vo]; output
    [qo_indptr[-1], num_qo_heads, head_dim_vo]; LSE [qo_indptr[-1], num_qo_heads] float32, base 2.
    CUDA-graph mode: qo_indptr_buf and kv_indptr_buf [batch_size + 1] (int32), and for masks
    custom_mask_buf / mask_indptr_buf.
    """

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Any = None, kv_indptr_buf: Any = None, custom_mask_buf: Any = None,
                 mask_indptr_buf: Any = None, backend: str = "auto", jit_args: Any = None) -> None:
        PlannedWrapper.__init__(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        if use_cuda_graph and kv_indptr_buf is None:
            raise Error("kv_indptr_buf: required in CUDA-graph mode (use_cuda_graph=True)")
        self._init_prefill(qo_indptr_buf, custom_mask_buf, mask_indptr_buf)
        self._kv_indptr_buf = kv_indptr_buf

    def plan(self, qo_indptr: Any, kv_indptr: Any, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: Optional[int] = None, custom_mask: Any = None, packed_custom_mask: Any = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type: Any = None,
             kv_data_type: Any = None, non_blocking: bool = True, prefix_len_ptr: Any = None,
             token_pos_in_items_ptr: Any = None, token_pos_in_items_len: int = 0, max_item_len_ptr: Any = None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, o_data_type: Any = None,
             data_type: Any = None) -> None:
        """Plans a ragged prefill batch: request i owns query rows qo_indptr[i]:qo_indptr[i+1]
        and K/V rows kv_indptr[i]:kv_indptr[i+1]. Other arguments as for the paged wrapper
        (fixed_split_size in tokens)."""
        check_pos_encoding(pos_encoding_mode)
        reject_multi_item_scoring(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        q_dt, kv_dt, o_dt = plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type)
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        batch_size = len(qo_indptr) - 1
        qo_host = self._plan_queries(qo_indptr, batch_size, non_blocking)
        kv_host = A.to_host_i32(kv_indptr, "kv_indptr")
        if kv_host.size != batch_size + 1:
            raise Error(f"kv_indptr: expected batch_size + 1 = {batch_size + 1} entries, got {kv_host.size}")
        kv_len = kv_lens_of(kv_host, None, 1)
        self._num_kv_rows = int(kv_host[-1])
        if self._use_cuda_graph:
            A.copy_into(self._kv_indptr_buf, kv_indptr, "kv_indptr", non_blocking)
            self._kv_indptr_run = self._kv_indptr_buf[: batch_size + 1]
        else:
            self._kv_indptr_buf = A.to_device_i32(kv_indptr, self._float_workspace_buffer, non_blocking)
            self._kv_indptr_run = self._kv_indptr_buf
        has_mask = self._plan_mask(custom_mask, packed_custom_mask, qo_host, kv_len, non_blocking)
        max_kv_len = 0
        if self._use_cuda_graph:
            # Like the query rows, the first CUDA-graph plan fixes the KV rows later plans may use.
            if getattr(self, "_max_total_kv_rows", None) is None:
                self._max_total_kv_rows = int(kv_host[-1])
            max_kv_len = self._max_total_kv_rows
        self._plan_both(qo_host, kv_len, int(num_qo_heads), int(num_kv_heads), int(head_dim_qk), int(head_dim_vo),
                        1, bool(causal), has_mask, int(window_left), as_tokens(fixed_split_size, 1),
                        disable_split_kv, max_kv_len)
        self._set_common(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, window_left, logits_soft_cap,
                         sm_scale, q_dt, kv_dt, o_dt)

    begin_forward = plan

    def run(self, q: Any, k: Any, v: Any, *args: Any, out: Any = None, lse: Any = None, return_lse: bool = False,
            enable_pdl: Optional[bool] = None, sinks: Any = None) -> Any:
        """Attention of q over k/v ([kv_indptr[-1], num_kv_heads, head_dim]) for the planned
        batch. Returns out, or (out, lse) when return_lse. sinks: float32 [num_qo_heads]
        attention sinks, or None."""
        if args:
            raise Error("run: extra positional arguments (custom kernel arguments) are not supported")
        plan, causal = self._plan_for(self._causal)
        self._check_q(q)
        if self._kv_data_type is not None and A.dtype_of(k) != self._kv_data_type:
            raise Error(f"k: dtype {A.dtype_of(k)} differs from the planned kv_data_type {self._kv_data_type}")
        # Checked here from the plan's host copy: the compiled run checks it only for host
        # arrays (on a GPU the values live on the device, where the kernel clamps rows).
        if len(k.shape) == 3 and int(k.shape[0]) < self._num_kv_rows:
            raise Error(f"kv_indptr: last value {self._num_kv_rows} exceeds k's {int(k.shape[0])} rows")
        scale = self._scales(int(q.shape[2]), self._sm_scale, None, None, None, False)[0]
        out, lse = self._outputs(q, int(v.shape[-1]), out, lse, return_lse)
        options = attention_options(causal=causal, window_left=self._window_left,
                                    logits_soft_cap=self._logits_soft_cap, sm_scale=scale,
                                    custom_mask=self._mask_run, mask_indptr=self._mask_indptr_run,
                                    sinks=sinks)
        plan.run_ragged(q=A.dl(q), k=A.dl(k), v=A.dl(v), qo_indptr=A.dl(self._qo_indptr_run),
                        kv_indptr=A.dl(self._kv_indptr_run), options=options, out=A.dl(out), lse=A.dl(lse),
                        stream=A.stream_of(q))
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: Any, k: Any, v: Any, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """The old API: sets causal, logits_soft_cap, sm_scale (and window_left when given) for
        this and later runs, then run()."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(causal, window_left, logits_soft_cap, sm_scale)
        return self.run(q, k, v)

    def forward_return_lse(self, q: Any, k: Any, v: Any, causal: bool = False, pos_encoding_mode: str = "NONE",
                           use_fp16_qk_reduction: bool = False, window_left: Optional[int] = None,
                           logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                           rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """forward() returning (out, lse)."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(causal, window_left, logits_soft_cap, sm_scale)
        return self.run(q, k, v, return_lse=True)
