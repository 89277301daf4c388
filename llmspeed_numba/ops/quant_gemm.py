"""Weight-only quantized GEMM: ``out = activation(x @ W^T + bias)``, W a ``QuantizedWeight``.

``x`` is (M, K) fp16 / bf16 with a contiguous last dimension (any row stride); W stands for the
(N, K) matrix ``qw.dequantize()`` (torch.nn.Linear's layout; formats in ``quant_weight``);
``bias`` (N,) fp16 / bf16 / fp32; ``out`` (M, N), any non-negative strides, fp16 / bf16 / fp32
(default: ``out``'s dtype when given, else x's).

Paths (kernels in ``_quant_stream``, ``_quant_kernels``, ``_quant_tc``):

- 4-bit weights with N a multiple of 16, M <= ``STREAM_MAX_M`` (groups of 32: M in
  ``STREAM_G32_M``), Hopper: the streaming kernel (``_quant_stream``): codes bulk-copied through
  an mbarrier ring by a producer warp, dequantized in registers (PRMT into a half's mantissa, one
  packed subtraction a pair, exact) and summed by ``mma.sync``, each scale unit's sum scaled in
  fp32; K split by whole stages, the last block finishing (one launch).
- else M <= ``DECODE_PLANNED_MAX_M`` (4 for int4, 2 for int8; up to ``DECODE_MAX_M`` = 16 when
  forced): the streaming SIMT kernel. Codes are unpacked in registers
  right before the math (bit operations and one FADD an element, the scale once per 16-byte chunk
  and row), products summed in fp32, the epilogue in fp32 with one rounding. Blocks of
  ``BLOCK_N`` output columns, K split over enough blocks to keep every SM's loads in flight
  (``BLOCKS_PER_SM``); with more than one split, fp32 partial sums that the last block of each
  column range sums (one launch).
- M >= ``DEQUANT_GEMM_MIN_M`` (prefill): the weight dequantized into a temporary (N, K) array of
  x's dtype (``_quant_kernels.dequant_kernel``: each element rounded once, as the Tensor Core
  kernel's operand is), then ``gemm`` (wgmma on Hopper): at large M the GEMM's FLOPs dwarf the
  extra pass over the weight (as vLLM's AWQ path does above 256 tokens).
- else the Tensor Core kernel (``_quant_tc``): x tiles and the packed codes staged in shared
  memory by 16-byte ``cp.async``, the codes dequantized in registers right before ``mma.sync``
  m16n8k16 (bit operations, one FADD and one FMUL an element, a pair rounded to x's dtype with
  one conversion; the group's scale / zero point / minimum per chunk), fp32 accumulation, gemm's
  staged epilogue. Every format (int4 symmetric, zero points, GGUF Q4_0 / Q4_1 / Q8_0, GPTQ,
  int8) and fp16 / bf16 x. Tiles by M (``tc_tile``); with few output tiles, K split over
  ``blockIdx.y`` (fp32 partial sums and gemm's split-K reduce, as gemm plans it).

Act-order GPTQ (``k_perm``): x's columns are first gathered into the weight's stored order (one
small kernel).

FP8 weights (``"fp8_e4m3"``, W8A8): x quantized per token, then a Hopper wgmma GEMM with e4m3
operands (``_fp8_gemm``; sm_90 only, every M).

Not yet: a wgmma kernel dequantizing in registers at large M (int4 / int8; the dequantize-then-
gemm path stands in for it), Marlin's half2 dequantization (``lop3`` into an fp16
/ bf16 mantissa, one HFMA2 a pair: needs the scales in x's dtype), a
fragment-ordered packed layout (one shared load per lane for several fragments); the Tensor Core
kernel's tiles are untuned (measurements: benchmarks/NOTES.md).
"""


import numpy as np

from .. import compile_check
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import (bias_vector, choice, last_dim_contiguous, no_overlap,
                       non_negative_strides, one_of_dtypes, output, result_dtype, same_dtype,
                       shape, tensor)
from .._env import SIMULATOR
from .._launch import (blocks_by_shared_memory, max_shared_per_block_optin, programmatic_launch,
                       sm_count)
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, DTypeLike, StreamLike
from .._workspace import workspace
from . import _fp8_gemm, _quant_stream, _quant_tc
from . import _quant_kernels as qk
from . import _rowwise as rw
from ._activations_device import ACTIVATIONS, GATED_ACTIVATIONS
from ._epilogue import GATE_BLOCK, vector_width
from . import gemm as _gemm
from .gemm import _address, _vector_ok, launch_splitk_reduce, splitk_partials
from .gemm_configs import wgmma_supported
from .quant_weight import QuantizedWeight

X_DTYPES = ("float16", "bfloat16")
OUT_DTYPES = ("float16", "bfloat16", "float32")
#: ``activation=`` values: gemm's, with its gated ones (the weight's rows gate and up
#: interleaved in blocks of ``GATE_BLOCK``, ``interleave_gate_up``; the result has N / 2 columns).
QUANT_ACTIVATIONS = ACTIVATIONS + tuple(GATED_ACTIVATIONS)
#: Largest M the decode kernel takes: its accumulators are a compile-time 1, 2, 4, 8 or 16 rows.
DECODE_MAX_M = 16
#: Largest M planned on the decode kernel, by code bits: above it the Tensor Core kernel is
#: faster (both timed at N x K = 4096 x 14336 and 14336 x 4096, benchmarks/NOTES.md).
DECODE_PLANNED_MAX_M = {4: 4, 8: 2}
#: Smallest M that dequantizes the weight and runs ``gemm`` (int4 / int8 weights).
DEQUANT_GEMM_MIN_M = 128
#: Output columns (weight rows) per decode block, one a thread: 128 keeps a warp's 16-byte loads
#: on 512 contiguous bytes and a block's x tile shared by 4 warps (untuned: no GPU run yet).
BLOCK_N = 128
#: Target decode blocks per SM when choosing the split of K (untuned).
BLOCKS_PER_SM = 8
#: Tensor Core tiles (block_m, block_n, block_k, warps_m, warps_n, stages, group_m) by the
#: largest M they take (untuned: no GPU run yet). One warp row (``warps_m`` 1) up to M = 64: each
#: warp dequantizes its own B fragments, so warps stacked along M repeat that work; block_k 64:
#: two int4 / four int8 chunks of a row per stage; 64 x 32 warp tiles (64 fp32 accumulators).
TC_TILES = ((32, (32, 128, 64, 1, 4, 4, 8)),
            (64, (64, 128, 64, 1, 4, 4, 8)),
            (None, (128, 128, 64, 2, 4, 3, 8)))
