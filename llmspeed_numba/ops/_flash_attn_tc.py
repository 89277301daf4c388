"""FlashAttention forward on Tensor Cores (mma.sync m16n8k16), FlashAttention-2 style.

A block of ``WARPS`` warps owns ``BLOCK_M = WARPS * 16 * M_TILES`` query rows of one
(batch, head); warp ``w`` owns rows ``w * 16 * M_TILES ...`` (``M_TILES`` m16 tiles). Per block:

1. The Q tile (``BLOCK_M x D``) is copied to shared memory once with cp.async and stays there;
   its A fragments are read with ``ldmatrix.x4`` for every key block.
2. Key blocks of ``BLOCK_N`` rows are visited from the last to the first (the ones that need a
   mask come first); blocks wholly outside the causal mask / window are never visited. The K and
   V tiles have one shared-memory buffer each and are double-buffered against each other, as in
   FlashAttention 2: V of block ``n`` is loading while ``S = Q K^T`` runs, K of block ``n - 1``
   while ``O += P V`` runs.
3. ``S = Q K^T`` (fp32, ``M_TILES x BLOCK_N / 8`` accumulator tiles per warp): K is the "col"
   operand, loaded by ``ldmatrix.x4`` (non-transposed: a K row is a column of K^T).
4. Only blocks that cross a mask edge (causal diagonal, window edge, ``seqlen_k``) are masked.
5. Online softmax in registers: each row's maximum and partial sum live in the 4 lanes of a quad
   (rows ``g`` and ``g + 8`` of each m16 tile, ``g = lane // 4``), reduced with two
   ``shfl.bfly``; probabilities are ``ex2(s * scale_log2 - max * scale_log2)`` (one FMA, one SFU
   op). The output accumulator is rescaled when the maximum moves.
6. ``O += P V``: the C fragments of two adjacent n8 tiles of S, packed to fp16/bf16 pairs, *are*
   the A fragment of one k16 slice, so P goes to the second mma straight from registers. V is
   the "col" operand of a row-major (key, d) tile: ``ldmatrix.x4.trans``.
7. At the end O is divided by the row sum once, staged through the (now free) Q tile of the warp
   and written with 16-byte stores; ``lse = max * scale + log(sum)``.

ldmatrix row addresses (lane ``L``; matrix ``m = L // 8`` of an ``.x4`` gets its rows from lanes
``8m .. 8m+7``; see ``ptx/__init__.py`` for the fragment layouts):
  Q (A operand, rows x d):   row ``L % 16``, column ``8 * (L // 16)``  -> a0..a3
  K (B operand, keys x d):   key ``L % 8 + 8 * (L // 16)``, column ``8 * ((L // 8) % 2)``
                             -> (b0, b1) of key tile n and (b0, b1) of key tile n + 1
  V (B operand, .trans):     key ``L % 8 + 8 * ((L // 8) % 2)``, column ``8 * (L // 16)``
                             -> (b0, b1) of d tile n and (b0, b1) of d tile n + 1

Shared-memory rows are ``D + 8`` elements long: the 16-byte pad puts the 8 rows an ``ldmatrix``
phase reads in 8 different bank groups (conflict-free), for every ``D`` that is a multiple of 16.
A head dimension that is a multiple of 8 but not 16 runs with ``D`` rounded up to 16: the extra
columns are zero-filled by the copies and never written back.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from .._launch import Kernel, jit
from ._attention_common import (NEG_INF, block_is_full, clamped_range, finish_row, fmax,
                                key_bounds, rescale_factor, row_key_range, scaled_max,
                                varlen_sequence)

_device = cuda.jit(device=True, inline="always")


@functools.lru_cache(maxsize=None)
def _tile_loader(rows, dim, head_dim, threads):
    """Device function copying a ``rows x dim`` tile from global memory into shared memory at
    ``smem_base`` (row pitch ``dim + 8``) by 16-byte cp.async chunks; thread ``tid`` takes
    chunks ``tid, tid + threads, ...`` in row-major order. The tile's row 0 is at global offset
    ``seq_base + tile_offset``, rows ``row_stride`` apart; rows ``>= valid_rows`` and columns
    ``>= head_dim`` are zero-filled and read nothing (source offset clamped to row 0).

    ``thread_base`` is ``seq_base`` plus the thread's own first chunk (``thread_offset``): when
    ``threads`` is a multiple of the ``dim / 8`` chunks of a row (every power-of-two ``dim``), a
    thread's chunks sit in one column ``row_step`` rows apart, and a tile wholly in bounds costs
    one add per chunk, with nothing else kept live across the kernel's loop.
    """
    chunks_per_row = dim // 8
    pitch = dim + 8
    strided = threads % chunks_per_row == 0
    row_step = threads // chunks_per_row
    per_thread = -(-rows // row_step) if strided else -(-rows * chunks_per_row // threads)
    even = rows % row_step == 0 if strided else rows * chunks_per_row % threads == 0
    total = rows * chunks_per_row

    @_device
    def load_tile(smem, smem_base, src, thread_base, tile_offset, row_stride, valid_rows, tid):
        if strided:
            first_row = tid // chunks_per_row
            col = (tid % chunks_per_row) * 8
            smem_offset = smem_base + first_row * pitch + col
            offset = thread_base + tile_offset
            step = row_step * row_stride
            rows_left = valid_rows - first_row
            if even and rows_left >= rows and (head_dim == dim or col < head_dim):
                for c in range(per_thread):      # the whole tile is in bounds: no predicates
                    ptx.cp_async_16(smem, smem_offset + c * row_step * pitch, src, offset, 16)
                    offset += step
            else:
                row0 = offset - first_row * row_stride - col
                for c in range(per_thread):
                    if even or first_row + c * row_step < rows:
                        ok = c * row_step < rows_left and (head_dim == dim or col < head_dim)
                        ptx.cp_async_16(smem, smem_offset + c * row_step * pitch, src,
                                        offset if ok else row0, 16 if ok else 0)
                    offset += step
        else:
            row0 = thread_base - thread_offset(tid, row_stride) + tile_offset
            for c in range(per_thread):
                i = tid + c * threads
                if even or i < total:
                    r = i // chunks_per_row
                    col = (i % chunks_per_row) * 8
                    ok = r < valid_rows and col < head_dim
                    ptx.cp_async_16(smem, smem_base + r * pitch + col, src,
                                    row0 + r * row_stride + col if ok else row0,
                                    16 if ok else 0)

    @_device
    def thread_offset(tid, row_stride):
        """Global offset of thread ``tid``'s first chunk from the tile's row 0."""
        if strided:
            return (tid // chunks_per_row) * row_stride + (tid % chunks_per_row) * 8
        return 0

    return load_tile, thread_offset


@functools.lru_cache(maxsize=None)
def _paged_tile_loader(rows, dim, head_dim, threads):
    """Device function copying a ``rows x dim`` tile of keys (or values) from a paged cache into
    shared memory at ``smem_base`` (row pitch ``dim + 8``), chunks dealt to threads as
    ``_tile_loader`` deals them. Key ``col0 + r`` of the sequence whose block-table row starts
    at ``bt_row`` is slot ``(col0 + r) % block_size`` of page
    ``block_table[bt_row + ((col0 + r) >> bs_shift) * bt_ss]``, the page id clamped to
    ``[0, num_pages)``; ``head_base`` is the KV head's offset inside a slot. Rows ``>=
    valid_rows`` and columns ``>= head_dim`` are zero-filled, reading neither the table nor the
    cache (their source is ``head_base``: page 0, slot 0, in bounds).

    Every page id of the thread's chunks is loaded before the first copy is issued (the copies'
    memory clobber would otherwise serialise each table load behind the previous copy): one
    table round trip a tile, not one a chunk. The ids come from L1 (the table row is tiny and
    every thread of the block reads the same few entries)."""
    chunks_per_row = dim // 8
    pitch = dim + 8
    per_thread = -(-rows * chunks_per_row // threads)
    even = rows * chunks_per_row % threads == 0
    total = rows * chunks_per_row

    @_device
    def load_paged(smem, smem_base, src, head_base, block_table, bt_row, bt_ss, col0,
                   page_stride, row_stride, valid_rows, num_pages, bs_shift, tid):
        offsets = cuda.local.array(per_thread, np.int64)
        slot_mask = (1 << bs_shift) - 1
        for c in range(per_thread):
            i = tid + c * threads
            r = i // chunks_per_row
            col = (i % chunks_per_row) * 8
            offset = np.int64(-1)
            if (even or i < total) and r < valid_rows and (head_dim == dim or col < head_dim):
                key = col0 + r
                page = block_table[bt_row + (key >> bs_shift) * bt_ss]
                page = min(max(page, 0), num_pages - 1)
                offset = page * page_stride + (key & slot_mask) * row_stride + col
            offsets[c] = offset
        for c in range(per_thread):
            i = tid + c * threads
            if even or i < total:
                r = i // chunks_per_row
                col = (i % chunks_per_row) * 8
                ok = offsets[c] >= 0
                ptx.cp_async_16(smem, smem_base + r * pitch + col, src,
                                head_base + offsets[c] if ok else head_base, 16 if ok else 0)

    return load_paged


def tc_shared_bytes(dim, warps, m_tiles, block_n):
    """Dynamic shared memory of one block: Q tile + one K tile + one V tile."""
    return 2 * (warps * 16 * m_tiles + 2 * block_n) * (dim + 8)


def _tc_kernel_fn(head_dim, dim, warps, m_tiles, block_n, is_bf16, is_varlen, min_blocks=0,
                  paged=False):
    """The kernel for a padded head dimension ``dim`` (multiple of 16) holding ``head_dim``.
    ``min_blocks`` (the launch bounds the kernel is compiled with) only enters the closure, so
    that numba's disk cache, which keys on the closure but not on launch bounds, keeps the
    variants apart.

    ``seqlen_q_arg`` / ``seqlen_k_arg``: the lengths of every sequence, or with ``is_varlen`` the
    packed totals (total_q, total_k) that bound each sequence's offsets (``varlen_sequence``), so
    any offsets are memory-safe.

    ``paged`` (with ``is_varlen``): K and V are read from a paged cache (``ops/paged_prefill.py``)
    instead of packed rows. Then ``cu_seqlens_k`` holds each sequence's total length (seq_lens),
    ``k_sb`` / ``k_sn`` / ``k_sh`` are the cache's page / slot / head strides (V alike), and
    ``seqlen_k_arg`` is the table's capacity in keys, to which the lengths are clamped. The other
    variants ignore ``block_table``, ``bt_sb``, ``bt_ss``, ``num_pages`` and ``bs_shift``."""
    assert dim % 16 == 0 and head_dim <= dim and block_n % 16 == 0
    assert is_varlen or not paged
    threads = 32 * warps
    rows_per_warp = 16 * m_tiles
    block_m = warps * rows_per_warp
    pitch = dim + 8
    n_tiles = block_n // 8          # n8 tiles of S per m16 tile
    d_tiles = dim // 8              # n8 tiles of O per m16 tile
    k_steps = dim // 16             # k16 steps of Q K^T
    p_steps = block_n // 16         # k16 steps of P V
    s_q = 0
    s_k = block_m * pitch
    s_v = s_k + block_n * pitch
    out_chunks = rows_per_warp * (dim // 8) // 32    # 16-byte output chunks per lane
    mma = ptx.mma_bf16 if is_bf16 else ptx.mma_f16
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2
    from_f32 = ptx.f32_to_bf16 if is_bf16 else ptx.f32_to_f16
    load_q, q_thread_offset = _tile_loader(block_m, dim, head_dim, threads)
    load_kv, kv_thread_offset = _tile_loader(block_n, dim, head_dim, threads)
    load_paged = _paged_tile_loader(block_n, dim, head_dim, threads)

    def flash_attn_tc_kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
                             seqlen_q_arg, seqlen_k_arg,
                             q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh,
                             o_sb, o_sn, o_sh, lse_sb, lse_sh, bt_sb, bt_ss, group,
                             softmax_scale, scale_log2, window_left, window_right, num_pages,
                             bs_shift):
        min_blocks  # noqa: B018  (cache key only, see the factory)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x   # longest causal rows first
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        if paged:
            q_start, seqlen_q = clamped_range(cu_seqlens_q, batch, seqlen_q_arg)
            k_start = 0
            seqlen_k = min(max(cu_seqlens_k[batch], 0), seqlen_k_arg)
        elif is_varlen:
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
        warp_row0 = row0 + warp * rows_per_warp

        smem = cuda.shared.array(0, np.uint16)
        acc_s = cuda.local.array((m_tiles, n_tiles, 4), np.float32)
        acc_o = cuda.local.array((m_tiles, d_tiles, 4), np.float32)
        frag = cuda.local.array((m_tiles, 4), np.uint32)
        row_max = cuda.local.array((m_tiles, 2), np.float32)
        row_sum = cuda.local.array((m_tiles, 2), np.float32)     # this lane's partial sums
        max_scaled = cuda.local.array((m_tiles, 2), np.float32)
        row_scale = cuda.local.array((m_tiles, 2), np.float32)
        # A literal 0 would make LLVM turn the zero-fill loops into a memset, which NVPTX
        # lowers to a loop over local memory: the accumulators would never reach registers.
        zero = ptx.ex2_approx(NEG_INF)
        for mt in range(m_tiles):
            for dt in range(d_tiles):
                for e in range(4):
                    acc_o[mt, dt, e] = zero
            for h in range(2):
                row_max[mt, h] = NEG_INF
                row_sum[mt, h] = zero

        # ldmatrix row addresses of this lane (see the module docstring for the fragments)
        q_frag = s_q + (warp * rows_per_warp + lane % 16) * pitch + (lane // 16) * 8
        k_frag = s_k + (lane % 8 + 8 * (lane // 16)) * pitch + 8 * ((lane // 8) % 2)
        v_frag = s_v + (lane % 8 + 8 * ((lane // 8) % 2)) * pitch + 8 * (lane // 16)

        q_base = batch * q_sb + (q_start + row0) * q_sn + head * q_sh
        load_q(smem, s_q, q, q_base + q_thread_offset(tid, q_sn), 0, q_sn, seqlen_q - row0, tid)
        k_thread = batch * k_sb + k_start * k_sn + head_k * k_sh + kv_thread_offset(tid, k_sn)
        v_thread = batch * v_sb + k_start * v_sn + head_k * v_sh + kv_thread_offset(tid, v_sn)

        lo, hi = key_bounds(row0, min(row0 + block_m, seqlen_q), offset, seqlen_k,
                            window_left, window_right)
        n_end = (hi + block_n - 1) // block_n
        n_blocks = n_end - lo // block_n if hi > lo else 0
        bt_row = batch * bt_sb
        if n_blocks > 0:
            col = (n_end - 1) * block_n
            if paged:
                load_paged(smem, s_k, k, head_k * k_sh, block_table, bt_row, bt_ss, col, k_sb,
                           k_sn, seqlen_k - col, num_pages, bs_shift, tid)
            else:
                load_kv(smem, s_k, k, k_thread, col * k_sn, k_sn, seqlen_k - col, tid)
        ptx.cp_async_commit()

        for it in range(n_blocks):
            col0 = (n_end - 1 - it) * block_n
            ptx.cp_async_wait(0)
            cuda.syncthreads()       # K (and Q) landed; every warp is done reading V
            if paged:
                load_paged(smem, s_v, v, head_k * v_sh, block_table, bt_row, bt_ss, col0, v_sb,
                           v_sn, seqlen_k - col0, num_pages, bs_shift, tid)
            else:
                load_kv(smem, s_v, v, v_thread, col0 * v_sn, v_sn, seqlen_k - col0, tid)
            ptx.cp_async_commit()

            # S = Q K^T
            for mt in range(m_tiles):
                for nt in range(n_tiles):
                    for e in range(4):
                        acc_s[mt, nt, e] = zero
            for ks in range(k_steps):
                for mt in range(m_tiles):
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, q_frag + mt * 16 * pitch + ks * 16)
                    frag[mt, 0] = a0
                    frag[mt, 1] = a1
                    frag[mt, 2] = a2
                    frag[mt, 3] = a3
                for pn in range(n_tiles // 2):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, k_frag + pn * 16 * pitch + ks * 16)
                    for mt in range(m_tiles):
                        n0 = 2 * pn
                        (acc_s[mt, n0, 0], acc_s[mt, n0, 1], acc_s[mt, n0, 2],
                         acc_s[mt, n0, 3]) = mma(
                            frag[mt, 0], frag[mt, 1], frag[mt, 2], frag[mt, 3], b0, b1,
                            acc_s[mt, n0, 0], acc_s[mt, n0, 1], acc_s[mt, n0, 2],
                            acc_s[mt, n0, 3])
                        n1 = n0 + 1
                        (acc_s[mt, n1, 0], acc_s[mt, n1, 1], acc_s[mt, n1, 2],
                         acc_s[mt, n1, 3]) = mma(
                            frag[mt, 0], frag[mt, 1], frag[mt, 2], frag[mt, 3], b2, b3,
                            acc_s[mt, n1, 0], acc_s[mt, n1, 1], acc_s[mt, n1, 2],
                            acc_s[mt, n1, 3])

            # mask the blocks that cross an edge (per row: keys outside [first, last])
            for mt in range(m_tiles):
                tile_row0 = warp_row0 + mt * 16
                if not block_is_full(tile_row0, tile_row0 + 16, col0, col0 + block_n, offset,
                                     seqlen_k, window_left, window_right):
                    for h in range(2):
                        first, last = row_key_range(tile_row0 + g + 8 * h, offset, seqlen_k,
                                                    window_left, window_right)
                        lane_col = col0 + 2 * t
                        first_rel = np.int32(first - lane_col)
                        last_rel = np.int32(last - lane_col)
                        for nt in range(n_tiles):
                            for e in range(2):
                                j = np.int32(nt * 8 + e)
                                if j < first_rel or j > last_rel:
                                    acc_s[mt, nt, 2 * h + e] = NEG_INF

            # online softmax: new row maxima (quad reduction), rescale O and the sums, P
            for mt in range(m_tiles):
                for h in range(2):
                    new_max = row_max[mt, h]
                    for nt in range(n_tiles):
                        new_max = fmax(new_max, fmax(acc_s[mt, nt, 2 * h],
                                                     acc_s[mt, nt, 2 * h + 1]))
                    new_max = fmax(new_max, ptx.shfl_xor_f32(new_max, 1))
                    new_max = fmax(new_max, ptx.shfl_xor_f32(new_max, 2))
                    max_scaled[mt, h] = scaled_max(new_max, scale_log2)
                    alpha = rescale_factor(row_max[mt, h], max_scaled[mt, h], scale_log2)
                    row_max[mt, h] = new_max
                    row_sum[mt, h] *= alpha
                    row_scale[mt, h] = alpha
            for mt in range(m_tiles):
                for dt in range(d_tiles):
                    for e in range(4):
                        acc_o[mt, dt, e] *= row_scale[mt, e // 2]
            for mt in range(m_tiles):
                for nt in range(n_tiles):
                    for e in range(4):
                        p = ptx.ex2_approx(cuda.fma(acc_s[mt, nt, e], scale_log2,
                                                    -max_scaled[mt, e // 2]))
                        acc_s[mt, nt, e] = p
                        row_sum[mt, e // 2] += p

            ptx.cp_async_wait(0)
            cuda.syncthreads()       # V landed; every warp is done reading K
            if it + 1 < n_blocks:
                col = col0 - block_n
                if paged:
                    load_paged(smem, s_k, k, head_k * k_sh, block_table, bt_row, bt_ss, col,
                               k_sb, k_sn, seqlen_k - col, num_pages, bs_shift, tid)
                else:
                    load_kv(smem, s_k, k, k_thread, col * k_sn, k_sn, seqlen_k - col, tid)
            ptx.cp_async_commit()

            # O += P V, P straight from the S accumulators
            for kk in range(p_steps):
                for mt in range(m_tiles):
                    frag[mt, 0] = pack(acc_s[mt, 2 * kk, 0], acc_s[mt, 2 * kk, 1])
                    frag[mt, 1] = pack(acc_s[mt, 2 * kk, 2], acc_s[mt, 2 * kk, 3])
                    frag[mt, 2] = pack(acc_s[mt, 2 * kk + 1, 0], acc_s[mt, 2 * kk + 1, 1])
                    frag[mt, 3] = pack(acc_s[mt, 2 * kk + 1, 2], acc_s[mt, 2 * kk + 1, 3])
                for pd in range(d_tiles // 2):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(smem, v_frag + kk * 16 * pitch
                                                           + pd * 16)
                    for mt in range(m_tiles):
                        d0 = 2 * pd
                        (acc_o[mt, d0, 0], acc_o[mt, d0, 1], acc_o[mt, d0, 2],
                         acc_o[mt, d0, 3]) = mma(
                            frag[mt, 0], frag[mt, 1], frag[mt, 2], frag[mt, 3], b0, b1,
                            acc_o[mt, d0, 0], acc_o[mt, d0, 1], acc_o[mt, d0, 2],
                            acc_o[mt, d0, 3])
                        d1 = d0 + 1
                        (acc_o[mt, d1, 0], acc_o[mt, d1, 1], acc_o[mt, d1, 2],
                         acc_o[mt, d1, 3]) = mma(
                            frag[mt, 0], frag[mt, 1], frag[mt, 2], frag[mt, 3], b2, b3,
                            acc_o[mt, d1, 0], acc_o[mt, d1, 1], acc_o[mt, d1, 2],
                            acc_o[mt, d1, 3])

        # normalise once, stage the warp's rows in its Q rows, write 16-byte chunks
        ptx.cp_async_wait(0)
        cuda.syncthreads()           # no copy into the Q tile is still in flight
        if is_varlen:                # read again rather than kept in registers over the loop
            q_start, seqlen_q = clamped_range(cu_seqlens_q, batch, seqlen_q_arg)
        for mt in range(m_tiles):
            for h in range(2):
                total = row_sum[mt, h]
                total += ptx.shfl_xor_f32(total, 1)
                total += ptx.shfl_xor_f32(total, 2)
                inv_sum, row_lse = finish_row(row_max[mt, h], total, softmax_scale)
                r = warp * rows_per_warp + mt * 16 + g + 8 * h
                for dt in range(d_tiles):
                    base = s_q + r * pitch + dt * 8 + 2 * t
                    smem[base] = from_f32(acc_o[mt, dt, 2 * h] * inv_sum)
                    smem[base + 1] = from_f32(acc_o[mt, dt, 2 * h + 1] * inv_sum)
                if t == 0 and row0 + r < seqlen_q:
                    lse[batch * lse_sb + head * lse_sh + q_start + row0 + r] = row_lse
        ptx.syncwarp()
        o_base = batch * o_sb + (q_start + row0) * o_sn + head * o_sh
        for c in range(out_chunks):
            i = lane + 32 * c
            r = warp * rows_per_warp + i // (dim // 8)
            col = (i % (dim // 8)) * 8
            if row0 + r < seqlen_q and col < head_dim:
                w0, w1, w2, w3 = ptx.load_u32x4(smem, s_q + r * pitch + col)
                ptx.store_u32x4(out, o_base + r * o_sn + col, w0, w1, w2, w3)

    return flash_attn_tc_kernel


@functools.lru_cache(maxsize=None)
def tc_kernel(signature, head_dim, dim, warps, m_tiles, block_n, min_blocks, is_bf16,
              is_varlen, paged=False):
    """The Tensor Core kernel for one configuration; ``min_blocks`` (launch bounds: blocks per
    SM the register allocation must allow) 0 leaves the register count to ptxas."""
    options = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}
    return Kernel(jit(_tc_kernel_fn(head_dim, dim, warps, m_tiles, block_n, is_bf16, is_varlen,
                                    min_blocks, paged), **options),
                  signature, "paged_prefill_tc_kernel" if paged else "flash_attn_tc_kernel")
