"""
flashkv's compiled operators, planner and backend (use the flashkv package).
"""

from collections.abc import Sequence
import enum
from typing import Any

from numpy.typing import NDArray


class Error(ValueError, RuntimeError):
    """
    An error raised by flashkv: a bad argument (naming it, with the expected and the actual value) or a failed operation. A ValueError and a RuntimeError.
    """

def built_with_cuda() -> bool:
    """Whether this build has the CUDA kernels."""

def cuda_available() -> bool:
    """Whether this build has CUDA and the process sees a GPU."""

def device_info(device: str) -> dict:
    """What the planner knows about a device ('cpu', 'cuda:N')."""

class BatchShape:
    """
    The batch as the planner sees it: host int32 arrays and the problem shape. batch_size is kv_len's length.
    """

    def __init__(self, *, kv_len: NDArray | None = None, qo_indptr: NDArray | None = None, num_qo_heads: int = 0, num_kv_heads: int = 0, head_dim_qk: int = 0, head_dim_v: int = 0, page_size: int = 1, causal: bool = False, window_left: int = -1) -> None: ...

    @property
    def kv_len(self) -> Any:
        """int32 [batch_size] on the host: KV tokens of each request."""

    @kv_len.setter
    def kv_len(self, value: NDArray | None) -> None: ...

    @property
    def qo_indptr(self) -> Any:
        """
        int32 [batch_size + 1] on the host: request i owns query rows qo_indptr[i]:qo_indptr[i+1]. None for decode (one row a request).
        """

    @qo_indptr.setter
    def qo_indptr(self, value: NDArray | None) -> None: ...

    @property
    def batch_size(self) -> int:
        """Requests in the batch (kv_len's length)."""

    @property
    def num_qo_heads(self) -> int: ...

    @num_qo_heads.setter
    def num_qo_heads(self, arg: int, /) -> None: ...

    @property
    def num_kv_heads(self) -> int: ...

    @num_kv_heads.setter
    def num_kv_heads(self, arg: int, /) -> None: ...

    @property
    def head_dim_qk(self) -> int: ...

    @head_dim_qk.setter
    def head_dim_qk(self, arg: int, /) -> None: ...

    @property
    def head_dim_v(self) -> int: ...

    @head_dim_v.setter
    def head_dim_v(self, arg: int, /) -> None: ...

    @property
    def page_size(self) -> int: ...

    @page_size.setter
    def page_size(self, arg: int, /) -> None: ...

    @property
    def causal(self) -> bool:
        """
        The runs apply a causal mask, so the planner may skip KV past each tile's last row.
        """

    @causal.setter
    def causal(self, arg: bool, /) -> None: ...

    @property
    def window_left(self) -> int:
        """
        The runs' sliding window (< 0: none), so the planner may skip KV before it.
        """

    @window_left.setter
    def window_left(self, arg: int, /) -> None: ...

