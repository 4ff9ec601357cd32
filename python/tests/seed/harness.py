"""A mock model runner that drives the seed's FlashInferAttnBackend on flashkv, and the float64
reference every layer output is compared with (reference.attention over K/V read back from the
KV pool, dequantized with the layer's scales)."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import reference as R

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class CudaAllocationsOnCpu(TorchFunctionMode):
    """The seed allocates a few index buffers with a literal device="cuda" (decode kv_indices,
    the multi-step draft's kv_indices, the CUDA-graph state). On a CPU run those go to the CPU;
    nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def on_device(device: str):
    return CudaAllocationsOnCpu() if device == "cpu" else contextlib.nullcontext()


def default_dtype(device: str) -> torch.dtype:
    """fp32 on the CPU; the CUDA kernels take 16-bit inputs only."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def tolerance(dtype: torch.dtype, kv_dtype: Optional[torch.dtype] = None) -> float:
    """Relative output error bound: fp32 computes in fp32; 16-bit inputs, and fp8 KV (whose dot
    products run in bf16; SEMANTICS.md allows 5e-2), get the 16-bit bound."""
    if dtype == torch.float32 and kv_dtype not in FP8:
        return 1e-4
    return 2e-2


class Model:
    """Pools, allocator, layers and the seed's backend for one model shape, plus what each
    request holds (rows of req_to_token), so the reference can be built from the pool."""

    def __init__(self, seed, st, device: str, *, hq: int = 4, hkv: int = 2, d: int = 64, num_layers: int = 2,
                 dtype: Optional[torch.dtype] = None, kv_dtype: Optional[torch.dtype] = None,
                 logit_cap: float = 0.0, window: Optional[int] = None, multimodal: bool = False,
                 deterministic: bool = False, encoder_decoder: bool = False, encoder_only: bool = False,
                 kv_scales: Optional[Sequence[float]] = None, max_reqs: int = 40, context_len: int = 160,
                 pool_size: int = 6000, rng_seed: int = 0, backend: bool = True) -> None:
        self.seed, self.st, self.device = seed, st, device
        self.hq, self.hkv, self.d = hq, hkv, d
        self.dtype = dtype or default_dtype(device)
        self.kv_dtype = kv_dtype or self.dtype
        self.gen = torch.Generator().manual_seed(rng_seed)
        self.window = window
        self.encoder_decoder = encoder_decoder
        self.layers = []
        for i in range(num_layers):
            layer = st.RadixAttention(hq, d, scaling=d ** -0.5, num_kv_heads=hkv, layer_id=i, logit_cap=logit_cap,
                                      sliding_window_size=window if (window is not None and i % 2 == 0) else -1,
                                      is_cross_attention=encoder_decoder and i % 2 == 1,
                                      attn_type=st.AttentionType.ENCODER_ONLY if encoder_only
                                      else st.AttentionType.DECODER)
            if kv_scales is not None:
                layer.set_kv_scales(*kv_scales)
            self.layers.append(layer)
        self.r2t = st.ReqToTokenPool(max_reqs, context_len, device)
        if window is not None:
            self.alloc = st.SWATokenToKVPoolAllocator(pool_size, pool_size // 2, device, self.gen)
            full = st.MHATokenToKVPool(pool_size, self.kv_dtype, hkv, d, num_layers, device)
            swa = st.MHATokenToKVPool(pool_size // 2, self.kv_dtype, hkv, d, num_layers, device)
            self.pool = st.SWAKVPool(full, swa, [l.layer_id for l in self.layers if l.sliding_window_size >= 0],
                                     self.alloc)
        else:
            self.alloc = st.TokenToKVPoolAllocator(pool_size, device, self.gen)
            self.pool = st.MHATokenToKVPool(pool_size, self.kv_dtype, hkv, d, num_layers, device)
        config = st.ModelConfig(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, context_len=context_len,
                                is_multimodal=multimodal, is_encoder_decoder=encoder_decoder)
        self.runner = st.ModelRunner(model_config=config,
                                     server_args=st.ServerArgs(enable_deterministic_inference=deterministic),
                                     device=device, dtype=self.dtype, kv_cache_dtype=self.kv_dtype,
                                     req_to_token_pool=self.r2t, token_to_kv_pool=self.pool,
                                     token_to_kv_pool_allocator=self.alloc, sliding_window_size=window)
        self.backend = seed.FlashInferAttnBackend(self.runner) if backend else None
        self.free_rows = list(range(max_reqs))
        self.rows: List[int] = []
        self.lens: List[int] = []       # decoder tokens held per request
        self.enc_lens: List[int] = []   # encoder tokens (before the decoder's in the row)

    # --- data -----------------------------------------------------------------------------
    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.dtype).to(self.device)

    def _write_random_kv(self, slots: torch.Tensor) -> None:
        for layer in self.layers:
            n = slots.numel()
            self.pool.set_kv_buffer(layer, slots, self.randn(n, self.hkv, self.d), self.randn(n, self.hkv, self.d),
                                    layer.k_scale, layer.v_scale)

    def add_requests(self, prefix_lens: Sequence[int], enc_lens: Optional[Sequence[int]] = None) -> List[int]:
        """New requests with prefix_lens cached decoder tokens (random KV in every layer) and,
        for an encoder-decoder model, enc_lens encoder tokens."""
        ids = []
        for i, n in enumerate(prefix_lens):
            row = self.free_rows.pop(0)
            e = enc_lens[i] if enc_lens is not None else 0
            slots = self.alloc.alloc(e + n)
            if e + n:
                self.r2t.req_to_token[row, :e + n] = slots.to(torch.int32)
                self._write_random_kv(slots)
            ids.append(len(self.rows))
            self.rows.append(row)
            self.lens.append(n)
            self.enc_lens.append(e)
        return ids

    def slots(self, i: int, start: int, n: int) -> torch.Tensor:
        base = self.enc_lens[i]
        return self.r2t.req_to_token[self.rows[i], base + start:base + start + n].long()

    # --- batches --------------------------------------------------------------------------
    def batch(self, mode, new_lens: Sequence[int], ids: Optional[Sequence[int]] = None, spec_info=None,
              grow: bool = True):
        """A ForwardBatch where request ids[i] gets new_lens[i] new tokens (slots allocated and
        written into req_to_token after what it holds)."""
        st, dev = self.st, self.device
        ids = list(range(len(self.rows))) if ids is None else list(ids)
        prefix = [self.lens[i] for i in ids]
        locs = []
        for i, n in zip(ids, new_lens):
            s = self.alloc.alloc(n)
            base = self.enc_lens[i] + self.lens[i]
            self.r2t.req_to_token[self.rows[i], base:base + n] = s.to(torch.int32)
            locs.append(s)
            if grow:
                self.lens[i] += n
        seq = [p + n for p, n in zip(prefix, new_lens)]
        seq_for_batch = prefix if mode == st.ForwardMode.TARGET_VERIFY else seq
        fb = st.ForwardBatch(
            forward_mode=mode, batch_size=len(ids),
            req_pool_indices=torch.tensor([self.rows[i] for i in ids], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_for_batch, dtype=torch.int64, device=dev),
            seq_lens_cpu=torch.tensor(seq_for_batch, dtype=torch.int64),
            seq_lens_sum=int(sum(seq_for_batch)),
            out_cache_loc=torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=dev),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
            extend_prefix_lens_cpu=list(prefix),
            extend_seq_lens=torch.tensor(list(new_lens), dtype=torch.int32, device=dev),
            extend_seq_lens_cpu=list(new_lens),
            positions=torch.tensor(seq_for_batch, dtype=torch.int64, device=dev),
            spec_info=spec_info, req_to_token_pool=self.r2t, token_to_kv_pool=self.pool, attn_backend=self.backend)
        if self.encoder_decoder:
            fb.encoder_lens = torch.tensor([self.enc_lens[i] for i in ids], dtype=torch.int32, device=dev)
            fb.encoder_out_cache_loc = torch.cat([self.r2t.req_to_token[self.rows[i], :self.enc_lens[i]].long()
                                                  for i in ids])
        fb.ids, fb.new_lens, fb.prefix = ids, list(new_lens), prefix
        return fb

    # --- the reference ----------------------------------------------------------------------
    def pool_kv(self, layer, slots: torch.Tensor):
        """float64 K, V of full-pool slots as a kernel must read them (SWA slots translated,
        fp8 times the layer's scales)."""
        if self.window is not None and layer.sliding_window_size >= 0:
            slots = self.alloc.translate_loc_from_full_to_swa(slots).long()
        k = self.pool.get_key_buffer(layer.layer_id)[slots].to(torch.float64).cpu()
        v = self.pool.get_value_buffer(layer.layer_id)[slots].to(torch.float64).cpu()
        if self.kv_dtype in FP8 and layer.k_scale_float is not None:
            k, v = k * layer.k_scale_float, v * layer.v_scale_float
        return k.numpy(), v.numpy()

    def reference(self, layer, fb, q, k_new=None, v_new=None, raw_new: bool = False, masks=None, causal=True,
                  kv_lens: Optional[Sequence[int]] = None):
        """[T, Hq * D] float64: each request's query rows (the last of its tokens) over its KV
        from the pool; raw_new: its new tokens' K/V as passed (a ragged extend reads those)."""
        ks, vs, qo = [], [], []
        row = 0
        for j, i in enumerate(fb.ids):
            lq = fb.new_lens[j]
            if layer.is_cross_attention:
                sl = self.r2t.req_to_token[self.rows[i], :self.enc_lens[i]].long()
                k, v = self.pool_kv(layer, sl)
            else:
                n = kv_lens[j] if kv_lens is not None else fb.prefix[j] + lq
                k, v = self.pool_kv(layer, self.slots(i, 0, n))
                if raw_new and lq:
                    k[-lq:] = k_new[row:row + lq].to(torch.float64).cpu().numpy()
                    v[-lq:] = v_new[row:row + lq].to(torch.float64).cpu().numpy()
            ks.append(k)
            vs.append(v)
            qo.append(lq)
            row += lq
        qq = q.to(torch.float64).cpu().numpy().reshape(-1, self.hq, self.d)
        window = layer.sliding_window_size if layer.sliding_window_size >= 0 else -1
        out, _ = R.attention(qq, ks, vs, qo, causal=causal and not layer.is_cross_attention, window_left=window,
                             logits_soft_cap=layer.logit_cap, sm_scale=layer.scaling, masks=masks)
        return out.reshape(len(qq), -1)

    def check(self, out, ref, what: str = "") -> None:
        assert out.dtype == self.dtype, f"{what}: output dtype {out.dtype}"
        err = R.rel_error(out.to(torch.float64).cpu().numpy(), ref)
        assert not torch.isnan(out).any(), f"{what}: NaN in the output"
        tol = tolerance(self.dtype, self.kv_dtype)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"

    # --- one forward pass through every layer -------------------------------------------------
    def forward(self, fb, masks=None, q_scale: float = 1.0, save_kv: bool = True, kv_lens=None,
                init: bool = True, check: bool = True, qkv=None) -> Dict[int, torch.Tensor]:
        """init_forward_metadata, then each layer's forward (RadixAttention.forward through the
        batch's backend) with random q/k/v; each output is checked against the reference.
        Returns the outputs by layer id."""
        if init:
            self.backend.init_forward_metadata(fb)
        t = sum(fb.new_lens)
        outs = {}
        md = self.backend.forward_metadata
        ragged = bool(getattr(md, "use_ragged", False))
        for layer in self.layers:
            if qkv is not None:
                q, k, v = qkv[layer.layer_id]
            else:
                q = self.randn(t, self.hq * self.d, scale=q_scale)
                if layer.is_cross_attention:
                    k = v = None  # the encoder's K/V are cached
                else:
                    k, v = self.randn(t, self.hkv, self.d), self.randn(t, self.hkv, self.d)
            out = layer.forward(q, k, v, fb, save_kv_cache=save_kv)
            assert tuple(out.shape) == (t, self.hq * self.d)
            outs[layer.layer_id] = out
            if check:
                causal = layer.attn_type != self.st.AttentionType.ENCODER_ONLY
                ref = self.reference(layer, fb, q, k, v, raw_new=ragged and k is not None, masks=masks,
                                     causal=causal, kv_lens=kv_lens)
                self.check(out, ref, f"layer {layer.layer_id}")
        return outs


def tree_masks(rng: np.random.Generator, prefix_lens: Sequence[int], n: int, device: str):
    """EAGLE verify masks: per request a random draft tree of n tokens (token j's parent is an
    earlier token); a draft token sees the whole prefix, its ancestors and itself. Returns the
    flattened bool mask the seed plans with and the per-request [n, prefix + n] matrices."""
    mats = []
    for p in prefix_lens:
        tree = np.eye(n, dtype=bool)
        for j in range(1, n):
            parent = int(rng.integers(0, j))
            tree[j] |= tree[parent]
        mats.append(np.concatenate([np.ones((n, p), bool), tree], axis=1))
    flat = torch.from_numpy(np.concatenate([m.reshape(-1) for m in mats])).to(device)
    return flat, mats
