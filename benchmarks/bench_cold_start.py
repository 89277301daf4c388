"""Time to the first result of an op in a fresh process: cold (empty kernel cache: NVVM compile +
link) and cached (the on-disk cache written by the cold run). Each measured in a child process,
from interpreter start to the synchronised result of the first call."""

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _harness import Results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import numpy as np
from numba import cuda
from llmspeed_numba.ops.warp_tile import warp_tile_matmul
a = cuda.to_device(np.ones((16, 64), np.float16)); b = cuda.to_device(np.ones((64, 8), np.float16))
out = warp_tile_matmul(a, b); cuda.synchronize()
"""


def first_result_s(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=REPO)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True)
    return time.perf_counter() - start


def main():
    results = Results("cold_start")
    with tempfile.TemporaryDirectory() as cache:
        cold = first_result_s(cache)
        cached = first_result_s(cache)
    baseline = first_result_s_import_only()
    for case, s in (("cold (empty cache)", cold), ("cached", cached)):
        results.add("first_result", case, "warp_tile_matmul 16x64x8", "float16",
                    {"median": s * 1e3, "p20": s * 1e3, "p80": s * 1e3},
                    "import numba + cuda init", {"median": baseline * 1e3}, "ms", s * 1e3,
                    baseline * 1e3)
    print("path written:", results.write())


def first_result_s_import_only():
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from numba import cuda; cuda.to_device([1.0]); "
                    "cuda.synchronize()"], check=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