class PlanOptions:
    """How the planner splits a batch's work."""

    def __init__(self, *, q_tile: int = 0, enable_split_kv: bool = True, fixed_split_size: int = 0, kv_align: int = 0, cuda_graph: bool = False, max_batch_size: int = 0, max_num_tokens: int = 0, max_kv_len: int = 0, blocks_per_sm: int = 0, min_split_size: int = 0) -> None: ...

    @property
    def q_tile(self) -> int:
        """Query rows per prefill item (0: the device's default tile)."""

    @q_tile.setter
    def q_tile(self, arg: int, /) -> None: ...

    @property
    def enable_split_kv(self) -> bool:
        """
        Cut a long tile's KV into chunks merged afterwards (False: never split).
        """

    @enable_split_kv.setter
    def enable_split_kv(self, arg: bool, /) -> None: ...

    @property
    def fixed_split_size(self) -> int:
        """
        > 0: deterministic mode, every request's KV cut at multiples of this many tokens.
        """

    @fixed_split_size.setter
    def fixed_split_size(self, arg: int, /) -> None: ...

    @property
    def kv_align(self) -> int:
        """
        Chunk boundaries are multiples of this (0: 16 tokens), rounded up to whole pages.
        """

    @kv_align.setter
    def kv_align(self, arg: int, /) -> None: ...

    @property
    def cuda_graph(self) -> bool:
        """
        CUDA-graph mode: capacities fixed at capture, the same layout for every plan.
        """

    @cuda_graph.setter
    def cuda_graph(self, arg: bool, /) -> None: ...

    @property
    def max_batch_size(self) -> int:
        """Graph mode capacity (requests)."""

    @max_batch_size.setter
    def max_batch_size(self, arg: int, /) -> None: ...

    @property
    def max_num_tokens(self) -> int:
        """Graph mode capacity (query rows)."""

    @max_num_tokens.setter
    def max_num_tokens(self, arg: int, /) -> None: ...

    @property
    def max_kv_len(self) -> int:
        """Graph mode with fixed_split_size: the longest request's KV."""

    @max_kv_len.setter
    def max_kv_len(self, arg: int, /) -> None: ...

    @property
    def blocks_per_sm(self) -> int:
        """CUDA: resident CTAs per SM the kernel is sized for (0: 2)."""

    @blocks_per_sm.setter
    def blocks_per_sm(self, arg: int, /) -> None: ...

    @property
    def min_split_size(self) -> int:
        """Shortest KV chunk an automatic split makes (0: the planner's default)."""

    @min_split_size.setter
    def min_split_size(self, arg: int, /) -> None: ...

class AttentionOptions:
    """The masks and scales of one attention run."""

    def __init__(self, *, causal: bool = True, window_left: int = -1, logits_soft_cap: float = 0.0, sm_scale: float = 0.0, custom_mask: NDArray | None = None, mask_indptr: NDArray | None = None, sinks: NDArray | None = None) -> None: ...

    @property
    def causal(self) -> bool:
        """
        Causal mask, aligned to the end of each request's KV (ignored with a custom mask).
        """

    @causal.setter
    def causal(self, arg: bool, /) -> None: ...

    @property
    def window_left(self) -> int:
        """
        < 0: no window; else key j is visible to the row at position p iff j >= p - window_left.
        """

    @window_left.setter
    def window_left(self, arg: int, /) -> None: ...

    @property
    def logits_soft_cap(self) -> float:
        """> 0: logits become cap * tanh(logits / cap); 0: off."""

    @logits_soft_cap.setter
    def logits_soft_cap(self, arg: float, /) -> None: ...

    @property
    def sm_scale(self) -> float:
        """Softmax scale (0: 1 / sqrt(head_dim_qk))."""

    @sm_scale.setter
    def sm_scale(self, arg: float, /) -> None: ...

    @property
    def custom_mask(self) -> Any:
        """
        uint8/bool: request i's [qo_len, kv_len] matrix at element offset mask_indptr[i]; replaces causal.
        """

    @custom_mask.setter
    def custom_mask(self, value: NDArray | None) -> None: ...

    @property
    def mask_indptr(self) -> Any:
        """int32 [batch_size + 1]: where each request's mask starts."""

    @mask_indptr.setter
    def mask_indptr(self, value: NDArray | None) -> None: ...

    @property
    def sinks(self) -> Any:
        """
        float32 [num_qo_heads] on q's device, or None: one natural-log logit per query head that
        joins the softmax denominator with no value (attention sinks); the LSE includes it. CPU
        only for now.
        """

    @sinks.setter
    def sinks(self, value: NDArray | None) -> None: ...