#: The simulator's tile: one warp, two n8 fragments, one int4 / two int8 chunks a stage.
SIM_TC_TILE = (16, 16, 32, 1, 1, 2, 8)
#: Largest M on the streaming kernel (``_quant_stream``: 4-bit weights, N a multiple of 16,
#: Hopper): its accumulators are one or two 8-token fragments.
STREAM_MAX_M = 16
#: Groups of 32 (GGUF's blocks) stream a copy of scales (and minimums) a chunk: the decode
#: kernel is faster up to M = 3 and the Tensor Core kernel above 8 (benchmarks/NOTES.md).
STREAM_G32_M = (4, 8)
#: Consumer warps of a streaming block (16 output columns each: 8 was faster than 4 at every
#: timed shape of groups of 128 but 14336 x 4096 M = 1), ring stages, and the blocks an SM the
#: split of K aims at.
STREAM_WARPS = 8
STREAM_STAGES = 4
STREAM_BLOCKS_PER_SM = 3
#: Blocks an SM the split plan counts on for affine weights (GGUF Q4_1: minimums and x's sums
#: a scale unit): their kernel takes ~93 registers (sm_90a, M = 1), too many for three.
STREAM_AFFINE_BLOCKS_PER_SM = 2


def stream_register_budget(blocks_per_sm):
    """Registers a thread of a streaming block may use for ``blocks_per_sm`` blocks an SM
    (65536 an SM, allocated 8 a thread at a time): the compile checks hold the registered
    one-fragment variants to the split plan's count."""
    return 65536 // (blocks_per_sm * 32 * (STREAM_WARPS + 1)) // 8 * 8
#: A block's fixed cost (barriers, x staged, the first copies' latency, its partial sums) in
#: stages, for the split plan: one more split is worth it only if it saves a wave.
STREAM_BLOCK_COST_STAGES = 1
#: Most shared memory a streaming block's staged x may take (bytes): a larger K range is split.
STREAM_X_BYTES = 64 * 1024
#: At M > 8 (two 8-token fragments) the split aims at one block an SM, x up to twice
#: ``STREAM_X_BYTES``: there more splits (more blocks an SM) were slower at every N > 6144
#: timed, K = 4096 unsplit fastest at N = 14336 and 28672 (benchmarks/NOTES.md, session 26).
STREAM_TWO_FRAGMENT_BLOCKS_PER_SM = 1
#: ``splits``: None (planned) or a forced split count (every kernel); ``block_n``: decode block
#: width; ``decode_max_m``: None (``DECODE_PLANNED_MAX_M``) or the largest M on the decode
#: kernel (tests force either path with it); ``tc_tile``: None (``TC_TILES`` by M) or a forced
#: Tensor Core tile; ``stream_max_m``: None (``STREAM_MAX_M``) or the largest M on the
#: streaming kernel (0: never); ``dequant_min_m``: None (``DEQUANT_GEMM_MIN_M``) or the
#: smallest M that dequantizes and runs ``gemm``.
TUNING = Knobs("quant_gemm", decode_max_m=None, block_n=32 if SIMULATOR else BLOCK_N,
               splits=None, blocks_per_sm=BLOCKS_PER_SM,
               tc_tile=SIM_TC_TILE if SIMULATOR else None, stream_max_m=None,
               fused_norm_max_m=None,
               stream_warps=1 if SIMULATOR else STREAM_WARPS,
               stream_stages=2 if SIMULATOR else STREAM_STAGES,
               stream_blocks_per_sm=STREAM_BLOCKS_PER_SM, dequant_min_m=None)


#: Largest M ``quant_gemm_rms_norm`` fuses (0: never, the two calls). Off: in Llama-3-8B's int4
#: decode (H200, benchmarks/NOTES.md session 34) the fused streaming kernel took ~2.9 us a call
#: more than the plain one plus ``rms_norm`` (its ticket's fence in every block, the last block
#: norming alone), more than the launch gap it saves. ``fused_norm_max_m`` turns it on.
FUSED_NORM_MAX_M = 0


def on_stream_kernel(qw, M):
    """Whether M rows of x against ``qw`` run on the streaming kernel."""
    max_m = STREAM_MAX_M if TUNING.stream_max_m is None else TUNING.stream_max_m
    if qw.groups > 1 and qw.group_size == 32 and TUNING.stream_max_m is None:
        low, high = STREAM_G32_M
        if not low <= M <= high:
            return False
    return (M <= min(max_m, STREAM_MAX_M) and qw.bits == 4 and qw.N % 16 == 0
            and (qw.groups == 1 or qw.group_size in (32, 64, 128)) and wgmma_supported())


