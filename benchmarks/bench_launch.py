"""Python-side cost of one op call: the library's raw launch path against numba's own dispatch.

Same near-empty kernel, same arrays, same process. "Host time per call" is the time the calling
thread spends per call, measured over bursts of calls short enough that the launch queue never
fills (so the GPU's own per-kernel time does not throttle the host), median over bursts. Also a
whole op call (validation, output allocation, launch) of ``warp_tile_matmul`` with numba arrays
and with torch tensors.
"""

import sys
import time

import numpy as np
from numba import types

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from llmspeed_numba._arrays import as_tensor, kernel_buffer  # noqa: E402
from llmspeed_numba._env import cuda  # noqa: E402
from llmspeed_numba._launch import Kernel, array1d, jit  # noqa: E402
from llmspeed_numba.ops.warp_tile import warp_tile_matmul  # noqa: E402

from _harness import Results  # noqa: E402

CALLS = 3000
BURST = 200     # launches per timed burst: well under the driver's queue depth
BURSTS = 15


def per_call_us(fn):
    """Median host time per call (us) over bursts of BURST calls, synchronising between bursts."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(BURSTS):
        cuda.synchronize()
        start = time.perf_counter()
        for _ in range(BURST):
            fn()
        samples.append((time.perf_counter() - start) / BURST * 1e6)
    cuda.synchronize()
    samples.sort()
    return samples[len(samples) // 2]


def _touch(x, n):
    if cuda.grid(1) < n:
        x[0] = x[0]


def main():
    import torch

    results = Results("launch")
    dispatcher = cuda.jit(_touch)
    kernel = Kernel(jit(_touch), (array1d(np.float32), types.int32), "touch")
    x_nb = cuda.to_device(np.ones(16, np.float32))
    x_torch = torch.ones(16, device="cuda")
    buf = kernel_buffer(as_tensor(x_nb, "x"))

    rows = {
        "raw Kernel launch (prepared buffer)": per_call_us(lambda: kernel(1, 32, (buf, 0))),
        "raw Kernel launch + as_tensor(torch)": per_call_us(
            lambda: kernel(1, 32, (kernel_buffer(as_tensor(x_torch, "x")), 0))),
        "numba dispatch, numba array": per_call_us(lambda: dispatcher[1, 32](x_nb, 0)),
        "numba dispatch, torch tensor": per_call_us(lambda: dispatcher[1, 32](x_torch, 0)),
    }
    a_nb = cuda.to_device(np.ones((16, 16), np.float16))
    b_nb = cuda.to_device(np.ones((16, 8), np.float16))
    out_nb = cuda.device_array((16, 8), np.float32)
    a_t, b_t = torch.ones(16, 16, device="cuda", dtype=torch.half), torch.ones(
        16, 8, device="cuda", dtype=torch.half)
    out_t = torch.empty(16, 8, device="cuda")
    rows["op call warp_tile_matmul, numba arrays, out="] = per_call_us(
        lambda: warp_tile_matmul(a_nb, b_nb, out=out_nb))
    rows["op call warp_tile_matmul, torch, out="] = per_call_us(
        lambda: warp_tile_matmul(a_t, b_t, out=out_t))
    rows["op call warp_tile_matmul, torch, allocating"] = per_call_us(
        lambda: warp_tile_matmul(a_t, b_t))

    from llmspeed_numba._arrays import stream_handle
    from llmspeed_numba._launch import PreparedLaunch, _libcuda

    # Floors: what one bare driver call costs from Python on this host (both entry points, every
    # argument ready), and what torch's own C++ launch path costs for a one-kernel op.
    prepared = PreparedLaunch(kernel, 1, 32, (buf, 16))
    _, _, config_address, params_address, _ = prepared._site()
    launch_ex, handle = prepared._launch, prepared.handle
    launch = _libcuda()
    floors = {
        "python no-op call": lambda: None,
        "ctypes cuLaunchKernel, args ready": lambda: launch(
            handle, 1, 1, 1, 32, 1, 1, 0, 0, params_address, None),
        "ctypes cuLaunchKernelEx, args ready": lambda: launch_ex(
            config_address, handle, params_address, None),
        "PreparedLaunch replay": lambda: prepared((buf.ptr,), 0),
        "torch x.add_(1) (C++ launch)": lambda: x_torch.add_(1),
        "torch.empty(16, 8)": lambda: torch.empty(16, 8, device="cuda"),
    }
    for label, fn in floors.items():
        print(f"floor {label:<40} {per_call_us(fn):7.2f} us")

    t = as_tensor(x_torch, "x")
    for label, fn in (("as_tensor(torch)", lambda: as_tensor(x_torch, "x")),
                      ("as_tensor(numba)", lambda: as_tensor(x_nb, "x")),
                      ("stream_handle(torch)", lambda: stream_handle(None, (t,))),
                      ("kernel_buffer", lambda: kernel_buffer(t)),
                      ("torch.empty", lambda: torch.empty(16, 8, device="cuda"))):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        print(f"component {label:<24} {(time.perf_counter() - start) / CALLS * 1e6:7.2f} us")

    base_nb = rows["numba dispatch, numba array"]
    base_t = rows["numba dispatch, torch tensor"]
    for name, us in rows.items():
        base_name, base = ("numba dispatch torch", base_t) if "torch" in name else (
            "numba dispatch numba", base_nb)
        results.add("launch", name, "1 block x 32", "-", {"median": us / 1e3, "p20": us / 1e3,
                                                           "p80": us / 1e3},
                    base_name, {"median": base / 1e3}, "us", us, base)
    print("path written:", results.write())


if __name__ == "__main__":
    main()
