"""The whole attention layer for engines that want it: SGLang's FlashInfer backend rules over
flashkv's pools, planner and operators.

    pool = KVPool(num_slots, num_layers=L, num_kv_heads=Hkv, head_dim_qk=D, dtype="bf16", device="cuda:0")
    req_to_token = ReqToTokenPool(max_reqs, max_context_len, device="cuda:0")
    backend = FlashKVBackend(num_qo_heads=Hq, num_kv_heads=Hkv, head_dim_qk=D, q_dtype="bf16", device="cuda:0")
    batch = ForwardBatch(); batch.forward_mode = ForwardMode.DECODE; ...
    backend.init_forward_metadata(batch)          # once per forward pass (host planning)
    o = backend.forward(q, k, v, layer, batch)    # per layer: [T, Hq * D_v]

The backend's operators run on the device's default stream (the C++ backend takes no stream).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import numpy as np

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import (AttentionType, ForwardBatch, ForwardMode, KVAllocator, LayerSpec, PagedAllocator,
                       SWAAllocator, TokenAllocator)

__all__ = ["AttentionType", "FlashKVBackend", "ForwardBatch", "ForwardMode", "KVAllocator", "KVPool",
           "LayerSpec", "PagedAllocator", "ReqToTokenPool", "SWAAllocator", "TokenAllocator"]


def _default_framework() -> str:
    return "torch" if "torch" in sys.modules else "numpy"


def _import_array(exported: Any, framework: str, dtype: str) -> Any:
    """An array of `framework` over memory exported by the compiled module (fp8 arrives as
    uint8 storage; PyTorch gets it back as its float8 dtype)."""
    if framework == "torch":
        torch = sys.modules["torch"]
        t = torch.from_dlpack(exported)
        if dtype in A.FP8:
            t = t.view(torch.float8_e4m3fn if dtype == A.E4M3 else torch.float8_e5m2)
        return t
    if framework == "cupy":
        return sys.modules["cupy"].from_dlpack(exported)
    return np.from_dlpack(exported)


class KVPool(_C.KVPool):
    """Per-layer K and V caches (see the compiled KVPool); framework ('torch', 'numpy', 'cupy')
    is the library get_kv_buffer returns arrays of (default: torch when imported)."""

    def __init__(self, num_slots: int, page_size: int = 1, num_layers: int = 1, num_kv_heads: int = 1,
                 head_dim_qk: int = 128, head_dim_v: int = 0, dtype: str = "bf16", device: str = "cpu",
                 framework: Optional[str] = None) -> None:
        super().__init__(num_slots=num_slots, page_size=page_size, num_layers=num_layers,
                         num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                         dtype=A.canonical_dtype(dtype), device=device)
        self.framework = framework or _default_framework()

    def get_kv_buffer(self, layer: int) -> Tuple[Any, Any]:
        """(K [num_rows, Hkv, D_qk], V [num_rows, Hkv, D_v]) of a layer, views of the pool."""
        return (_import_array(self.k_buffer(layer), self.framework, self.dtype),
                _import_array(self.v_buffer(layer), self.framework, self.dtype))


class ReqToTokenPool(_C.ReqToTokenPool):
    """Request rows of token slots; req_to_token_array() views the int32 [max_reqs,
    max_context_len] table in `framework`."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str = "cpu",
                 framework: Optional[str] = None) -> None:
        super().__init__(max_reqs, max_context_len, device)
        self.framework = framework or _default_framework()

    def req_to_token_array(self) -> Any:
        return _import_array(self.req_to_token, self.framework, A.I32)


class FlashKVBackend(_C.FlashKVBackend):
    """SGLang's FlashInfer attention backend over flashkv (see the compiled class for the
    options). forward() returns [num_tokens, num_qo_heads * head_dim_v] in q's dtype.

    Context parallelism (docs/PARALLEL.md): cp_comm, a flashkv.parallel.Communicator or a
    torch.distributed ProcessGroup, shards each request's KV across its ranks by cp (a
    flashkv.parallel.CpOptions); each batch then carries this rank's share (its req_to_token rows
    list the slots of the positions it holds, out_cache_loc the dummy slot 0 for the others)."""

    def __init__(self, *args: Any, cp_comm: Any = None, cp: Any = None, **kwargs: Any) -> None:
        if cp_comm is not None:
            from .parallel import as_communicator
            cp_comm = as_communicator(cp_comm)
        elif cp is not None:
            raise _C.Error("cp: given without cp_comm (the communicator whose ranks share the KV)")
        super().__init__(*args, cp_comm=cp_comm, cp=cp, **kwargs)
        self.cp_comm = cp_comm

    def forward(self, q: Any, k: Any, v: Any, layer: LayerSpec, forward_batch: ForwardBatch,
                save_kv_cache: bool = True, out: Any = None, sinks: Any = None) -> Any:
        """One layer: writes k/v [T, Hkv, D] (or [T, Hkv * D]) into the pool at out_cache_loc
        when save_kv_cache, then attends with q [T, Hq, D] (or [T, Hq * D]). IDLE batches return
        an empty [0, Hq * D_v] array. sinks: float32 [Hq] attention sinks on the backend's
        device (default: the layer's `sinks` attribute, if set), counted once per output row."""
        if sinks is None:
            sinks = getattr(layer, "sinks", None)
        width = layer.num_qo_heads * (layer.head_dim_v or layer.head_dim_qk)
        if forward_batch.forward_mode == ForwardMode.IDLE:
            return A.empty(q, (0, width)) if out is None else out
        if out is None:
            out = A.empty(q, (int(q.shape[0]), width))
        self._forward(q=A.dl(q), k=A.dl(k), v=A.dl(v), layer=layer, forward_batch=forward_batch,
                      save_kv_cache=save_kv_cache, out=A.dl(out), sinks=A.dl(sinks))
        return out
