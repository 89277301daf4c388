"""Where the time of softmax / argmax on few long rows goes (issue 6): each variant and kernel
alone, beside copies of the same size.

    python benchmarks/probes/probe_softmax.py [--dtypes float16,bfloat16,float32] [--rows 64]
                                       [--vocab 128256]

For each dtype, on (rows, vocab) (temperature 0.7 as in bench_fused):
- references: the 2 GiB device-to-device copy, a same-size copy (a copy moving the op's bytes:
  half read, half written) and the timing floor (a 4-byte memset);
- softmax: the planned call, each split path forced ("resident": the span in registers, one
  kernel; "streamed": one kernel re-reading its span from L2; "two_kernels": stats then write,
  also each kernel alone), a few split counts;
- argmax: the planned call (one wave), the split count of the previous planner, a sweep;
- the planned calls and the copies again with a clean L2 (flushed by reading) and a hot one (no
  flush): the harness flushes by writing, so each line the timed call evicts is first written
  back, which at tens of MB is a large share of the traffic.

Each line: us per call (median of 20 CUDA-graph replays through ``_harness.time_gpu``, L2 flushed
by writing unless said), GB/s (the op's bytes: input read once, output written once), % of the
same-size copy, % of the 2 GiB copy, the plan (grid, chunks a thread, registers, blocks the GPU
holds at once) and the error against torch. About 30-60 s of GPU time (kernel compiles included
on a machine without numba's disk cache).
"""

import argparse
import contextlib
import os
import sys
import time

import numpy as np

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules

import _harness  # noqa: E402
from _harness import copy_bandwidth, graphed, time_gpu  # noqa: E402

from llmspeed_numba._arrays import Buffer, kernel_buffer  # noqa: E402
from llmspeed_numba._checks import tensor  # noqa: E402
from llmspeed_numba.ops import _rowwise as rw  # noqa: E402
from llmspeed_numba.ops import softmax as sm  # noqa: E402

TEMPERATURE = 0.7


class _ReadFlusher:
    """Evicts the L2 by reading 256 MB: the timed call then finds clean lines only."""

    def __init__(self, nbytes=256 << 20):
        import torch

        self.buf = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.amax()


_READ_FLUSHER = None


def time_us(fn, flush="write"):
    """Median GPU us of a graph replay of ``fn`` (eager if capture fails); ``flush``: "write"
    (the harness's), "read" (clean L2) or "none" (hot L2)."""
    global _READ_FLUSHER
    replay = graphed(fn) or fn
    if flush == "none":
        return time_gpu(replay, flush_l2=False)["median"] * 1e3
    if flush == "write":
        return time_gpu(replay)["median"] * 1e3
    if _READ_FLUSHER is None:
        _READ_FLUSHER = _ReadFlusher()
    saved, _harness._FLUSHER = _harness._FLUSHER, _READ_FLUSHER
    try:
        return time_gpu(replay)["median"] * 1e3
    finally:
        _harness._FLUSHER = saved


