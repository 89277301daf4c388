"""Python share of a replayed op call, without a GPU (issue 18): the host time of each
``bench_host.py`` call (same ops, shapes and arguments) on the repeated-call fast path
(``_replay.OpCalls`` + ``_launch.PreparedLaunch``), with the driver's
``cuLaunchKernelEx`` replaced by a C function that returns 0 (so ctypes still converts the four
arguments; what the driver itself costs is bench_host's "cuLaunchKernelEx floor" on a GPU host).

Nothing here runs a kernel. To record a plan, each op's checked path runs once on a fake device:
torch CPU tensors stand for CUDA tensors (``is_cuda`` not checked, device -1, torch's current
stream a constant), host NumPy memory behind a numba-like device array class stands for numba
device arrays, kernels get a dummy handle instead of being compiled, and device attributes are an
H200's. Every op's checks still run when it records (bad input still raises there), and the probe
checks that every timed call replayed (its checked path never ran again).

    python benchmarks/probes/probe_replay_host.py [--ops rms_norm,sample] [--kinds torch,numba]
        [--repeat 7] [--profile]

Prints per op and kind the median over ``--repeat`` runs of the best burst's us per call (this
thread's CPU time), and with ``--profile`` a cProfile of each op's torch call (top functions by
own time). numba "allocating" rows allocate host memory here (a fake ``cuda.device_array``):
not numba's cost.
Do not set NUMBA_ENABLE_CUDASIM (the simulator has no replay path).
"""

import argparse
import contextlib
import cProfile
import ctypes
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("probe_replay_host: unset NUMBA_ENABLE_CUDASIM (the simulator never replays)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))                  # benchmarks/ (bench_host)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmspeed_numba import _arrays, _env, _launch, _replay  # noqa: E402
from llmspeed_numba import paged_cache  # noqa: E402

# ---- the fake device --------------------------------------------------------------------------

H200 = {"MULTIPROCESSOR_COUNT": 132, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
        "MAX_THREADS_PER_BLOCK": 1024, "WARP_SIZE": 32, "MAX_SHARED_MEMORY_PER_BLOCK": 49152,
        "MAX_REGISTERS_PER_BLOCK": 65536, "MAX_THREADS_PER_MULTI_PROCESSOR": 2048,
        "L2_CACHE_SIZE": 60 * 2**20, "COMPUTE_CAPABILITY_MAJOR": 9,
        "COMPUTE_CAPABILITY_MINOR": 0, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
        "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024}
STREAM = 0x5000  # torch's "current stream" handle


class FakeDeviceArray:
    """A numba device array's interface over host memory (``replay_key`` and ``as_tensor`` read
    it as they read ``DeviceNDArray``: module ``numba...``, ``device_ctypes_pointer``)."""

    __module__ = "numba.probe_fake"

    def __init__(self, host):
        self.host = host
        self.shape, self.strides, self.dtype = host.shape, host.strides, host.dtype
        self.size, self.nbytes = host.size, host.nbytes
        self.gpu_data = types.SimpleNamespace(context=FAKE_CONTEXT)

    @property
    def device_ctypes_pointer(self):
        return ctypes.c_void_p(self.host.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.host.ctypes.data, False), "version": 3}

    def __getitem__(self, index):
        return FakeDeviceArray(self.host[index])

    def view(self, dtype):
        return FakeDeviceArray(self.host.view(dtype))

    def reshape(self, *shape):
        return FakeDeviceArray(self.host.reshape(*shape))

    def copy_to_host(self):
        return self.host.copy()


FAKE_CONTEXT = types.SimpleNamespace(device=types.SimpleNamespace(id=0))
FAKE_DEVICE = types.SimpleNamespace(id=0, compute_capability=(9, 0), name=b"NVIDIA H200",
                                    **H200)


def _noop_launch():
    """A ctypes function of cuLaunchKernelEx's four pointer arguments that returns 0 (compiled
    with the C compiler; a Python function when there is none)."""
    src = "int noop_launch(void *a, void *b, void *c, void *d) { return 0; }\n"
    directory = tempfile.mkdtemp(prefix="probe_replay_")
    c_file, so_file = os.path.join(directory, "noop.c"), os.path.join(directory, "noop.so")
    with open(c_file, "w") as f:
        f.write(src)
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so_file, c_file], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        print("no C compiler: the driver call is a Python function (not counted as ctypes)")
        return lambda *args: 0
    fn = ctypes.CDLL(so_file).noop_launch
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


