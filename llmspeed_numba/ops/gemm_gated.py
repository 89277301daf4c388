"""The gated GEMM of a transformer MLP: ``gemm(x, w_gate_up, activation="silu_and_mul")``.

    out[m, j] = act(x @ W_gate + bias_gate)[m, j] * (x @ W_up + bias_up)[m, j]      out (M, N / 2)

computed by one GEMM kernel from one operand ``b`` (K, N) that holds the gate and up columns
(N = 2 x intermediate) **interleaved in blocks of** ``GATE_BLOCK = 8``:

    b[:, 16 i + r]     = W_gate[:, 8 i + r]     r = 0 .. 7
    b[:, 16 i + 8 + r] = W_up[:, 8 i + r]

so output column j takes gate column ``n = 16 (j // 8) + j % 8`` of b and up column ``n + 8``.
Why 8: it is the width of one n8 accumulator fragment (mma.sync m16n8k16, and each 8-column block
of a wgmma m64nN accumulator), in which a thread holds columns ``2 (lane % 4)`` and ``+ 1`` of
rows ``lane / 4`` and ``+ 8``, the same positions in every fragment. A gate block and its up block
are two neighbouring fragments, so every thread holds each gate value together with its up value
and the epilogue pairs them in registers, no shuffle and no shared-memory exchange; a thread's two
results per row are adjacent output columns, so the gated result has exactly the fragment layout
of a plain GEMM with half the columns and every store path of the plain epilogue applies. (An
interleave of single columns would pair within a fragment as well, but leaves a thread one output
column in four; one of 4 would split a pair between threads.)

``bias`` (optional) has b's N entries, interleaved the same way (``interleave_gate_up`` of the gate
and up biases), and is added before the activation; ``alpha`` scales both products. "gelu_and_mul"
is the tanh form, as gemm's "gelu" (``activations.gelu_and_mul(approximate="tanh")``). The epilogue
is fp32 (accumulators, bias, activation, product) with one rounding to ``out_dtype``; for fp16 /
bf16 results the activation is its SFU form (``ex2.approx``, ``rcp.approx``: relative error under
3e-5, a tenth of an fp16 ulp, as ``activations.silu_and_mul`` on half-precision data), for fp32
results libdevice's (as gemm's plain "silu" / "gelu"). The SFU form is also lighter on registers:
with libdevice's ``expf`` and IEEE division the 128 x 256 mma.sync tile (64 x 64 warp tiles, 128
accumulators a thread, 254 registers without an epilogue) spills 8 bytes in the gated epilogue,
which it still does for fp32 results (offline SASS; the wgmma tiles and the smaller mma.sync ones
do not).
``beta * c`` is not supported with a gated activation. Split-K adds the fp32 partial sums first,
so there the gated epilogue runs after them: in the last block of each tile on Tensor Cores
(``_epilogue.gated_raw_store``), in the reduce kernel (``gated_reduce_kernel_fn``) on SIMT, whose
gated epilogue always runs there (its threads hold columns four apart, never a gate block and
its up block).

Weights stored as a Linear layer's (out_features, in_features) are interleaved along dim 0 and
passed transposed:

    w_gate_up = interleave_gate_up(w_gate, w_up)          # (2 I, K), contiguous
    h = gemm(x, w_gate_up.T, activation="silu_and_mul")   # (M, I)
"""

import numpy as np

from .._env import cuda
from .._typing import ArrayLike
from ._activations_device import GATED_ACTIVATIONS
from ._epilogue import GATE_BLOCK, gate_column, gated_epilogue, storer

__all__ = ["GATE_BLOCK", "GATED_ACTIVATIONS", "interleave_gate_up", "deinterleave_gate_up"]


# ---- the interleaved operand -------------------------------------------------------------------

