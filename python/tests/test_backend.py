"""FlashKVBackend through Python, with NumPy arrays on the CPU and PyTorch tensors on CUDA (the
`xp` fixture, devices.py): an extend batch with cached prefixes, then decode steps, eager and in
CUDA-graph mode, against the float64 reference."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import FlashKVBackend, ForwardBatch, ForwardMode, KVPool, LayerSpec, ReqToTokenPool, TokenAllocator

HQ, HKV, D, LAYERS = 4, 2, 64, 2  # 64: the smallest head dim the CUDA kernels have


class Engine:
    """A tiny model runner: pools, allocator, and the KV each request holds (for the reference)."""

    def __init__(self, xp, rng, **backend_kw):
        self.xp, self.rng = xp, rng
        dtype = np.dtype(xp.float).name
        self.pool = KVPool(512, num_layers=LAYERS, num_kv_heads=HKV, head_dim_qk=D, dtype=dtype, device=xp.device,
                           framework=xp.framework)
        self.r2t = ReqToTokenPool(8, 256, device=xp.device)
        self.alloc = TokenAllocator(512)
        self.backend = FlashKVBackend(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, q_dtype=dtype,
                                      device=xp.device, **backend_kw)
        self.layers = [LayerSpec(layer_id=i, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, scaling=0.2)
                       for i in range(LAYERS)]
        self.rows, self.slots = [], []

    def add_requests(self, prefix_lens):
        """New requests whose first prefix_lens tokens are already cached (random KV)."""
        rows = self.r2t.alloc(len(prefix_lens))
        for row, n in zip(rows, prefix_lens):
            slots = self.alloc.alloc(n) if n else []
            self.r2t.write(row, 0, slots)
            for layer in range(LAYERS):
                k, v = self.pool.get_kv_buffer(layer)
                rows = self.xp.put(np.array(slots, np.int64))
                k[rows] = self.xp.put(self.random((n, HKV, D)))
                v[rows] = self.xp.put(self.random((n, HKV, D)))
            self.rows.append(row)
            self.slots.append(list(slots))

    def batch(self, mode, new_lens):
        fb = ForwardBatch()
        fb.forward_mode = mode
        fb.batch_size = len(new_lens)
        out_loc = []
        for i, n in enumerate(new_lens):
            slots = self.alloc.alloc(n)
            self.r2t.write(self.rows[i], len(self.slots[i]), slots)
            out_loc += slots
        prefix = [len(s) for s in self.slots]
        for i, n in enumerate(new_lens):
            self.slots[i] += out_loc[sum(new_lens[:i]):sum(new_lens[:i + 1])]
        fb.req_pool_indices = self.xp.put(np.array(self.rows, np.int32))
        fb.seq_lens_cpu = [p + n for p, n in zip(prefix, new_lens)]
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens_cpu = prefix
            fb.extend_seq_lens_cpu = list(new_lens)
        fb.out_cache_loc = self.xp.put(np.array(out_loc, np.int32))
        fb.req_to_token_pool = self.r2t
        fb.token_to_kv_pool = self.pool
        return fb

    def run_layers(self, fb, new_lens):
        t = sum(new_lens)
        xp = self.xp
        for spec in self.layers:
            q = self.random((t, HQ * D))
            k = self.random((t, HKV, D))
            v = self.random((t, HKV, D))
            out = xp.get(self.backend.forward(*xp.put((q, k, v)), spec, fb))
            assert out.shape == (t, HQ * D)
            kc, vc = xp.get(self.pool.get_kv_buffer(spec.layer_id))
            assert np.array_equal(kc[xp.get(fb.out_cache_loc)], k), "the new tokens' K was saved"
            ks = [kc[s] for s in self.slots]
            vs = [vc[s] for s in self.slots]
            ref_out, _ = R.attention(q.reshape(t, HQ, D), ks, vs, new_lens, causal=True, sm_scale=0.2)
            R.assert_close(out.reshape(t, HQ, D), None, ref_out, None)

    def random(self, shape):
        return self.rng.standard_normal(shape).astype(self.xp.float)


@pytest.mark.parametrize("extend_path", ["auto", "ragged", "one_paged_pass"])
def test_extend_then_decode(xp, rng, extend_path):
    """An extend on cached prefixes by each path (auto: one paged pass with a 16-bit or f32 pool),
    then decode."""
    e = Engine(xp, rng, extend_path=extend_path)
    e.add_requests([10, 0, 25])
    fb = e.batch(ForwardMode.EXTEND, [5, 7, 1])
    e.backend.init_forward_metadata(fb)
    ragged = extend_path == "ragged"
    assert e.backend.uses_ragged == ragged and not e.backend.extend_without_prefix
    e.run_layers(fb, [5, 7, 1])
    for _ in range(2):
        fb = e.batch(ForwardMode.DECODE, [1, 1, 1])
        e.backend.init_forward_metadata(fb)
        e.run_layers(fb, [1, 1, 1])


@pytest.mark.parametrize("use_tensor_cores", [None, False, True])
def test_decode_kernel_choice(xp, rng, use_tensor_cores):
    """use_tensor_cores=True decodes through the prefill kernel, False (and unset) through the
    decode operator; both match the reference."""
    e = Engine(xp, rng, use_tensor_cores=use_tensor_cores)
    assert e.backend.decode_uses_prefill_kernel == bool(use_tensor_cores)
    e.add_requests([40, 1, 17])
    for _ in range(2):
        fb = e.batch(ForwardMode.DECODE, [1, 1, 1])
        e.backend.init_forward_metadata(fb)
        e.run_layers(fb, [1, 1, 1])


def test_cuda_graph_state_replays_other_batches(xp, rng):
    """CUDA-graph mode, run eagerly (test_torch.py captures real graphs): fixed buffers sized by
    init_cuda_graph_state; capture plans one batch, replays plan others of the same size into
    the same buffers."""
    e = Engine(xp, rng, deterministic=True)
    e.add_requests([30, 3])
    e.backend.init_cuda_graph_state(4, 4)
    fb = e.batch(ForwardMode.DECODE, [1, 1])
    e.backend.init_forward_metadata_capture_cuda_graph(fb)
    e.run_layers(fb, [1, 1])
    for _ in range(2):
        fb = e.batch(ForwardMode.DECODE, [1, 1])
        e.backend.init_forward_metadata_replay_cuda_graph(fb)
        e.run_layers(fb, [1, 1])
    assert e.backend.get_cuda_graph_seq_len_fill_value() == 1


def test_backend_errors(xp, rng):
    e = Engine(xp, rng)
    e.add_requests([4])
    fb = e.batch(ForwardMode.DECODE, [1])
    with pytest.raises(flashkv.Error, match="init_forward_metadata"):
        e.backend.forward(xp.zeros((1, HQ * D), xp.float), None, None, e.layers[0], fb)
    fb.seq_lens_cpu = [999]
    with pytest.raises(flashkv.Error, match="seq_lens_cpu"):
        e.backend.init_forward_metadata(fb)
    with pytest.raises(flashkv.Error, match="num_qo_heads"):
        FlashKVBackend(num_qo_heads=3, num_kv_heads=2, head_dim_qk=D, device=xp.device)
    with pytest.raises(flashkv.Error):
        KVPool(10, page_size=4, device=xp.device)
    idle = ForwardBatch()
    idle.forward_mode = ForwardMode.IDLE
    e.backend.init_forward_metadata(idle)
    assert tuple(e.backend.forward(xp.zeros((0, HQ * D), xp.float), None, None, e.layers[0], idle).shape) == (0, HQ * D)


def test_extend_path_is_checked():
    with pytest.raises(flashkv.Error, match="extend_path: expected auto, ragged or one_paged_pass, got 'paged'"):
        FlashKVBackend(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, extend_path="paged")
