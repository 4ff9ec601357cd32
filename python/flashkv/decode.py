"""Batch decode over a paged KV cache, shaped like FlashInfer's BatchDecodeWithPagedKVCacheWrapper:
plan once per batch on the host (plan / begin_forward), run once per layer (run / forward /
forward_return_lse). Each request has one query row that sees all of its KV entries."""

from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error
from ._wrapper import PagedWrapper, as_tokens, check_pos_encoding, kv_lens_of, plan_dtypes


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
        # FlashInfer's query indptr of the tensor-core form (one row per request); the runs do not
        # read it, since a decode batch has one query row per request.
        self._qo_indptr_buf = None
        self._pos_encoding_mode = "NONE"
        self._window_left = -1
        self._logits_soft_cap: Optional[float] = None
        self._sm_scale: Optional[float] = None
        self._rope_scale: Optional[float] = None
        self._rope_theta: Optional[float] = None
        self._plan_info: Optional[DecodePlanInfo] = None
        # FlashInfer's compiled module: what code that plans without plan() calls (fast_decode_plan).
        self._cached_module = DecodePlanModule(self)

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
            o_data_type: the output's dtype: q's (default) or float32 (e.g. partial outputs that
                merge_state then combines without rounding them first).
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
        self._rope_scale, self._rope_theta = rope_scale, rope_theta

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
        q_dt, kv_dt, o_dt = plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type)
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
        if self._use_tensor_cores:
            self._qo_indptr_buf = A.to_device_i32(np.arange(batch_size + 1, dtype=np.int32),
                                                  self._float_workspace_buffer, non_blocking)
        self._plan_info = self._make_plan(kv_len, batch_size, int(num_qo_heads), int(num_kv_heads), int(head_dim),
                                          int(head_dim), page_size, int(window_left),
                                          -1 if fixed_split_size is None else int(fixed_split_size),
                                          bool(disable_split_kv))
        self._pos_encoding_mode = pos_encoding_mode
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale
        self._q_data_type, self._kv_data_type, self._o_data_type = q_dt, kv_dt, o_dt
        self._planned = True

    def _make_plan(self, kv_len: np.ndarray, batch_size: int, num_qo_heads: int, num_kv_heads: int,
                   head_dim_qk: int, head_dim_vo: int, page_size: int, window_left: int, fixed_split_size: int,
                   disable_split_kv: bool) -> "DecodePlanInfo":
        """Plans the batch (plan() and _cached_module.plan() both end here) and sets the fields
        the runs read. fixed_split_size in pages, -1 (or any value < 1) for none."""
        graph = self._use_cuda_graph
        max_kv_len = int(self._paged_kv_indices_buf.shape[0]) * page_size if graph else 0
        batch = _C.BatchShape(kv_len=kv_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                              head_dim_qk=head_dim_qk, head_dim_v=head_dim_vo, page_size=page_size,
                              causal=False, window_left=window_left)
        options = _C.PlanOptions(enable_split_kv=not disable_split_kv,
                                 fixed_split_size=as_tokens(fixed_split_size, page_size), cuda_graph=graph,
                                 max_batch_size=batch_size if graph else 0,
                                 max_num_tokens=batch_size if graph else 0, max_kv_len=max_kv_len)
        plan = self._plan_object("decode")
        plan.plan(decode=True, batch=batch, options=options, stream=A.stream_of(self._float_workspace_buffer))
        self._page_size = page_size
        self._batch_size = batch_size
        self._num_qo_heads, self._num_kv_heads, self._head_dim = num_qo_heads, num_kv_heads, head_dim_qk
        self._window_left = window_left
        return DecodePlanInfo(plan, kv_len, batch_size, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                              page_size, window_left, as_tokens(fixed_split_size, page_size), disable_split_kv,
                              graph)

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Any = None) -> Any:
        """Decode attention of q [batch_size, num_qo_heads, head_dim] over the planned batch.

        Allocates nothing beyond `out`/`lse` when they are not given, and never synchronizes, so a
        run can be captured into a CUDA graph. Returns out [batch_size, num_qo_heads, head_dim]
        (q's dtype), or (out, lse) with lse [batch_size, num_qo_heads] float32 in base 2 when
        return_lse. k_scale/v_scale: the cache holds values divided by these (fp8 KV).
        sinks: float32 [num_qo_heads] attention sinks (natural-log logits that join each row's
        softmax denominator with no value; the LSE includes them), or None.
        """
        if args:
            raise Error("run: extra positional arguments (custom kernel arguments) are not supported")
        self._require_planned()
        info = self._plan_info
        if not isinstance(info, DecodePlanInfo) or info.plan is not self._plans.get("decode"):
            raise Error("_plan_info: expected what this wrapper's plan() or _cached_module.plan() returned, "
                        f"got {type(info).__name__}")
        check_pos_encoding(self._pos_encoding_mode)
        if int(q.shape[0]) != self._batch_size:
            raise Error(f"q: {int(q.shape[0])} rows, but the batch was planned with batch_size {self._batch_size}")
        window = self._window_left if window_left is None else int(window_left)
        return self._run_paged(info.plan, q, paged_kv_cache, None, False, window,
                               self._logits_soft_cap, self._sm_scale, q_scale, k_scale, v_scale, None, None,
                               out, lse, return_lse, sinks)

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


