"""Context parallelism: one request's KV sharded across the ranks of a group (docs/PARALLEL.md).

A :class:`Communicator` is the group the sharded operators exchange their partial states over:

    comm = flashkv.parallel.from_process_group(group)       # torch.distributed: gloo (CPU) or NCCL (GPU)
    comm = flashkv.parallel.mpi_communicator(MPI.COMM_WORLD)  # mpi4py, where flashkv was built with MPI
    comm = flashkv.parallel.nccl_communicator(ptr, "cuda:0")  # a raw ncclComm_t, where built with NCCL

Every operator and the backend also take a ProcessGroup (or an SGLang / vLLM GroupCoordinator)
where they take a communicator (:func:`as_communicator`). :class:`CpDecode` and :class:`CpExtend`
are the sharded operators (plan once per batch, run once per layer);
``FlashKVBackend(..., cp_comm=group, cp=CpOptions(...))`` serves through them. :class:`CpShard`
says which rank holds which position, and :func:`zigzag_rows` which new tokens of an extend each
rank gives and gets.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import (CallbackCommunicator, Communicator, CpOptions, CpShard, Error, OneRankCommunicator,
                       built_with_mpi, built_with_nccl, zigzag_rows)
from ._wrapper import as_tokens, kv_cache_views

__all__ = ["CallbackCommunicator", "Communicator", "CpDecode", "CpExtend", "CpOptions", "CpShard",
           "OneRankCommunicator", "as_communicator", "built_with_mpi", "built_with_nccl", "from_process_group",
           "mpi_communicator", "nccl_communicator", "zigzag_rows"]


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch without distributed
        raise Error("torch.distributed is not available: a process group needs PyTorch with distributed") from e
    return dist


def _is_process_group(x: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "distributed") or not torch.distributed.is_available():
        return False
    return isinstance(x, torch.distributed.ProcessGroup)


class _TorchTransport:
    """The collectives of a CallbackCommunicator over a torch.distributed process group. Every
    buffer arrives as a uint8 DLPack array over exactly its bytes; the collectives run on tensors
    over that memory, on the given CUDA stream (made current while they are issued). With
    timeout_s, a collective on the CPU waits at most that long (async_op, then Work.wait with the
    timeout); otherwise, and for NCCL, the group's own timeout applies."""

    def __init__(self, group: Any, device: str, timeout_s: Optional[float]) -> None:
        import torch
        dist = _dist()
        self.torch, self.dist = torch, dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)
        # Collectives name their root by its global rank.
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
        self.timeout = (datetime.timedelta(seconds=float(timeout_s))
                        if timeout_s is not None and timeout_s > 0 and self.device.type == "cpu" else None)

    def _t(self, a: Any) -> Any:
        return self.torch.from_dlpack(a)

    @contextlib.contextmanager
    def _on(self, stream: int) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        cuda = self.torch.cuda
        s = cuda.ExternalStream(stream, device=self.device) if stream else cuda.default_stream(self.device)
        with cuda.device(self.device), cuda.stream(s):
            yield

    def _wait(self, work: Any) -> None:
        if work is None:
            return
        if self.timeout is None:
            work.wait()
        else:
            work.wait(timeout=self.timeout)

    def all_gather(self, send: Any, recv: Any, stream: int) -> None:
        with self._on(stream):
            self._wait(self.dist.all_gather_into_tensor(self._t(recv), self._t(send), group=self.group,
                                                        async_op=True))

    def all_gather_v(self, send: Any, recv: Any, counts: List[int], displs: List[int], stream: int) -> None:
        s, r = self._t(send), self._t(recv)
        with self._on(stream):
            c = counts[0]
            if all(n == c for n in counts) and all(d == displs[0] + i * c for i, d in enumerate(displs)):
                base = displs[0]
                self._wait(self.dist.all_gather_into_tensor(r[base:base + c * self.size], s, group=self.group,
                                                            async_op=True))
                return
            # Uneven: each rank's bytes are broadcast from it into their place (exact sizes, no
            # padding); a rank with nothing to send is skipped on every rank (counts agree).
            for src in range(self.size):
                n = counts[src]
                if n == 0:
                    continue
                view = r[displs[src]:displs[src] + n]
                if src == self.rank:
                    view.copy_(s)
                self._wait(self.dist.broadcast(view, src=self.global_ranks[src], group=self.group, async_op=True))

    @staticmethod
    def _packed(counts: List[int], displs: List[int]) -> bool:
        at = displs[0]
        for n, d in zip(counts, displs):
            if d != at:
                return False
            at += n
        return True

    def all_to_all_v(self, send: Any, send_counts: List[int], send_displs: List[int], recv: Any,
                     recv_counts: List[int], recv_displs: List[int], stream: int) -> None:
        s, r = self._t(send), self._t(recv)
        with self._on(stream):
            # all_to_all_single takes the ranks' regions back to back, in rank order.
            if self._packed(send_counts, send_displs):
                inp = s[send_displs[0]:send_displs[0] + sum(send_counts)]
            else:
                inp = self.torch.cat([s[d:d + n] for n, d in zip(send_counts, send_displs)])
            packed_out = self._packed(recv_counts, recv_displs)
            out = (r[recv_displs[0]:recv_displs[0] + sum(recv_counts)] if packed_out
                   else self.torch.empty(sum(recv_counts), dtype=self.torch.uint8, device=r.device))
            self._wait(self.dist.all_to_all_single(out, inp, output_split_sizes=list(recv_counts),
                                                   input_split_sizes=list(send_counts), group=self.group,
                                                   async_op=True))
            if not packed_out:
                at = 0
                for n, d in zip(recv_counts, recv_displs):
                    r[d:d + n].copy_(out[at:at + n])
                    at += n

    def broadcast(self, data: Any, root: int, stream: int) -> None:
        with self._on(stream):
            self._wait(self.dist.broadcast(self._t(data), src=self.global_ranks[root], group=self.group,
                                           async_op=True))

    def send_recv(self, send: Any, dest: int, recv: Any, source: int, stream: int) -> None:
        s, r = self._t(send), self._t(recv)
        with self._on(stream):
            if dest == self.rank:  # then source is this rank too (checked by the caller)
                r.copy_(s)
                return
            # An empty message is skipped on both sides: what a rank receives is what its source
            # sends it.
            ops = []
            if s.numel():
                ops.append(self.dist.P2POp(self.dist.isend, s, self.global_ranks[dest], group=self.group))
            if r.numel():
                ops.append(self.dist.P2POp(self.dist.irecv, r, self.global_ranks[source], group=self.group))
            for work in self.dist.batch_isend_irecv(ops) if ops else []:
                self._wait(work)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            self._wait(self.dist.barrier(group=self.group, async_op=True, device_ids=[self.device.index]))
        else:
            self._wait(self.dist.barrier(group=self.group, async_op=True))

    def synchronize(self, stream: int) -> None:
        if self.device.type == "cuda":
            cuda = self.torch.cuda
            s = cuda.ExternalStream(stream, device=self.device) if stream else cuda.default_stream(self.device)
            s.synchronize()


