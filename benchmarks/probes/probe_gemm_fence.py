"""Does the proxy fence drain the wgmma GEMM's cp.async prefetch? (issue 20; NOTES, session 21)

ptxas compiles ``fence.proxy.async.shared::cta`` to ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``.
The plain few-row loop runs it in every thread each K tile while that thread's copies of later
tiles are in flight. Run once as is (``fence``) and once with ``ptx.fence_proxy_async`` replaced
by nothing before any kernel compiles (``nofence``: wgmma may then read tiles that are not yet
visible to it, so results are not checked; timing only), each in a fresh process with the kernel
caches off. If ``nofence`` is much faster, the fence drains the pipeline, and a loop whose copying
threads never fence (the producer form of ``_gemm_wgmma``) is the way out; both forms are timed.

    python benchmarks/probes/probe_gemm_fence.py fence|nofence [compile|time]

With ``FENCE_CACHE_ROOT`` set, each variant keeps its caches under ``$FENCE_CACHE_ROOT/<variant>``
so that ``compile`` (every tile once, untimed; variants in parallel) and ``time`` (alone on the
GPU) can run as two processes.
"""
import os
import sys
import tempfile

VARIANT = sys.argv[1]
STAGE = sys.argv[2] if len(sys.argv) > 2 else "all"
assert VARIANT in ("fence", "nofence") and STAGE in ("all", "compile", "time"), sys.argv
# machine code of this variant only: the two compile the same kernel source to different code
ROOT = os.environ.get("FENCE_CACHE_ROOT")
for var, sub in (("LLMSPEED_NUMBA_CACHE", "library"), ("NUMBA_CACHE_DIR", "numba")):
    os.environ[var] = os.path.join(ROOT, VARIANT, sub) if ROOT else tempfile.mkdtemp()
    os.makedirs(os.environ[var], exist_ok=True)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import graphed, time_gpu  # noqa: E402

from llmspeed_numba import gemm, ptx  # noqa: E402
from llmspeed_numba._env import cuda  # noqa: E402

if VARIANT == "nofence":
    ptx.fence_proxy_async = cuda.jit(device=True, inline="always")(lambda: None)

SHAPES = ((64, 4096, 4096), (128, 4096, 4096), (64, 14336, 4096), (256, 4096, 4096))
TILES = ("wg_64x64x64_s8_k1", "wg_64x64x64_s8_p_k1", "wg_64x128x64_s8_k1",
         "wg_64x128x64_s8_p_k1", "wg_128x128x64_s5_k1", "wg_128x128x64_s5_p_k1")
if STAGE == "compile":
    M, N, K = SHAPES[0]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    for tile in TILES:
        gemm(x, w.T, config=tile)
    torch.cuda.synchronize()
    print(f"{VARIANT}: {len(TILES)} tiles compiled")
    sys.exit(0)
for M, N, K in SHAPES:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = x @ w.T
    cublas = time_gpu(graphed(lambda: torch.matmul(x, w.T, out=out)))["median"]
    line = [f"{VARIANT} {M}x{N}x{K}: cuBLAS {1e3 * cublas:.1f} us"]
    for tile in TILES:
        fn = lambda: gemm(x, w.T, out=out, config=tile)  # noqa: E731
        fn()
        err = (out.float() - ref.float()).abs().max().item()
        t = time_gpu(graphed(fn))["median"]
        line.append(f"{tile} {1e3 * t:.1f} us (err {err:.1e})")
    print("; ".join(line), flush=True)
