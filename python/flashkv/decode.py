"""Batch decode over a paged KV cache, shaped like FlashInfer's BatchDecodeWithPagedKVCacheWrapper:
plan once per batch on the host (plan / begin_forward), run once per layer (run / forward /
forward_return_lse). Each request has one query row that sees all of its KV entries."""

from __future__ import annotations

import functools
from typing import Any, Optional

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error
from ._wrapper import PagedWrapper, as_tokens, check_pos_encoding


class BatchDecodeWithPagedKVCacheWrapper(PagedWrapper):
    """Decode attention for a batch of requests over a paged KV cache.

    Shapes: q [batch_size, num_qo_heads, head_dim]; the KV cache a (k_cache, v_cache) tuple of
    [num_slots, num_kv_heads, head_dim] arrays (page size 1) or NHD
    [num_pages, page_size, num_kv_heads, head_dim] arrays, or one array
    [num_pages, 2, page_size, num_kv_heads, head_dim]; output [batch_size, num_qo_heads,
    head_dim]; LSE [batch_size, num_qo_heads] float32 in base 2 (-inf for a request with no KV).

    Args:
        float_workspace_buffer: uint8 array on the device the wrapper runs on. Split-KV partial
            states go there when it is large enough (it may be shared by all wrappers), else into
            memory the plan allocates.
        kv_layout: "NHD" (flashkv stores no other layout).
        use_cuda_graph: fixed buffers for a batch size that cannot change; plan() copies the
            page table into them, and runs read only them, so a captured run replays with any
            batch of that size that is planned before the replay.
        use_tensor_cores: accepted for compatibility (flashkv picks its decode kernel itself).
        paged_kv_indptr_buffer / paged_kv_indices_buffer / paged_kv_last_page_len_buffer: int32
            buffers [batch_size + 1] / [max entries] / [batch_size], CUDA-graph mode only.
        backend: accepted and ignored (flashkv has one implementation per device).
    """

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Any = None,
                 paged_kv_indices_buffer: Any = None, paged_kv_last_page_len_buffer: Any = None,
                 backend: str = "auto", jit_args: Any = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._check_graph_buffers(paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            self._fixed_batch_size = int(paged_kv_last_page_len_buffer.shape[0])
            if int(paged_kv_indptr_buffer.shape[0]) != self._fixed_batch_size + 1:
                raise Error("paged_kv_indptr_buffer: expected batch_size + 1 = "
                            f"{self._fixed_batch_size + 1} entries, got {int(paged_kv_indptr_buffer.shape[0])}")
        else:
            self._fixed_batch_size = 0
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: Optional[float] = None, q_data_type: Any = None, kv_data_type: Any = None,
             data_type: Any = None, sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True, block_tables: Any = None,
             seq_lens: Any = None, fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
             o_data_type: Any = None, q_len_per_req: int = 1) -> None:
        """Plans a decode batch (on the host; not capturable into a CUDA graph).

        Args:
            indptr: int32/int64 [batch_size + 1]: request i owns indices[indptr[i]:indptr[i+1]].
            indices: int32/int64 [>= indptr[-1]]: page ids (token slots when page_size is 1);
                entries past indptr[-1] are ignored.
            last_page_len: int32/int64 [batch_size]: tokens in each request's last page.
            num_qo_heads, num_kv_heads, head_dim, page_size: the problem shape.
            window_left: >= 0: each query sees its last window_left + 1 tokens; -1: all.
            logits_soft_cap: > 0: logits become cap * tanh(logits / cap).
            q_data_type / kv_data_type / data_type: checked against the run's arrays when given
                (data_type sets both); an fp8 kv_data_type lets a uint8 cache hold fp8 values.
            sm_scale: softmax scale (default 1 / sqrt(head_dim)).
            seq_lens: [batch_size] KV tokens per request, instead of deriving them from the
                page table.
            fixed_split_size: split every request's KV into chunks of this many pages (results
                then do not depend on the rest of the batch).
            disable_split_kv: never split a request's KV.
        """
        self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                        pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
                        sm_scale, non_blocking, block_tables, seq_lens, fixed_split_size, disable_split_kv,
                        o_data_type, q_len_per_req, None)

    begin_forward = plan

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
                   sm_scale, non_blocking, block_tables, seq_lens, fixed_split_size, disable_split_kv,
                   o_data_type, q_len_per_req, indptr_host) -> None:
        check_pos_encoding(pos_encoding_mode)
        if block_tables is not None:
            raise Error("block_tables: not supported by flashkv; pass the page table as indptr/indices")
        if q_len_per_req != 1:
            raise Error(f"q_len_per_req: flashkv decode takes one query per request, got {q_len_per_req}; "
                        "use BatchPrefillWithPagedKVCacheWrapper for several")
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dt, kv_dt, o_dt = (A.canonical_dtype(t) for t in (q_data_type, kv_data_type, o_data_type))
        if o_dt is not None and q_dt is not None and o_dt != q_dt:
            raise Error(f"o_data_type: flashkv writes the output in q's dtype ({q_dt}), got {o_dt}")
        page_size = int(page_size)
        if page_size < 1:
            raise Error(f"page_size: expected >= 1, got {page_size}")
        batch_size = int(last_page_len.shape[0]) if hasattr(last_page_len, "shape") else len(last_page_len)
        if self._use_cuda_graph and batch_size != self._fixed_batch_size:
            raise Error(f"batch size {batch_size} differs from the CUDA-graph batch size {self._fixed_batch_size} "
                        "fixed by the wrapper's buffers")
        if indptr_host is None:
            indptr_host = A.to_host_i32(indptr, "indptr")
        else:
            indptr_host = A.to_host_i32(indptr_host, "global_override_indptr_cpu")[: batch_size + 1]
        kv_len = self._plan_page_table(indptr, indices, last_page_len, indptr_host, seq_lens, batch_size, page_size,
                                       non_blocking, "")
        graph = self._use_cuda_graph
        max_kv_len = int(self._paged_kv_indices_buf.shape[0]) * page_size if graph else 0
        batch = _C.BatchShape(kv_len=kv_len, num_qo_heads=int(num_qo_heads), num_kv_heads=int(num_kv_heads),
                              head_dim_qk=int(head_dim), head_dim_v=int(head_dim), page_size=page_size,
                              causal=False, window_left=int(window_left))
        options = _C.PlanOptions(enable_split_kv=not disable_split_kv,
                                 fixed_split_size=as_tokens(fixed_split_size, page_size), cuda_graph=graph,
                                 max_batch_size=batch_size if graph else 0,
                                 max_num_tokens=batch_size if graph else 0, max_kv_len=max_kv_len)
        self._plan_object("decode").plan(decode=True, batch=batch, options=options,
                                         stream=A.stream_of(self._float_workspace_buffer))
        self._page_size = page_size
        self._batch_size = batch_size
        self._num_qo_heads, self._num_kv_heads, self._head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        self._window_left = int(window_left)
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale
        self._q_data_type, self._kv_data_type = q_dt, kv_dt
        self._planned = True

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Any = None) -> Any:
        """Decode attention of q [batch_size, num_qo_heads, head_dim] over the planned batch.

        Allocates nothing beyond `out`/`lse` when they are not given, and never synchronizes, so a
        run can be captured into a CUDA graph. Returns out [batch_size, num_qo_heads, head_dim]
        (q's dtype), or (out, lse) with lse [batch_size, num_qo_heads] float32 in base 2 when
        return_lse. k_scale/v_scale: the cache holds values divided by these (fp8 KV).
        """
        if args:
            raise Error("run: extra positional arguments (custom kernel arguments) are not supported")
        if sinks is not None:
            raise Error("sinks: attention sinks are not supported by flashkv")
        self._require_planned()
        if int(q.shape[0]) != self._batch_size:
            raise Error(f"q: {int(q.shape[0])} rows, but the batch was planned with batch_size {self._batch_size}")
        window = self._window_left if window_left is None else int(window_left)
        return self._run_paged(self._plans["decode"], q, paged_kv_cache, None, False, window,
                               self._logits_soft_cap, self._sm_scale, q_scale, k_scale, v_scale, None, None,
                               out, lse, return_lse)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: Any, paged_kv_cache: Any, pos_encoding_mode: str = "NONE", q_scale: Optional[float] = None,
                k_scale: Optional[float] = None, v_scale: Optional[float] = None, window_left: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """The old API: sets logits_soft_cap, sm_scale (and window_left when given) for this and
        later runs, then run()."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(window_left, logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: Any, paged_kv_cache: Any, pos_encoding_mode: str = "NONE",
                           q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, window_left: Optional[int] = None,
                           logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                           rope_scale: Optional[float] = None, rope_theta: Optional[float] = None) -> Any:
        """forward() returning (out, lse)."""
        check_pos_encoding(pos_encoding_mode)
        self._set_run_options(window_left, logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _set_run_options(self, window_left, logits_soft_cap, sm_scale) -> None:
        self._require_planned()
        if window_left is not None:
            self._window_left = int(window_left)
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale


def fast_decode_plan(self: BatchDecodeWithPagedKVCacheWrapper, indptr: Any, indices: Any, last_page_len: Any,
                     num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                     pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap: Optional[float] = None,
                     q_data_type: Any = None, kv_data_type: Any = None, data_type: Any = None,
                     sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                     rope_theta: Optional[float] = None, non_blocking: bool = True,
                     fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
                     global_override_indptr_cpu: Any = None) -> None:
    """plan() for a decode wrapper that skips the device-to-host copy of indptr when the caller
    has it on the host (global_override_indptr_cpu, [>= batch_size + 1]). Meant to replace a
    CUDA-graph wrapper's begin_forward: `w.begin_forward = functools.partial(fast_decode_plan, w)`."""
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise Error(f"fast_decode_plan: expected a BatchDecodeWithPagedKVCacheWrapper, got {type(self).__name__}")
    self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                    pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
                    sm_scale, non_blocking, None, None, fixed_split_size, disable_split_kv, None, 1,
                    global_override_indptr_cpu)
