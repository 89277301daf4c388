"""The command line: ``info`` reports the target; ``demo`` runs and checks ops, and on a machine
without a GPU restarts itself in the simulator (so the README's first command works anywhere)."""

import os
import subprocess
import sys


def _run(*args, simulator_env):
    env = dict(os.environ)
    if not simulator_env:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, "-m", "llmspeed_numba", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_info_names_the_target():
    proc = _run("info", simulator_env=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "numba-cuda:" in proc.stdout and "target:" in proc.stdout


def test_demo_checks_ops_on_whatever_target_exists():
    proc = _run("demo", "warp_tile", simulator_env=False)  # no GPU: it must re-run itself
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "warp_tile_matmul float16" in proc.stdout and "0 failure(s)" in proc.stdout


def test_unknown_command_is_refused():
    proc = _run("frobnicate", simulator_env=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