class Plan:
    """
    A planned batch: the work split, and the workspace its runs read it from.
    """

    def __init__(self, device: str, float_workspace_buffer: NDArray | None = None) -> None:
        """
        Plans for `device` ('cpu', 'cuda:N'); partial states of split work go into `float_workspace_buffer` (uint8 [bytes], shared between plans) when it is large enough, else into memory the plan allocates.
        """

    def plan(self, *, decode: bool, batch: BatchShape, options: PlanOptions, stream: int) -> None:
        """
        Plans `batch` (a decode batch: qo_indptr None, one query row a request) with `options` and uploads the plan on `stream`.
        
        """

    def run_paged(self, *, q: NDArray, k_cache: NDArray, v_cache: NDArray, paged_kv_indptr: NDArray, paged_kv_indices: NDArray, paged_kv_last_page_len: NDArray | None, qo_indptr: NDArray | None, page_size: int, k_scale: float, v_scale: float, kv_dtype: str, options: AttentionOptions, out: NDArray, lse: NDArray | None, stream: int) -> None:
        """
        Paged decode (a decode plan) or paged prefill (a prefill plan) into out [T, Hq, Dv] and lse [T, Hq] (float32, base 2).
        """

    def run_ragged(self, *, q: NDArray, k: NDArray, v: NDArray, qo_indptr: NDArray, kv_indptr: NDArray, options: AttentionOptions, out: NDArray, lse: NDArray | None, stream: int) -> None:
        """
        Ragged prefill: q [Tq, Hq, D] against k/v [Tk, Hkv, D] into out and lse.
        """

    @property
    def planned(self) -> bool: ...

    @property
    def decode(self) -> bool: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def num_qo_tokens(self) -> int: ...

    @property
    def num_items(self) -> int: ...

    @property
    def num_merges(self) -> int: ...

    @property
    def kv_chunk(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def equal_runs(self) -> bool: ...

    @property
    def cuda_graph(self) -> bool: ...

    @property
    def workspace_bytes(self) -> int: ...

    @property
    def workspace_ptr(self) -> int: ...

    @property
    def scratch_ptr(self) -> int: ...

    @property
    def uses_caller_scratch(self) -> bool:
        """
        Whether split partial states go to the caller's float workspace buffer.
        """

def merge_state(*, v_a: NDArray, s_a: NDArray, v_b: NDArray, s_b: NDArray, v_out: NDArray, s_out: NDArray | None, stream: int) -> None:
    """
    Merges two attention states: v [T, H, D], s [T, H] float32 (base-2 LSE).
    """

def merge_states(*, v: NDArray, s: NDArray, v_out: NDArray, s_out: NDArray | None, stream: int) -> None:
    """
    Folds N states: v [T, N, H, D], s [T, N, H] -> v_out [T, H, D], s_out [T, H].
    """

def append_kv(*, k_new: NDArray, v_new: NDArray, cache_loc: NDArray, k_cache: NDArray, v_cache: NDArray, k_scale: float, v_scale: float, kv_dtype: str, stream: int) -> None:
    """
    k_cache[cache_loc[t]] = k_new[t] / k_scale (v likewise); caches [slots, Hkv, D] or NHD [pages, page_size, Hkv, D].
    """

def build_kv_indices(*, req_to_token: NDArray, req_pool_indices: NDArray, lens: NDArray, kv_start: NDArray | None, kv_indptr: NDArray, kv_indices: NDArray, stream: int) -> None:
    """
    kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j] for j < lens[i].
    """

class Communicator:
    """
    The group a sharded operator exchanges its states over (C++ parallel::Communicator). Build one with flashkv.parallel: from a torch.distributed process group, an mpi4py communicator or an NCCL communicator. Its collectives move bytes between contiguous arrays on `device` and must be called by every rank in the same order.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def name(self) -> str: ...

    def all_gather(self, send: NDArray, recv: NDArray, stream: int = 0) -> None:
        """Rank r's send bytes land at byte r * len(send) of recv on every rank."""

    def all_gather_v(self, send: NDArray, recv: NDArray, counts: Sequence[int], displs: Sequence[int], stream: int = 0) -> None:
        """
        Uneven all-gather: rank r's counts[r] bytes land at byte displs[r] of recv (counts and displs in bytes, the same on every rank).
        """

    def all_to_all_v(self, send: NDArray, send_counts: Sequence[int], send_displs: Sequence[int], recv: NDArray, recv_counts: Sequence[int], recv_displs: Sequence[int], stream: int = 0) -> None:
        """
        Rank r gets send_counts[r] bytes from byte send_displs[r] of send; rank r's bytes land at byte recv_displs[r] of recv (recv_counts[r] of them).
        """

    def broadcast(self, data: NDArray, root: int, stream: int = 0) -> None:
        """Copies root's data into data on every rank."""

    def send_recv(self, send: NDArray, dest: int, recv: NDArray, source: int, stream: int = 0) -> None:
        """
        One ring step, called by every rank at once: send goes to rank dest, recv gets what rank source sends this rank (its whole size).
        """

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def synchronize(self, stream: int = 0) -> None:
        """Waits for the collectives enqueued on `stream`."""

class OneRankCommunicator(Communicator):
    """The group of one: every collective is a copy."""

    def __init__(self, device: str = 'cpu') -> None: ...

class CallbackCommunicator(Communicator):
    """
    A communicator whose collectives call the methods of `transport` (flashkv.parallel builds one over a torch.distributed process group). A method that raises breaks it.
    """

    def __init__(self, transport: object, rank: int, size: int, device: str, name: str) -> None: ...

    @property
    def broken(self) -> bool:
        """Whether a collective failed (every later call then raises at once)."""

def built_with_mpi() -> bool:
    """Whether this build has the MPI communicator (mpi_communicator)."""

def built_with_nccl() -> bool:
    """Whether this build has the NCCL communicator (nccl_communicator)."""

def mpi_communicator(fortran_comm: int, timeout_s: float = 300.0) -> Communicator:
    """
    The MPI communicator (host memory) over a duplicate of the communicator with this Fortran handle (mpi4py: comm.py2f()); collective.
    """

def nccl_communicator(comm: int, device: str, timeout_s: float = 300.0) -> Communicator:
    """
    The NCCL communicator (GPU memory) over an ncclComm_t given as an int (not owned: it must outlive this communicator) on `device` ('cuda:N').
    """

class CpOptions:
    """
    How a request's KV is sharded and how the states are exchanged (C++ parallel::CpOptions).
    """

    def __init__(self, *, layout: str = 'interleaved', block: int = 1, exchange: str = 'all_gather', kv_pass: str = 'all_gather') -> None:
        """
        layout 'interleaved' (runs of `block` tokens round robin: position t on rank (t // block) % P) or 'contiguous' (rank r holds [r * block, (r + 1) * block), the last rank everything after); exchange 'all_gather' or 'all_to_all'; kv_pass: how an extend's new tokens' K/V reach the ranks, 'all_gather' or 'ring' (passed from rank to rank, each block attended as it passes).
        """

    @property
    def layout(self) -> str: ...

    @property
    def block(self) -> int: ...

    @property
    def exchange(self) -> str: ...

    @property
    def kv_pass(self) -> str: ...

    def __repr__(self) -> str: ...

class CpShard:
    """Where a request's positions live."""

    def __init__(self, options: CpOptions, world: int) -> None: ...

    @property
    def world(self) -> int: ...

    def owner(self, pos: int) -> int:
        """The rank holding position pos."""

    def local_len(self, rank: int, len: int) -> int:
        """How many of the positions [0, len) rank `rank` holds."""

    def local_index(self, pos: int) -> int:
        """The index of position pos among its owner's positions."""

    def global_pos(self, rank: int, local: int) -> int:
        """The position of rank `rank`'s local entry `local`."""

    def positions(self, rank: int, len: int) -> list[int]:
        """
        The positions of [0, len) rank `rank` holds, in increasing order (its local entries).
        """

def zigzag_rows(n: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """
    The new tokens rank `rank` owns of a request's n: ((begin, len), (begin, len)), chunks r and 2 * world - 1 - r of 2 * world.
    """

class CpDecode:
    """
    Sharded decode (C++ parallel::CpDecode): every rank holds the batch's queries and its shard of each request's KV, and gets the whole output.
    """

    def __init__(self, comm: Communicator, options: CpOptions) -> None: ...

    def plan(self, *, kv_len: Sequence[int], num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_v: int, page_size: int, dtype: str, window_left: int, plan_options: PlanOptions, stream: int) -> None: ...

    @property
    def local_kv_len(self) -> list[int]: ...

    def run(self, *, q: NDArray, k_cache: NDArray, v_cache: NDArray, paged_kv_indptr: NDArray, paged_kv_indices: NDArray, paged_kv_last_page_len: NDArray | None, page_size: int, k_scale: float, v_scale: float, kv_dtype: str, sm_scale: float, logits_soft_cap: float, window_left: int, sinks: NDArray | None, out: NDArray, lse: NDArray | None, stream: int) -> None: ...

class CpExtend:
    """
    Sharded extend (C++ parallel::CpExtend): a sharded cached prefix and new tokens split zigzag; each rank gives and gets its own new tokens' rows.
    """

    def __init__(self, comm: Communicator, options: CpOptions) -> None: ...

    def plan(self, *, prefix_len: Sequence[int], extend_len: Sequence[int], num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_v: int, page_size: int, dtype: str, causal: bool, window_left: int, custom_mask: NDArray | None, mask_indptr: NDArray | None, plan_options: PlanOptions, stream: int) -> None: ...

    @property
    def local_prefix_len(self) -> list[int]: ...

    @property
    def num_own_rows(self) -> int: ...

    @property
    def num_local_new(self) -> int: ...

    def run(self, *, q: NDArray, k: NDArray, v: NDArray, k_cache: NDArray, v_cache: NDArray, paged_kv_indptr: NDArray, paged_kv_indices: NDArray, paged_kv_last_page_len: NDArray | None, page_size: int, k_scale: float, v_scale: float, kv_dtype: str, sm_scale: float, logits_soft_cap: float, causal: bool, window_left: int, sinks: NDArray | None, out: NDArray, lse: NDArray | None, stream: int) -> None: ...

    def append_local_kv(self, *, k: NDArray, v: NDArray, out_cache_loc: NDArray, k_pool: NDArray, v_pool: NDArray, k_scale: float, v_scale: float, kv_dtype: str, stream: int) -> None: ...

class KVPool:
    """
    Per-layer K [num_slots + page_size, Hkv, D_qk] and V [.., D_v] memory; page 0 (slot 0) is reserved for padding.
    """

    def __init__(self, num_slots: int, page_size: int = 1, num_layers: int = 1, num_kv_heads: int = 1, head_dim_qk: int = 128, head_dim_v: int = 0, dtype: str = 'bf16', device: str = 'cpu') -> None: ...

    @property
    def page_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim_qk(self) -> int: ...

    @property
    def head_dim_v(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    def k_buffer(self, layer: int) -> Any:
        """
        Layer `layer`'s K [num_rows, Hkv, D_qk] as a DLPack array (fp8: uint8).
        """

    def v_buffer(self, layer: int) -> Any:
        """Layer `layer`'s V [num_rows, Hkv, D_v] as a DLPack array (fp8: uint8)."""

    def k_scale(self, layer: int) -> float: ...

    def v_scale(self, layer: int) -> float: ...

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None: ...

class ReqToTokenPool:
    """
    Rows of token slots per request: req_to_token int32 [max_reqs, max_context_len].
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: str = 'cpu') -> None: ...

    @property
    def max_reqs(self) -> int: ...

    @property
    def max_context_len(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def req_to_token(self) -> Any:
        """int32 [max_reqs, max_context_len] as a DLPack array."""

    def alloc(self, n: int) -> list[int] | None:
        """`n` free rows, or None when fewer are free."""

    def free(self, rows: Sequence[int]) -> None: ...

    def write(self, row: int, start: int, slots: Sequence[int]) -> None: ...

    def read(self, row: int, start: int, n: int) -> list[int]: ...

class KVAllocator:
    """Slot allocator of a KV pool (host-side free lists)."""

    @property
    def page_size(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def is_live(self, slot: int) -> bool: ...

    def alloc(self, n: int) -> list[int] | None:
        """Slots for a new request of `n` tokens, or None when out of memory."""

    def alloc_extend(self, requests: Sequence[tuple[int, int, int]]) -> list[int] | None:
        """
        Slots for every request's new tokens, given (prefix_len, last_slot, num_new) per request, all or nothing (None when out of memory).
        """

    def free(self, slots: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

class PagedAllocator(KVAllocator):
    """Page-granular slot allocator (pages 1.., page 0 reserved)."""

    def __init__(self, num_slots: int, page_size: int) -> None: ...

class TokenAllocator(PagedAllocator):
    """Token-granular slot allocator (slots 1..num_slots)."""

    def __init__(self, num_slots: int) -> None: ...

class SWAAllocator(KVAllocator):
    """Full + sliding-window slots, with the full-to-SWA table."""

    def __init__(self, num_full_slots: int, num_swa_slots: int, page_size: int = 1, device: str = 'cpu') -> None: ...

    def free_swa(self, full_slots: Sequence[int]) -> None: ...

    def translate_full_to_swa(self, full_slots: Sequence[int]) -> list[int]: ...

class ForwardMode(enum.Enum):
    """What a forward pass runs (SGLang's ForwardMode)."""

    EXTEND = 0

    DECODE = 1

    MIXED = 2

    IDLE = 3

    TARGET_VERIFY = 4

    DRAFT_EXTEND = 5

class AttentionType(enum.Enum):
    """Decoder (causal) or encoder-only (bidirectional) attention."""

    DECODER = 0

    ENCODER_ONLY = 1

class LayerSpec:
    """
    One attention layer as the model declares it; set `sinks` (float32 [num_qo_heads]) on it for
    attention sinks.
    """

    sinks: Any

    def __init__(self, layer_id: int = 0, num_qo_heads: int = 0, num_kv_heads: int = 0, head_dim_qk: int = 0, head_dim_v: int = 0, scaling: float = 0.0, logit_cap: float = 0.0, sliding_window_size: int = -1, is_cross_attention: bool = False, attn_type: AttentionType = AttentionType.DECODER) -> None: ...

    @property
    def layer_id(self) -> int: ...

    @layer_id.setter
    def layer_id(self, arg: int, /) -> None: ...

    @property
    def num_qo_heads(self) -> int: ...

    @num_qo_heads.setter
    def num_qo_heads(self, arg: int, /) -> None: ...

    @property
    def num_kv_heads(self) -> int: ...

    @num_kv_heads.setter
    def num_kv_heads(self, arg: int, /) -> None: ...

    @property
    def head_dim_qk(self) -> int: ...

    @head_dim_qk.setter
    def head_dim_qk(self, arg: int, /) -> None: ...

    @property
    def head_dim_v(self) -> int: ...

    @head_dim_v.setter
    def head_dim_v(self, arg: int, /) -> None: ...

    @property
    def scaling(self) -> float: ...

    @scaling.setter
    def scaling(self, arg: float, /) -> None: ...

    @property
    def logit_cap(self) -> float: ...

    @logit_cap.setter
    def logit_cap(self, arg: float, /) -> None: ...

    @property
    def sliding_window_size(self) -> int: ...

    @sliding_window_size.setter
    def sliding_window_size(self, arg: int, /) -> None: ...

    @property
    def is_cross_attention(self) -> bool: ...

    @is_cross_attention.setter
    def is_cross_attention(self, arg: bool, /) -> None: ...

    @property
    def attn_type(self) -> AttentionType: ...

    @attn_type.setter
    def attn_type(self, arg: AttentionType, /) -> None: ...

class ForwardBatch:
    """
    What the backend needs of a forward batch (SGLang's field names); arrays are kept alive by the batch.
    """

    def __init__(self) -> None: ...

    @property
    def forward_mode(self) -> ForwardMode: ...

    @forward_mode.setter
    def forward_mode(self, arg: ForwardMode, /) -> None: ...

    @property
    def batch_size(self) -> int: ...

    @batch_size.setter
    def batch_size(self, arg: int, /) -> None: ...

    @property
    def seq_lens_cpu(self) -> list[int]: ...

    @seq_lens_cpu.setter
    def seq_lens_cpu(self, arg: Sequence[int], /) -> None: ...

    @property
    def extend_prefix_lens_cpu(self) -> list[int]: ...

    @extend_prefix_lens_cpu.setter
    def extend_prefix_lens_cpu(self, arg: Sequence[int], /) -> None: ...

    @property
    def extend_seq_lens_cpu(self) -> list[int]: ...

    @extend_seq_lens_cpu.setter
    def extend_seq_lens_cpu(self, arg: Sequence[int], /) -> None: ...

    @property
    def encoder_lens_cpu(self) -> list[int]: ...

    @encoder_lens_cpu.setter
    def encoder_lens_cpu(self, arg: Sequence[int], /) -> None: ...

    @property
    def draft_token_num(self) -> int: ...

    @draft_token_num.setter
    def draft_token_num(self, arg: int, /) -> None: ...

    @property
    def accept_length_cpu(self) -> list[int]: ...

    @accept_length_cpu.setter
    def accept_length_cpu(self, arg: Sequence[int], /) -> None: ...

    @property
    def req_to_token_pool(self) -> object: ...

    @req_to_token_pool.setter
    def req_to_token_pool(self, value: object | None) -> None: ...

    @property
    def token_to_kv_pool(self) -> object: ...

    @token_to_kv_pool.setter
    def token_to_kv_pool(self, value: object | None) -> None: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def req_pool_indices(self) -> object:
        """int32 [B] on the batch's device: each request's req_to_token row."""

    @req_pool_indices.setter
    def req_pool_indices(self, value: object | None) -> None: ...

    @property
    def out_cache_loc(self) -> object:
        """int32 [num_tokens] on the device: the KV slot of each new token."""

    @out_cache_loc.setter
    def out_cache_loc(self, value: object | None) -> None: ...

    @property
    def encoder_out_cache_loc(self) -> object:
        """int32 [sum encoder_lens]: KV slots of encoder tokens."""

    @encoder_out_cache_loc.setter
    def encoder_out_cache_loc(self, value: object | None) -> None: ...

    @property
    def custom_mask(self) -> object:
        """
        TARGET_VERIFY tree mask: uint8/bool, request i's [draft_token_num, seq_lens[i]] matrix after the previous requests'.
        """

    @custom_mask.setter
    def custom_mask(self, value: object | None) -> None: ...

class FlashKVBackend:
    """
    SGLang's FlashInfer attention backend over flashkv: plan once per forward batch, attend once per layer.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_v: int = 0, q_dtype: str = 'bf16', device: str = 'cpu', sliding_window_size: int = -1, is_encoder_decoder: bool = False, is_multimodal: bool = False, has_encoder_only_layers: bool = False, swa_kv_pool: KVPool | None = None, swa_allocator: SWAAllocator | None = None, deterministic: bool = False, decode_split_size: int = 2048, prefill_split_size: int = 4096, disable_split_kv: bool = False, use_tensor_cores: bool | None = None, cp_comm: Communicator | None = None, cp: CpOptions | None = None, extend_path: str = 'auto') -> None: ...

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None: ...

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None: ...

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None: ...

    def get_cuda_graph_seq_len_fill_value(self) -> int: ...

    @property
    def num_wrappers(self) -> int: ...

    @property
    def uses_ragged(self) -> bool: ...

    @property
    def extend_without_prefix(self) -> bool: ...

    @property
    def decode_uses_prefill_kernel(self) -> bool: ...