def from_process_group(group: Any = None, device: Optional[str] = None,
                       timeout_s: Optional[float] = None) -> Communicator:
    """A communicator over a torch.distributed process group (None: the default group) that has
    been initialised on every rank. Its buffers live on `device`: default 'cpu' for gloo (and
    other non-NCCL backends), 'cuda:<current device>' for NCCL. Collective calls go through
    torch.distributed (all_gather_into_tensor, all_to_all_single, broadcast, batch_isend_irecv,
    barrier) on tensors over flashkv's buffers, so no copies but the ones uneven layouts need. timeout_s bounds each
    collective's wait on the CPU (None: the group's own timeout, set by init_process_group /
    new_group); a collective that fails or times out raises flashkv.Error naming it, and the
    communicator is then unusable (every later call raises at once)."""
    dist = _dist()
    if not dist.is_initialized():
        raise Error("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    if group is not None and not _is_process_group(group):
        raise Error(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    backend = str(dist.get_backend(group))
    if device is None:
        if backend == "nccl":
            import torch
            device = f"cuda:{torch.cuda.current_device()}"
        else:
            device = "cpu"
    if backend == "nccl" and not str(device).startswith("cuda"):
        raise Error(f"device: an NCCL process group moves CUDA memory; expected 'cuda:N', got {device!r}")
    transport = _TorchTransport(group, str(device), timeout_s)
    return CallbackCommunicator(transport, transport.rank, transport.size, str(device),
                                f"torch.distributed ({backend})")


def mpi_communicator(comm: Any, timeout_s: float = 300.0) -> Communicator:
    """The MPI communicator (host memory) over an mpi4py communicator (or its Fortran handle,
    comm.py2f()), where flashkv was built with MPI; collective (it duplicates the communicator).
    MPI must stay initialised while it lives, and mpi4py must use the MPI flashkv was built
    against."""
    handle = comm if isinstance(comm, (int, np.integer)) else getattr(comm, "py2f", None)
    if callable(handle):
        handle = handle()
    if not isinstance(handle, (int, np.integer)):
        raise Error(f"comm: expected an mpi4py communicator or its Fortran handle (int), got {type(comm).__name__}")
    return _C.mpi_communicator(int(handle), timeout_s)


def nccl_communicator(comm: int, device: Any, timeout_s: float = 300.0) -> Communicator:
    """The NCCL communicator (GPU memory) over an ncclComm_t given as an int (not owned: it must
    outlive the returned communicator) on `device` ('cuda:N' or a torch device), where flashkv
    was built with NCCL."""
    if not isinstance(comm, (int, np.integer)):
        raise Error(f"comm: expected an ncclComm_t as an int, got {type(comm).__name__}")
    dev = str(device)
    if dev == "cuda":
        dev = "cuda:0"
    return _C.nccl_communicator(int(comm), dev, timeout_s)


def as_communicator(comm: Any) -> Communicator:
    """A Communicator as is; a torch.distributed ProcessGroup through from_process_group; an
    SGLang or vLLM GroupCoordinator (an object with `device_group` and `cpu_group`, such as
    get_tp_group()) through its device group, on its `device`."""
    if isinstance(comm, Communicator):
        return comm
    if _is_process_group(comm):
        return from_process_group(comm)
    if _is_process_group(getattr(comm, "device_group", None)) and hasattr(comm, "cpu_group"):
        device = getattr(comm, "device", None)
        return from_process_group(comm.device_group, device=None if device is None else str(device))
    raise Error(f"comm: expected a flashkv.parallel.Communicator, a torch.distributed ProcessGroup or a "
                f"GroupCoordinator, got {type(comm).__name__}")


def _plan_options(fixed_split_size: Optional[int], disable_split_kv: bool, page_size: int) -> Any:
    return _C.PlanOptions(enable_split_kv=not disable_split_kv,
                          fixed_split_size=as_tokens(fixed_split_size, page_size))


def _lens(x: Any, name: str) -> List[int]:
    return [int(n) for n in A.to_host_i32(x, name)]


class _CpOperator:
    """What CpDecode and CpExtend share: the communicator, the planned shape, the paged KV."""

    def __init__(self, comm: Any, options: Optional[CpOptions]) -> None:
        self.comm = as_communicator(comm)
        self.options = options if options is not None else CpOptions()
        if not isinstance(self.options, CpOptions):
            raise Error(f"options: expected a flashkv.parallel.CpOptions, got {type(self.options).__name__}")
        self._planned = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.size

    def _require_planned(self) -> None:
        if not self._planned:
            raise Error(f"{type(self).__name__}: call plan() before run()")

    def _set_plan(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: Optional[int],
                  page_size: int, q_data_type: Any) -> Tuple[int, str]:
        dv = int(head_dim_v or head_dim)
        dtype = A.canonical_dtype(q_data_type)
        self._shape = (int(num_qo_heads), int(num_kv_heads), int(head_dim), dv)
        self._page_size = int(page_size)
        self._dtype = dtype
        return dv, dtype

    def _paged(self, paged_kv_cache: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any,
               kv_data_type: Any) -> dict:
        """The compiled run's paged-KV keywords (this rank's cache and page table)."""
        k, v = kv_cache_views(paged_kv_cache)
        kv_dt = A.canonical_dtype(kv_data_type) if kv_data_type is not None else None
        actual = A.dtype_of(k)
        if actual == A.U8 and kv_dt in A.FP8:
            override = kv_dt
        elif kv_dt is not None and kv_dt != actual:
            raise Error(f"paged_kv_cache: dtype {actual} differs from kv_data_type {kv_dt}")
        else:
            override = actual if actual in A.FP8 else ""
        like = k
        return dict(k_cache=A.dl(k), v_cache=A.dl(v), paged_kv_indptr=A.dl(A.to_device_i32(kv_indptr, like)),
                    paged_kv_indices=A.dl(A.to_device_i32(kv_indices, like)),
                    paged_kv_last_page_len=(A.dl(A.to_device_i32(kv_last_page_len, like))
                                            if kv_last_page_len is not None else None),
                    page_size=self._page_size, kv_dtype=override)

    def _scale(self, sm_scale: Optional[float]) -> float:
        return 1.0 / math.sqrt(self._shape[2]) if sm_scale is None else float(sm_scale)


class CpDecode(_CpOperator):
    """Sharded decode (C++ parallel::CpDecode). Every rank holds the batch's queries and its shard
    of each request's KV (the positions CpShard gives it, in increasing order), and gets the whole
    output, equal to the one-rank decode.

        dec = CpDecode(group, CpOptions(layout="interleaved", block=16))
        dec.plan(kv_len, num_qo_heads, num_kv_heads, head_dim, page_size=1, q_data_type="bf16")
        # this rank's cache holds dec.local_kv_len[i] tokens of request i
        o = dec.run(q, (k_cache, v_cache), kv_indptr, kv_indices, kv_last_page_len)

    comm: a Communicator or a torch.distributed ProcessGroup. Every rank calls plan() and run()
    with the same global arguments; run() raises flashkv.Error naming a bad argument before it
    communicates (the other ranks then fail at their collective's timeout)."""

    def __init__(self, comm: Any, options: Optional[CpOptions] = None) -> None:
        super().__init__(comm, options)
        self._op = _C.CpDecode(self.comm, self.options)

    def plan(self, kv_len: Any, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, page_size: int = 1,
             head_dim_v: Optional[int] = None, q_data_type: Any = "bf16", window_left: int = -1,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, stream: int = 0) -> None:
        """kv_len: each request's global KV length (its new token included), on the host.
        window_left: a sliding window over global positions (< 0: none)."""
        self._planned = False
        dv, dtype = self._set_plan(num_qo_heads, num_kv_heads, head_dim, head_dim_v, page_size, q_data_type)
        self._window_left = int(window_left)
        self._op.plan(kv_len=_lens(kv_len, "kv_len"), num_qo_heads=int(num_qo_heads),
                      num_kv_heads=int(num_kv_heads), head_dim_qk=int(head_dim), head_dim_v=dv,
                      page_size=int(page_size), dtype=dtype, window_left=self._window_left,
                      plan_options=_plan_options(fixed_split_size, disable_split_kv, int(page_size)), stream=stream)
        self._planned = True

    @property
    def local_kv_len(self) -> np.ndarray:
        """This rank's KV length of each request (what run()'s cache must hold), int32."""
        return np.asarray(self._op.local_kv_len, dtype=np.int32)

    def run(self, q: Any, paged_kv_cache: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any = None, *,
            sm_scale: Optional[float] = None, logits_soft_cap: Optional[float] = None, sinks: Any = None,
            kv_data_type: Any = None, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Any = None, lse: Any = None, return_lse: bool = False) -> Any:
        """q [B, Hq, D] (the same on every rank); paged_kv_cache: this rank's (k_cache, v_cache)
        as the FlashInfer wrappers take it, with its page table (kv_indptr, kv_indices,
        kv_last_page_len for page sizes > 1). sinks: float32 [Hq], counted once. Returns out
        [B, Hq, D_v] in q's dtype, or (out, lse) with return_lse (lse [B, Hq] float32, base 2)."""
        self._require_planned()
        hq, _, _, dv = self._shape
        if out is None:
            out = A.empty(q, (int(q.shape[0]), hq, dv))
        if lse is None and return_lse:
            lse = A.empty(q, (int(q.shape[0]), hq), A.F32)
        self._op.run(q=A.dl(q), **self._paged(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_data_type),
                     k_scale=1.0 if k_scale is None else float(k_scale),
                     v_scale=1.0 if v_scale is None else float(v_scale), sm_scale=self._scale(sm_scale),
                     logits_soft_cap=float(logits_soft_cap or 0.0), window_left=self._window_left,
                     sinks=A.dl(sinks), out=A.dl(out), lse=A.dl(lse), stream=A.stream_of(q))
        return (out, lse) if return_lse else out


class CpExtend(_CpOperator):
    """Sharded extend, target verify and draft extend (C++ parallel::CpExtend). Each request has
    a cached prefix, sharded as in decode, and new tokens split zigzag: each rank gives the q/k/v
    of its own new tokens (zigzag_rows of each request, packed request by request) and gets their
    output rows.

        ext = CpExtend(group, CpOptions())
        ext.plan(prefix_len, extend_len, num_qo_heads, num_kv_heads, head_dim, causal=True)
        o = ext.run(q_own, k_own, v_own, (k_cache, v_cache), kv_indptr, kv_indices)
        ext.append_local_kv(k_own, v_own, out_cache_loc, k_cache, v_cache)  # keep this rank's new tokens
    """

    def __init__(self, comm: Any, options: Optional[CpOptions] = None) -> None:
        super().__init__(comm, options)
        self._op = _C.CpExtend(self.comm, self.options)

    def plan(self, prefix_len: Any, extend_len: Any, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
             page_size: int = 1, head_dim_v: Optional[int] = None, q_data_type: Any = "bf16", causal: bool = True,
             window_left: int = -1, custom_mask: Any = None, mask_indptr: Any = None,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False, stream: int = 0) -> None:
        """prefix_len / extend_len: each request's cached and new tokens (global, host).
        custom_mask (target verify's tree mask, bool/uint8): request i's [extend_len[i],
        prefix_len[i] + extend_len[i]] matrix, flattened, at mask_indptr[i] (default: packed)."""
        self._planned = False
        dv, dtype = self._set_plan(num_qo_heads, num_kv_heads, head_dim, head_dim_v, page_size, q_data_type)
        prefix, extend = _lens(prefix_len, "prefix_len"), _lens(extend_len, "extend_len")
        mask = indptr = None
        if custom_mask is not None:
            mask = np.ascontiguousarray(A.to_numpy(custom_mask).reshape(-1), dtype=np.uint8)
            if mask_indptr is None and len(prefix) == len(extend):
                sizes = [e * (p + e) for p, e in zip(prefix, extend)]
                indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
            elif mask_indptr is not None:
                indptr = A.to_host_i32(mask_indptr, "mask_indptr")
        elif mask_indptr is not None:
            raise Error("mask_indptr: given without custom_mask")
        self._causal = bool(causal)
        self._window_left = int(window_left)
        self._op.plan(prefix_len=prefix, extend_len=extend, num_qo_heads=int(num_qo_heads),
                      num_kv_heads=int(num_kv_heads), head_dim_qk=int(head_dim), head_dim_v=dv,
                      page_size=int(page_size), dtype=dtype, causal=self._causal, window_left=self._window_left,
                      custom_mask=mask, mask_indptr=indptr,
                      plan_options=_plan_options(fixed_split_size, disable_split_kv, int(page_size)), stream=stream)
        self._planned = True

    @property
    def local_prefix_len(self) -> np.ndarray:
        """This rank's cached-prefix length of each request (what run()'s cache must hold)."""
        return np.asarray(self._op.local_prefix_len, dtype=np.int32)

    @property
    def num_own_rows(self) -> int:
        """The new tokens this rank gives and gets (q's rows)."""
        return int(self._op.num_own_rows)

    @property
    def num_local_new(self) -> int:
        """The new tokens this rank's KV pool keeps (append_local_kv's out_cache_loc entries)."""
        return int(self._op.num_local_new)

    def run(self, q: Any, k: Any, v: Any, paged_kv_cache: Any, kv_indptr: Any, kv_indices: Any,
            kv_last_page_len: Any = None, *, sm_scale: Optional[float] = None,
            logits_soft_cap: Optional[float] = None, sinks: Any = None, kv_data_type: Any = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None, out: Any = None, lse: Any = None,
            return_lse: bool = False) -> Any:
        """q [T_own, Hq, D], k/v [T_own, Hkv, D]: this rank's new tokens; paged_kv_cache and
        its page table: this rank's prefix shard (local_prefix_len). Returns out [T_own, Hq,
        D_v] (or (out, lse) with return_lse)."""
        self._require_planned()
        hq, _, _, dv = self._shape
        if out is None:
            out = A.empty(q, (int(q.shape[0]), hq, dv))
        if lse is None and return_lse:
            lse = A.empty(q, (int(q.shape[0]), hq), A.F32)
        self._op.run(q=A.dl(q), k=A.dl(k), v=A.dl(v),
                     **self._paged(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_data_type),
                     k_scale=1.0 if k_scale is None else float(k_scale),
                     v_scale=1.0 if v_scale is None else float(v_scale), sm_scale=self._scale(sm_scale),
                     logits_soft_cap=float(logits_soft_cap or 0.0), causal=self._causal,
                     window_left=self._window_left, sinks=A.dl(sinks), out=A.dl(out), lse=A.dl(lse),
                     stream=A.stream_of(q))
        return (out, lse) if return_lse else out

    def append_local_kv(self, k: Any, v: Any, out_cache_loc: Any, k_cache: Any, v_cache: Any, *,
                        k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                        kv_data_type: Any = None) -> None:
        """After run(): writes the new tokens this rank keeps (num_local_new, in increasing
        position) into its cache at out_cache_loc. k, v: what run() was given."""
        kv_dt = A.canonical_dtype(kv_data_type) if kv_data_type is not None else ""
        if kv_dt and kv_dt not in A.FP8:
            kv_dt = ""
        self._op.append_local_kv(k=A.dl(k), v=A.dl(v), out_cache_loc=A.dl(A.to_device_i32(out_cache_loc, k_cache)),
                                 k_pool=A.dl(k_cache), v_pool=A.dl(v_cache),
                                 k_scale=1.0 if k_scale is None else float(k_scale),
                                 v_scale=1.0 if v_scale is None else float(v_scale), kv_dtype=kv_dt,
                                 stream=A.stream_of(k))
