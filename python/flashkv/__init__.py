"""flashkv: paged-KV attention for LLM serving (decode, prefill/extend, merge), on CPUs and NVIDIA
GPUs, with FlashInfer-compatible wrappers.

Arrays are NumPy, PyTorch or CuPy (anything with DLPack), on the CPU or a CUDA device; work is
ordered on the caller's current CUDA stream. An engine written against FlashInfer switches with
its import line: ``import flashkv as flashinfer``; one that is not to be edited runs under
``python -m flashkv.as_flashinfer`` (or calls :func:`install_as_flashinfer` before it imports
flashinfer), which makes ``import flashinfer`` resolve to flashkv.

Errors are raised as :class:`flashkv.Error` (a ValueError and a RuntimeError) carrying the
message of the C++ check that failed.
"""

from ._flashkv import Error, built_with_cuda, cuda_available, device_info
from . import cascade, decode, page, parallel, prefill
from .backend import (AttentionType, FlashKVBackend, ForwardBatch, ForwardMode, KVAllocator, KVPool,
                      LayerSpec, PagedAllocator, ReqToTokenPool, SWAAllocator, TokenAllocator)
from .as_flashinfer import install_as_flashinfer
from .cascade import merge_state, merge_state_in_place, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

__version__ = "0.1.0"

__all__ = [
    "AttentionType", "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper", "Error", "FlashKVBackend", "ForwardBatch", "ForwardMode",
    "KVAllocator", "KVPool", "LayerSpec", "PagedAllocator", "ReqToTokenPool", "SWAAllocator",
    "TokenAllocator", "append_paged_kv_cache", "built_with_cuda", "cascade", "cuda_available", "decode",
    "device_info", "fast_decode_plan", "get_batch_indices_positions", "get_seq_lens", "install_as_flashinfer",
    "merge_state",
    "merge_state_in_place", "merge_states", "page", "parallel", "prefill",
]
