"""The Tensor Core kernel of ``quant_gemm`` (M above the decode kernel's range): ``x`` tiles and the
packed weight codes staged in shared memory by ``cp.async``, the codes dequantized in registers
right before ``mma.sync`` m16n8k16 (fp32 accumulation), gemm's staged epilogue.

One thread block computes a ``block_m x block_n`` tile of ``x @ W^T`` over the K range of its
split (``blockIdx.y``); its warps form a ``warps_m x warps_n`` grid of ``wm x wn`` warp tiles of
m16n8k16 fragments (A: x, row-major; B: W^T, i.e. the weight's rows n, k contiguous: mma's
``.col`` operand).

Shared memory (dynamic, one ``uint16`` buffer): ``stages`` x tiles, then ``stages`` code tiles.
- x tile: ``block_m x block_k`` b16, copied and swizzled by gemm's ``tile_loader`` (16-byte
  ``cp.async``, zeros past M and K), read with ``ldmatrix.x4`` (gemm's addressing).
- code tile: the weight's private chunk-major layout (``quant_weight``) as it is, a 16-byte chunk
  (32 int4 / 16 int8 codes of one row) per ``cp.async``: chunk ``cc`` of the tile, row ``r`` at
  b16 offset ``(cc * block_n + r) * 8`` (zeros past N and K_padded, from an in-bounds address).

B fragments in registers: lane ``(g, t) = (lane // 4, lane % 4)`` needs, per k16 step, row
``g`` of its n8 fragment at k = 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1). It reads its row's whole
chunk with one 16-byte shared load (the 4 lanes of a row read the same 16 bytes: a broadcast,
and a warp's 8 rows are 128 contiguous bytes: no bank conflict), then:
- int4 (a chunk is two k16 steps; word j holds k = 8j .. 8j + 7 at nibbles 0..7): step h's b0
  is nibbles 2t, 2t + 1 of word 2h, b1 those of word 2h + 1: the word shifted right by ``8t``
  (once), then the nibbles at bits 0 and 4;
- int8 (a chunk is one k16 step; word j holds k = 4j .. 4j + 3): b0 is bytes 2(t % 2), +1 of
  word t // 2, b1 the same of word 2 + t // 2: a select and a shift by ``16 (t % 2)``.
Each code becomes the exact float ``u - z`` with one LOP3 and one FADD (``_quant_kernels._code``:
the code OR-ed into the mantissa of 2^23), times the group's scale (plus the minimum, affine),
and a pair is rounded to x's dtype with one ``cvt.rn.{f16x2,bf16x2}.f32``: each weight element is
the exact value rounded once, as ``dequantize()`` gives it rounded to x's dtype. The group's
scale / zero point / minimum are loaded per chunk and fragment (every group size is a whole
number of chunks), or once per block when the row has one group (``one_group``: int8, int4
``group_size=-1``).

Pipeline: ``stages - 1`` K tiles in flight; one ``__syncthreads`` per tile, after which the tile
``stages - 1`` ahead is issued into the stage the previous tile used.

Epilogue: gemm's (``_gemm_tensor_core._staged_epilogue``): accumulators staged through shared
memory as an fp32 tile, then 16-byte stores through bias / activation / rounding; or, split-K,
raw fp32 partial sums ``out_z`` elements apart per split for gemm's reduce kernel.
"""

import functools

import numpy as np
from numba import types

from .. import ptx
from .._env import cuda
from .._launch import Kernel, jit
from ._epilogue import block_work, epilogue_tile_ld, loader, packer
from ._gemm_tensor_core import _staged_epilogue, _swizzle_params, tile_loader
from ._quant_kernels import _code, _group_offset, operand_types

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


