"""What code written against FlashInfer's internals reaches in flashkv.decode: _get_range_buf,
get_seq_lens, and a decode wrapper planned through `_cached_module.plan(...)` with FlashInfer's
positional argument lists (18 in the tensor-core form, 15 in the CUDA-core form), which must give
the plan that plan() gives for the same batch. On CPU arrays: NumPy and, when importable, PyTorch."""

import numpy as np
import pytest

import flashkv
import reference as R
from flashkv import BatchDecodeWithPagedKVCacheWrapper
from flashkv.decode import _get_range_buf, get_seq_lens

HQ, HKV, D = 8, 2, 64

try:
    import torch
except ImportError:  # the torch cases skip
    torch = None

LIBS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="PyTorch is not installed"))]


def put(lib, a):
    if isinstance(a, tuple):
        return tuple(put(lib, x) for x in a)
    if a is None or lib == "numpy":
        return a
    return torch.from_numpy(np.ascontiguousarray(a))


def get(x):
    return x.numpy() if torch is not None and isinstance(x, torch.Tensor) else np.asarray(x)


# --- _get_range_buf and get_seq_lens ---------------------------------------------------------

def test_get_range_buf():
    buf = _get_range_buf(6, "cpu")
    assert get(buf).tolist() == list(range(6)) and str(buf.dtype).endswith("int32")
    assert _get_range_buf(6, "cpu") is buf  # cached
    assert get(_get_range_buf(0, "cpu")).size == 0
    if torch is not None:
        t = _get_range_buf(3, torch.device("cpu"))
        assert isinstance(t, torch.Tensor) and t.tolist() == [0, 1, 2] and t.dtype == torch.int32


@pytest.mark.parametrize("seq_len, device, match", [
    (-1, "cpu", "seq_len: expected an int >= 0"), (2.0, "cpu", "seq_len: expected an int >= 0"),
    (True, "cpu", "seq_len"), (3, 0, "device: expected a device name")])
def test_get_range_buf_bad_input(seq_len, device, match):
    with pytest.raises(flashkv.Error, match=match):
        _get_range_buf(seq_len, device)


@pytest.mark.parametrize("lib", LIBS)
def test_get_seq_lens_has_flashinfer_meaning(lib):
    indptr = np.array([0, 2, 2, 5, 6], np.int32)
    last = np.array([3, 0, 4, 1], np.int32)
    out = get_seq_lens(put(lib, indptr), put(lib, last), 4)
    assert type(out) is type(put(lib, indptr))  # the caller's library
    assert get(out).tolist() == [7, 0, 12, 1]
    # A request with no pages counts its last_page_len, as FlashInfer's does.
    assert get(get_seq_lens(put(lib, np.array([0, 0, 1])), put(lib, np.array([1, 1])), 1)).tolist() == [1, 1]


def test_get_seq_lens_bad_input():
    with pytest.raises(flashkv.Error, match="kv_indptr: expected len\\(kv_last_page_len\\) \\+ 1 = 3 entries, got 2"):
        get_seq_lens(np.array([0, 1]), np.array([1, 1]), 1)
    with pytest.raises(flashkv.Error, match="kv_last_page_len: expected a 1-D array"):
        get_seq_lens(np.array([0, 1]), [1], 1)
    with pytest.raises(flashkv.Error, match="page_size: expected an int >= 1"):
        get_seq_lens(np.array([0, 1]), np.array([1]), 0)


# --- _cached_module.plan against plan() ------------------------------------------------------

def tensor_core_args(w, indptr_host, kv_lens_host, batch_size, page_size, fixed=-1, disable=False, graph=None):
    """FlashInfer's tensor-core argument list, in its order."""
    return [w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
            _get_range_buf(batch_size + 1, "cpu"), indptr_host, kv_lens_host, batch_size, batch_size, HQ, HKV,
            page_size, w.is_cuda_graph_enabled if graph is None else graph, D, D, False, -1, fixed, disable]


def cuda_core_args(w, indptr_host, batch_size, page_size, q_dtype, kv_dtype, cap=0.0):
    """FlashInfer's CUDA-core argument list, in its order."""
    return [w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer, indptr_host,
            batch_size, HQ, HKV, page_size, w.is_cuda_graph_enabled, -1, cap, D, D, q_dtype, kv_dtype]


