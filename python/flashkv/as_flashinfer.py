"""flashkv under the name ``flashinfer``, for programs written against FlashInfer that are not
to be edited.

In a process::

    import flashkv
    flashkv.install_as_flashinfer()
    import flashinfer                      # flashkv
    from flashinfer.decode import _get_range_buf

From the command line, for an unmodified program (a script or, with -m, a module)::

    python -m flashkv.as_flashinfer serve.py --port 30000
    python -m flashkv.as_flashinfer -m sglang.launch_server --model-path ...

The runner also makes ``import flashinfer`` resolve to flashkv in the Python processes that the
program starts (multiprocessing workers, subprocesses): it puts a directory holding a one-line
``flashinfer`` package that installs the alias first on their PYTHONPATH.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence

from ._flashkv import Error

ALIAS = "flashinfer"
# flashkv's modules that FlashInfer has under the same name.
SUBMODULES = ("decode", "prefill", "cascade", "page")


def _flashkv():
    import flashkv
    return flashkv


def is_installed() -> bool:
    """Whether ``flashinfer`` currently resolves to flashkv in this process."""
    return sys.modules.get(ALIAS) is _flashkv()


def install_as_flashinfer(force: bool = False) -> None:
    """Registers flashkv as ``flashinfer`` (and ``flashinfer.decode``, ``.prefill``, ``.cascade``,
    ``.page``) for the whole process, so ``import flashinfer`` and
    ``importlib.util.find_spec("flashinfer")`` find flashkv. Idempotent.

    Args:
        force: replace a different ``flashinfer`` module that is already imported (its
            submodules included). Without it that case raises flashkv.Error, since code that
            already holds the other module would keep using it.
    """
    if not isinstance(force, bool):
        raise Error(f"force: expected a bool, got {type(force).__name__}")
    pkg = _flashkv()
    current = sys.modules.get(ALIAS)
    if getattr(current, "__flashkv_alias__", False):  # the runner's own package, being imported
        current = None
    if current is not None and current is not pkg:
        if not force:
            where = getattr(current, "__file__", None) or repr(current)
            raise Error(f"install_as_flashinfer: a different 'flashinfer' module is already imported ({where}); "
                        "install the alias before anything imports flashinfer, or pass force=True to replace it")
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
            del sys.modules[name]
    sys.modules[ALIAS] = pkg
    for sub in SUBMODULES:
        module = getattr(pkg, sub, None)
        if module is None:  # not part of this flashkv
            continue
        sys.modules[f"{ALIAS}.{sub}"] = module


_SHIM_DIR: Optional[str] = None


def _shim_dir() -> str:
    """A directory with a ``flashinfer`` package whose import installs the alias (for child
    processes), made once per process and removed at exit."""
    global _SHIM_DIR
    if _SHIM_DIR is None:
        root = tempfile.mkdtemp(prefix="flashkv-as-flashinfer-")
        os.makedirs(os.path.join(root, ALIAS))
        with open(os.path.join(root, ALIAS, "__init__.py"), "w", encoding="utf-8") as f:
            f.write("# Resolves 'flashinfer' to flashkv (written by python -m flashkv.as_flashinfer).\n"
                    "__flashkv_alias__ = True\nimport flashkv\nflashkv.install_as_flashinfer()\n")
        atexit.register(shutil.rmtree, root, True)
        _SHIM_DIR = root
    return _SHIM_DIR


def _usage() -> str:
    return ("usage: python -m flashkv.as_flashinfer <script.py> [args...]\n"
            "       python -m flashkv.as_flashinfer -m <module> [args...]\n"
            "Runs a program with 'import flashinfer' resolving to flashkv.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The runner: installs the alias (here and for child processes), then runs the script or
    module with the remaining arguments as its sys.argv."""
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    module = None
    if args[0] == "-m":
        if len(args) < 2:
            print("flashkv.as_flashinfer: -m needs a module name\n" + _usage(), file=sys.stderr)
            return 2
        module, rest = args[1], args[2:]
    else:
        script, rest = args[0], args[1:]
        if not os.path.isfile(script):
            print(f"flashkv.as_flashinfer: no such script: {script}\n" + _usage(), file=sys.stderr)
            return 2
    install_as_flashinfer()
    shim = _shim_dir()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = shim if not old else shim + os.pathsep + old
    if module is not None:
        sys.argv = [module] + rest
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script] + rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