def chunk_k(bits):
    return 4 * (32 // bits)


def shared_bytes(bits, block_m, block_n, block_k, stages):
    """Dynamic shared memory of one block: the pipeline's x and code tiles, or the fp32
    epilogue tile if larger (the same memory)."""
    return max(stages * (2 * block_m * block_k + block_n * block_k * bits // 8),
               4 * block_m * epilogue_tile_ld(block_n))


def make_kernel(bits, block_m, block_n, block_k, warps_m, warps_n, stages, group_m, a_vec,
                mode, zero_point, scale_dtype, x_dtype, out_dtype, bias_dtype, act, one_group):
    """The kernel function (not yet jitted) of one configuration. Parameters ``(x, qw, scales,
    aux, out, bias, M, N, K, x_sm, group, k_split, tiles_m, tiles_n, so_m, so_n, out_z,
    out_vec)``: ``k_split`` a multiple of ``block_k`` (itself a multiple of the 16-byte chunk's
    k), ``out_z`` the offset between splits' outputs, ``out_vec`` nonzero when ``out`` takes
    16-byte stores. Launch ``tiles_m * tiles_n`` x splits blocks of ``32 * warps_m * warps_n``
    threads with ``shared_bytes(...)`` bytes of dynamic shared memory. ``a_vec``: x allows
    16-byte ``cp.async`` (aligned base and row stride)."""
    threads = 32 * warps_m * warps_n
    wm = block_m // warps_m
    wn = block_n // warps_n
    mf = wm // 16
    nf = wn // 8
    ck = chunk_k(bits)
    chunks = block_k // ck                # chunks of a row per K tile
    int4 = bits == 4
    a_stage = block_m * block_k            # b16 elements
    b_stage = chunks * block_n * 8
    b_base = stages * a_stage
    b_copies = chunks * block_n
    b_iters = (b_copies + threads - 1) // threads
    b_exact = b_copies % threads == 0
    k_steps = block_k // 16
    is_bf16 = x_dtype == "bfloat16"
    affine = mode == "affine"
    wait_pending = stages - 2
    load_s = loader(scale_dtype)
    offset = _group_offset(mode, zero_point)
    code_lo = _code(bits, 0)
    code_hi = _code(bits, bits)
    pack = packer(x_dtype)
    load_a = tile_loader(block_m, block_k, threads, a_vec, False)
    a_div, a_mod = _swizzle_params(block_k)
    stage_acc, store_tile = _staged_epilogue(block_m, block_n, wm, wn, threads, out_dtype, None,
                                             bias_dtype, act)
    work = block_work(block_m, block_n, block_k, group_m)

    @cuda.jit(device=True, inline="always")
    def load_stage(smem, stage, k0, x, qw, m0, n0, M, N, K, x_sm, n_chunks, tid):
        load_a(smem, np.int32(stage * a_stage), x, m0 * x_sm + k0, x_sm, M - m0, K - k0, tid)
        s0 = np.int32(b_base + stage * b_stage)
        kc0 = k0 // ck
        for it in range(b_iters):
            i = np.int32(tid + it * threads)
            if b_exact or i < b_copies:
                cc = i // block_n
                n = n0 + (i - cc * block_n)
                c = kc0 + cc
                ok = c < n_chunks and n < N
                g_off = (np.int64(c) * N + n) * 4 if ok else np.int64(0)
                ptx.cp_async_16(smem, s0 + i * 8, qw, g_off, np.int32(16 if ok else 0))

    @cuda.jit(device=True, inline="always")
    def group_params(scales, aux, gi, n, N, j, s_reg, o_reg, m_reg):
        idx = gi * N + min(n, N - 1)
        s_reg[j] = load_s(scales, idx)
        o_reg[j] = offset(aux, idx)
        if affine:
            m_reg[j] = load_s(aux, idx)

    @cuda.jit(device=True, inline="always")
    def value(word, code, off, s, mn):
        if affine:
            return code(word, off) * s + mn
        return code(word, off) * s

    @cuda.jit(device=True, inline="always")
    def b_pair(wlo, whi, sh, off, s, mn):
        """(b0, b1) of a k16 step: the pairs at bits ``sh`` of ``wlo`` and of ``whi``."""
        lo = wlo >> sh
        hi = whi >> sh
        return (pack(value(lo, code_lo, off, s, mn), value(lo, code_hi, off, s, mn)),
                pack(value(hi, code_lo, off, s, mn), value(hi, code_hi, off, s, mn)))

    @cuda.jit(device=True, inline="always")
    def mma_column(acc, a_frag, j, b0, b1):
        for i in range(mf):
            if is_bf16:
                d0, d1, d2, d3 = ptx.mma_bf16(a_frag[i, 0], a_frag[i, 1], a_frag[i, 2],
                                              a_frag[i, 3], b0, b1, acc[i, j, 0], acc[i, j, 1],
                                              acc[i, j, 2], acc[i, j, 3])
            else:
                d0, d1, d2, d3 = ptx.mma_f16(a_frag[i, 0], a_frag[i, 1], a_frag[i, 2],
                                             a_frag[i, 3], b0, b1, acc[i, j, 0], acc[i, j, 1],
                                             acc[i, j, 2], acc[i, j, 3])
            acc[i, j, 0] = d0
            acc[i, j, 1] = d1
            acc[i, j, 2] = d2
            acc[i, j, 3] = d3

    @cuda.jit(device=True, inline="always")
    def load_a_frags(smem, a_s, a_off, ks, a_frag):
        for i in range(mf):
            f0, f1, f2, f3 = ptx.ldmatrix_x4(smem, np.int32(a_s + a_off[ks] + i * 16 * block_k))
            a_frag[i, 0] = f0
            a_frag[i, 1] = f1
            a_frag[i, 2] = f2
            a_frag[i, 3] = f3

    @cuda.jit(device=True, inline="always")
    def compute_chunk(smem, a_s, b_row, cc, a_off, sh, sel, words, a_frag, acc, s_reg, o_reg,
                      m_reg):
        for j in range(nf):
            w0, w1, w2, w3 = ptx.load_u32x4(smem, np.int32(b_row + (cc * block_n + 8 * j) * 8))
            words[j, 0] = w0
            words[j, 1] = w1
            words[j, 2] = w2
            words[j, 3] = w3
        if int4:
            load_a_frags(smem, a_s, a_off, 2 * cc, a_frag)
            for j in range(nf):
                b0, b1 = b_pair(words[j, 0], words[j, 1], sh, o_reg[j], s_reg[j], m_reg[j])
                mma_column(acc, a_frag, j, b0, b1)
            load_a_frags(smem, a_s, a_off, 2 * cc + 1, a_frag)
            for j in range(nf):
                b0, b1 = b_pair(words[j, 2], words[j, 3], sh, o_reg[j], s_reg[j], m_reg[j])
                mma_column(acc, a_frag, j, b0, b1)
        else:
            load_a_frags(smem, a_s, a_off, cc, a_frag)
            for j in range(nf):
                wlo = words[j, 0] if sel else words[j, 1]
                whi = words[j, 2] if sel else words[j, 3]
                b0, b1 = b_pair(wlo, whi, sh, o_reg[j], s_reg[j], m_reg[j])
                mma_column(acc, a_frag, j, b0, b1)

    def quant_tc_kernel(x, qw, scales, aux, out, bias, M, N, K, x_sm, group, k_split, tiles_m,
                        tiles_n, so_m, so_n, out_z, out_vec):
        smem = cuda.shared.array(0, np.uint16)
        tid = np.int32(cuda.threadIdx.x)
        lane = np.int32(tid & 31)
        warp = np.int32(tid >> 5)
        wm0 = np.int32((warp // warps_n) * wm)
        wn0 = np.int32((warp % warps_n) * wn)
        g = lane >> 2
        t = lane & 3
        n_chunks = (K + ck - 1) // ck
        m0, n0, z, k_begin, _k_end, k_tiles = work(tiles_m, tiles_n, n_chunks * ck, k_split)

        acc = cuda.local.array((mf, nf, 4), np.float32)
        for i in range(mf):
            for j in range(nf):
                for q in range(4):
                    acc[i, j, q] = _F0
        a_frag = cuda.local.array((mf, 4), np.uint32)
        words = cuda.local.array((nf, 4), np.uint32)
        s_reg = cuda.local.array(nf, np.float32)
        o_reg = cuda.local.array(nf, np.float32)
        m_reg = cuda.local.array(nf, np.float32)
        a_off = cuda.local.array(k_steps, np.int32)
        for ks in range(k_steps):   # gemm's ldmatrix addressing of a k-inner A tile
            r = np.int32(wm0 + lane % 16)
            ch = np.int32(ks * 2 + lane // 16)
            a_off[ks] = np.int32(r * block_k + ((ch ^ ((r // a_div) % a_mod)) * 8))
        if int4:
            sh = np.uint32(8 * t)
            sel = True
        else:
            sh = np.uint32(16 * (t & 1))
            sel = t < 2
        n_lane = n0 + wn0 + g       # the weight row of this lane's fragment 0
        for j in range(nf):
            m_reg[j] = _F0
            if one_group:
                group_params(scales, aux, 0, n_lane + 8 * j, N, j, s_reg, o_reg, m_reg)
        groups = (K + group - 1) // group

        for s in range(stages - 1):
            if s < k_tiles:
                load_stage(smem, s, k_begin + s * block_k, x, qw, m0, n0, M, N, K, x_sm,
                           n_chunks, tid)
            ptx.cp_async_commit()

        read_stage = 0
        write_stage = stages - 1
        kt = 0
        while kt < k_tiles:
            ptx.cp_async_wait(wait_pending)
            cuda.syncthreads()   # tile kt landed; every warp is done with tile kt - 1's stage
            nxt = kt + stages - 1
            if nxt < k_tiles:
                load_stage(smem, write_stage, k_begin + nxt * block_k, x, qw, m0, n0, M, N, K,
                           x_sm, n_chunks, tid)
            ptx.cp_async_commit()
            a_s = np.int32(read_stage * a_stage)
            b_row = np.int32(b_base + read_stage * b_stage + (wn0 + g) * 8)
            k0 = k_begin + kt * block_k
            for cc in range(chunks):
                if not one_group:
                    gi = min((k0 + cc * ck) // group, groups - 1)
                    for j in range(nf):
                        group_params(scales, aux, gi, n_lane + 8 * j, N, j, s_reg, o_reg,
                                     m_reg)
                compute_chunk(smem, a_s, b_row, cc, a_off, sh, sel, words, a_frag, acc, s_reg,
                              o_reg, m_reg)
            read_stage = read_stage + 1 if read_stage < stages - 1 else 0
            write_stage = write_stage + 1 if write_stage < stages - 1 else 0
            kt += 1

        ptx.cp_async_wait(0)
        cuda.syncthreads()   # every warp is done with the pipeline's buffers
        tile = cuda.shared.array(0, np.float32)
        stage_acc(tile, acc, lane, wm0, wn0, n0, N, bias, _F1)
        cuda.syncthreads()
        store_tile(tile, tid, m0, n0, M, N, out, z * out_z, so_m, so_n, out, 0, 0, bias, _F1,
                   _F0, out_vec)

    return quant_tc_kernel


def signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype):
    i32, i64 = types.int32, types.int64
    return operand_types(mode, scale_dtype, x_dtype, out_dtype, bias_dtype) + (
        i32, i32, i32, i64, i32, i32, i32, i32, i64, i64, i64, i32)


@functools.cache
def tc_kernel(bits, tile, a_vec, mode, zero_point, scale_dtype, x_dtype, out_dtype, bias_dtype,
              act, one_group):
    """The compiled kernel (``Kernel``) of ``tile`` = (block_m, block_n, block_k, warps_m,
    warps_n, stages, group_m) and the weight / call's compile-time choices."""
    block_m, block_n, block_k, warps_m, warps_n, stages, group_m = tile
    fn = make_kernel(bits, block_m, block_n, block_k, warps_m, warps_n, stages, group_m, a_vec,
                     mode, zero_point, scale_dtype, x_dtype, out_dtype, bias_dtype, act,
                     one_group)
    return Kernel(jit(fn), signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype),
                  "quant_tc_kernel")