_RANGE_BUFS: Dict[Tuple[str, str], Any] = {}


def _get_range_buf(seq_len: int, device: Any) -> Any:
    """int32 [seq_len] holding 0, 1, ..., seq_len - 1 on `device`, cached per (seq_len, device):
    callers must not write to it. A PyTorch tensor when `device` is a torch.device or PyTorch is
    imported, else a NumPy array (then `device` must be the CPU)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or int(seq_len) < 0:
        raise Error(f"_get_range_buf: seq_len: expected an int >= 0, got {seq_len!r}")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(device, torch.device):
        dev = str(device)
    elif isinstance(device, str):
        dev = device
    else:
        raise Error(f"_get_range_buf: device: expected a device name such as 'cpu' or 'cuda:0' or a torch.device, "
                    f"got {type(device).__name__}")
    key = (str(int(seq_len)), dev)
    buf = _RANGE_BUFS.get(key)
    if buf is None:
        if torch is not None:
            buf = torch.arange(int(seq_len), dtype=torch.int32, device=dev)
        elif dev == "cpu":
            buf = np.arange(int(seq_len), dtype=np.int32)
        else:
            raise Error(f"_get_range_buf: device {dev!r} needs PyTorch; without it only 'cpu' (NumPy) is available")
        _RANGE_BUFS[key] = buf
    return buf


def get_seq_lens(kv_indptr: Any, kv_last_page_len: Any, page_size: int) -> Any:
    """KV tokens of each request of a page table, FlashInfer's way:
    max(pages - 1, 0) * page_size + last_page_len, computed with the caller's array library on its
    device (NumPy, PyTorch or CuPy in, the same out). A request with no pages counts
    last_page_len tokens here, as in FlashInfer; the planners count 0 for it
    (flashkv.page.get_seq_lens is the host form with that rule)."""
    for name, a in (("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
        if not hasattr(a, "shape") or len(a.shape) != 1:
            raise Error(f"get_seq_lens: {name}: expected a 1-D array, got {type(a).__name__}"
                        + (f" of shape {tuple(a.shape)}" if hasattr(a, "shape") else ""))
    if int(kv_indptr.shape[0]) != int(kv_last_page_len.shape[0]) + 1:
        raise Error(f"get_seq_lens: kv_indptr: expected len(kv_last_page_len) + 1 = {int(kv_last_page_len.shape[0]) + 1} "
                    f"entries, got {int(kv_indptr.shape[0])}")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise Error(f"get_seq_lens: page_size: expected an int >= 1, got {page_size!r}")
    full = kv_indptr[1:] - kv_indptr[:-1] - 1
    full = full * (full > 0)
    return full * int(page_size) + kv_last_page_len


class DecodePlanInfo:
    """What a decode plan was made from (FlashInfer's `_plan_info`): the compiled plan it made and
    the batch and options it was made with. Two are equal when they describe the same plan."""

    __slots__ = ("plan", "kv_len", "batch_size", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
                 "page_size", "window_left", "fixed_split_tokens", "disable_split_kv", "cuda_graph")

    def __init__(self, plan: Any, kv_len: np.ndarray, batch_size: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim_qk: int, head_dim_vo: int, page_size: int, window_left: int, fixed_split_tokens: int,
                 disable_split_kv: bool, cuda_graph: bool) -> None:
        self.plan = plan
        self.kv_len = tuple(int(x) for x in kv_len)
        self.batch_size, self.num_qo_heads, self.num_kv_heads = batch_size, num_qo_heads, num_kv_heads
        self.head_dim_qk, self.head_dim_vo, self.page_size = head_dim_qk, head_dim_vo, page_size
        self.window_left, self.fixed_split_tokens = window_left, fixed_split_tokens
        self.disable_split_kv, self.cuda_graph = disable_split_kv, cuda_graph

    def key(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__[1:])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodePlanInfo) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return "DecodePlanInfo(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__[1:]) + ")"


# FlashInfer's positional argument lists of its compiled decode plan: (name, kind). Kinds: "array",
# "array?" (an array or None), "int", "bool", "float".
_WORKSPACES = (("float_workspace_buffer", "array"), ("int_workspace_buffer", "array?"),
               ("page_locked_int_workspace_buffer", "array?"))
TENSOR_CORE_PLAN_ARGS = _WORKSPACES + (
    ("qo_indptr", "array"), ("paged_kv_indptr", "array"), ("kv_len_arr", "array"), ("total_num_rows", "int"),
    ("batch_size", "int"), ("num_qo_heads", "int"), ("num_kv_heads", "int"), ("page_size", "int"),
    ("enable_cuda_graph", "bool"), ("head_dim_qk", "int"), ("head_dim_vo", "int"), ("causal", "bool"),
    ("window_left", "int"), ("fixed_split_size", "int"), ("disable_split_kv", "bool"))
CUDA_CORE_PLAN_ARGS = _WORKSPACES + (
    ("indptr", "array"), ("batch_size", "int"), ("num_qo_heads", "int"), ("num_kv_heads", "int"),
    ("page_size", "int"), ("enable_cuda_graph", "bool"), ("window_left", "int"), ("logits_soft_cap", "float"),
    ("head_dim_qk", "int"), ("head_dim_vo", "int"), ("empty_q_data", "array"), ("empty_kv_data", "array"))


def _is_array(x: Any) -> bool:
    try:
        A.framework(x)
        return True
    except Error:
        return False


def _check_kind(value: Any, kind: str) -> bool:
    if kind == "array":
        return _is_array(value)
    if kind == "array?":
        return value is None or _is_array(value)
    if kind == "bool":
        return isinstance(value, (bool, np.bool_))
    if kind == "int":
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


class DecodePlanModule:
    """A decode wrapper's `_cached_module` (FlashInfer's compiled module): `plan(*args)` takes
    FlashInfer's positional argument lists, 18 in the tensor-core form (use_tensor_cores=True) and
    15 in the CUDA-core form, plans exactly as the wrapper's plan() does for the same batch, and
    returns the `_plan_info` the next run uses (the caller assigns it to `_plan_info`).

    The page table is the one the wrapper holds (`_paged_kv_indptr_buf`, `_paged_kv_indices_buf`,
    `_paged_kv_last_page_len_buf`): the fixed buffers in CUDA-graph mode, else what the caller
    assigned to them before this call. The CUDA-core form carries no KV lengths, so for a
    page size above 1 they come from `_paged_kv_last_page_len_buf` (a device-to-host copy)."""

    def __init__(self, wrapper: "BatchDecodeWithPagedKVCacheWrapper") -> None:
        self._wrapper = wrapper

    def plan(self, *args: Any) -> DecodePlanInfo:
        w = self._wrapper
        spec = TENSOR_CORE_PLAN_ARGS if w.use_tensor_cores else CUDA_CORE_PLAN_ARGS
        form = "tensor-core form (use_tensor_cores=True)" if w.use_tensor_cores else \
            "CUDA-core form (use_tensor_cores=False)"
        if len(args) != len(spec):
            raise Error(f"_cached_module.plan: expected {len(spec)} positional arguments in the {form}, got "
                        f"{len(args)}: " + ", ".join(f"{i}={n}" for i, (n, _) in enumerate(spec)))
        for i, ((name, kind), value) in enumerate(zip(spec, args)):
            if not _check_kind(value, kind):
                want = {"array": "an array", "array?": "an array or None", "bool": "a bool", "int": "an int",
                        "float": "a float"}[kind]
                raise Error(f"_cached_module.plan: argument {i} ({name}): expected {want}, got {type(value).__name__}")
        a = dict(zip((n for n, _ in spec), args))

        def fail(name: str, message: str) -> Error:
            i = [n for n, _ in spec].index(name)
            return Error(f"_cached_module.plan: argument {i} ({name}): {message}")

        if a["float_workspace_buffer"] is not w._float_workspace_buffer:
            raise fail("float_workspace_buffer", "expected the wrapper's own _float_workspace_buffer "
                       "(its plans are bound to it; use reset_workspace_buffer to change it)")
        if bool(a["enable_cuda_graph"]) != w.is_cuda_graph_enabled:
            raise fail("enable_cuda_graph", f"expected the wrapper's is_cuda_graph_enabled "
                       f"({w.is_cuda_graph_enabled}), got {bool(a['enable_cuda_graph'])}")
        batch_size, page_size = int(a["batch_size"]), int(a["page_size"])
        if batch_size < 0:
            raise fail("batch_size", f"expected >= 0, got {batch_size}")
        if page_size < 1:
            raise fail("page_size", f"expected >= 1, got {page_size}")
        if w.is_cuda_graph_enabled and batch_size != w._fixed_batch_size:
            raise fail("batch_size", f"{batch_size} differs from the CUDA-graph batch size {w._fixed_batch_size} "
                       "fixed by the wrapper's buffers")
        for name in ("num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo"):
            if int(a[name]) < 1:
                raise fail(name, f"expected >= 1, got {int(a[name])}")
        if w._paged_kv_indices_buf is None or w._paged_kv_indptr_buf is None:
            raise Error("_cached_module.plan: _paged_kv_indptr_buf / _paged_kv_indices_buf: expected the page "
                        "table's arrays (assign them before planning), got None")
        indptr_name = "paged_kv_indptr" if w.use_tensor_cores else "indptr"
        indptr = A.to_host_i32(a[indptr_name], indptr_name)
        if indptr.size < batch_size + 1:
            raise fail(indptr_name, f"expected at least batch_size + 1 = {batch_size + 1} entries, got {indptr.size}")
        indptr = indptr[: batch_size + 1]
        pages = np.diff(indptr.astype(np.int64))
        if (pages < 0).any():
            raise fail(indptr_name, f"expected non-decreasing values, got {indptr.tolist()}")
        if w.use_tensor_cores:
            if int(a["total_num_rows"]) != batch_size:
                raise fail("total_num_rows", f"a decode batch has one query row per request: expected batch_size "
                           f"= {batch_size}, got {int(a['total_num_rows'])}")
            qo = A.to_host_i32(a["qo_indptr"], "qo_indptr")
            if qo.size < batch_size + 1 or (qo[: batch_size + 1] != np.arange(batch_size + 1)).any():
                raise fail("qo_indptr", f"expected 0, 1, ..., batch_size = {batch_size} (one query row per request)")
            if a["causal"]:
                raise fail("causal", "a decode plan is not causal; expected False")
            lens = A.to_host_i32(a["kv_len_arr"], "kv_len_arr").astype(np.int64)
            if lens.size < batch_size:
                raise fail("kv_len_arr", f"expected at least batch_size = {batch_size} entries, got {lens.size}")
            lens = lens[:batch_size]
            # A request without pages has no KV, whatever its entry says (FlashInfer's
            # get_seq_lens gives it last_page_len).
            lens = np.where(pages > 0, lens, 0)
            bad = (pages > 0) & ((lens <= (pages - 1) * page_size) | (lens > pages * page_size))
            if bad.any():
                i = int(np.argmax(bad))
                raise fail("kv_len_arr", f"request {i}: {int(lens[i])} tokens do not fit its {int(pages[i])} "
                           f"pages of {page_size}")
            kv_len = lens.astype(np.int32)
            fixed, disable = int(a["fixed_split_size"]), bool(a["disable_split_kv"])
            if fixed == 0 or fixed < -1:
                raise fail("fixed_split_size", f"expected -1 (none) or a number of pages >= 1, got {fixed}")
        else:
            if page_size == 1:
                kv_len = pages.astype(np.int32)
            else:
                last = w._paged_kv_last_page_len_buf
                if last is None:
                    raise Error("_cached_module.plan: _paged_kv_last_page_len_buf: the CUDA-core form takes the "
                                "last page lengths from it; expected an array, got None")
                kv_len = kv_lens_of(indptr, A.to_host_i32(last, "_paged_kv_last_page_len_buf")[:batch_size],
                                    page_size)
            fixed, disable = -1, False
            q_dt, kv_dt = A.dtype_of(a["empty_q_data"]), A.dtype_of(a["empty_kv_data"])
        if int(indptr[-1]) > int(w._paged_kv_indices_buf.shape[0]):
            raise fail(indptr_name, f"indptr[-1] = {int(indptr[-1])} exceeds the {int(w._paged_kv_indices_buf.shape[0])} "
                       "entries of _paged_kv_indices_buf")
        ws = w._float_workspace_buffer
        if w.is_cuda_graph_enabled:
            w._indptr_run = w._paged_kv_indptr_buf[: batch_size + 1]
            w._last_page_len_run = w._paged_kv_last_page_len_buf[:batch_size]
            w._indices_run = w._paged_kv_indices_buf
        else:
            w._indptr_run = A.to_device_i32(w._paged_kv_indptr_buf, ws)
            w._indices_run = A.to_device_i32(w._paged_kv_indices_buf, ws)
            last = w._paged_kv_last_page_len_buf
            w._last_page_len_run = A.to_device_i32(last, ws) if last is not None else None
            if page_size > 1 and last is None:
                raise Error("_cached_module.plan: _paged_kv_last_page_len_buf: expected an array for page_size > 1, "
                            "got None")
        info = w._make_plan(kv_len, batch_size, int(a["num_qo_heads"]), int(a["num_kv_heads"]), int(a["head_dim_qk"]),
                            int(a["head_dim_vo"]), page_size, int(a["window_left"]), fixed, disable)
        if not w.use_tensor_cores:
            w._logits_soft_cap = float(a["logits_soft_cap"])
            w._q_data_type, w._kv_data_type = q_dt, kv_dt
        else:
            w._q_data_type = w._kv_data_type = None
        w._planned = True
        return info
