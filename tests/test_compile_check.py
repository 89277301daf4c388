"""Compile-only check, no GPU: every registered kernel is compiled for sm_90a offline and must
keep its Tensor Core / vector instructions in SASS with no local memory (see compile_check.py).

Runs ``python -m llmspeed_numba compile-check`` in child processes without the simulator (this
process has ``NUMBA_ENABLE_CUDASIM=1``), each on half of the registered kernels. They start when
this module is collected, so their minutes of NVVM/ptxas work run beside the simulator tests.
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile

import pytest

#: Child processes: with two cores, two children and the simulator tests share them, so the
#: NVVM/ptxas minutes end about when the tests do instead of a single child running on alone.
CHILDREN = 2


def _start_compile_check():
    import llmspeed_numba  # noqa: F401  (importing the package registers every op's kernels)
    from llmspeed_numba import compile_check

    names = sorted(compile_check.registered())
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.pop("LLMSPEED_NUMBA_PTX_BACKEND", None)
    children = []
    for i in range(CHILDREN):
        stdout = tempfile.TemporaryFile(mode="w+")
        stderr = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmspeed_numba", "compile-check", "--json", "-",
             *names[i::CHILDREN]],
            stdout=stdout, stderr=stderr, text=True, env=env)
        atexit.register(lambda proc=proc: proc.poll() is None and proc.kill())  # deselected
        children.append((proc, stdout, stderr))
    return names, children


_NAMES, _CHILDREN = _start_compile_check()


@pytest.fixture(scope="module")
def reports():
    found = {}
    for proc, stdout, stderr in _CHILDREN:
        returncode = proc.wait(timeout=1800)
        stdout.seek(0)
        stderr.seek(0)
        log = stderr.read()
        if returncode not in (0, 1):
            pytest.fail(f"compile-check crashed:\n{log[-4000:]}")
        part = json.loads(stdout.read())
        found.update((r["name"], r) for r in part)
        # progress (one line per kernel, stderr is not a terminal) and the summary on stderr
        failed = sum(bool(r["problems"]) for r in part)
        assert all(f"] {r['name']} " in log for r in part), log[-2000:]
        assert (f"compile-check: {len(part)} kernels, {len(part) - failed} ok, {failed} failed"
                in log), log[-2000:]
    assert sorted(found) == _NAMES, "a registered kernel was not compiled"
    return found


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
