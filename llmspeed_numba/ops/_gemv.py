"""GEMM for a few rows of ``a`` (decode: M <= 4) streaming a K-major ``b`` (a Linear weight's
``W.T`` view) at memory speed, on CUDA cores: at these M a Tensor Core tile computes mostly padding,
and what matters is how many bytes of the weight each SM keeps in flight.

A block of ``warps`` warps owns ``cols`` output columns (rows of W) and splits K between its warps
in contiguous stretches; lane ``l`` of a warp reads 16-byte chunks (8 values) ``l, l + 32, ...``
of its stretch from every one of the block's W rows, ``unroll`` chunk steps a loop iteration, all
their loads issued before the multiply-adds that use them, and the matching chunks of the ``a``
rows (small, cached). Each thread keeps ``rows x cols`` fp32 sums; the warp adds them across lanes
with shuffles, the block across warps in warp order through shared memory (the same order every
call: bitwise reproducible), and one thread an output applies the GEMM epilogue.

Gated activations (``gemm_gated``): a block owns ``cols / 2`` output columns and reads, for each,
its gate row of W and the up row ``GATE_BLOCK`` further (the interleaved layout); the grid is the
same ``ceil(N / cols)``.

Same kernel parameters as the Tensor Core kernel (``gemm._signature``; the split-K workspace and
tickets are not used); needs K a multiple of 8 and both operands allowing 16-byte loads.

Launched as a programmatic dependent (``programmatic``), a block first releases the next
programmatic kernel's launch, then waits for the previous kernel (``griddep_wait``) before any
memory access: its launch and set-up overlap that kernel's end. (No operand is read before the
wait: ``b`` may be what that kernel writes.)
"""

import numpy as np

from .. import ptx
from .._env import cuda
from ._activations_device import GATED_ACTIVATIONS
from ._epilogue import GATE_BLOCK, epilogue, gate_column, gated_epilogue, storer


def make_kernel(rows, cols, warps, unroll, is_bf16, out_dtype, c_dtype, bias_dtype, act,
                programmatic=False):
    """The kernel function (not yet jitted) for M <= ``rows``; ``cols`` rows of W a block of
    ``32 * warps`` threads (grid: ``ceil(N / cols)`` blocks; a gated ``act`` needs ``cols``
    even)."""
    gated = act in GATED_ACTIVATIONS
    half = cols // 2
    if gated:
        bias_pair, combine = gated_epilogue(bias_dtype, act, out_dtype)
        store = storer(out_dtype)
        apply_epilogue = None
    else:
        bias_pair = combine = store = None
        apply_epilogue = epilogue(out_dtype, c_dtype, bias_dtype, act)
    unpack = ptx.unpack_bf16x2 if is_bf16 else ptx.unpack_f16x2
    sums = rows * cols
    threads = 32 * warps

    @cuda.jit(device=True, inline="always")
    def w_row(block, r):
        # the column of b (row of W) that the block's sum r accumulates
        if gated:
            col = gate_column(block * half + r % half)
            return col + GATE_BLOCK if r >= half else col
        return block * cols + r

    @cuda.jit(device=True, inline="always")
    def accumulate(acc, xw, ww, u, m, r):
        # acc[m * cols + r] += the 8-value dot product of step u's x chunk m and weight chunk r
        s = acc[m * cols + r]
        for i in range(4):
            x0, x1 = unpack(xw[u, m, i])
            w0, w1 = unpack(ww[u, r, i])
            s += x0 * w0
            s += x1 * w1
        acc[m * cols + r] = s

    def gemv_kernel(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, mn, sc_m, sc_n, alpha,
                    beta, k_split, tiles_m, tiles_n, out_vec, ws, tickets):
        if programmatic:
            ptx.griddep_launch_dependents()
            ptx.griddep_wait()
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        block = cuda.blockIdx.x
        chunks = K // 8
        per_warp = (chunks + warps - 1) // warps
        lo = warp * per_warp
        hi = min(chunks, lo + per_warp)

        acc = cuda.local.array(sums, np.float32)
        for i in range(sums):
            acc[i] = np.float32(0.0)
        # rows past M / columns past N read row M - 1 / column N - 1 (valid memory) and are
        # never stored
        a_row = cuda.local.array(rows, np.int64)
        for m in range(rows):
            a_row[m] = min(m, M - 1) * np.int64(lda)
        b_row = cuda.local.array(cols, np.int64)
        for r in range(cols):
            b_row[r] = min(w_row(block, r), N - 1) * np.int64(ldb)

        xw = cuda.local.array((unroll, rows, 4), np.uint32)
        ww = cuda.local.array((unroll, cols, 4), np.uint32)
        ch = lo + lane
        while ch < hi:
            # every load of the iteration first: unroll x (rows + cols) 16-byte loads in flight
            for u in range(unroll):
                k = np.int64(ch + 32 * u) * 8
                if ch + 32 * u < hi:
                    for r in range(cols):
                        w = ptx.load_u32x4(b, b_row[r] + k)
                        for i in range(4):
                            ww[u, r, i] = w[i]
                    for m in range(rows):
                        x = ptx.load_u32x4(a, a_row[m] + k)
                        for i in range(4):
                            xw[u, m, i] = x[i]
            for u in range(unroll):
                if ch + 32 * u < hi:
                    for m in range(rows):
                        for r in range(cols):
                            accumulate(acc, xw, ww, u, m, r)
            ch += 32 * unroll

        # lanes, then warps in a fixed order
        part = cuda.shared.array((warps, sums), np.float32)
        for i in range(sums):
            v = acc[i]
            for offset in (16, 8, 4, 2, 1):
                v += ptx.shfl_xor_f32(v, offset)
            if lane == 0:
                part[warp, i] = v
        cuda.syncthreads()
        if gated:
            t = tid
            while t < rows * half:
                m = t // half
                jj = t % half
                j = block * half + jj
                if m < M and j < N // 2:
                    gate = part[0, m * cols + jj]
                    up = part[0, m * cols + jj + half]
                    for w in range(1, warps):
                        gate += part[w, m * cols + jj]
                        up += part[w, m * cols + jj + half]
                    n = gate_column(j)
                    bias_gate, bias_up = bias_pair(bias, n, N)
                    store(out, m * so_m + j * so_n, combine(gate, up, bias_gate, bias_up, alpha))
                t += threads
        else:
            t = tid
            while t < sums:
                m = t // cols
                n = block * cols + t % cols
                if m < M and n < N:
                    s = part[0, t]
                    for w in range(1, warps):
                        s += part[w, t]
                    apply_epilogue(s, n, out, m * so_m + n * so_n, c, m * sc_m + n * sc_n,
                                   bias, alpha, beta)
                t += threads

    return gemv_kernel
