"""Softmax over the vocabulary: the sampling end of an LLM (greedy argmax: ``argmax.py``).

    softmax(x, temperature)[r, j] = exp((x[r, j] - max_j x[r, :]) / T) / sum_j exp(...)

``x`` (..., vocab) fp16 / bf16 / fp32 with a contiguous last dimension (leading dimensions
collapsing into one row stride), vocab up to 2^31 - 1. Accumulation in fp32 (the max, the sum of
exponentials, each probability); the softmax output has x's dtype or float32 (``dtype=``,
``out=``).

Special values, as torch: a NaN anywhere in a row makes that row's softmax NaN; a row of -inf
only has a NaN softmax (0 / 0 - torch's answer too: a fully masked row is an upstream bug worth
seeing); +inf in a row makes its softmax NaN.

Kernels (``_softmax_kernels.py``; ``_rowwise`` layout; split rows planned as ``_split_rows``):
- rows that fit in registers (<= 32768 halves / 16384 floats) with enough rows to fill the GPU:
  one fused kernel, the row read once into registers, max and sum reduced, probabilities written;
- otherwise (few long rows, e.g. 64 x 128256) each row is split over ``splits`` blocks of
  ``SPLIT_THREADS``, grid (rows, splits), sized to what the GPU holds at once (occupancy of the
  compiled kernel x SMs), so the whole grid is one wave. One kernel per call: each block
  computes its span's (max, sum of exp), publishes it (a 64-bit atomic per block), counts itself
  in the row's arrival counter and waits until the row's other blocks have arrived; then every
  block merges the row's partials (fixed order: every block gets the same bits) and writes its
  span. When the span fits in registers (``RESIDENT_CHUNKS`` 16-byte chunks a thread: 64 x 128256
  in half precision) x is read once; otherwise (fp32 there) the write pass re-reads the span, just
  read by the same block, from L2. Waiting needs the row's blocks running together: the host
  launches this only when the grid fits at once, and a block that has polled ``SPIN_POLLS`` times
  in vain (another kernel holding SMs, a debugger serialising blocks, the simulator's sequential
  blocks) computes the missing spans' statistics itself - the same code, so the same bits - and
  carries on: never a deadlock. The last block to leave resets the row's counters (workspace kept
  per device and stream, so calls on one stream reuse it and CUDA graphs can capture the kernel).

Tests force a path through ``TUNING`` (scope ``softmax`` of ``_overrides.overrides``):
``split_path`` "resident" / "streamed", ``splits`` (blocks a row), ``spin_polls``.
"""

import math

import numpy as np

from .. import compile_check
from .._arrays import dtype_name, empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import SIMULATOR
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, DTypeLike, StreamLike
from .._workspace import workspace
from . import _rowwise as rw
from . import _softmax_kernels as sk
from . import _split_rows as rs

#: Chunks a thread keeps in registers in the one-kernel split path (32 registers of words).
RESIDENT_CHUNKS = rw.MAX_CHUNKS_PER_THREAD
#: Polls of a row's arrival counter before a block computes the missing spans itself (about
#: 10-30 ms on a GPU; a block whose row is complete never gets there). Negative: never wait
#: (tests: every block takes the fallback).
SPIN_POLLS = 2 if SIMULATOR else 1 << 14
#: Split-row softmax: ``split_path`` "auto" (the span in registers when the grid fits at once
#: with it, else streamed) or "resident" / "streamed" (forced); ``splits``: blocks a row (None:
#: planned); ``spin_polls``: ``SPIN_POLLS``.
TUNING = Knobs("softmax", choices={"split_path": ("auto", "resident", "streamed")},
               split_path="auto", splits=None, spin_polls=SPIN_POLLS)

_LOG2E = math.log2(math.e)


# ---- planning --------------------------------------------------------------------------------

def _aim(rows, chunks, threads):
    """Blocks a row: ``rs.aim``, or the forced ``TUNING.splits``."""
    forced = TUNING.splits
    return rs.aim(rows, chunks, threads) if forced is None else max(1, min(forced, rs.MAX_SPLITS))


