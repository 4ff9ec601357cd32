"""Minimal stand-ins for the ``sglang.*`` modules that the seed (SGLang's FlashInfer attention
backend file, loaded unmodified from ../shared/seed/) imports. Each behaves as its SGLang
counterpart does for what the seed reads; nothing here does attention (that is flashkv's).

``modules()`` returns the module objects by their SGLang names; the suite's fixture puts them in
sys.modules for one test and takes them out again.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

# ---------------------------------------------------------------------------------------------
# sglang.global_config, sglang.srt.utils, sglang.srt.layers.dp_attention


class GlobalConfig:
    def __init__(self) -> None:
        # SGLang's default; the seed raises it for some models and for deterministic mode.
        self.flashinfer_workspace_size = 384 * 1024 * 1024


def get_int_env_var(name: str, default: int = 0) -> int:
    value = os.getenv(name)
    return default if value is None or not value.strip() else int(value)


def is_flashinfer_available() -> bool:
    """SGLang also requires CUDA here; the stand-in asks only whether ``flashinfer`` resolves
    (to flashkv, on the CPU as well)."""
    return importlib.util.find_spec("flashinfer") is not None


def is_sm100_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def next_power_of_2(n: int) -> int:
    return 1 if n <= 0 else 1 << (int(n) - 1).bit_length()


def get_attention_tp_size() -> int:
    return 1


# ---------------------------------------------------------------------------------------------
# sglang.srt.model_executor.forward_batch_info


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    seq_lens_cpu: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    positions: Optional[torch.Tensor] = None
    encoder_lens: Optional[torch.Tensor] = None
    encoder_out_cache_loc: Optional[torch.Tensor] = None
    spec_info: Any = None
    req_to_token_pool: Any = None
    token_to_kv_pool: Any = None
    attn_backend: Any = None


# ---------------------------------------------------------------------------------------------
# sglang.srt.layers.radix_attention


class AttentionType(enum.Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class RadixAttention(torch.nn.Module):
    """One attention layer's constants; forward hands the call to the batch's backend."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 logit_cap: float = 0.0, v_head_dim: int = -1, sliding_window_size: int = -1,
                 is_cross_attention: bool = False, attn_type: AttentionType = AttentionType.DECODER) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim != -1 else head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = logit_cap
        self.sliding_window_size = sliding_window_size or -1
        self.is_cross_attention = is_cross_attention
        self.attn_type = attn_type
        self.k_scale = None
        self.v_scale = None
        self.k_scale_float = None
        self.v_scale_float = None

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """What loading a checkpoint's KV scales does: a tensor for the pool, a float for kernels."""
        self.k_scale = torch.tensor(float(k_scale), dtype=torch.float32)
        self.v_scale = torch.tensor(float(v_scale), dtype=torch.float32)
        self.k_scale_float, self.v_scale_float = float(k_scale), float(v_scale)

    def forward(self, q, k, v, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)


# ---------------------------------------------------------------------------------------------
# sglang.srt.layers.attention.base_attn_backend, ...attention.utils


class AttentionBackend:
    """The dispatch SGLang's base class does: IDLE gives an empty output, DECODE goes to
    forward_decode, every other mode to forward_extend."""

    def __init__(self) -> None:
        pass

    def forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool = True,
                **kwargs):
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


class _Launchable:
    """``kernel[grid](*args)``, as a Triton kernel is called; the body is torch code."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args: self.fn(grid, *args)


def _kv_indices(grid, req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx, kv_indices,
                req_to_token_stride):
    """kv_indices[kv_indptr[i]:][:len_i] = req_to_token[req_pool_indices[i], start_i:][:len_i]
    for the grid's requests (start_i 0 without kv_start_idx)."""
    rows = req_pool_indices.tolist()
    lens = page_kernel_lens.tolist()
    offs = kv_indptr.tolist()
    starts = kv_start_idx.tolist() if kv_start_idx is not None else [0] * len(rows)
    for i in range(grid[0]):
        n, s = int(lens[i]), int(starts[i])
        kv_indices[offs[i]:offs[i] + n] = req_to_token[rows[i], s:s + n]


