import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import devices  # noqa: E402  (after the path insert)


@pytest.fixture
def rng(request):
    """A generator seeded from FLASHKV_TEST_SEED (default 1234) and the test's name."""
    seed = int(os.environ.get("FLASHKV_TEST_SEED", "1234"))
    salt = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.name)) % (1 << 31)
    return np.random.default_rng([seed, salt])


@pytest.fixture(params=devices.NAMES)
def xp(request):
    """Where the test's arrays live (devices.py): "numpy" on the CPU, "torch-cuda" on a GPU
    (skipped, with the reason, where there is none)."""
    return devices.make(request.param)


@pytest.fixture
def workspace(xp):
    return xp.zeros(16 << 20, np.uint8)
