"""Where a test's arrays live: every wrapper test takes the `xp` fixture (conftest.py) and runs
once per value of it: "numpy" and "torch-cpu" (the CPU kernels, reached through NumPy arrays and
through PyTorch tensors) and "torch-cuda" (PyTorch tensors on a CUDA GPU, the CUDA kernels).

Tests build their inputs with NumPy, move what the wrappers read (inputs, caches, index arrays,
workspace buffers, masks) to the device with `xp.put`, bring results back with `xp.get`, and
compare against the float64 reference on the NumPy inputs.

The CUDA attention kernels take bf16/f16 inputs only (tensor cores; cuda/decode.cu and
cuda/prefill.cu reject f32), so attention inputs are made in `xp.float`: float32 on the CPU,
float16 on CUDA. float16 is NumPy's own, so the reference reads exactly the values the kernels
read; tolerances follow the output's dtype (reference.bounds). Merges and KV writes take
float32 everywhere (their CUDA kernels take it).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

import flashkv
import reference as R

NAMES = ("numpy", "torch-cpu", "torch-cuda")


class NumpyArrays:
    """Arrays stay NumPy arrays: put and get are the identity (no copies), so a test that
    changes a buffer in place changes what the wrapper reads."""

    name = "numpy"
    float = np.float32
    is_cuda = False
    device = "cpu"
    framework = "numpy"

    def put(self, a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return type(a)(self.put(x) for x in a)
        return a

    def get(self, x: Any) -> Any:
        if x is None:
            return None
        if isinstance(x, (tuple, list)):
            return type(x)(self.get(y) for y in x)
        return np.asarray(x)

    def zeros(self, shape: Any, dtype: Any) -> Any:
        return self.put(np.zeros(shape, dtype))

    def assert_close(self, out: Any, lse: Any, ref_out: Any, ref_lse: Any, tol: Optional[float] = None,
                     lse_tol: Optional[float] = None) -> None:
        """R.assert_close on the outputs brought back, with the bounds of out's dtype unless given."""
        R.assert_close(self.get(out), self.get(lse), ref_out, ref_lse, tol, lse_tol)


class TorchArrays(NumpyArrays):
    """PyTorch tensors on the CPU or the current CUDA device (same dtype as the NumPy arrays; on
    the CPU they may share the NumPy arrays' memory, as NumpyArrays does)."""

    framework = "torch"

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch = torch
        self.is_cuda = cuda
        self.name = "torch-cuda" if cuda else "torch-cpu"
        self.device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        self.float = np.float16 if cuda else np.float32

    def put(self, a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return type(a)(self.put(x) for x in a)
        if isinstance(a, self.torch.Tensor):
            return a.to(self.device)
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def get(self, x: Any) -> Any:
        if isinstance(x, self.torch.Tensor):
            return x.detach().cpu().numpy()
        return super().get(x)


def make(name: str) -> NumpyArrays:
    """The arrays of one parametrization; skips (with the reason) what this machine cannot run."""
    import pytest

    if name == "numpy":
        return NumpyArrays()
    assert name in ("torch-cpu", "torch-cuda"), name
    try:
        import torch
    except ImportError:
        pytest.skip(f"{name}: PyTorch is not installed")
    if name == "torch-cpu":
        return TorchArrays(torch, cuda=False)
    if not torch.cuda.is_available():
        pytest.skip("torch-cuda: PyTorch sees no CUDA GPU")
    if not flashkv.built_with_cuda():
        pytest.skip("torch-cuda: this flashkv was built without CUDA (FLASHKV_CUDA=OFF)")
    if not flashkv.cuda_available():
        pytest.skip("torch-cuda: flashkv sees no CUDA GPU")
    return TorchArrays(torch, cuda=True)