create_flashinfer_kv_indices_triton = _Launchable(_kv_indices)


def _draft_decode_kv_indices(grid, req_pool_indices, req_to_token, paged_kernel_lens, kv_indices, kv_indptr,
                             positions, pool_len, kv_indices_stride, kv_indptr_stride, bs_upper, iter_upper,
                             num_tokens_upper, page_size):
    """The page table of each draft step (page size 1): step s (0-based) gives branch t of
    request b its seq_len prefix tokens, then its own draft tokens of steps 0..s, which the
    draft loop stores at req_to_token[row, seq_len + step * topk + t]. Rows are b * topk + t;
    kv_indptr[s] is the running sum of positions[:row] + row * (s + 1)."""
    num_steps, num_seqs, topk = grid
    assert page_size == 1, "the stand-in covers page size 1"
    rows = req_pool_indices.tolist()
    lens = paged_kernel_lens[:num_seqs].tolist()
    pos = positions.tolist()
    for s in range(num_steps):
        it = s + 1
        kv_indptr[s, 0] = 0
        for z in range(1, num_seqs * topk + 1):
            kv_indptr[s, z] = sum(pos[:z]) + z * it
        for b in range(num_seqs):
            for t in range(topk):
                n = int(lens[b])
                base = sum(lens[:b]) * topk + b * it * topk + t * (n + it)
                table = req_to_token[rows[b]]
                kv_indices[s, base:base + n] = table[:n]
                draft = n + torch.arange(it, device=table.device) * topk + t
                kv_indices[s, base + n:base + n + it] = table[draft]


generate_draft_decode_kv_indices = _Launchable(_draft_decode_kv_indices)


# ---------------------------------------------------------------------------------------------
# sglang.srt.mem_cache: the req_to_token pool, KV pools, the SWA allocator


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values


class MHATokenToKVPool:
    """Per-layer K and V buffers [size + 1, Hkv, D] (slot 0 is the padding slot). fp8 caches are
    stored as uint8 and viewed as their fp8 dtype; set_kv_buffer divides by the layer's scales
    before the cast, as SGLang's does."""

    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, v_head_dim: Optional[int] = None, start_layer: int = 0) -> None:
        self.size, self.dtype, self.device = size, dtype, device
        self.store_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.start_layer = start_layer
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=self.store_dtype, device=device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, self.v_head_dim), dtype=self.store_dtype, device=device)
                         for _ in range(layer_num)]

    def _index(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        b = self.k_buffer[self._index(layer_id)]
        return b.view(self.dtype) if self.store_dtype != self.dtype else b

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        b = self.v_buffer[self._index(layer_id)]
        return b.view(self.dtype) if self.store_dtype != self.dtype else b

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer: RadixAttention, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                      layer_id_override: Optional[int] = None) -> None:
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k = cache_k / k_scale.to(cache_k.device)
            if v_scale is not None:
                cache_v = cache_v / v_scale.to(cache_v.device)
            cache_k = cache_k.to(self.dtype)
            cache_v = cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
            cache_v = cache_v.view(self.store_dtype)
        i = self._index(layer_id)
        self.k_buffer[i][loc] = cache_k.view(-1, self.head_num, self.head_dim)
        self.v_buffer[i][loc] = cache_v.view(-1, self.head_num, self.v_head_dim)