def stream_plan(qw, M):
    """(m_block, group_chunks, splits, kspan) of the streaming kernel: K split by whole stages
    into the most splits whose blocks all run at once (one wave: resident blocks by
    ``stream_blocks_per_sm``, ``STREAM_TWO_FRAGMENT_BLOCKS_PER_SM`` at M > 8, and the shared
    memory a block of that span takes), else (more column blocks than one wave holds) the
    fewest that minimise waves x a block's time (a partial wave costs a whole one; a block costs
    its stages and ``STREAM_BLOCK_COST_STAGES``); x's staged bytes, the block's shared memory
    and the partial sums' traffic bounded."""
    m_block = _m_block(M)
    block_n = 16 * TUNING.stream_warps
    S = _quant_stream.STAGE_CHUNKS
    chunks = _cdiv(qw.K_padded, _quant_stream.CHUNK_K)
    stages_total = _cdiv(chunks, S)
    group_chunks = 0 if qw.groups == 1 else qw.group_size // _quant_stream.CHUNK_K
    if TUNING.splits is not None:
        splits = max(1, min(TUNING.splits, stages_total))
    else:
        column_blocks = _cdiv(qw.N, block_n)
        two_fragments = m_block > 8
        per_sm = STREAM_TWO_FRAGMENT_BLOCKS_PER_SM if two_fragments else TUNING.stream_blocks_per_sm
        if qw.mode == "affine":
            per_sm = min(per_sm, STREAM_AFFINE_BLOCKS_PER_SM)
        # partial sums (8 bytes an output, written and read) at most a quarter of the codes'
        cap = max(1, qw.K_padded // (64 * M))
        x_bytes = STREAM_X_BYTES * (2 if two_fragments else 1)
        x_stages = x_bytes // (m_block * S * _quant_stream.CHUNK_K * 2)
        least = _cdiv(stages_total, max(1, x_stages))

        def shared(splits):
            return _quant_stream.shared_bytes(
                TUNING.stream_warps, TUNING.stream_stages, m_block,
                _cdiv(stages_total, splits) * S, group_chunks, qw.mode, qw.scale_dtype)

        limit = max_shared_per_block_optin() - 1024   # static shared memory: the barriers
        while least < stages_total and shared(least) > limit:
            least += 1

        def blocks(splits):
            return column_blocks * _cdiv(stages_total, _cdiv(stages_total, splits))

        def resident(splits):
            return min(per_sm, blocks_by_shared_memory(shared(splits) + 1024)) * sm_count()

        # more column blocks than one wave holds (the LM head's shape): resident blocks by the
        # register bound alone, as session 26 planned them (128256 x 4096 M = 1 unsplit, 2.9x
        # cuBLAS); counting shared memory there too would split it, untimed
        def cost(splits):
            span = _cdiv(stages_total, splits)
            waves = _cdiv(blocks(splits), per_sm * sm_count())
            return waves * (span + STREAM_BLOCK_COST_STAGES)

        candidates = range(least, max(least, min(cap, stages_total)) + 1)
        one_wave = [s for s in candidates if blocks(s) <= resident(s)]
        if one_wave:
            splits = max(one_wave, key=lambda s: (blocks(s), -s))
        else:
            splits = min(candidates, key=lambda s: (cost(s), s))
    kspan = _cdiv(stages_total, splits) * S
    return m_block, group_chunks, _cdiv(chunks, kspan), kspan


def on_decode_kernel(qw, M):
    """Whether M rows of x against ``qw`` run on the decode kernel (else the Tensor Core one)."""
    max_m = TUNING.decode_max_m
    if max_m is None:
        max_m = DECODE_PLANNED_MAX_M[qw.bits]
    return M <= min(max_m, DECODE_MAX_M)


def on_dequant_gemm(qw, M):
    """Whether M rows of x against ``qw`` dequantize it and run ``gemm``."""
    min_m = DEQUANT_GEMM_MIN_M if TUNING.dequant_min_m is None else TUNING.dequant_min_m
    return M >= min_m


def _cdiv(a, b):
    return -(-a // b)


def _m_block(M):
    """Rows of the decode kernel's accumulators: the power of two >= M."""
    return 1 << max(0, (M - 1).bit_length())


def decode_plan(qw, M):
    """(block_n, splits, k_split) of the decode kernel for ``qw`` and M rows."""
    block_n = TUNING.block_n
    tile_k = qk.tile_k(qw.bits)
    tiles = _cdiv(qw.K_padded, tile_k)
    if TUNING.splits is not None:
        splits = TUNING.splits
    else:
        want = _cdiv(TUNING.blocks_per_sm * sm_count(), _cdiv(qw.N, block_n))
        # partial sums (written and read: 8 bytes a row) at most a quarter of the codes' bytes
        cap = qw.K_padded * qw.bits // (256 * M)
        splits = min(want, cap)
    splits = max(1, min(splits, tiles))
    k_split = _cdiv(tiles, splits) * tile_k
    return block_n, _cdiv(qw.K_padded, k_split), k_split


def group_shift(qw):
    """The decode kernel's ``k >> shift`` for k's group: log2 of the group size (a power of
    two: 32, 64, 128), or 31 for one group a row (k < 2^31)."""
    if qw.groups == 1:
        return 31
    shift = qw.group_size.bit_length() - 1
    if qw.group_size != 1 << shift:
        raise AssertionError(f"group size {qw.group_size} is not a power of two")
    return shift


def _buffers(qw):
    scales = kernel_buffer(tensor(qw.scales, "qw.scales"))
    aux = kernel_buffer(tensor(qw.aux, "qw.aux")) if qw.aux is not None else scales
    return kernel_buffer(tensor(qw.qweight, "qw.qweight")), scales, aux


def _split_buffers(tx, stream, col_blocks, splits, M, N):
    """(tickets, partial sums) of a kernel whose last block of each column range finishes a
    split K: a ticket counter a column block, and fp32 sums (splits, M, N); without a split the
    sums are not read (the tickets stand in)."""
    counters = workspace(tx, stream, "quant_gemm_tickets", col_blocks, np.int32,
                         own_in_graph="graph")
    return counters, splitk_partials(tx, stream, splits * M * N) if splits > 1 else counters


def _decode(tx, qw, tbias, to, out_dtype, activation, stream, norm=None):
    """The decode kernel; ``norm`` as ``_stream``'s."""
    M, K = tx.shape
    N = qw.N
    block_n, splits, k_split = decode_plan(qw, M)
    bias_dtype = tbias.dtype if tbias is not None else None
    partial = splits > 1
    kernel = qk.decode_kernel(qw.bits, _m_block(M), block_n, qw.mode, qw.zero_point,
                              qw.scale_dtype, tx.dtype, out_dtype, bias_dtype, activation,
                              partial, None if norm is None else norm[1].dtype)
    codes, scales, aux = _buffers(qw)
    out_buf = kernel_buffer(to)
    bias_buf = kernel_buffer(tbias) if tbias is not None else out_buf
    col_blocks = _cdiv(N, block_n)
    counters, work = _split_buffers(tx, stream, col_blocks + (norm is not None), splits, M, N)
    x_sm = tx.strides[0] if M > 1 else K
    so_m, so_n = to.strides
    args = (kernel_buffer(tx), codes, scales, aux, out_buf, bias_buf, work, counters, M, N, K,
            x_sm, group_shift(qw), k_split, so_m, so_n)
    kernel((col_blocks, splits), block_n, args + _norm_args(norm, to), stream)


def tc_tile(M):
    """The Tensor Core kernel's tile for M rows."""
    if TUNING.tc_tile is not None:
        return TUNING.tc_tile
    for max_m, tile in TC_TILES:
        if max_m is None or M <= max_m:
            return tile


def tc_plan(qw, M):
    """(tile, splits, k_split) of the Tensor Core kernel: K split (as ``gemm_configs.
    split_count``) for about two waves of blocks, each split at least two K tiles, the fp32
    partial sums' traffic bounded by the codes'."""
    tile = tc_tile(M)
    block_m, block_n, block_k = tile[:3]
    kp = qw.K_padded
    k_tiles = _cdiv(kp, block_k)
    if TUNING.splits is not None:
        splits = TUNING.splits
    else:
        tiles = _cdiv(M, block_m) * _cdiv(qw.N, block_n)
        want = (2 * sm_count()) // tiles
        # partial sums: 8 bytes an output (written and read) against N * K * bits / 8 of codes
        cap = min(k_tiles // 2, max(1, kp * qw.bits // (64 * M)), 32)
        splits = min(want, cap)
    splits = max(1, min(splits, k_tiles))
    k_split = _cdiv(k_tiles, splits) * block_k
    return tile, _cdiv(kp, k_split), k_split


def _stream(tx, qw, tbias, to, out_dtype, activation, stream, norm=None, x_norm=None,
            accumulate=False):
    """The streaming kernel; ``norm``: ``(residual, norm weight, normed, eps)`` tensors of
    ``quant_gemm_rms_norm``, fused after the GEMM; ``x_norm``: ``(norm weight, eps)``, x's rows
    normed before it (``stream_norm_gemm``); ``accumulate``: the result added into ``to``
    (``stream_add_gemm``)."""
    M, K = tx.shape
    N = qw.N
    m_block, group_chunks, splits, kspan = stream_plan(qw, M)
    warps, stages = TUNING.stream_warps, TUNING.stream_stages
    partial = splits > 1
    kernel = _quant_stream.stream_kernel(warps, stages, m_block, group_chunks, qw.mode,
                                         qw.zero_point, qw.scale_dtype, tx.dtype, out_dtype,
                                         tbias.dtype if tbias is not None else None,
                                         activation, partial, programmatic_launch(),
                                         None if norm is None else norm[1].dtype,
                                         None if x_norm is None else x_norm[0].dtype,
                                         accumulate)
    codes, scales, aux = _buffers(qw)
    out_buf = kernel_buffer(to)
    bias_buf = kernel_buffer(tbias) if tbias is not None else out_buf
    col_blocks = _cdiv(N, 16 * warps)
    # the fused norm's ticket follows the column blocks' (``_quant_stream.kernel_fn``)
    counters, work = _split_buffers(tx, stream, col_blocks + (norm is not None), splits, M, N)
    x_sm = tx.strides[0] if M > 1 else K
    x_buf = kernel_buffer(tx)
    x_vec = _address(x_buf) % 16 == 0 and x_sm % 8 == 0 and K % 8 == 0
    so_m, so_n = to.strides
    args = (x_buf, codes, scales, aux, out_buf, bias_buf, work, counters, M, N, K, x_sm, kspan,
            so_m, so_n, x_vec)
    if x_norm is not None:
        args += (kernel_buffer(x_norm[0]), np.float32(x_norm[1]))
    kernel((col_blocks, splits), 32 * (warps + 1), args + _norm_args(norm, to), stream,
           _quant_stream.shared_bytes(warps, stages, m_block, kspan, group_chunks, qw.mode,
                                      qw.scale_dtype))


def _norm_args(norm, to):
    """The fused norm's kernel arguments (``_quant_kernels.norm_types``), or none; ``to``: the
    projection's output, which the norm reads back."""
    if norm is None:
        return ()
    tr, tw, tn, eps = norm
    width = rw.vector_width(to.dtype)
    vec = (to.shape[1] % width == 0 and to.strides[1] == 1 and tw.ptr % 16 == 0
           and all(rw.vector_aligned(t, t.strides[0], width) for t in (to, tr, tn)))
    return (kernel_buffer(tr), kernel_buffer(tw), kernel_buffer(tn), tr.strides[0],
            tn.strides[0], np.float32(eps), vec)


def _dequant_gemm(tx, qw, bias, activation, out, out_dtype, stream):
    """The weight dequantized to a new (N, K) array of x's dtype, then ``gemm`` (x @ w.T)."""
    N, K = qw.shape
    w = empty(tx, (N, K), tx.dtype)
    codes, scales, aux = _buffers(qw)
    vector = K % qk.DEQUANT_VECTOR == 0
    threads = qk.dequant_threads(qw.bits, qw.K_padded, N, vector)
    kernel = qk.dequant_kernel(qw.bits, qw.mode, qw.zero_point, qw.scale_dtype, tx.dtype, vector)
    kernel((_cdiv(threads, qk.DEQUANT_THREADS),), qk.DEQUANT_THREADS,
           (codes, scales, aux, kernel_buffer(tensor(w, "w")), N, K, group_shift(qw)), stream)
    _gemm._gemm_checked(tx.obj, w.T, None, 1.0, 0.0, bias, activation, out, out_dtype, "auto",
                        None, stream)


def _through_fp32(plain, tx, N, tbias, to, out_dtype, activation, stream):
    """A gated ``activation`` on a path whose kernel has no gated epilogue: ``plain(tmp)``
    writes the plain sums into a new fp32 (M, N) array, then gemm's split-K reduce (one split)
    pairs each gate column with its up column (bias, activation, one rounding)."""
    M = tx.shape[0]
    tmp = tensor(empty(tx, (M, N), "float32"), "out")
    plain(tmp)
    launch_splitk_reduce(kernel_buffer(tmp), to, None, tbias, M, N, N // 2, 1, out_dtype,
                         activation, 1.0, 0.0, stream)


def _tensor_core(tx, qw, tbias, to, out_dtype, activation, stream):
    M, K = tx.shape
    N = qw.N
    tile, splits, k_split = tc_plan(qw, M)
    block_m, block_n, block_k, warps_m, warps_n, stages, _ = tile
    gated = activation in GATED_ACTIVATIONS
    partial = splits > 1 or gated   # the reduce's epilogue pairs gate and up columns
    bias_dtype = tbias.dtype if tbias is not None and not partial else None
    kernel_out = "float32" if partial else out_dtype
    x_sm = tx.strides[0]
    a_vec = _vector_ok(tx, x_sm)
    kernel = _quant_tc.tc_kernel(qw.bits, tile, a_vec, qw.mode, qw.zero_point, qw.scale_dtype,
                                 tx.dtype, kernel_out, bias_dtype,
                                 None if partial else activation, qw.groups == 1)
    codes, scales, aux = _buffers(qw)
    if partial:
        out_buf = bias_buf = splitk_partials(tx, stream, splits * M * N)
        so_m, so_n = N, 1
    else:
        out_buf = kernel_buffer(to)
        bias_buf = kernel_buffer(tbias) if tbias is not None else out_buf
        so_m, so_n = to.strides
    out_vec = int(so_n == 1 and so_m % vector_width(kernel_out) == 0
                  and _address(out_buf) % 16 == 0)
    tiles_m, tiles_n = _cdiv(M, block_m), _cdiv(N, block_n)
    kernel((tiles_m * tiles_n, splits), 32 * warps_m * warps_n,
           (kernel_buffer(tx), codes, scales, aux, out_buf, bias_buf, M, N, K, x_sm,
            qw.group_size, k_split, tiles_m, tiles_n, so_m, so_n, M * N, out_vec), stream,
           _quant_tc.shared_bytes(qw.bits, block_m, block_n, block_k, stages))
    if partial:
        launch_splitk_reduce(out_buf, to, None, tbias, M, N, N // 2 if gated else N, splits,
                             out_dtype, activation, 1.0, 0.0, stream)


def _gather_columns(tx, qw, stream):
    """x's columns in the act-order weight's stored order, into a new (M, K) array."""
    M, K = tx.shape
    gathered = empty(tx, (M, K), tx.dtype)
    tg = tensor(gathered, "x")
    kernel = qk.gather_kernel(tx.dtype)
    kernel((_cdiv(M * K, qk.GATHER_THREADS),), qk.GATHER_THREADS,
           (kernel_buffer(tx), kernel_buffer(tensor(qw.k_perm, "qw.k_perm")), kernel_buffer(tg),
            M, K, tx.strides[0]), stream)
    return tg


_QUANT_GEMM_CALLS = OpCalls("quant_gemm")


def quant_gemm(x: ArrayLike, qw: QuantizedWeight, *, bias: ArrayLike | None = None,
               activation: str | None = None, out: ArrayLike | None = None,
               out_dtype: DTypeLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """``out = activation(x @ qw.dequantize().T + bias)``, (M, N).

    Args:
        x: (M, K) fp16 / bf16, last dimension contiguous; K must be qw's K.
        qw: a ``QuantizedWeight`` (``quantize_weight``, ``QuantizedWeight.from_gguf`` /
            ``from_gptq`` / ``from_awq``) whose arrays live where x does.
        bias: optional (N,) fp16 / bf16 / fp32, contiguous.
        activation: None, "relu", "gelu" (tanh form) or "silu"; or gated, "silu_and_mul" /
            "gelu_and_mul": qw's rows are gate and up interleaved in blocks of 8
            (``interleave_gate_up`` before quantizing; N a multiple of 16) and the result is
            ``act(x @ Wg^T + bg) * (x @ Wu^T + bu)``, (M, N / 2), as gemm's gated epilogue;
            a bias (N,) is interleaved the same way.
        out: optional (M, N) (gated: (M, N / 2)), any non-negative strides.
        out_dtype: fp16, bf16 or fp32; default: out's dtype when given, else x's.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns ``out`` (allocated in x's kind when not given). A gated activation is fused into
    the streaming kernel and into ``gemm`` (dequantize-then-gemm); the other kernels write fp32
    sums that gemm's split-K reduce pairs (one more launch). Arithmetic: products summed in fp32
    (the streaming kernel, 4-bit weights on Hopper at M up to 16: ``q - z`` exact on Tensor
    Cores, each group's sum scaled in fp32; the decode kernel, M up to 4 (int4) or 2 (int8): the
    weight exact in fp32; larger M: each weight element rounded once to x's dtype, Tensor
    Cores), the epilogue in fp32, one rounding to ``out_dtype``.
    An fp8_e4m3 weight (W8A8): x quantized per token to e4m3 (one fp32 scale a row, as the
    weight), e4m3 products summed by Hopper's FP8 wgmma, the two scales in the epilogue.

    Raises:
        TypeError: qw not a QuantizedWeight, a non-array, x not fp16 / bf16, bias / out /
            out_dtype of an unsupported dtype.
        ValueError: x not 2-D or its K not qw's, a non-contiguous last dimension, bias or out of
            the wrong shape, an unknown activation, a gated one with N not a multiple of 16.
        NotImplementedError: an fp8_e4m3 weight on a GPU other than Hopper (sm_90).
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw: expected a QuantizedWeight (quantize_weight, QuantizedWeight."
                        f"from_gguf / from_gptq / from_awq), got {type(qw).__name__}")
    result = _QUANT_GEMM_CALLS.replay((x, qw.qweight, qw.scales, qw.aux, qw.k_perm, bias, out),
                                      (qw.key, activation, out_dtype), stream)
    if result is MISS:
        result = _QUANT_GEMM_CALLS.record(_quant_gemm_checked, x, qw, bias, activation, out,
                                          out_dtype, stream)
    return result


def _checked_x(x, qw):
    """x as a ``Tensor`` (M, qw's K), fp16 / bf16, last dimension contiguous."""
    tx = tensor(x, "x", ndim=2)
    shape("x", tx, (None, qw.shape[1]), "to match qw's K (qw.shape = " + str(qw.shape) + ")")
    if tx.dtype not in X_DTYPES:
        raise TypeError(f"x: expected dtype in {X_DTYPES}, got {tx.dtype}")
    last_dim_contiguous("x", tx)
    return tx


def _checked_norm_weight(norm_weight, tx, length, what):
    """``norm_weight`` as a ``Tensor``: (``length``,), x's dtype or float32, contiguous."""
    tw = tensor(norm_weight, "norm_weight", ndim=1)
    shape("norm_weight", tw, (length,), "to match " + what)
    one_of_dtypes("norm_weight", tw, (tx.dtype, "float32"), "x's")
    if length > 1 and tw.strides[0] != 1:
        raise ValueError(f"norm_weight: expected a contiguous vector, got strides {tw.strides}")
    return tw


def _checked_residual(residual, tx, N):
    """``residual`` as a ``Tensor``: (x's M, N), x's dtype, last dimension contiguous,
    non-negative strides."""
    tr = tensor(residual, "residual", ndim=2)
    shape("residual", tr, (tx.shape[0], N), "to be (x's M, qw's N)")
    same_dtype("x", tx, residual=tr)
    last_dim_contiguous("residual", tr)
    non_negative_strides("residual", tr)
    if tx.shape[0] > 1 and tr.strides[0] < N:
        raise ValueError(f"residual: its rows overlap (row stride {tr.strides[0]} < {N} "
                         f"elements): updated in place, each element must be its own")
    return tr


def _quant_gemm_checked(x, qw, bias, activation, out, out_dtype, stream):
    """The checked path of ``quant_gemm`` (validation, planning, launch)."""
    tx = _checked_x(x, qw)
    N = qw.N
    M = tx.shape[0]
    tbias = bias_vector(bias, N, OUT_DTYPES, "(qw's N,)")
    choice("activation", activation, QUANT_ACTIVATIONS)
    gated = activation in GATED_ACTIVATIONS
    if gated and N % (2 * GATE_BLOCK):
        raise ValueError(f"activation: {activation!r} needs qw's N (gate and up rows "
                         f"interleaved in blocks of {GATE_BLOCK}) a multiple of "
                         f"{2 * GATE_BLOCK}, got N = {N}")
    out_cols = N // 2 if gated else N
    out_dtype = result_dtype(out_dtype, out, tx.dtype, OUT_DTYPES)
    to = output("out", out, (M, out_cols), out_dtype, tx)
    if to is None:
        out = empty(tx, (M, out_cols), out_dtype)
        to = tensor(out, "out")
    if M == 0:
        return out
    handle = stream_handle(stream, (tx,))
    if qw.format == "fp8_e4m3":   # W8A8 on Hopper
        if gated:
            _through_fp32(lambda tmp: _fp8_gemm.fp8_gemm(tx, qw, None, tmp, "float32", None,
                                                         handle),
                          tx, N, tbias, to, out_dtype, activation, handle)
        else:
            _fp8_gemm.fp8_gemm(tx, qw, tbias, to, out_dtype, activation, handle)
        return out
    if qw.k_perm is not None:
        tx = _gather_columns(tx, qw, handle)
    if on_stream_kernel(qw, M):
        _stream(tx, qw, tbias, to, out_dtype, activation, handle)
    elif on_decode_kernel(qw, M):
        if gated:
            _through_fp32(lambda tmp: _decode(tx, qw, None, tmp, "float32", None, handle),
                          tx, N, tbias, to, out_dtype, activation, handle)
        else:
            _decode(tx, qw, tbias, to, out_dtype, activation, handle)
    elif on_dequant_gemm(qw, M):
        _dequant_gemm(tx, qw, bias, activation, out, out_dtype, handle)
    else:
        _tensor_core(tx, qw, tbias, to, out_dtype, activation, handle)
    return out


_QUANT_GEMM_NORM_CALLS = OpCalls("quant_gemm_rms_norm")


def quant_gemm_rms_norm(x: ArrayLike, qw: QuantizedWeight, residual: ArrayLike,
                        norm_weight: ArrayLike, eps: float = 1e-6, *,
                        bias: ArrayLike | None = None, out: ArrayLike | None = None,
                        normed: ArrayLike | None = None,
                        stream: StreamLike = None) -> ArrayLike:
    """A projection, then vLLM's fused add + RMSNorm: ``h = x @ qw.dequantize().T + bias``
    (rounded to x's dtype, into ``out``), ``residual += h`` in place (rounded), and the result
    ``normed = rms_norm(residual) * norm_weight``: what ``rms_norm(quant_gemm(x, qw, bias=bias),
    norm_weight, eps, residual=residual)`` returns, as a decoder layer's output projection and
    the next norm run. Where the streaming or the decode kernel runs (4-bit weights on Hopper;
    int4 / int8 at M up to 4 / 2, GGUF blocks) and M is at most ``FUSED_NORM_MAX_M`` (0 by
    default: measured slower) it is one launch (the kernel's last block to finish adds and norms
    the rows); elsewhere those two calls. The norm's mean square is summed in another order than ``rms_norm``'s, so the
    two may differ in the last bit.

    Args:
        x: (M, K) fp16 / bf16, last dimension contiguous; K must be qw's K.
        qw: a ``QuantizedWeight`` whose arrays live where x does (not gated: N outputs).
        residual: (M, N), x's dtype, last dimension contiguous; updated in place.
        norm_weight: (N,) x's dtype or float32, contiguous.
        eps: added to the mean square (a finite number >= 0).
        bias: optional (N,) fp16 / bf16 / fp32, contiguous.
        out: optional (M, N) of x's dtype for ``h`` (else a new array; read back by the norm).
        normed: optional (M, N) of x's dtype, last dimension contiguous.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns ``normed`` (allocated in x's kind when not given).

    Raises:
        TypeError / ValueError: as ``quant_gemm`` and ``rms_norm`` for the arguments they share;
            ``out``, ``residual`` and ``normed`` overlapping.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw: expected a QuantizedWeight (quantize_weight, QuantizedWeight."
                        f"from_gguf / from_gptq / from_awq), got {type(qw).__name__}")
    result = _QUANT_GEMM_NORM_CALLS.replay(
        (x, qw.qweight, qw.scales, qw.aux, qw.k_perm, residual, norm_weight, bias, out, normed),
        (qw.key, eps), stream)
    if result is MISS:
        result = _QUANT_GEMM_NORM_CALLS.record(_quant_gemm_rms_norm_checked, x, qw, residual,
                                               norm_weight, eps, bias, out, normed, stream)
    return result


def _quant_gemm_rms_norm_checked(x, qw, residual, norm_weight, eps, bias, out, normed, stream):
    """The checked path of ``quant_gemm_rms_norm``."""
    from .rms_norm import _rms_norm_checked, check_eps

    eps = check_eps(eps)
    tx = _checked_x(x, qw)
    M, N = tx.shape[0], qw.N
    tbias = bias_vector(bias, N, OUT_DTYPES, "(qw's N,)")
    tr = _checked_residual(residual, tx, N)
    tw = _checked_norm_weight(norm_weight, tx, N, "qw's N")
    to = output("out", out, (M, N), tx.dtype, tx)
    if to is None:
        out = empty(tx, (M, N), tx.dtype)
        to = tensor(out, "out")
    last_dim_contiguous("out", to)      # rms_norm reads it back on the two-call path
    tn = output("normed", normed, (M, N), tx.dtype, tx)
    if tn is None:
        normed = empty(tx, (M, N), tx.dtype)
        tn = tensor(normed, "normed")
    last_dim_contiguous("normed", tn)
    for name, t in (("out", to), ("normed", tn)):
        non_negative_strides(name, t)
    for name, t, others in (("out", to, (("x", tx), ("residual", tr), ("normed", tn))),
                            ("residual", tr, (("x", tx), ("norm_weight", tw))),
                            ("normed", tn, (("x", tx), ("residual", tr), ("norm_weight", tw)))):
        for other_name, other in others:
            no_overlap(name, t, other_name, other)
    if M == 0:
        return normed
    stream_kernel = on_stream_kernel(qw, M)
    max_m = FUSED_NORM_MAX_M if TUNING.fused_norm_max_m is None else TUNING.fused_norm_max_m
    if (qw.format == "fp8_e4m3" or M > max_m
            or not (stream_kernel or on_decode_kernel(qw, M))):
        _quant_gemm_checked(x, qw, bias, None, out, None, stream)
        return _rms_norm_checked(out, norm_weight, eps, residual, normed, stream)
    handle = stream_handle(stream, (tx,))
    if qw.k_perm is not None:
        tx = _gather_columns(tx, qw, handle)
    run = _stream if stream_kernel else _decode
    run(tx, qw, tbias, to, tx.dtype, None, handle, norm=(tr, tw, tn, eps))
    return normed


# ---- a decoder layer's norms in its projections (the model's decode step) ------------------

#: Largest M whose rows ``stream_norm_gemm`` norms in every block (each block sums the squares
#: of all M rows of x over the whole K: M row reductions before x is staged).
PROLOGUE_NORM_MAX_M = 8


def prologue_norm_fits(qw, M):
    """Whether ``stream_norm_gemm`` and ``stream_add_gemm`` take M rows against ``qw``: the
    streaming kernel runs it (4-bit weights on Hopper, N a multiple of 16), x's columns are
    not gathered (act-order GPTQ), M is at most ``PROLOGUE_NORM_MAX_M``."""
    return (isinstance(qw, QuantizedWeight) and qw.k_perm is None and qw.format != "fp8_e4m3"
            and 0 < M <= PROLOGUE_NORM_MAX_M and on_stream_kernel(qw, M))


def _fitting_x(x, qw, name):
    """x as ``_checked_x`` gives it, for ``name`` (a ``stream_*`` form): ValueError unless
    ``prologue_norm_fits``."""
    tx = _checked_x(x, qw)
    if not prologue_norm_fits(qw, tx.shape[0]):
        raise ValueError(f"{name}: the streaming kernel does not take this call (M = "
                         f"{tx.shape[0]}, qw {qw.format} {qw.shape}); check prologue_norm_fits")
    return tx


def stream_norm_gemm(x: ArrayLike, qw: QuantizedWeight, norm_weight: ArrayLike,
                     eps: float = 1e-6, *, bias: ArrayLike | None = None,
                     activation: str | None = None, stream: StreamLike = None) -> ArrayLike:
    """``quant_gemm(rms_norm(x, norm_weight, eps), qw, bias=bias, activation=activation)`` in one
    launch of the streaming kernel: every block sums the squares of x's rows over the whole K
    (M x K elements from L2 a block, however few of them it stages) and stages ``x * inv * w``
    rounded to x's dtype, as ``rms_norm`` rounds it (its mean square summed in another order: a
    normed element may differ in the last bit). Returns a new (M, N) array (N / 2 gated) of x's
    dtype. Only where ``prologue_norm_fits(qw, M)`` (a ``ValueError`` elsewhere): a decoder
    layer's norm and the projection after it, at decode."""
    from .rms_norm import check_eps

    tx = _fitting_x(x, qw, "stream_norm_gemm")
    eps = check_eps(eps)
    M, K = tx.shape
    tw = _checked_norm_weight(norm_weight, tx, K, "x's K")
    tbias = bias_vector(bias, qw.N, OUT_DTYPES, "(qw's N,)")
    choice("activation", activation, QUANT_ACTIVATIONS)
    gated = activation in GATED_ACTIVATIONS
    if gated and qw.N % (2 * GATE_BLOCK):
        raise ValueError(f"activation: {activation!r} needs qw's N a multiple of "
                         f"{2 * GATE_BLOCK}, got N = {qw.N}")
    out = empty(tx, (M, qw.N // 2 if gated else qw.N), tx.dtype)
    _stream(tx, qw, tbias, tensor(out, "out"), tx.dtype, activation,
            stream_handle(stream, (tx,)), x_norm=(tw, eps))
    return out


def stream_add_gemm(x: ArrayLike, qw: QuantizedWeight, residual: ArrayLike, *,
                    bias: ArrayLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """``residual += quant_gemm(x, qw, bias=bias)`` in one launch of the streaming kernel: the
    projection rounded to x's dtype, added, the sum rounded again (the same bits as storing the
    projection, then ``rms_norm``'s ``residual`` add). Returns ``residual``, (M, N) of x's
    dtype, last dimension contiguous, not overlapping x. Only where ``prologue_norm_fits(qw,
    M)`` (a ``ValueError`` elsewhere): a decoder layer's output and down projections."""
    tx = _fitting_x(x, qw, "stream_add_gemm")
    N = qw.N
    tbias = bias_vector(bias, N, OUT_DTYPES, "(qw's N,)")
    tr = _checked_residual(residual, tx, N)
    no_overlap("residual", tr, "x", tx)
    _stream(tx, qw, tbias, tr, tx.dtype, None, stream_handle(stream, (tx,)), accumulate=True)
    return residual


# ---- compile-only checks (sm_90a SASS): the decode kernels of the shapes ------------

def _register():
    variants = {
        # name: (bits, m_block, mode, zero point, scale dtype, x dtype, out dtype, partial)
        "quant_decode_int4_g128_bf16_m1": (4, 1, "const", 8, "bfloat16", "bfloat16", "bfloat16",
                                           False),
        "quant_decode_int4_g128_f16_m16_splitk": (4, 16, "const", 8, "float16", "float16",
                                                  "float16", True),
        "quant_decode_int4_awq_bf16_m4": (4, 4, "zeros", None, "bfloat16", "bfloat16",
                                          "bfloat16", False),
        "quant_decode_q4_1_f16_m1": (4, 1, "affine", None, "float16", "float16", "float16",
                                     False),
        "quant_decode_int8_bf16_m8": (8, 8, "const", 128, "bfloat16", "bfloat16", "float32",
                                      True),
        # the default model's (SmolLM2 Q4_1) output / down projections with the next norm
        "quant_decode_q4_1_f16_m1_splitk_norm": (4, 1, "affine", None, "float16", "float16",
                                                 "float16", True),
    }
    for name, (bits, mb, mode, zp, sd, xd, od, partial) in variants.items():
        norm_dtype = xd if name.endswith("_norm") else None

        def build(bits=bits, mb=mb, mode=mode, zp=zp, sd=sd, xd=xd, od=od, partial=partial,
                  norm_dtype=norm_dtype):
            fn = qk.decode_kernel_fn(bits, mb, BLOCK_N, mode, zp, sd, xd, od, None, None,
                                     partial, norm_dtype)
            return (fn, qk.decode_signature(mode, sd, xd, od, None, norm_dtype),
                    qk.decode_options(BLOCK_N, mb, norm_dtype is not None))

        compile_check.register(name, build, sass_must_have=("LDG.E.128", "LDS.128"))
    stream_variants = {
        # name: (m_block, group chunks, mode, zero point, scale dtype, x dtype, out dtype, bias,
        #        act, partial)
        "quant_stream_int4_g128_bf16_m1": (1, 4, "const", 8, "bfloat16", "bfloat16", "bfloat16",
                                           None, None, False),
        "quant_stream_int4_g128_f16_m16_splitk": (16, 4, "const", 8, "float16", "float16",
                                                  "float16", "float16", "silu", True),
        "quant_stream_int4_awq_bf16_m4": (4, 4, "zeros", None, "bfloat16", "bfloat16",
                                          "bfloat16", None, None, True),
        "quant_stream_q4_1_f16_m1": (1, 1, "affine", None, "float16", "float16", "float16", None,
                                     None, True),
        "quant_stream_int4_g128_bf16_m1_programmatic": (1, 4, "const", 8, "bfloat16", "bfloat16",
                                                        "bfloat16", None, None, True),
        # the model's gated MLP at decode (gate / up interleaved): split and unsplit
        "quant_stream_int4_g128_bf16_m1_gated_splitk": (1, 4, "const", 8, "bfloat16", "bfloat16",
                                                        "bfloat16", None, "silu_and_mul", True),
        "quant_stream_int4_g128_bf16_m8_gated": (8, 4, "const", 8, "bfloat16", "bfloat16",
                                                 "bfloat16", "bfloat16", "silu_and_mul", False),
        # the output / down projections with the next norm fused (``quant_gemm_rms_norm``)
        "quant_stream_int4_g128_bf16_m1_splitk_norm": (1, 4, "const", 8, "bfloat16", "bfloat16",
                                                       "bfloat16", None, None, True),
        "quant_stream_int4_g128_bf16_m16_norm": (16, 4, "const", 8, "bfloat16", "bfloat16",
                                                 "bfloat16", None, None, False),
    }
    for name, (mb, gc, mode, zp, sd, xd, od, bd, act, partial) in stream_variants.items():
        programmatic = name.endswith("_programmatic")
        norm_dtype = xd if name.endswith("_norm") else None

        def build_stream(mb=mb, gc=gc, mode=mode, zp=zp, sd=sd, xd=xd, od=od, bd=bd, act=act,
                         partial=partial, programmatic=programmatic, norm_dtype=norm_dtype):
            return (_quant_stream.kernel_fn(STREAM_WARPS, STREAM_STAGES, mb, gc, mode, zp, sd, xd,
                                            od, bd, act, partial, programmatic, norm_dtype),
                    _quant_stream.signature(mode, sd, xd, od, bd, norm_dtype))

        compile_check.register(name, build_stream,
                               ptx_must_have=("mma.sync.aligned.m16n8k16",
                                              "cp.async.bulk.shared::cluster.global")
                               + ("griddepcontrol.wait",) * programmatic,
                               sass_must_have=("HMMA", "UBLKCP", "LDS.128")
                               + ("ACQBULK",) * programmatic,
                               max_registers=0 if mb > 8 else stream_register_budget(
                                   STREAM_AFFINE_BLOCKS_PER_SM if mode == "affine"
                                   else STREAM_BLOCKS_PER_SM))
    # the model's norms inside the projections (``llama.PROLOGUE``) at M = 1: qkv / o / down's
    # code (x normed, the result added into the residual stream: both in one kernel, K split)
    # and gate / up's (x normed, gated, unsplit)
    norms_inside = {
        "quant_stream_int4_g128_bf16_m1_splitk_xnorm_accumulate": (None, True, True),
        "quant_stream_int4_g128_bf16_m1_gated_xnorm": ("silu_and_mul", False, False),
    }
    for name, (act, partial, accumulate) in norms_inside.items():
        def build_norms_inside(act=act, partial=partial, accumulate=accumulate):
            return (_quant_stream.kernel_fn(STREAM_WARPS, STREAM_STAGES, 1, 4, "const", 8,
                                            "bfloat16", "bfloat16", "bfloat16", None, act,
                                            partial, x_norm_dtype="bfloat16",
                                            accumulate=accumulate),
                    _quant_stream.signature("const", "bfloat16", "bfloat16", "bfloat16", None,
                                            x_norm_dtype="bfloat16"))

        compile_check.register(name, build_norms_inside,
                               sass_must_have=("HMMA", "UBLKCP", "LDS.128"),
                               max_registers=stream_register_budget(STREAM_BLOCKS_PER_SM))
    tc_variants = {
        # name: (bits, tile, mode, zero point, scale dtype, x dtype, out dtype, bias, act,
        #        one group)
        "quant_tc_int4_g128_bf16_m64": (4, TC_TILES[1][1], "const", 8, "bfloat16", "bfloat16",
                                        "bfloat16", "bfloat16", None, False),
        "quant_tc_int4_awq_f16_m32_silu": (4, TC_TILES[0][1], "zeros", None, "float16",
                                           "float16", "float16", None, "silu", False),
        "quant_tc_q4_1_f16_m256_splitk": (4, TC_TILES[2][1], "affine", None, "float16",
                                          "float16", "float32", None, None, False),
        "quant_tc_int8_bf16_m256": (8, TC_TILES[2][1], "const", 128, "bfloat16", "bfloat16",
                                    "bfloat16", None, None, True),
    }
    for name, (bits, tile, mode, zp, sd, xd, od, bd, act, one) in tc_variants.items():
        def build_tc(bits=bits, tile=tile, mode=mode, zp=zp, sd=sd, xd=xd, od=od, bd=bd,
                     act=act, one=one):
            bm, bn, bk, wm, wn, st, gm = tile
            return (_quant_tc.make_kernel(bits, bm, bn, bk, wm, wn, st, gm, True, mode, zp, sd,
                                          xd, od, bd, act, one),
                    _quant_tc.signature(mode, sd, xd, od, bd))

        compile_check.register(name, build_tc,
                               ptx_must_have=("mma.sync.aligned.m16n8k16",
                                              "ldmatrix.sync.aligned.m8n8.x4",
                                              "cp.async.cg.shared"),
                               sass_must_have=("HMMA", "LDSM", "LDGSTS.E.BYPASS.128",
                                               "LDS.128"))
    dequant_variants = {   # name: (bits, mode, zero point, scale dtype, weight dtype)
        "quant_dequant_int4_awq_bf16": (4, "zeros", None, "bfloat16", "bfloat16"),
        "quant_dequant_q4_1_f16": (4, "affine", None, "float16", "float16"),
        "quant_dequant_int8_f16": (8, "const", 128, "float16", "float16"),
    }
    for name, (bits, mode, zp, sd, wd) in dequant_variants.items():
        def build_dequant(bits=bits, mode=mode, zp=zp, sd=sd, wd=wd):
            return (qk.dequant_kernel_fn(bits, mode, zp, sd, wd, True),
                    qk.dequant_signature(mode, sd, wd))

        compile_check.register(name, build_dequant, sass_must_have=("STG.E.128",))


_register()
