"""A decode step the way SGLang's FlashInfer attention backend drives FlashInfer: one shared
workspace buffer, kv_indptr/kv_indices built from req_to_token, begin_forward once per batch,
forward once per layer with the KV cache as a (k, v) tuple of [slots, num_kv_heads, head_dim].

The only change from FlashInfer code is the import line. Runs on CUDA when available, else on
the CPU (PyTorch tensors either way).
"""

import torch

import flashkv as flashinfer  # was: import flashinfer

device = "cuda" if torch.cuda.is_available() and flashinfer.cuda_available() else "cpu"
dtype = torch.bfloat16
num_layers, num_qo_heads, num_kv_heads, head_dim = 2, 32, 8, 128
max_reqs, max_context_len, num_slots = 8, 1024, 4096

# The model runner's pools: req_to_token rows of KV slots, and per-layer K/V buffers.
req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
k_buffers = [torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
v_buffers = [torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

# A decode batch: three requests with their cached tokens in random slots.
seq_lens = torch.tensor([700, 5, 300], dtype=torch.int32, device=device)
req_pool_indices = torch.tensor([3, 0, 6], dtype=torch.int32, device=device)
slots = torch.randperm(num_slots - 1, device=device)[: int(seq_lens.sum())].to(torch.int32) + 1
start = 0
for row, n in zip(req_pool_indices.tolist(), seq_lens.tolist()):
    req_to_token[row, :n] = slots[start:start + n]
    start += n
bs = seq_lens.numel()

# --- what the backend does once per batch (FlashInferIndicesUpdaterDecode.call_begin_forward) ---
workspace_buffer = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace_buffer, "NHD", use_tensor_cores=True)
kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
kv_indices = torch.empty(int(seq_lens.sum()) + 256, dtype=torch.int32, device=device)  # spare entries
for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
    kv_indices[kv_indptr[i]:kv_indptr[i] + n] = req_to_token[row, :n]
kv_last_page_len = torch.ones(bs, dtype=torch.int32, device=device)
decode_wrapper.begin_forward(
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    1,
    data_type=dtype,
    q_data_type=dtype,
    non_blocking=True,
    fixed_split_size=None,
    disable_split_kv=False,
)

# --- what the backend does per layer (FlashInferAttnBackend.forward_decode) ---
scaling, logit_cap = head_dim ** -0.5, 0.0
for layer_id in range(num_layers):
    q = torch.randn(bs, num_qo_heads * head_dim, dtype=dtype, device=device)
    o = decode_wrapper.forward(
        q.contiguous().view(-1, num_qo_heads, head_dim),
        (k_buffers[layer_id], v_buffers[layer_id]),
        sm_scale=scaling,
        logits_soft_cap=logit_cap,
        k_scale=None,
        v_scale=None,
    )
    o = o.view(-1, num_qo_heads * head_dim)

    # Check against plain PyTorch attention.
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        idx = req_to_token[row, :n].long()
        k = k_buffers[layer_id][idx].float().repeat_interleave(num_qo_heads // num_kv_heads, dim=1)
        v = v_buffers[layer_id][idx].float().repeat_interleave(num_qo_heads // num_kv_heads, dim=1)
        qi = q[i].view(num_qo_heads, head_dim).float()
        p = torch.softmax(torch.einsum("hd,khd->hk", qi, k) * scaling, dim=-1)
        ref = torch.einsum("hk,khd->hd", p, v).reshape(-1)
        err = (o[i].float() - ref).norm() / ref.norm()
        assert err < 1e-2, f"layer {layer_id} request {i}: relative error {err:.3g}"
print(f"decode of {bs} requests x {num_layers} layers on {device}: matches the PyTorch reference")
