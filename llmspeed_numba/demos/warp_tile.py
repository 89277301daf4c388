"""Demo of the one-warp Tensor Core tile product (the PTX op layer's self-test)."""

import numpy as np

from ._case import DemoCase, time_call
from ..ops.warp_tile import warp_tile_matmul
from ..testing import f64, random_array, to_device


def cases(on_gpu):
    k_total = 4096 if on_gpu else 32
    rng = np.random.default_rng(0)

    def run(dtype):
        a_host = random_array((16, k_total), dtype, rng)
        b_host = random_array((k_total, 8), dtype, rng)
        a, b = to_device(a_host), to_device(b_host)
        expected = f64(a_host) @ f64(b_host)
        got = f64(warp_tile_matmul(a, b))
        # fp32 accumulation of exact products: error grows like sqrt(K) * eps32 * |a||b|
        tol = 4 * np.sqrt(k_total) * np.finfo(np.float32).eps * (
            np.abs(f64(a_host)) @ np.abs(f64(b_host))).max()
        seconds = time_call(lambda: warp_tile_matmul(a, b), on_gpu)
        return float(np.abs(got - expected).max()), float(tol), seconds

    return [DemoCase(f"warp_tile_matmul {dt}", f"16x{k_total} @ {k_total}x8",
                     lambda dt=dt: run(dt)) for dt in ("float16", "bfloat16")]


