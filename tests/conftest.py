"""Test configuration: hypothesis profiles and the gpu marker.

Profiles: ``simulator`` (few examples, tiny shapes; the default under NUMBA_ENABLE_CUDASIM=1) and
``gpu`` (many examples, real shapes; the default on a GPU). Both are derandomized: every run
draws the same examples, so on the GPU a warm kernel cache covers them (a new shape or epilogue
is often a new kernel specialisation, a compile of seconds). Tests marked ``gpu`` are skipped
under the simulator and run in the GPU suite:

    python -m pytest -m gpu tests          # on a machine with a CUDA GPU
"""

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from llmspeed_numba import SIMULATOR

settings.register_profile(
    "simulator", max_examples=6, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "gpu", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "simulator" if SIMULATOR else "gpu"))

if SIMULATOR:
    # the tests' own kernels launched straight through numba too (see SIMULATOR_SWITCH_INTERVAL)
    from llmspeed_numba._launch import SIMULATOR_SWITCH_INTERVAL

    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)


def pytest_collection_finish(session):
    # test_compile_check.py's children are waited for at exit only when its tests run
    os.environ["LLMSPEED_COMPILE_CHECK_SELECTED"] = "1" if any(
        item.module.__name__.endswith("test_compile_check") for item in session.items) else "0"


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


def pytest_runtest_logreport(report):
    # LLMSPEED_TEST_OUTCOMES=FILE: one "outcome node_id" line a finished test, appended as it
    # ends, so a GPU suite cut off at a call's time limit resumes with the tests not yet run
    path = os.environ.get("LLMSPEED_TEST_OUTCOMES")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.outcome} {report.nodeid}\n")


@pytest.fixture(autouse=True)
def _fresh_replay_plans():
    """Each test starts without recorded op calls: a test that changes a module knob (a config
    table, a schedule) must not replay launches recorded under another (llmspeed_numba._replay)."""
    from llmspeed_numba import _replay

    _replay.clear()


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name: reproducible, different per test."""
    import numpy as np
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


class BenchmarkData:
    """GPU tests on benchmark shapes (10^8 elements), checked without a float64 reference of the
    whole output (minutes on the host at that size):

    - inputs are drawn on the device (``normal``): drawing them on the host takes seconds;
    - every output element is checked on the device: written (outputs start as NaN) and finite
      (``assert_finite``), and inputs unchanged bit for bit (``assert_same_bits``);
    - the float64 reference runs on a sample of rows (``rows``: the first, the last and 64
      random ones; ``take`` copies them to the host). The ops under test compute each row
      independently with the same code, so a sampled row checks every column position, and a
      fault that moves, drops or corrupts rows leaves NaN or a mismatch in most samples.
    """

    def __init__(self, rng):
        import torch

        self.rng = rng
        self.generator = torch.Generator(device="cuda")
        self.generator.manual_seed(int(rng.integers(2**62)))

    def normal(self, shape, dtype, scale=1.0):
        """A torch CUDA tensor of ``dtype`` ("float16", "bfloat16", "float32"): normal values
        times ``scale``, drawn in fp32 and rounded once (as ``testing.random_array``)."""
        import torch

        x = torch.randn(shape, generator=self.generator, device="cuda", dtype=torch.float32)
        return x.mul_(scale).to(getattr(torch, dtype))

    def rows(self, n, k=64):
        """Sorted distinct row indices: 0, ``n - 1`` and ``k`` random ones."""
        import numpy as np

        picked = self.rng.choice(n, size=min(k, n), replace=False)
        return np.unique(np.concatenate([[0, n - 1], picked]))

    @staticmethod
    def take(x, rows):
        """Host copy of ``x[rows]`` (rows along the first dimension)."""
        import torch

        from llmspeed_numba.testing import host_copy

        return host_copy(x[torch.as_tensor(rows, device=x.device)])

    @staticmethod
    def assert_finite(x, name="output"):
        import torch

        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            first = bad.nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {int(bad.sum())} of {x.numel()} elements not finite "
                                 f"(NaN: never written, or produced), first at {first}")

    @staticmethod
    def assert_same_bits(got, expected, name="array"):
        import torch

        g = got.contiguous().view(torch.uint8)
        e = expected.contiguous().view(torch.uint8)
        if not torch.equal(g, e):
            raise AssertionError(f"{name}: {int((g != e).sum())} bytes differ")


@pytest.fixture
def bench_data(rng):
    """GPU only: a ``BenchmarkData`` seeded from the test's ``rng``."""
    return BenchmarkData(rng)
