"""Compile-only check, no GPU: every registered kernel is compiled for sm_90a offline and must
keep its Tensor Core / vector instructions in SASS with no local memory (see compile_check.py).

Runs ``python -m llmspeed_numba compile-check`` in a child process without the simulator (this
process has ``NUMBA_ENABLE_CUDASIM=1``). The child starts when this module is collected, so its
minutes of NVVM/ptxas work run on the second core while the simulator tests run.
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile

import pytest


def _start_compile_check():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.pop("LLMSPEED_NUMBA_PTX_BACKEND", None)
    stdout = tempfile.TemporaryFile(mode="w+")
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "llmspeed_numba", "compile-check"],
                            stdout=stdout, stderr=stderr, text=True, env=env)
    atexit.register(lambda: proc.poll() is None and proc.kill())  # deselected: don't linger
    return proc, stdout, stderr


_CHILD = _start_compile_check()


@pytest.fixture(scope="module")
def reports():
    proc, stdout, stderr = _CHILD
    returncode = proc.wait(timeout=1800)
    stdout.seek(0)
    stderr.seek(0)
    if returncode not in (0, 1):
        pytest.fail(f"compile-check crashed:\n{stderr.read()[-4000:]}")
    return {r["name"]: r for r in json.loads(stdout.read())}


def test_warp_tile_kernel_is_registered(reports):
    assert {"warp_tile_f16", "warp_tile_bf16"} <= set(reports)
    assert reports["warp_tile_f16"]["sass_found"]["HMMA"] > 0


def test_each_op_registers_its_kernels(reports):
    prefixes = ("gemm_tc", "gemm_simt", "flash_attn_tc", "paged_decode", "rms_norm",
                "layer_norm", "softmax", "argmax", "rotary", "silu_and_mul")
    missing = [p for p in prefixes if not any(name.startswith(p) for name in reports)]
    assert not missing, f"no compile-check registered for {missing}; have {sorted(reports)}"


def test_every_registered_kernel_is_clean(reports):
    problems = {name: r["problems"] for name, r in reports.items() if r["problems"]}
    assert not problems, json.dumps(problems, indent=1)