def make(lib, batch, tensor_cores, graph, max_pages=64):
    ws = put(lib, np.zeros(4 << 20, np.uint8))
    kw = dict(use_tensor_cores=tensor_cores)
    if graph:
        b = len(batch.kv_lens)
        kw.update(use_cuda_graph=True, paged_kv_indptr_buffer=put(lib, np.zeros(b + 1, np.int32)),
                  paged_kv_indices_buffer=put(lib, np.zeros(max_pages, np.int32)),
                  paged_kv_last_page_len_buffer=put(lib, np.zeros(b, np.int32)))
    return BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kw)


def plan_directly(lib, w, batch, tensor_cores, fixed=-1, disable=False, override=None):
    """What FlashInfer-internal code does: sets the page table (copies into the fixed buffers in
    CUDA-graph mode, assigns otherwise), then calls _cached_module.plan with host arrays."""
    b, ps = len(batch.kv_lens), batch.page_size
    indptr, indices, last = (put(lib, a) for a in (batch.indptr, batch.indices, batch.last_page_len))
    if w.is_cuda_graph_enabled:
        for buf, a in ((w._paged_kv_indptr_buf, batch.indptr), (w._paged_kv_indices_buf, batch.indices),
                       (w._paged_kv_last_page_len_buf, batch.last_page_len)):
            get(buf)[: len(a)] = a  # CPU arrays: writes through
    else:
        w._paged_kv_indptr_buf, w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf = indptr, indices, last
    indptr_host = put(lib, batch.indptr) if override is None else put(lib, override)
    if tensor_cores:
        lens = get_seq_lens(put(lib, get(indptr_host)[: b + 1]), last, ps)
        args = tensor_core_args(w, indptr_host, lens, b, ps, fixed, disable)
    else:
        dt = np.empty(0, batch.k_cache.dtype) if lib == "numpy" else torch.empty(0, dtype=torch.float32)
        args = cuda_core_args(w, indptr_host, b, ps, dt, dt)
    w._plan_info = w._cached_module.plan(*args)
    return w._plan_info


