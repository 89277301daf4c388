"""Compile-only check, no GPU: every registered kernel is compiled for sm_90a offline and must
keep its Tensor Core / vector instructions in SASS with no local memory (see compile_check.py).

Runs ``python -m llmspeed_numba compile-check`` in a child process without the simulator, since
this test process may have ``NUMBA_ENABLE_CUDASIM=1`` set.
"""

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.pop("LLMSPEED_NUMBA_PTX_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "llmspeed_numba", "compile-check"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode not in (0, 1):
        pytest.fail(f"compile-check crashed:\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in json.loads(proc.stdout)}


def test_warp_tile_kernel_is_registered(reports):
    assert {"warp_tile_f16", "warp_tile_bf16"} <= set(reports)
    assert reports["warp_tile_f16"]["sass_found"]["HMMA"] > 0


def test_every_registered_kernel_is_clean(reports):
    problems = {name: r["problems"] for name, r in reports.items() if r["problems"]}
    assert not problems, json.dumps(problems, indent=1)
