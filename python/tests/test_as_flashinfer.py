"""flashkv under the name flashinfer: install_as_flashinfer() and the
`python -m flashkv.as_flashinfer` runner."""

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest

import flashkv


@pytest.fixture
def clean_alias():
    """Removes every flashinfer module before the test and restores the previous ones after."""
    saved = {n: m for n, m in sys.modules.items() if n == "flashinfer" or n.startswith("flashinfer.")}
    for n in saved:
        del sys.modules[n]
    yield
    for n in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        del sys.modules[n]
    sys.modules.update(saved)


def test_import_flashinfer_resolves_to_flashkv(clean_alias):
    flashkv.install_as_flashinfer()
    import flashinfer
    assert flashinfer is flashkv
    for sub in ("decode", "prefill", "cascade", "page"):
        assert importlib.import_module(f"flashinfer.{sub}") is getattr(flashkv, sub)
    from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    from flashinfer.cascade import merge_state
    assert BatchDecodeWithPagedKVCacheWrapper is flashkv.BatchDecodeWithPagedKVCacheWrapper
    assert merge_state is flashkv.merge_state
    assert importlib.util.find_spec("flashinfer") is not None
    assert flashkv.as_flashinfer.is_installed()
    flashkv.install_as_flashinfer()  # idempotent
    assert sys.modules["flashinfer"] is flashkv


def test_unknown_submodule_is_not_found(clean_alias):
    flashkv.install_as_flashinfer()
    with pytest.raises(ImportError):
        importlib.import_module("flashinfer.no_such_module")


def test_refuses_a_different_flashinfer_unless_forced(clean_alias):
    other = types.ModuleType("flashinfer")
    other_sub = types.ModuleType("flashinfer.sampling")
    sys.modules["flashinfer"] = other
    sys.modules["flashinfer.sampling"] = other_sub
    with pytest.raises(flashkv.Error, match="different 'flashinfer' module is already imported.*force=True"):
        flashkv.install_as_flashinfer()
    assert sys.modules["flashinfer"] is other  # left as it was
    flashkv.install_as_flashinfer(force=True)
    assert sys.modules["flashinfer"] is flashkv
    assert "flashinfer.sampling" not in sys.modules  # the other package's submodules go with it


def test_force_must_be_a_bool(clean_alias):
    with pytest.raises(flashkv.Error, match="force: expected a bool"):
        flashkv.install_as_flashinfer(force="yes")
    assert "flashinfer" not in sys.modules


PROGRAM = textwrap.dedent("""
    import importlib.util, subprocess, sys
    assert importlib.util.find_spec("flashinfer") is not None
    import flashinfer
    from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    print("main", flashinfer.__name__, BatchDecodeWithPagedKVCacheWrapper.__module__, sys.argv[1:], __name__)
    child = ("import importlib.util; assert importlib.util.find_spec('flashinfer') is not None; "
             "import flashinfer, flashinfer.prefill; print('child', flashinfer.__name__, flashinfer.prefill.__name__)")
    print(subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True).stdout.strip())
""")


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "flashkv.as_flashinfer", *args], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ), timeout=120)


def test_runner_runs_an_unmodified_script_and_its_children(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    r = _run([str(script), "--port", "7"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "main flashkv flashkv.decode ['--port', '7'] __main__"
    assert lines[1] == "child flashkv flashkv.prefill"


def test_runner_runs_a_module(tmp_path):
    (tmp_path / "progmod.py").write_text(PROGRAM)
    r = _run(["-m", "progmod", "x"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["main flashkv flashkv.decode ['x'] __main__", "child flashkv flashkv.prefill"]


def test_runner_bad_arguments(tmp_path):
    r = _run([], tmp_path)
    assert r.returncode == 2 and "usage: python -m flashkv.as_flashinfer" in r.stderr
    r = _run([str(tmp_path / "missing.py")], tmp_path)
    assert r.returncode == 2 and "no such script" in r.stderr
    r = _run(["-m"], tmp_path)
    assert r.returncode == 2 and "-m needs a module name" in r.stderr