def install_fake_device():
    _env._HAVE_GPU[:] = [True]
    noop = _noop_launch()
    _launch._libcuda_ex = lambda: noop

    def handle(self):
        if self._handle is None:
            self._handle = self._raw_handle = 1
        return self._handle

    _launch.Kernel.handle = handle
    _launch.Kernel.resources = lambda self: {"registers": 128, "local_bytes": 0,
                                             "static_shared_bytes": 0}
    _launch.Kernel.blocks_per_sm = lambda self, threads, shared_bytes=0: max(
        1, min(2048 // max(threads, 1), 232448 // max(shared_bytes, 1)))
    _launch.Kernel._opt_in_shared = lambda self, n: setattr(self, "_shared_optin", n)
    _launch._DEVICE_ATTRS.update(H200)
    # torch CPU tensors pass for CUDA ones: the reader without its is_cuda check
    original = _arrays._torch_tensor

    def torch_tensor(obj):
        if not _arrays._TORCH_DTYPES:
            try:
                original(obj)  # fills the dtype table, then refuses the CPU tensor
            except TypeError:
                pass
        dtype = _arrays._TORCH_DTYPES.get(obj.dtype)
        if dtype is None:
            raise TypeError(f"unsupported dtype {obj.dtype}")
        return _arrays.Tensor(obj, "torch", obj.data_ptr(), obj.shape, obj.stride(), dtype)

    _arrays._torch_tensor = torch_tensor
    # torch's raw current-stream accessor and current device: C builtins of about the same cost
    _arrays._RAW_STREAM[:] = [lambda device: STREAM, int]
    cuda = _env.cuda
    cuda.get_current_device = lambda: FAKE_DEVICE
    cuda.current_context = lambda: FAKE_CONTEXT
    cuda.synchronize = lambda: None
    cuda.to_device = lambda host, *a, **k: FakeDeviceArray(np.array(host))
    cuda.device_array = lambda shape, dtype=np.float64, *a, **k: FakeDeviceArray(
        np.zeros(shape, dtype))
    torch.cuda.is_current_stream_capturing = lambda: False

    def zeros(self, shape, dtype):
        if self.kind == "torch":
            return torch.zeros(shape, dtype=getattr(torch, dtype))
        return FakeDeviceArray(np.zeros(shape, _arrays.numpy_dtype(dtype)))

    def to_device(self, host):
        host = np.ascontiguousarray(host, dtype=np.int32)
        return torch.from_numpy(host) if self.kind == "torch" else FakeDeviceArray(host)

    paged_cache.PagedKVCache._zeros = zeros
    paged_cache.PagedKVCache._to_device = to_device


# ---- the calls --------------------------------------------------------------------------------

def _bench_host():
    import bench_host

    bench_host.torch, bench_host.F = torch, F
    return bench_host


def _arrays_class(bench_host):
    """bench_host's ``Arrays`` on the fake device: CPU torch tensors or fake numba arrays."""
    class Arrays(bench_host.Arrays):
        def put(self, host, dtype):
            if self.torch:
                return torch.from_numpy(np.ascontiguousarray(host)).to(getattr(torch, dtype))
            return FakeDeviceArray(np.ascontiguousarray(host, _arrays.numpy_dtype(dtype)))

    return Arrays


@contextlib.contextmanager
def counting_checked_paths():
    """Counts the checked-path runs of every op (``OpCalls.record``) and paged decode's."""
    count = [0]
    record = _replay.OpCalls.record

    def counted(self, fn, *args):
        count[0] += 1
        return record(self, fn, *args)

    from llmspeed_numba.ops import paged_decode

    validate = paged_decode._validate

    def counted_validate(*args):
        count[0] += 1
        return validate(*args)

    _replay.OpCalls.record = counted
    paged_decode._validate = counted_validate
    try:
        yield count
    finally:
        _replay.OpCalls.record = record
        paged_decode._validate = validate


def per_call_us(fn, calls=500, bursts=20):
    """us per call of ``bursts`` bursts of ``calls`` calls each, in this thread's CPU time
    (time the thread was descheduled, frequent on a shared 2-core machine, not counted)."""
    clock = time.thread_time
    out = []
    for _ in range(bursts):
        start = clock()
        for _ in range(calls):
            fn()
        out.append((clock() - start) / calls * 1e6)
    return out


def profile_text(fn, calls=5000, top=14):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values()) / calls * 1e6
    lines = [f"{total:.2f} us per call (profiled); top {top} by own time:",
             f"{'calls':>6} {'own us':>7} {'cum us':>7}  function (per op call)"]
    for (file, line, name), (_, n, own, cum, _) in sorted(
            stats.items(), key=lambda kv: -kv[1][2])[:top]:
        lines.append(f"{n / calls:6.1f} {own / calls * 1e6:7.2f} {cum / calls * 1e6:7.2f}  "
                     f"{os.path.basename(file)}:{line}({name})")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None, help="comma list (default: bench_host's)")
    parser.add_argument("--kinds", default="torch,numba")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    install_fake_device()
    bench_host = _bench_host()
    Arrays = _arrays_class(bench_host)
    ops = args.ops.split(",") if args.ops else bench_host.OPS
    s = types.SimpleNamespace(**bench_host.SHAPES)
    rows, profiles, failed = [], [], []
    for kind in args.kinds.split(","):
        A = Arrays(kind)
        for op in ops:
            try:
                shape, calls = getattr(bench_host, op)(A, s)
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{op} {kind} setup: {type(exc).__name__}: {exc}")
                continue
            for variant, fn, *_ in calls:
                case = f"{op} {kind} {variant}"
                try:
                    fn()
                    fn()  # recorded; this one replays
                    with counting_checked_paths() as checked:
                        fn()
                    if checked[0]:
                        failed.append(f"{case}: not replayed (the checked path ran)")
                        continue
                    runs = [min(per_call_us(fn)) for _ in range(args.repeat)]
                    with counting_checked_paths() as checked:
                        fn()
                    assert not checked[0]
                except Exception as exc:  # noqa: BLE001
                    failed.append(f"{case}: {type(exc).__name__}: {exc}")
                    continue
                rows.append((op, kind, variant, statistics.median(runs), min(runs), max(runs)))
                print(f"{case:<44} {rows[-1][3]:6.2f} us (min {min(runs):.2f}, max "
                      f"{max(runs):.2f})", flush=True)
                if args.profile and kind == "torch" and variant == calls[0][0]:
                    profiles.append(f"==== {case} ({shape})\n" + profile_text(fn))
    for p in profiles:
        print("\n" + p)
    if failed:
        print("\nfailed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
