"""FlashAttention forward, SIMT version: the same tiled online-softmax algorithm without Tensor
Cores. It is the simulator's broad-coverage kernel and the GPU fallback for inputs the Tensor Core
kernel cannot take (pointers or strides not 16-byte aligned).

One block of ``BLOCK_M`` threads owns ``BLOCK_M`` query rows of one (batch, head); each thread
owns one row (query, output accumulator and the scores of the current key block in local memory).
Key/value blocks of ``BLOCK_N`` rows are staged in shared memory by the whole block; blocks wholly
outside the mask are skipped. Kernel arguments are those of ``flash_attn._launch`` (shared with
the Tensor Core kernel).
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from .._launch import Kernel, jit
from ._attention_common import (NEG_INF, attends, finish_row, key_bounds, rescale_factor,
                                scaled_max, varlen_sequence)

#: Threads (query rows) per block and keys per shared-memory block on the GPU. The kernel is a
#: fallback: the values only need to be reasonable (64 rows keep 2 warps busy per block, 32 keys
#: keep the two K / V tiles at 32 KB for headdim 256).
BLOCK_M = 64
BLOCK_N = 32


def _simt_kernel_fn(head_dim, block_m, block_n, is_bf16, is_varlen):
    tile = block_n * head_dim
    kv_elements = 2 * tile      # shapes must be closure constants, not expressions
    to_f32 = ptx.bf16_to_f32 if is_bf16 else ptx.f16_to_f32
    from_f32 = ptx.f32_to_bf16 if is_bf16 else ptx.f32_to_f16

    def flash_attn_simt_kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
                               seqlen_q_arg, seqlen_k_arg,
                               q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh,
                               o_sb, o_sn, o_sh, lse_sb, lse_sh, bt_sb, bt_ss, group,
                               softmax_scale, scale_log2, window_left, window_right, num_pages,
                               bs_shift):
        # block_table, bt_sb, bt_ss, num_pages, bs_shift: the Tensor Core kernel's paged
        # variant only (one signature for both kernels)
        tid = cuda.threadIdx.x
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        if is_varlen:
            q_start, seqlen_q, k_start, seqlen_k = varlen_sequence(
                cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg)
        else:
            q_start = 0
            seqlen_q = seqlen_q_arg
            k_start = 0
            seqlen_k = seqlen_k_arg
        row0 = m_block * block_m
        if row0 >= seqlen_q:
            return
        offset = seqlen_k - seqlen_q
        head_k = head // group
        row = row0 + tid
        row_ok = row < seqlen_q

        # one array for both tiles: the simulator's alignment= shim makes every static shared
        # array of a kernel alias the same allocation
        kv_smem = cuda.shared.array(kv_elements, np.uint16)
        q_row = cuda.local.array(head_dim, np.float32)
        acc = cuda.local.array(head_dim, np.float32)
        scores = cuda.local.array(block_n, np.float32)

        q_base = batch * q_sb + (q_start + min(row, seqlen_q - 1)) * q_sn + head * q_sh
        for d in range(head_dim):
            q_row[d] = to_f32(q[q_base + d])
            acc[d] = np.float32(0.0)
        row_max = NEG_INF
        row_sum = np.float32(0.0)

        k_base = batch * k_sb + k_start * k_sn + head_k * k_sh
        v_base = batch * v_sb + k_start * v_sn + head_k * v_sh
        lo, hi = key_bounds(row0, min(row0 + block_m, seqlen_q), offset, seqlen_k,
                            window_left, window_right)
        for col0 in range((lo // block_n) * block_n, hi, block_n):
            cuda.syncthreads()  # everyone is done with the previous tiles
            for i in range(tid, tile, block_m):
                col = col0 + i // head_dim
                d = i % head_dim
                if col < seqlen_k:
                    kv_smem[i] = k[k_base + col * k_sn + d]
                    kv_smem[tile + i] = v[v_base + col * v_sn + d]
                else:
                    kv_smem[i] = 0
                    kv_smem[tile + i] = 0
            cuda.syncthreads()
            tile_max = NEG_INF
            for j in range(block_n):
                col = col0 + j
                s = NEG_INF
                if col < seqlen_k and attends(row, col, offset, window_left, window_right):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q_row[d] * to_f32(kv_smem[j * head_dim + d])
                scores[j] = s
                tile_max = max(tile_max, s)
            new_max = max(row_max, tile_max)
            new_scaled = scaled_max(new_max, scale_log2)
            alpha = rescale_factor(row_max, new_scaled, scale_log2)
            row_max = new_max
            row_sum *= alpha
            for d in range(head_dim):
                acc[d] *= alpha
            for j in range(block_n):
                p = ptx.ex2_approx(scores[j] * scale_log2 - new_scaled)
                if p > np.float32(0.0):
                    row_sum += p
                    for d in range(head_dim):
                        acc[d] += p * to_f32(kv_smem[tile + j * head_dim + d])

        inv_sum, row_lse = finish_row(row_max, row_sum, softmax_scale)
        if row_ok:
            o_base = batch * o_sb + (q_start + row) * o_sn + head * o_sh
            for d in range(head_dim):
                out[o_base + d] = from_f32(acc[d] * inv_sum)
            lse[batch * lse_sb + head * lse_sh + q_start + row] = row_lse

    return flash_attn_simt_kernel


@functools.lru_cache(maxsize=None)
def simt_kernel(signature, head_dim, block_m, block_n, is_bf16, is_varlen):
    """The SIMT kernel for one configuration (``head_dim`` is the real, unpadded one)."""
    return Kernel(jit(_simt_kernel_fn(head_dim, block_m, block_n, is_bf16, is_varlen)),
                  signature, "flash_attn_simt_kernel")
