"""Command line: ``python -m llmspeed_numba {info,demo,compile-check}``."""

import os
import sys


def _rerun_in_simulator(argv):
    """numba picks the simulator at import, from the environment: on a machine without a GPU,
    start this command again with ``NUMBA_ENABLE_CUDASIM=1``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    os.execve(sys.executable, [sys.executable, "-m", "llmspeed_numba", *argv], env)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else "demo"
    if command == "info":
        from ._info import print_info

        print_info()
        return 0
    if command == "demo":
        from ._env import SIMULATOR, have_gpu

        if not SIMULATOR and not have_gpu():
            _rerun_in_simulator(argv or ["demo"])
        from ._demo import run_demo

        return run_demo(argv[1:])
    if command == "compile-check":
        from .compile_check import main as compile_check_main

        return compile_check_main(argv[1:])
    print(f"usage: python -m llmspeed_numba {{info,demo,compile-check}}; got {command!r}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
