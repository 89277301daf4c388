"""Test configuration: hypothesis profiles and the gpu marker.

Profiles: ``simulator`` (few examples, tiny shapes; the default under NUMBA_ENABLE_CUDASIM=1) and
``gpu`` (many examples, real shapes; the default on a GPU). Tests marked ``gpu`` are skipped
under the simulator and run in the GPU suite:

    python -m pytest -m gpu tests          # on a machine with a CUDA GPU
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from llmspeed_numba import SIMULATOR

settings.register_profile(
    "simulator", max_examples=6, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "gpu", max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "simulator" if SIMULATOR else "gpu"))


def pytest_collection_modifyitems(config, items):
    # The compile check's child process starts at collection and compiles on the second core;
    # its tests wait for it, so they run last, after the simulator tests.
    items.sort(key=lambda item: item.module.__name__.endswith("test_compile_check"))
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: part of the GPU suite (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name: reproducible, different per test."""
    import numpy as np
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