def _namespace(x, name):
    """``stack`` of the array's own library: numpy, torch or CuPy (weights may live on the host
    or the device; no kernel is needed to reorder them)."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch.stack
    if module.startswith("cupy"):
        import cupy

        return cupy.stack
    if isinstance(x, np.ndarray):
        return np.stack
    raise TypeError(f"{name}: expected a NumPy array, a torch tensor or a CuPy array, got "
                    f"{type(x).__name__} (numba device arrays: copy_to_host() first)")


def _feature_dim(x, name, dim):
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    ndim = len(x.shape)
    if ndim not in (1, 2):
        raise ValueError(f"{name}: expected 1 or 2 dimensions, got shape {tuple(x.shape)}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: expected a dimension of {name}'s {ndim}, got {dim}")
    return int(dim) % ndim


def interleave_gate_up(w_gate: ArrayLike, w_up: ArrayLike, *, dim: int = 0) -> ArrayLike:
    """The gated GEMM's operand from separate gate and up weights (or biases): their
    ``dim``-th dimension (the output features, I of them) interleaved in blocks of
    ``GATE_BLOCK`` (8): gate features ``8 i .. 8 i + 7`` then up features ``8 i .. 8 i + 7``,
    for i = 0, 1, ... (see the module docstring for why 8).

    w_gate, w_up: the same shape, dtype and kind: NumPy arrays, torch tensors (any device) or
    CuPy arrays, 1-D (a bias, I) or 2-D. ``dim=0`` (default): a Linear layer's (out_features,
    in_features) = (I, K); the result (2 I, K) is passed to ``gemm`` transposed, ``.T``.
    ``dim=1``: (K, I), gemm's ``b`` layout; the result (K, 2 I) is ``b`` itself. A 1-D bias
    gives the (2 I,) ``bias`` of the gated call. Returns a new contiguous array of the same
    kind, dtype and device.

    Raises ``TypeError`` for other array kinds, mixed kinds or dtypes, a non-int ``dim``;
    ``ValueError`` for different shapes, a rank other than 1 or 2, ``dim`` out of range, or I
    not a multiple of 8.
    """
    stack = _namespace(w_gate, "w_gate")
    if type(w_up) is not type(w_gate):
        raise TypeError(f"w_up: expected a {type(w_gate).__name__} like w_gate, got "
                        f"{type(w_up).__name__}")
    d = _feature_dim(w_gate, "w_gate", dim)
    shape = tuple(w_gate.shape)
    if tuple(w_up.shape) != shape:
        raise ValueError(f"w_up: expected shape {shape} to match w_gate, got "
                         f"{tuple(w_up.shape)}")
    if w_up.dtype != w_gate.dtype:
        raise TypeError(f"w_up: expected dtype {w_gate.dtype} to match w_gate, got "
                        f"{w_up.dtype}")
    features = shape[d]
    if features % GATE_BLOCK:
        raise ValueError(f"w_gate: expected dimension {d} (the output features) to be a "
                         f"multiple of {GATE_BLOCK}, the interleave block, got shape {shape}")
    blocks = shape[:d] + (features // GATE_BLOCK, GATE_BLOCK) + shape[d + 1:]
    pair = stack((w_gate.reshape(blocks), w_up.reshape(blocks)), d + 1)
    return pair.reshape(shape[:d] + (2 * features,) + shape[d + 1:])


def deinterleave_gate_up(w_gate_up: ArrayLike, *,
                         dim: int = 0) -> tuple[ArrayLike, ArrayLike]:
    """The inverse of ``interleave_gate_up``: ``(w_gate, w_up)`` from the interleaved operand
    (``dim``: its interleaved dimension, 2 I entries, a multiple of 16). New contiguous arrays
    of the same kind. Errors as ``interleave_gate_up``."""
    _namespace(w_gate_up, "w_gate_up")
    d = _feature_dim(w_gate_up, "w_gate_up", dim)
    shape = tuple(w_gate_up.shape)
    if shape[d] % (2 * GATE_BLOCK):
        raise ValueError(f"w_gate_up: expected dimension {d} (gate and up features) to be a "
                         f"multiple of {2 * GATE_BLOCK}, got shape {shape}")
    blocks = w_gate_up.reshape(shape[:d] + (shape[d] // (2 * GATE_BLOCK), 2, GATE_BLOCK)
                               + shape[d + 1:])
    half = shape[:d] + (shape[d] // 2,) + shape[d + 1:]
    lead = (slice(None),) * (d + 1)
    return _copy(blocks[lead + (0,)].reshape(half)), _copy(blocks[lead + (1,)].reshape(half))


def _copy(x):
    """A new array (a reshape may return a view when there is a single block)."""
    return x.clone() if hasattr(x, "clone") else x.copy()


# ---- validation ----------------------------------------------------------------------------------

def check_gated(activation, tb, N, c, beta):
    """``gemm``'s checks of a gated call (``activation`` in ``GATED_ACTIVATIONS``): no
    ``beta * c`` term, and b's N whole gate / up block pairs."""
    if c is not None and beta != 0.0:
        raise ValueError(f"beta: beta * c is not supported with activation={activation!r} "
                         f"(expected beta=0 or c=None, got beta={beta})")
    if N % (2 * GATE_BLOCK):
        raise ValueError(f"b: activation={activation!r} expects N, b's gate and up columns "
                         f"interleaved in blocks of {GATE_BLOCK} (interleave_gate_up), to be a "
                         f"multiple of {2 * GATE_BLOCK}, got shape {tb.shape}")


# ---- split-K reduce ------------------------------------------------------------------------------

def gated_reduce_kernel_fn(out_dtype, bias_dtype, act):
    """The split-K reduce kernel of a gated activation; same parameters as ``gemm``'s plain one
    (``c``, ``sc_m``, ``sc_n``, ``beta`` unused). Each thread takes output elements (m, j):
    ``combine(sum_z ws[z, m, n], sum_z ws[z, m, n + 8])``, n = b's gate column of j, the
    partials summed in split order (as the plain reduce). ``splits == 0`` gives the K = 0
    result ``act(bias_gate) * bias_up``."""
    bias_pair, combine = gated_epilogue(bias_dtype, act, out_dtype)
    store = storer(out_dtype)

    def gated_reduce_kernel(ws, out, c, bias, M, N, splits, so_m, so_n, sc_m, sc_n, alpha,
                            beta):
        mn = M * N
        half = N >> 1
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        while i < M * half:
            m = i // half
            j = i - m * half
            n = gate_column(j)
            gate = np.float32(0.0)
            up = np.float32(0.0)
            for z in range(splits):
                gate += ws[z * mn + m * N + n]
                up += ws[z * mn + m * N + n + GATE_BLOCK]
            bias_gate, bias_up = bias_pair(bias, n, N)
            store(out, m * so_m + j * so_n, combine(gate, up, bias_gate, bias_up, alpha))
            i += step

    return gated_reduce_kernel
