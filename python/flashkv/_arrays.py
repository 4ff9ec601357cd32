"""Array-library adapters: what the wrappers need from NumPy, PyTorch and CuPy arrays.

The compiled operators take any DLPack array; this module hands them over without a stream
synchronization, finds the caller's CUDA stream, allocates outputs with the caller's library,
and makes the host and int32 copies the planner needs. Index arrays may be int32 or int64.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import numpy as np

from ._flashkv import Error

# flashkv dtype names (what the compiled module's dtype arguments take).
F32, F16, BF16, E4M3, E5M2, I32, I64, U8 = "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "i32", "i64", "u8"
FP8 = (E4M3, E5M2)

_DTYPE_ALIASES = {
    "float32": F32, "float": F32, "f32": F32, "fp32": F32,
    "float16": F16, "half": F16, "f16": F16, "fp16": F16,
    "bfloat16": BF16, "bf16": BF16,
    "float8_e4m3fn": E4M3, "float8_e4m3": E4M3, "fp8_e4m3": E4M3, "e4m3": E4M3,
    "float8_e5m2": E5M2, "fp8_e5m2": E5M2, "e5m2": E5M2,
    "int32": I32, "i32": I32, "int64": I64, "i64": I64,
    "uint8": U8, "u8": U8, "bool": U8,
}


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def framework(x: Any) -> str:
    """'torch', 'cupy' or 'numpy' for an array of that library (else flashkv.Error)."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    raise Error(f"expected a NumPy, PyTorch or CuPy array, got {type(x).__name__}")


def canonical_dtype(spec: Any) -> Optional[str]:
    """A flashkv dtype name for a dtype given as a string, torch dtype or NumPy dtype (None
    passes through)."""
    if spec is None:
        return None
    name = spec if isinstance(spec, str) else str(spec)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in _DTYPE_ALIASES:
        try:
            name = np.dtype(spec).name
        except TypeError:
            pass
    if name not in _DTYPE_ALIASES:
        raise Error(f"unsupported dtype {spec!r}: expected float32/float16/bfloat16/float8_e4m3fn/float8_e5m2")
    return _DTYPE_ALIASES[name]


def dtype_of(x: Any) -> str:
    """The flashkv dtype name of an array."""
    return canonical_dtype(x.dtype)


def device_of(x: Any) -> str:
    """'cpu' or 'cuda:N'."""
    fw = framework(x)
    if fw == "torch":
        return "cpu" if x.device.type == "cpu" else f"cuda:{x.device.index or 0}"
    if fw == "cupy":
        return f"cuda:{x.device.id}"
    return "cpu"


def is_cuda(x: Any) -> bool:
    return device_of(x) != "cpu"


def stream_of(x: Any) -> int:
    """The caller's current CUDA stream on x's device as an integer handle (0 on the CPU)."""
    fw = framework(x)
    if fw == "torch" and x.is_cuda:
        return _torch().cuda.current_stream(x.device).cuda_stream
    if fw == "cupy":
        return _cupy().cuda.get_current_stream().ptr
    return 0