class SWAKVPool:
    """Two pools: layers in swa_layer_ids live in the sliding-window pool (indexed by SWA slots),
    the others in the full pool; set_kv_buffer translates full slots for SWA layers."""

    def __init__(self, full_pool: MHATokenToKVPool, swa_pool: MHATokenToKVPool, swa_layer_ids: List[int],
                 allocator: "SWATokenToKVPoolAllocator") -> None:
        self.full_pool, self.swa_pool = full_pool, swa_pool
        self.swa_layer_ids = set(swa_layer_ids)
        self.allocator = allocator
        self.dtype = full_pool.dtype

    def _pool(self, layer_id: int) -> MHATokenToKVPool:
        return self.swa_pool if layer_id in self.swa_layer_ids else self.full_pool

    def get_key_buffer(self, layer_id: int):
        return self._pool(layer_id).get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        return self._pool(layer_id).get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int):
        return self._pool(layer_id).get_kv_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None) -> None:
        if layer.layer_id in self.swa_layer_ids:
            loc = self.allocator.translate_loc_from_full_to_swa(loc)
        self._pool(layer.layer_id).set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale)


class TokenToKVPoolAllocator:
    """Free slots 1..size, handed out in a shuffled order so requests' KV is scattered."""

    def __init__(self, size: int, device: str, generator: torch.Generator) -> None:
        self.size, self.device = size, device
        self.free = (torch.randperm(size, generator=generator) + 1).tolist()

    def alloc(self, n: int) -> torch.Tensor:
        assert n <= len(self.free), "pool exhausted"
        out, self.free = self.free[:n], self.free[n:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)


class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """Full slots as the plain allocator; each also gets a slot of the (smaller) SWA pool, and
    full_to_swa_index_mapping maps one to the other."""

    def __init__(self, size: int, size_swa: int, device: str, generator: torch.Generator) -> None:
        super().__init__(size, device, generator)
        self.size_swa = size_swa
        self.swa_free = (torch.randperm(size_swa, generator=generator) + 1).tolist()
        self.full_to_swa_index_mapping = torch.zeros(size + 1, dtype=torch.int64, device=device)

    def alloc(self, n: int) -> torch.Tensor:
        full = super().alloc(n)
        assert n <= len(self.swa_free), "SWA pool exhausted"
        swa, self.swa_free = self.swa_free[:n], self.swa_free[n:]
        self.full_to_swa_index_mapping[full] = torch.tensor(swa, dtype=torch.int64, device=self.device)
        return full

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[kv_indices].to(torch.int32)


# ---------------------------------------------------------------------------------------------
# sglang.srt.speculative: spec_info, eagle_info, spec_utils


class SpecInput:
    def is_draft_input(self) -> bool:
        return False

    def is_verify_input(self) -> bool:
        return False


class EagleDraftInput(SpecInput):
    """Draft side: accept_length per request (DRAFT_EXTEND queries); the draft-decode loop
    sets kv_indptr / kv_indices per step."""

    def __init__(self, accept_length: Optional[torch.Tensor] = None) -> None:
        self.accept_length = accept_length
        self.kv_indptr: Optional[torch.Tensor] = None
        self.kv_indices: Optional[torch.Tensor] = None

    def is_draft_input(self) -> bool:
        return True

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, req_to_token):
        bs = self.accept_length.numel()
        device = req_pool_indices.device
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        qo_indptr[1:] = torch.cumsum(self.accept_length, dim=0)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(paged_kernel_lens, dim=0)
        if paged_kernel_lens_sum is None:
            paged_kernel_lens_sum = int(kv_indptr[-1])
        kv_indices = torch.empty(paged_kernel_lens_sum, dtype=torch.int32, device=device)
        create_flashinfer_kv_indices_triton[(bs,)](req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr,
                                                   None, kv_indices, req_to_token.size(1))
        return kv_indices, kv_indptr, qo_indptr, None