@contextlib.contextmanager
def patched(**values):
    """Module constants of ``softmax`` set for the duration (plans are made per call)."""
    saved = {k: getattr(sm, k) for k in values}
    for k, v in values.items():
        setattr(sm, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(sm, k, v)


def kernel_note(kernel, threads):
    r = kernel.resources()
    return f"{r['registers']} regs, {sm._resident_blocks(kernel, threads)} blocks fit"


def softmax_plan(x, out):
    """The plan softmax() makes for x on its split path (few long rows): (note, splits, fits),
    ``fits`` False when one kernel's blocks of a row would not all run at once."""
    tx, to = tensor(x, "x"), tensor(out, "out")
    rows, cols, _ = rw.rows_view("x", tx)
    vec = rw.vector_width(tx.dtype)
    kernels, splits, cpt = sm._softmax_split_plan(rows, cols // vec, rw.kind(tx.dtype),
                                                  rw.kind(to.dtype), vec)
    what = (f"{len(kernels)} kernels" if len(kernels) == 2
            else f"{kernels[0].name}, {cpt or sm.UNROLL} chunks/thread"
            f"{'' if cpt else ' in flight'}")
    fits = (len(kernels) == 2 or splits == 1
            or rows * splits <= sm._resident_blocks(kernels[0], sm.SPLIT_THREADS))
    note = f"grid ({rows}, {splits}) x {sm.SPLIT_THREADS}: {what}; " + "; ".join(
        kernel_note(k, sm.SPLIT_THREADS) for k in kernels)
    return note, splits, fits


def two_kernel_parts(x, out, splits):
    """The stats and write kernels of the two-kernel path as separate calls (own partials)."""
    import torch

    tx, to = tensor(x, "x"), tensor(out, "out")
    rows, cols, x_stride = rw.rows_view("x", tx)
    _, _, o_stride = rw.rows_view("out", to)
    vec = rw.vector_width(tx.dtype)
    chunks = cols // vec
    span = -(-chunks // splits)
    pm = torch.zeros(rows * splits, dtype=torch.float32, device="cuda")
    pl = torch.zeros_like(pm)
    args = (kernel_buffer(tx), kernel_buffer(to), Buffer(pm.data_ptr(), pm.numel(), np.float32),
            Buffer(pl.data_ptr(), pl.numel(), np.float32), cols, x_stride, o_stride, span,
            sm._LOG2E / TEMPERATURE)
    parts = []
    for write in (False, True):
        kernel = sm._softmax_split_kernel(rw.kind(tx.dtype), rw.kind(to.dtype), vec,
                                          sm.SPLIT_THREADS, sm.UNROLL, write)

        def launch(kernel=kernel):
            kernel((rows, splits), sm.SPLIT_THREADS, args,
                   torch.cuda.current_stream().cuda_stream)

        parts.append((kernel, launch))
    parts[0][1]()  # partials for the write kernel timed alone
    torch.cuda.synchronize()
    return parts, (pm, pl)


def read_floor_call(x, blocks, threads, unroll=8):
    """A call of a kernel that only reads ``x`` (16-byte loads, ``unroll`` in flight a thread,
    the words folded, one word a thread written), launched like the ops: the floor of a one-pass
    reduction over these bytes, with nothing of argmax's index search or merge."""
    import torch
    from numba import types

    from llmspeed_numba import ptx
    from llmspeed_numba._arrays import stream_handle
    from llmspeed_numba._env import cuda
    from llmspeed_numba._launch import Kernel, array1d, jit

    def read_floor(x, out, n16, per):
        t = cuda.grid(1)
        stride = cuda.gridsize(1)
        acc = np.uint32(0)
        c = t
        while c < n16:
            w = cuda.local.array((unroll, 4), np.uint32)
            for u in range(unroll):  # all loads before any use
                cu = min(c + u * stride, n16 - 1)
                w[u, 0], w[u, 1], w[u, 2], w[u, 3] = ptx.load_u32x4(x, cu * per)
            for u in range(unroll):
                acc ^= w[u, 0] ^ w[u, 1] ^ w[u, 2] ^ w[u, 3]
            c += unroll * stride
        out[t] = np.int32(acc & np.uint32(0x7FFFFFFF))

    tx = tensor(x, "x")
    flat = kernel_buffer(tx)
    elem = np.dtype(flat.dtype)
    kernel = Kernel(jit(read_floor), (array1d(elem), array1d(np.int32), types.int64,
                                      types.int64), "read_floor")
    out = torch.empty(blocks * threads, dtype=torch.int32, device="cuda")
    tout = kernel_buffer(tensor(out, "out"))
    per = 16 // elem.itemsize
    args = (flat, tout, x.numel() // per, per)

    def call():  # the stream looked up per call: graph capture runs on its own stream
        kernel(blocks, threads, args, stream_handle(None, (tx,)))

    return call


def old_splits(rows, chunks):
    """The split count of the previous planner (about 4 blocks per SM, at least 4 chunks a
    thread, what fits at once not considered)."""
    want = -(-4 * sm.sm_count() // rows)
    return max(1, min(want, chunks // (sm.SPLIT_THREADS * 4)))


def probe(dtype, rows, vocab, row, same_size):
    """Every line of one dtype."""
    import torch

    tdt = getattr(torch, dtype)
    x = (torch.randn(rows, vocab, device="cuda") * 4).to(tdt)
    out = torch.empty_like(x)
    want_p = (x.float() / TEMPERATURE).softmax(-1)
    want_i = torch.argmax(x, -1)
    item = x.element_size()
    sm_bytes = 2 * rows * vocab * item
    am_bytes = rows * vocab * item + rows * 8
    chunks = vocab // rw.vector_width(dtype)
    for nbytes in (sm_bytes, am_bytes):
        us = same_size(nbytes)
        row(dtype, "copy", f"same-size copy {nbytes / 1e6:.1f} MB", us, nbytes)

    def err():
        return ((out.float() - want_p).abs().max() / want_p.abs().max()).item()

    def call_softmax():
        sm.softmax(x, temperature=TEMPERATURE, out=out)

    # softmax: the plan, each path forced, the two kernels alone, a few split counts
    for path, splits in (("auto", None), ("resident", None), ("streamed", None),
                         ("two_kernels", None), ("streamed", 2), ("two_kernels", 4)):
        with patched(SPLIT_PATH=path, FORCE_SPLITS=splits):
            note, _planned, fits = softmax_plan(x, out)
            if not fits or (path == "resident" and "resident" not in note):
                continue  # forced one-kernel grid larger than the GPU holds (blocks wait)
            out.fill_(float("nan"))
            call_softmax()
            torch.cuda.synchronize()
            label = path + ("" if splits is None else f", {splits} splits")
            row(dtype, "softmax", label, time_us(call_softmax), sm_bytes,
                note=f"{note}; err {err():.1e}")
    with patched(SPLIT_PATH="two_kernels"):
        splits = softmax_plan(x, out)[1]
    parts, _keep = two_kernel_parts(x, out, splits)
    for (kernel, launch), what in zip(parts, ("stats alone", "write alone")):
        bytes_ = sm_bytes // 2 if what.startswith("stats") else sm_bytes
        row(dtype, "softmax", f"{what} ({splits} splits)", time_us(launch), bytes_,
            note=kernel_note(kernel, sm.SPLIT_THREADS))
        if what.startswith("write"):
            row(dtype, "softmax", f"{what}, hot L2", time_us(launch, "none"), bytes_,
                "none", note="x in L2 as after the stats kernel")
    for flush in ("read", "none"):
        row(dtype, "softmax", f"auto, L2 flushed by {flush}".replace("by none", "none"),
            time_us(call_softmax, flush), sm_bytes, flush)

    # argmax: the plan (one wave), the previous split count, a sweep
    res = torch.empty(rows, dtype=torch.int64, device="cuda")

    def call_argmax():
        sm.argmax(x, out=res)

    tx = tensor(x, "x")

    def timed_argmax(label):
        """One line: the argmax plan under the current patches, checked against torch, timed."""
        kernel, planned, tpr, rpb = sm._argmax_plan(
            rows, chunks, rw.kind(tx.dtype), rw.vector_width(dtype))
        res.fill_(-1)
        call_argmax()
        torch.cuda.synchronize()
        bad = int((res != want_i).sum().item())
        row(dtype, "argmax", label, time_us(call_argmax), am_bytes,
            note=f"grid ({-(-rows // rpb)}, {planned}) x {tpr * rpb}; "
            f"{kernel_note(kernel, tpr * rpb)}; {bad} mismatches")
        return tpr

    for splits in (None, old_splits(rows, chunks), 2, 4, 8, 16):
        with patched(FORCE_SPLITS=splits):
            label = "planned" if splits is None else f"{splits} splits"
            if splits == old_splits(rows, chunks):
                label += " (previous plan)"
            timed_argmax(label)
    # loads in flight a thread (UNROLL chunks) x blocks an SM: one load round trip or two
    # (and one block a row of row_threads: no cross-block merge, but 64 SMs at most)
    for unroll, per_sm, force, row_threads in (
            (8, 2, None, 512), (8, 1, None, 512), (4, 1, None, 512), (4, 2, 1, 512),
            (8, 2, 1, 512), (16, 2, 1, 512), (4, 2, 1, 1024), (8, 2, 1, 1024)):
        saved_tpr, rw.MAX_THREADS_PER_ROW = rw.MAX_THREADS_PER_ROW, row_threads
        with patched(UNROLL=unroll, ARGMAX_BLOCKS_PER_SM=per_sm, FORCE_SPLITS=force):
            label = f"1 block a row ({row_threads})" if force == 1 else f"{per_sm} blocks/SM"
            timed_argmax(f"unroll {unroll}, {label}")
        rw.MAX_THREADS_PER_ROW = saved_tpr
    # the read floor: a kernel that only reads these bytes (no index, no merge)
    for blocks_per_sm, threads in ((2, 512), (1, 1024), (4, 512)):
        call = read_floor_call(x, blocks_per_sm * sm.sm_count(), threads)
        call()
        row(dtype, "argmax", f"read floor {blocks_per_sm}x{threads}/SM", time_us(call),
            am_bytes, note="only reads x (16-byte loads, 8 in flight a thread)")
    # a mature read-and-reduce reference over the same bytes (no index)
    row(dtype, "argmax", "torch amax (reference)", time_us(lambda: torch.amax(x, -1)), am_bytes)
    for flush in ("read", "none"):
        row(dtype, "argmax", f"planned, L2 flushed by {flush}".replace("by none", "none"),
            time_us(call_argmax, flush), am_bytes, flush)
    for nbytes in (sm_bytes, am_bytes):
        for flush in ("read", "none"):
            row(dtype, "copy", f"same-size {nbytes / 1e6:.1f} MB, flush {flush}",
                same_size(nbytes, flush), nbytes, flush)


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    rows, vocab = args.rows, args.vocab

    copy = copy_bandwidth()
    floor_buf = torch.empty(1, dtype=torch.int32, device="cuda")
    floor = {f: time_us(floor_buf.zero_, f) for f in ("write", "read", "none")}
    print(f"{torch.cuda.get_device_name()}: 2 GiB copy {copy:.0f} GB/s; timing floor (4-byte "
          f"memset graph) {floor['write']:.1f} us (flush by write), {floor['read']:.1f} (by "
          f"read), {floor['none']:.1f} (none); {sm.sm_count()} SMs\n")
    print(f"{'dtype':9} {'op':8} {'variant':34} {'us':>7} {'GB/s':>6} {'%same':>6} {'%2GiB':>6}"
          f"  notes")

    same_cache = {}

    def same_size(nbytes, flush="write"):
        if (nbytes, flush) not in same_cache:
            n = max(nbytes // 4, 1)  # fp16 elements copied: nbytes moved in all
            src = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
            dst = torch.empty_like(src)
            same_cache[nbytes, flush] = time_us(lambda: dst.copy_(src), flush)
        return same_cache[nbytes, flush]

    def row(dtype, op, variant, us, nbytes, flush="write", note=""):
        gbs = nbytes / (us * 1e-6) / 1e9
        same_gbs = nbytes / (same_size(nbytes, flush) * 1e-6) / 1e9
        print(f"{dtype:9} {op:8} {variant:34} {us:7.1f} {gbs:6.0f} {100 * gbs / same_gbs:5.1f}% "
              f"{100 * gbs / copy:5.1f}%  {note}", flush=True)

    for dtype in args.dtypes.split(","):
        probe(dtype, rows, vocab, row, same_size)
        torch.cuda.empty_cache()
        print()
    print(f"{time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