def dl(x: Any) -> Any:
    """x as the compiled module takes it: a DLPack capsule made without a stream
    synchronization (PyTorch, CuPy), or the NumPy array itself. fp8 and bool arrays travel as
    uint8 storage (their dtype is passed separately where it matters)."""
    if x is None:
        return None
    fw = framework(x)
    if fw == "torch":
        torch = _torch()
        if x.dtype in (torch.bool, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
            x = x.view(torch.uint8)
        return torch.utils.dlpack.to_dlpack(x)
    if fw == "cupy":
        if x.dtype == np.bool_:
            x = x.view(np.uint8)
        return x.toDlpack()
    return x


def empty(like: Any, shape: Sequence[int], dtype: Optional[str] = None) -> Any:
    """An uninitialised array of `like`'s library and device; dtype None: like's dtype, else
    'f32' (the only other dtype outputs take)."""
    fw = framework(like)
    if fw == "torch":
        torch = _torch()
        dt = like.dtype if dtype is None else {F32: torch.float32, I32: torch.int32, U8: torch.uint8}[dtype]
        return torch.empty(tuple(shape), dtype=dt, device=like.device)
    dt = like.dtype if dtype is None else {F32: np.float32, I32: np.int32, U8: np.uint8}[dtype]
    if fw == "cupy":
        with like.device:
            return _cupy().empty(tuple(shape), dtype=dt)
    return np.empty(tuple(shape), dtype=dt)


def strides_of(x: Any) -> tuple:
    """x's strides in elements (PyTorch counts elements, NumPy and CuPy bytes)."""
    if framework(x) == "torch":
        return tuple(int(s) for s in x.stride())
    return tuple(int(s) // x.itemsize for s in x.strides)


def contiguous(x: Any) -> Any:
    """x, or a contiguous copy of it."""
    fw = framework(x)
    if fw == "torch":
        return x.contiguous()
    if fw == "cupy":
        return _cupy().ascontiguousarray(x)
    return np.ascontiguousarray(x)


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy view or copy of any array (a device array is copied: a synchronization)."""
    if isinstance(x, (list, tuple, range)):
        return np.asarray(x)
    fw = framework(x)
    if fw == "torch":
        return x.detach().to("cpu").numpy()
    if fw == "cupy":
        return _cupy().asnumpy(x)
    return np.asarray(x)


def to_host_i32(x: Any, name: str) -> np.ndarray:
    """A contiguous NumPy int32 copy (a device array is copied to the host: a synchronization)."""
    a = to_numpy(x)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int32)
    if a.ndim != 1:
        raise Error(f"{name}: expected a 1-D array, got shape {tuple(a.shape)}")
    if a.dtype.kind not in "iu":
        raise Error(f"{name}: expected an int32 or int64 array, got {a.dtype}")
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise Error(f"{name}: values exceed the int32 range")
    return np.ascontiguousarray(a, dtype=np.int32)


def to_device_i32(x: Any, like: Any, non_blocking: bool = True) -> Any:
    """A contiguous int32 array on `like`'s device, in `like`'s library (x itself when it
    already is one)."""
    fw = framework(like)
    if fw == "torch":
        torch = _torch()
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        elif not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        return x.to(device=like.device, dtype=torch.int32, non_blocking=non_blocking).contiguous()
    if fw == "cupy":
        with like.device:
            return _cupy().ascontiguousarray(_cupy().asarray(x), dtype=np.int32)
    if not isinstance(x, (np.ndarray, list, tuple, range)):
        return to_host_i32(x, "indices")
    return np.ascontiguousarray(x, dtype=np.int32)


def to_device_u8(x: Any, like: Any, non_blocking: bool = True) -> Any:
    """A contiguous uint8 copy of a bool/uint8 mask on `like`'s device, flattened."""
    fw = framework(like)
    if fw == "torch":
        torch = _torch()
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        return x.reshape(-1).to(device=like.device, dtype=torch.uint8, non_blocking=non_blocking).contiguous()
    if fw == "cupy":
        with like.device:
            return _cupy().ascontiguousarray(_cupy().asarray(x).reshape(-1), dtype=np.uint8)
    return np.ascontiguousarray(to_numpy(x).reshape(-1), dtype=np.uint8)


def copy_into(dst: Any, src: Any, name: str, non_blocking: bool = True) -> None:
    """dst[:len(src)] = src (dtype converted), in dst's library and on the current stream; a
    copy of an array onto itself is skipped."""
    n = int(src.shape[0]) if hasattr(src, "shape") else len(src)
    if n > int(dst.shape[0]):
        raise Error(f"{name}: {n} entries do not fit the fixed CUDA-graph buffer of {int(dst.shape[0])}")
    fw = framework(dst)
    if fw == "torch":
        torch = _torch()
        if isinstance(src, torch.Tensor) and src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype:
            return
        if not isinstance(src, torch.Tensor):
            src = torch.as_tensor(np.asarray(src))
        dst[:n].copy_(src, non_blocking=non_blocking)
    elif fw == "cupy":
        dst[:n] = _cupy().asarray(src)
    else:
        if isinstance(src, np.ndarray) and src.ctypes.data == dst.ctypes.data and src.dtype == dst.dtype:
            return
        dst[:n] = src if isinstance(src, np.ndarray) else to_host_i32(src, name)
