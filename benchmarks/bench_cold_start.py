"""Time to the first result of an op in a fresh process: cold (empty kernel caches: NVVM compile +
link), cached (the machine-code store written by the cold run; see llmspeed_numba/_kernel_cache)
and cached without the store (numba's own disk cache only). Each measured in a child process,
from interpreter start to the synchronised result of the first call; the cached cases take the
best of two processes."""

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _harness import Results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# op -> (shape label, script computing its first result). warp_tile is one small kernel; gemm's
# 128x128 Tensor Core kernel is a large one, whose NVVM + ptxas compile the cache saves.
SCRIPTS = {
    "warp_tile_matmul": ("16x64x8", """
import numpy as np
from numba import cuda
from llmspeed_numba.ops.warp_tile import warp_tile_matmul
a = cuda.to_device(np.ones((16, 64), np.float16)); b = cuda.to_device(np.ones((64, 8), np.float16))
out = warp_tile_matmul(a, b); cuda.synchronize()
"""),
    "gemm": ("1024x1024x1024 tc", """
import numpy as np
from numba import cuda
import llmspeed_numba as ln
a = cuda.to_device(np.ones((1024, 1024), np.float16))
out = ln.gemm(a, a, backend="tensor_core"); cuda.synchronize()
"""),
    "rms_norm": ("8x4096", """
import numpy as np
from numba import cuda
import llmspeed_numba as ln
x = cuda.to_device(np.ones((8, 4096), np.float16))
out = ln.rms_norm(x, cuda.to_device(np.ones(4096, np.float16))); cuda.synchronize()
"""),
    "flash_attn": ("1x512 h8 d128 causal", """
import numpy as np
from numba import cuda
import llmspeed_numba as ln
q = cuda.to_device(np.ones((1, 512, 8, 128), np.float16))
out = ln.flash_attn(q, q, q, causal=True); cuda.synchronize()
"""),
}
# (numba arrays, so no torch import is timed: torch alone takes ~1 s to import)


def first_result_s(script, cache_dir, store=True):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, LLMSPEED_NUMBA_CACHE=cache_dir,
               LLMSPEED_NUMBA_KERNEL_STORE="1" if store else "0", PYTHONPATH=REPO)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    return time.perf_counter() - start


def main():
    results = Results("cold_start")
    baseline = first_result_s_import_only()
    for op, (shape, script) in SCRIPTS.items():
        with tempfile.TemporaryDirectory() as cache:
            cases = {"cold (empty cache)": first_result_s(script, cache),
                     "cached": min(first_result_s(script, cache) for _ in range(2)),
                     "cached, numba's cache only": min(first_result_s(script, cache, store=False)
                                                       for _ in range(2))}
        for case, s in cases.items():
            print(f"{op:<18} {case:<28} {s:7.2f} s (import numba + cuda init {baseline:.2f} s)")
            results.add("first_result", f"{op} {case}", shape, "float16",
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