def plan_properties(info):
    p = info.plan
    return (p.batch_size, p.num_items, p.num_merges, p.kv_chunk, p.num_workers, p.cuda_graph)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_module_plan_equals_plan(rng, lib, tensor_cores, graph, page_size):
    batch = R.paged_batch(rng, [5, 0, 70, 17, 1, 33], HKV, D, page_size, dtype=np.float32)
    cache = put(lib, batch.flat())
    q = rng.standard_normal((len(batch.kv_lens), HQ, D)).astype(np.float32)
    a = make(lib, batch, tensor_cores, graph, max_pages=int(batch.indptr[-1]) + 8)
    a.plan(*(put(lib, x) for x in (batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, page_size)
    out_a, lse_a = (get(x) for x in a.run(put(lib, q), cache, return_lse=True))
    b = make(lib, batch, tensor_cores, graph, max_pages=int(batch.indptr[-1]) + 8)
    info = plan_directly(lib, b, batch, tensor_cores)
    assert info == a._plan_info and plan_properties(info) == plan_properties(a._plan_info)
    out_b, lse_b = (get(x) for x in b.run(put(lib, q), cache, return_lse=True))
    assert np.array_equal(out_a, out_b) and np.array_equal(lse_a, lse_b)
    ks, vs = batch.all_kv()
    R.assert_close(out_b, lse_b, *R.attention(q, ks, vs, [1] * len(batch.kv_lens)))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("fixed, disable", [(2, False), (-1, True), (1, False)])
def test_split_options_and_host_indptr_override(rng, lib, fixed, disable):
    """fixed_split_size (pages; -1: none) and disable_split_kv reach the plan as plan() takes them;
    a host indptr longer than batch_size + 1 (garbage past it) is cut, as plan() cuts
    global_override_indptr_cpu."""
    batch = R.paged_batch(rng, [40, 3, 90, 0, 12], HKV, D, 4, dtype=np.float32)
    q = rng.standard_normal((len(batch.kv_lens), HQ, D)).astype(np.float32)
    cache = put(lib, batch.flat())
    override = np.concatenate([batch.indptr, np.array([-7, 99999], np.int32)])
    a = make(lib, batch, True, False)
    a.plan(*(put(lib, x) for x in (batch.indptr, batch.indices, batch.last_page_len)), HQ, HKV, D, 4,
           fixed_split_size=None if fixed == -1 else fixed, disable_split_kv=disable)
    b = make(lib, batch, True, False)
    info = plan_directly(lib, b, batch, True, fixed, disable, override=override)
    assert info == a._plan_info and plan_properties(info) == plan_properties(a._plan_info)
    assert info.fixed_split_tokens == (0 if fixed == -1 else 4 * fixed) and info.disable_split_kv == disable
    out_a = get(a.run(put(lib, q), cache))
    assert np.array_equal(out_a, get(b.run(put(lib, q), cache)))
    # The flashkv fast_decode_plan with the same host indptr gives the same plan as well.
    c = make(lib, batch, True, False)
    flashkv.fast_decode_plan(c, *(put(lib, x) for x in (batch.indptr, batch.indices, batch.last_page_len)),
                             HQ, HKV, D, 4, fixed_split_size=None if fixed == -1 else fixed,
                             disable_split_kv=disable, global_override_indptr_cpu=put(lib, override))
    assert c._plan_info == info


def test_split_options_change_the_plan(rng):
    """The comparison above can tell plans apart."""
    batch = R.paged_batch(rng, [400, 3, 900], HKV, D, 4, dtype=np.float32)
    a, b = make("numpy", batch, True, False), make("numpy", batch, True, False)
    plan_directly("numpy", a, batch, True, fixed=2)
    plan_directly("numpy", b, batch, True, fixed=-1, disable=True)
    assert a._plan_info != b._plan_info
    assert plan_properties(a._plan_info) != plan_properties(b._plan_info)


def test_run_reads_fields_set_after_the_plan(rng):
    """Code that plans through _cached_module sets _logits_soft_cap / _sm_scale / _window_left
    itself afterwards; the run applies them."""
    batch = R.paged_batch(rng, [30, 9], HKV, D, 1, dtype=np.float32)
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    w = make("numpy", batch, True, False)
    plan_directly("numpy", w, batch, True)
    w._logits_soft_cap, w._sm_scale, w._pos_encoding_mode = 5.0, 0.3, "NONE"
    ks, vs = batch.all_kv()
    out, lse = w.run(q, batch.flat(), return_lse=True)
    R.assert_close(out, lse, *R.attention(q, ks, vs, [1, 1], logits_soft_cap=5.0, sm_scale=0.3))
    w._pos_encoding_mode = "ROPE_LLAMA"
    with pytest.raises(flashkv.Error, match="pos_encoding_mode"):
        w.run(q, batch.flat())
    w._pos_encoding_mode = "NONE"
    w._plan_info = object()
    with pytest.raises(flashkv.Error, match="_plan_info: expected what this wrapper's plan"):
        w.run(q, batch.flat())


# --- bad argument lists ----------------------------------------------------------------------

@pytest.fixture
def tc(rng):
    batch = R.paged_batch(rng, [5, 8, 2], HKV, D, 4, dtype=np.float32)
    w = make("numpy", batch, True, False)
    w._paged_kv_indptr_buf, w._paged_kv_indices_buf = batch.indptr, batch.indices
    w._paged_kv_last_page_len_buf = batch.last_page_len
    lens = get_seq_lens(batch.indptr, batch.last_page_len, 4)
    return w, tensor_core_args(w, batch.indptr, lens, 3, 4), batch


@pytest.mark.parametrize("pos, value, match", [
    (0, "ws", r"argument 0 \(float_workspace_buffer\): expected an array, got str"),
    (0, np.zeros(8, np.uint8), r"argument 0 \(float_workspace_buffer\): expected the wrapper's own"),
    (1, 3, r"argument 1 \(int_workspace_buffer\): expected an array or None"),
    (3, None, r"argument 3 \(qo_indptr\): expected an array, got NoneType"),
    (3, np.array([0, 1, 1, 3]), r"argument 3 \(qo_indptr\): expected 0, 1, ..., batch_size"),
    (5, np.array([5, 8, 99]), r"argument 5 \(kv_len_arr\): request 2: 99 tokens do not fit"),
    (6, 4, r"argument 6 \(total_num_rows\): a decode batch has one query row per request"),
    (7, 3.0, r"argument 7 \(batch_size\): expected an int, got float"),
    (8, True, r"argument 8 \(num_qo_heads\): expected an int, got bool"),
    (10, 0, r"argument 10 \(page_size\): expected >= 1"),
    (11, 1, r"argument 11 \(enable_cuda_graph\): expected a bool, got int"),
    (11, True, r"argument 11 \(enable_cuda_graph\): expected the wrapper's is_cuda_graph_enabled"),
    (14, True, r"argument 14 \(causal\): a decode plan is not causal"),
    (16, 0, r"argument 16 \(fixed_split_size\): expected -1 \(none\) or a number of pages"),
    (16, None, r"argument 16 \(fixed_split_size\): expected an int, got NoneType"),
    (17, None, r"argument 17 \(disable_split_kv\): expected a bool"),
])
def test_tensor_core_form_bad_arguments(tc, pos, value, match):
    w, args, _ = tc
    args[pos] = value
    with pytest.raises(flashkv.Error, match=match):
        w._cached_module.plan(*args)


def test_wrong_argument_counts(tc, rng):
    w, args, batch = tc
    with pytest.raises(flashkv.Error, match=r"expected 18 positional arguments in the tensor-core form.*got 15"):
        w._cached_module.plan(*args[:15])
    with pytest.raises(flashkv.Error, match=r"expected 18 positional arguments.*got 19"):
        w._cached_module.plan(*args, 0)
    w._cached_module.plan(*args)  # the list itself is right
    cc = make("numpy", batch, False, False)
    with pytest.raises(flashkv.Error, match=r"expected 15 positional arguments in the CUDA-core form.*got 18"):
        cc._cached_module.plan(*tensor_core_args(cc, batch.indptr, np.array(batch.kv_lens), 3, 4))


def test_cuda_core_form_bad_arguments(rng):
    batch = R.paged_batch(rng, [5, 8, 2], HKV, D, 4, dtype=np.float32)
    w = make("numpy", batch, False, False)
    dt = np.empty(0, np.float32)
    args = cuda_core_args(w, batch.indptr, 3, 4, dt, dt)
    with pytest.raises(flashkv.Error, match=r"_paged_kv_indptr_buf / _paged_kv_indices_buf: expected the page"):
        w._cached_module.plan(*args)
    w._paged_kv_indptr_buf, w._paged_kv_indices_buf = batch.indptr, batch.indices
    with pytest.raises(flashkv.Error, match=r"_paged_kv_last_page_len_buf: the CUDA-core form takes"):
        w._cached_module.plan(*args)
    w._paged_kv_last_page_len_buf = batch.last_page_len
    for pos, value, match in [(10, "0", r"argument 10 \(logits_soft_cap\): expected a float, got str"),
                              (13, "float16", r"argument 13 \(empty_q_data\): expected an array"),
                              (3, np.array([0, 2]), r"argument 3 \(indptr\): expected at least batch_size \+ 1"),
                              (3, np.array([0, 3, 2, 4]), r"argument 3 \(indptr\): expected non-decreasing")]:
        bad = list(args)
        bad[pos] = value
        with pytest.raises(flashkv.Error, match=match):
            w._cached_module.plan(*bad)
    w._plan_info = w._cached_module.plan(*args)
    assert w._plan_info.kv_len == tuple(batch.kv_lens)


def test_graph_mode_batch_size_must_match(rng):
    batch = R.paged_batch(rng, [5, 8, 2], HKV, D, 1, dtype=np.float32)
    w = make("numpy", batch, True, True)
    args = tensor_core_args(w, batch.indptr[:3], np.array(batch.kv_lens[:2]), 2, 1)
    with pytest.raises(flashkv.Error, match=r"argument 7 \(batch_size\): 2 differs from the CUDA-graph batch size 3"):
        w._cached_module.plan(*args)