class EagleVerifyInput(SpecInput):
    """Verify side: draft_token_num tokens per request after its seq_len cached ones, and the
    tree mask custom_mask (bool, each request's [draft_token_num, seq_len + draft_token_num]
    flattened, back to back)."""

    def __init__(self, draft_token_num: int, custom_mask: torch.Tensor) -> None:
        self.draft_token_num = draft_token_num
        self.custom_mask = custom_mask

    def is_verify_input(self) -> bool:
        return True

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, req_to_token):
        bs = len(req_pool_indices)
        device = req_pool_indices.device
        n = self.draft_token_num
        qo_indptr = torch.arange(0, (bs + 1) * n, step=n, dtype=torch.int32, device=device)
        lens = paged_kernel_lens + n
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(lens, dim=0)
        kv_indices = torch.empty(paged_kernel_lens_sum + n * bs, dtype=torch.int32, device=device)
        create_flashinfer_kv_indices_triton[(bs,)](req_to_token, req_pool_indices, lens, kv_indptr, None,
                                                   kv_indices, req_to_token.size(1))
        return kv_indices, kv_indptr, qo_indptr, self.custom_mask


# ---------------------------------------------------------------------------------------------
# sglang.srt.model_executor.model_runner (configs)


@dataclass
class HFConfig:
    architectures: List[str] = field(default_factory=lambda: ["LlamaForCausalLM"])


@dataclass
class ModelConfig:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    context_len: int
    is_multimodal: bool = False
    is_encoder_decoder: bool = False
    hf_config: HFConfig = field(default_factory=HFConfig)

    def get_num_kv_heads(self, tensor_parallel_size: int) -> int:
        return max(1, self.num_key_value_heads // tensor_parallel_size)


@dataclass
class ServerArgs:
    enable_deterministic_inference: bool = False


@dataclass
class ModelRunner:
    model_config: ModelConfig
    server_args: ServerArgs
    device: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: Any
    token_to_kv_pool_allocator: Any
    sliding_window_size: Optional[int] = None
    page_size: int = 1


def modules() -> Dict[str, types.ModuleType]:
    """The stand-in modules under their SGLang names (packages included)."""
    contents = {
        "sglang.global_config": {"global_config": GlobalConfig()},
        "sglang.srt.utils": {"get_int_env_var": get_int_env_var, "is_flashinfer_available": is_flashinfer_available,
                             "is_sm100_supported": is_sm100_supported, "next_power_of_2": next_power_of_2},
        "sglang.srt.layers.dp_attention": {"get_attention_tp_size": get_attention_tp_size},
        "sglang.srt.layers.radix_attention": {"AttentionType": AttentionType, "RadixAttention": RadixAttention},
        "sglang.srt.layers.attention.base_attn_backend": {"AttentionBackend": AttentionBackend},
        "sglang.srt.layers.attention.utils": {
            "create_flashinfer_kv_indices_triton": create_flashinfer_kv_indices_triton},
        "sglang.srt.mem_cache.allocator": {"SWATokenToKVPoolAllocator": SWATokenToKVPoolAllocator,
                                           "TokenToKVPoolAllocator": TokenToKVPoolAllocator},
        "sglang.srt.mem_cache.memory_pool": {"MHATokenToKVPool": MHATokenToKVPool, "ReqToTokenPool": ReqToTokenPool,
                                             "SWAKVPool": SWAKVPool},
        "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": ForwardBatch, "ForwardMode": ForwardMode},
        "sglang.srt.model_executor.model_runner": {"ModelRunner": ModelRunner},
        "sglang.srt.speculative.eagle_info": {"EagleDraftInput": EagleDraftInput,
                                              "EagleVerifyInput": EagleVerifyInput},
        "sglang.srt.speculative.spec_info": {"SpecInput": SpecInput},
        "sglang.srt.speculative.spec_utils": {"generate_draft_decode_kv_indices": generate_draft_decode_kv_indices},
    }
    out: Dict[str, types.ModuleType] = {}
    for name, attrs in contents.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg not in out:
                out[pkg] = types.ModuleType(pkg)
                out[pkg].__path__ = []  # a package
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        out[name] = mod
    for name, mod in out.items():  # attributes for parent.child access
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(out[parent], child, mod)
    return out
