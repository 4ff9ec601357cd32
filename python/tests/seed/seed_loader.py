"""Finds SGLang's FlashInfer backend file (the seed) outside the repository, checks that it is
the expected file, and loads fresh module objects from it, unmodified.

The seed is third-party code (SGLang, Apache-2.0) and is never copied into this repository: it
is read from ``<repo>/../shared/seed/flashinfer_backend.py`` or from the path in
FLASHKV_SEED_PATH.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from typing import Optional

SEED_SHA256 = "f4040706f6bee043ddb3d2cedf4f765ae09b8b0e8cb4d78a97f2fe32399810f0"
SEED_MODULE = "sglang.srt.layers.attention.flashinfer_backend"
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def seed_path() -> str:
    return os.environ.get("FLASHKV_SEED_PATH") or os.path.join(REPO_ROOT, "..", "shared", "seed",
                                                               "flashinfer_backend.py")


class SeedMissing(Exception):
    """The file is not there (a clone without ../shared): the suite skips."""


class SeedMismatch(Exception):
    """The file is there but is not the expected one: the suite fails."""


_code = None


def seed_code():
    """The compiled seed, after the sha256 check (cached per process)."""
    global _code
    if _code is None:
        path = os.path.abspath(seed_path())
        if not os.path.isfile(path):
            raise SeedMissing(f"the seed {path} is absent (set FLASHKV_SEED_PATH, or clone with ../shared)")
        with open(path, "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SEED_SHA256:
            raise SeedMismatch(f"{path}: sha256 {digest}, expected {SEED_SHA256}: not the seed this suite checks")
        _code = compile(data, path, "exec")
    return _code


def load(name: Optional[str] = None) -> types.ModuleType:
    """A fresh module from the seed (its module globals, such as the shared workspace buffer,
    start anew). The sglang stand-ins and the ``flashinfer`` alias must be in sys.modules."""
    code = seed_code()
    name = name or SEED_MODULE
    module = types.ModuleType(name)
    module.__file__ = code.co_filename
    sys.modules[name] = module  # dataclasses look the module up while the file runs
    exec(code, module.__dict__)
    return module