def _softmax_split_plan(rows, chunks, x_kind, o_kind, vec):
    """``(kernel, splits, cpt)`` for rows split over blocks: the span in registers (``cpt``
    chunks a thread) when the grid fits on the GPU at once with it, else streamed (``cpt ==
    0``; more than one block a row only if they fit at once)."""
    threads = rs.TUNING.split_threads
    forced, path, polls = TUNING.splits, TUNING.split_path, TUNING.spin_polls
    aim = _aim(rows, chunks, threads)
    most = min(rs.MAX_SPLITS, threads)  # each partial read by one thread of the block
    need = -(-chunks // (threads * RESIDENT_CHUNKS))  # blocks a row for registers to hold it
    if path != "streamed" and need <= most:
        widest = sk.one_kernel(x_kind, o_kind, vec, threads, RESIDENT_CHUNKS, rs.UNROLL, polls)
        fit = rs.resident_blocks(widest, threads) // rows
        if path == "resident" or need <= fit:
            splits = min(most, max(need, aim if forced is not None else min(aim, fit)))
            span = -(-chunks // splits)
            cpt = rw.pow2_ceil(-(-span // threads))  # chunks a thread, a power of two
            return (sk.one_kernel(x_kind, o_kind, vec, threads, cpt, rs.UNROLL, polls), splits,
                    cpt)
    kernel = sk.one_kernel(x_kind, o_kind, vec, threads, 0, rs.UNROLL, polls)
    if forced is None:
        aim = min(aim, rs.resident_blocks(kernel, threads) // rows)
    return kernel, max(1, min(aim, most)), 0


_SOFTMAX_CALLS = OpCalls("softmax")


def softmax(x: ArrayLike, *, temperature: float = 1.0, dtype: DTypeLike | None = None,
            out: ArrayLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """Softmax of ``x / temperature`` over the last dimension, accumulated in fp32.

    Args:
        x: (..., vocab) fp16 / bf16 / fp32 logits, last dimension contiguous.
        temperature: a finite float > 0 (an int is a TypeError: pass ``float(t)``).
        dtype: output dtype, x's (default) or float32 (a name, numpy or torch dtype).
        out: optional output, x's shape, dtype ``dtype`` (or x's / float32 when ``dtype`` is
            None); may be ``x`` itself when the dtypes agree.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: probabilities, in x's array kind. Rows of -inf only (or with NaN or +inf) are
        NaN, as in torch.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` / ``dtype`` not x's dtype or float32,
            a non-float temperature.
        ValueError: an empty or non-contiguous last dimension, shapes that disagree, a
            temperature that is not finite and > 0.
    """
    result = _SOFTMAX_CALLS.replay((x, out), (temperature, dtype), stream)
    if result is MISS:
        result = _SOFTMAX_CALLS.record(_softmax_checked, x, temperature, dtype, out, stream)
    return result


def _softmax_checked(x, temperature, dtype, out, stream):
    """The checked path of ``softmax`` (validation, planning, launch)."""
    tx, rows, cols, x_stride = rs.prepare(x)
    if not isinstance(temperature, (float, np.floating)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
    if dtype is not None:
        dtype = dtype_name(dtype, "dtype")
        if dtype not in (tx.dtype, "float32"):
            shown = "float32" if tx.dtype == "float32" else f"{tx.dtype} (x's) or float32"
            raise TypeError(f"dtype: expected {shown}, got {dtype}")
    if out is not None:
        to = tensor(out, "out")
        want = dtype or (to.dtype if to.dtype in (tx.dtype, "float32") else tx.dtype)
        to = output("out", out, tx.shape, want, tx)
    else:
        out = empty(tx, tx.shape, dtype or tx.dtype)
        to = tensor(out, "out")
    if rows == 0:
        return out
    _, _, o_stride = rw.rows_view("out", to)
    scale = _LOG2E / float(temperature)
    x_kind, o_kind = rw.kind(tx.dtype), rw.kind(to.dtype)
    vec = rw.vector_width(tx.dtype)
    one = rows == 1  # a single row's stride is never used: (1, vocab) still gets 16-byte access
    if not (rw.vector_aligned(tx, 0 if one else x_stride, vec)
            and rw.vector_aligned(to, 0 if one else o_stride, vec)):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    tpr, rpb, cpt = rw.row_plan(chunks)
    xb, ob = kernel_buffer(tx), kernel_buffer(to)
    threads = rs.TUNING.split_threads
    if cpt > 0 and _aim(rows, chunks, threads) == 1:
        kernel = sk.fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt)
        kernel(-(-rows // rpb), tpr * rpb, (xb, ob, rows, cols, x_stride, o_stride, scale),
               handle)
        return out
    kernel, splits, _ = _softmax_split_plan(rows, chunks, x_kind, o_kind, vec)
    span = -(-chunks // splits)
    parts = workspace(tx, handle, "softmax_parts", rows * splits, np.uint64)
    counts = workspace(tx, handle, "softmax_counts", 2 * rows, np.uint32, own_in_graph="graph")
    kernel((rows, splits), threads,
           (xb, ob, parts, counts, cols, x_stride, o_stride, span, scale), handle)
    return out


def _register():
    f16, bf16, f32 = rw.KIND_F16, rw.KIND_BF16, rw.KIND_F32
    vec128 = ("LDG.E.128", "STG.E.128")
    threads = rs.SPLIT_THREADS
    checks = {
        "softmax_fused_f16_4096": lambda: (
            sk.fused_kernel_fn(f16, f16, 8, *rw.row_plan(512)), sk.fused_signature(f16, f16)),
        "softmax_resident_bf16": lambda: (  # 64 x 128256 in half precision
            sk.one_kernel_fn(bf16, bf16, 8, threads, RESIDENT_CHUNKS, rs.UNROLL, SPIN_POLLS),
            sk.one_kernel_signature(bf16, bf16), sk.one_kernel_options(threads)),
        "softmax_streamed_f32": lambda: (  # 64 x 128256 in fp32
            sk.one_kernel_fn(f32, f32, 4, threads, 0, rs.UNROLL, SPIN_POLLS),
            sk.one_kernel_signature(f32, f32), sk.one_kernel_options(threads)),
    }
    for name, build in checks.items():
        compile_check.register(name, build, sass_must_have=vec128)


_register()
