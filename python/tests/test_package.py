"""Package-level checks: the type stub covers the compiled module, errors carry the C++
message, and the SGLang-style example runs."""

import inspect
import os
import re
import runpy

import pytest

import flashkv
from flashkv import _flashkv

HERE = os.path.dirname(os.path.abspath(__file__))


def test_stub_covers_the_compiled_module():
    stub = open(os.path.join(os.path.dirname(_flashkv.__file__), "_flashkv.pyi")).read()
    for name, obj in vars(_flashkv).items():
        if name.startswith("_"):
            continue
        if inspect.isclass(obj):
            assert re.search(rf"^class {name}\b", stub, re.M), f"class {name} missing from _flashkv.pyi"
            for member in vars(obj):
                if not member.startswith("_") and not isinstance(getattr(obj, member), obj):
                    assert re.search(rf"def {member}\b", stub), f"{name}.{member} missing from _flashkv.pyi"
        elif callable(obj):
            assert re.search(rf"^def {name}\(", stub, re.M), f"function {name} missing from _flashkv.pyi"


def test_public_api_has_docstrings():
    for name in flashkv.__all__:
        obj = getattr(flashkv, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"flashkv.{name} has no docstring"


def test_cpp_errors_are_python_exceptions():
    with pytest.raises(flashkv.Error, match="device"):
        _flashkv.Plan("tpu:0")
    with pytest.raises(ValueError):
        flashkv.KVPool(0)
    with pytest.raises(RuntimeError):
        flashkv.KVPool(0)


def test_sglang_style_example_runs():
    pytest.importorskip("torch")
    runpy.run_path(os.path.join(HERE, "..", "examples", "sglang_style_decode.py"), run_name="__main__")


def test_torch_imports_after_flashkv():
    """flashkv loads no library that PyTorch loads too in another version (NCCL): `import torch`
    after `import flashkv` works. A fresh interpreter, since this one may have torch already."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    r = subprocess.run([sys.executable, "-c", "import flashkv, torch; print(torch.__version__)"],
                       capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
