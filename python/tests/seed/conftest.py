"""Fixtures of the seed suite: the seed module with the sglang stand-ins and ``flashinfer``
resolving to flashkv, for one test (sys.modules is restored afterwards), and the device."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import seed_loader  # noqa: E402


def _seed_problem():
    try:
        seed_loader.seed_code()
    except seed_loader.SeedMissing as e:
        return "skip", str(e)
    except seed_loader.SeedMismatch as e:
        return "fail", str(e)
    return None, None


@pytest.fixture(scope="session")
def seed_code():
    kind, why = _seed_problem()
    if kind == "skip":
        pytest.skip(why)
    if kind == "fail":
        pytest.fail(why)
    return seed_loader.seed_code()


@pytest.fixture
def sglang_env(monkeypatch):
    """sglang.* stand-ins and flashinfer -> flashkv in sys.modules for this test only."""
    torch = pytest.importorskip("torch")  # noqa: F841
    import flashkv
    import sglang_standins

    saved = {n: m for n, m in sys.modules.items()
             if n == "sglang" or n.startswith("sglang.") or n == "flashinfer" or n.startswith("flashinfer.")}
    for n in saved:
        del sys.modules[n]
    monkeypatch.setenv("SGLANG_ENABLE_TORCH_COMPILE", "0")
    monkeypatch.delenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", raising=False)
    monkeypatch.delenv("SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", raising=False)
    monkeypatch.delenv("SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE", raising=False)
    sys.modules.update(sglang_standins.modules())
    flashkv.install_as_flashinfer()
    try:
        yield sglang_standins
    finally:
        for n in [n for n in sys.modules
                  if n == "sglang" or n.startswith("sglang.") or n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[n]
        sys.modules.update(saved)


@pytest.fixture
def seed(seed_code, sglang_env):
    """A fresh seed module (loaded unmodified from ../shared/seed/)."""
    return seed_loader.load()


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    torch = pytest.importorskip("torch")
    import flashkv

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("cuda: PyTorch sees no CUDA GPU")
        if not flashkv.built_with_cuda() or not flashkv.cuda_available():
            pytest.skip("cuda: this flashkv was built without CUDA or sees no GPU")
    return request.param
