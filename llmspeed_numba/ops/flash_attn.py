"""FlashAttention forward: ``softmax(scale * Q K^T + mask) V`` without materialising the scores.

    out[b, i, h, :] = sum_j P[b, h, i, j] v[b, j, h // group, :]
    P[b, h, i, j]   = exp(scale * q[b, i, h] . k[b, j, h // group] - lse[b, h, i])   (attended j)
    lse[b, h, i]    = log sum_{attended j} exp(scale * q[b, i, h] . k[b, j, h // group])

Layout: q ``(batch, seqlen_q, nheads, headdim)``, k / v ``(batch, seqlen_k, nheads_k, headdim)``
with ``group = nheads // nheads_k`` (GQA / MQA); the varlen form packs the sequences along the
first axis, ``(total_tokens, nheads, headdim)``, delimited by int32 ``cu_seqlens``. Only the last
dimension must be contiguous: q, k, v sliced out of one packed qkv tensor work without copies.

Mask (FlashAttention 2): aligned to the bottom-right corner. With ``offset = seqlen_k -
seqlen_q``, query ``i`` attends key ``j`` iff ``i + offset - window_left <= j <= i + offset +
window_right`` (a bound of -1 is absent); ``causal`` means ``window_right = 0``. A query row
whose mask is empty gets output 0 and lse ``-inf``.

Kernels (``_flash_attn_wgmma.py``, ``_flash_attn_tc.py``, ``_flash_attn_simt.py``), when q, k, v
and out are 16-byte aligned (pointers and strides multiples of 8 elements): on Hopper (sm_90) the
wgmma kernel for the head dimensions of ``WGMMA_CONFIGS`` (at ``WGMMA_TMA_ONLY`` ones only where
K and V fit a tensor map); else the Tensor Core kernel (mma.sync,
cp.async, ldmatrix, online softmax in registers), every head dimension (padded up to a multiple
of 16). Misaligned inputs, and the CUDA simulator, run the SIMT kernel of the same algorithm.
The grid is (query blocks, nheads, batch); query blocks run longest-first.

Tests and the benchmark's sweep force a kernel through ``TUNING`` (scope ``flash_attn`` of
``_overrides.overrides``, for ``flash_attn`` and ``flash_attn_varlen``): ``impl`` "wgmma" / "tc"
/ "simt", ``config`` a ``WGMMA_CONFIGS`` or ``TC_CONFIGS`` tuple, or ``(block_m, block_n)`` for
SIMT.
"""


import weakref

import numpy as np
from numba import types

from .. import _checks, _recording, compile_check
from .._arrays import Buffer, Tensor, empty, host_ints, kernel_buffer, stream_handle
from .._checks import (aligned, contiguous, last_dim_contiguous, non_negative_strides, output,
                       same_dtype, shape, tensor)
from .._env import SIMULATOR
from .._launch import array1d, collecting, sm_count
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._tensor_map import may_make_map, tensor_map_2d
from .._typing import ArrayLike, StreamLike
from .._workspace import workspace
from ._attention_common import LOG2E
from . import _flash_attn_simt, _flash_attn_tc, _flash_attn_wgmma
from .gemm_configs import wgmma_supported

HALF_DTYPES = ("float16", "bfloat16")
MAX_HEADDIM = 256

#: Tensor Core configurations ``(warps, m_tiles, block_n, min_blocks)`` by padded head dimension:
#: a block owns ``warps * 16 * m_tiles`` query rows and streams ``block_n`` keys at a time;
#: ``min_blocks`` > 0 sets launch bounds (registers capped at 65536 / (threads * min_blocks)).
#: Up to 64: two m16 tiles per warp (K/V fragments reused twice; S and O are 64 + 64 fp32
#: registers; 248 registers, 2 blocks per SM). Up to 128: one m16 tile per warp (32 + 64 fp32)
#: capped at 168 registers, which sm_90a holds without spilling: 3 blocks (12 warps) per SM.
#: 256: one m16 tile (32 + 128 fp32), 255 registers, 2 blocks per SM. Offline register counts;
#: ``benchmarks/bench_flash_attn.py --sweep`` times the alternatives on the H200.
TC_CONFIGS = {64: (4, 2, 64, 0), 128: (4, 1, 64, 3), 256: (4, 1, 64, 0)}

#: Simulator configuration of the Tensor Core kernel: one warp, one m16 tile, 16-key blocks (an
#: emulated mma costs ~0.2 s per warp).
SIMULATOR_TC_CONFIG = (1, 1, 16, 0)

#: wgmma configurations ``(groups, block_n, stages, min_blocks, producer, pingpong, tma)`` by head
#: dimension (the kernel pads to a multiple of 64; other head dimensions take the mma.sync
#: kernel on Hopper too): a block owns ``64 * groups`` query rows (one consumer warpgroup each)
#: and streams ``block_n`` keys at a time through a ring of ``stages`` K / V buffers;
#: ``min_blocks`` > 0 sets launch bounds; ``producer`` 1: a producer warpgroup copies K / V
#: (mbarrier hand-over, setmaxnreg split), 0: every thread copies (block barrier a key block);
#: ``pingpong`` 1 (with a producer, 2+ groups): the groups take turns issuing their MMAs;
#: ``tma`` 1 (with a producer): whole key blocks come by the Tensor Memory Accelerator when K and
#: V allow a tensor map (``_kv_tensor_maps``; else that call copies with cp.async); ``lazy`` 1:
#: rows keep their maximum until a block raises it by more than 2 ** 8, and warps whose rows all
#: kept it skip O's rescale (``_flash_attn_wgmma``; opt-in: within +-2% of the planned forms at
#: d64 / d128 / d256, session 31); ``overlap`` 1 (with a producer): the softmax of key block
#: j + 1 runs under block j's P V (opt-in until timed on the H200); ``persistent`` 1 (with the
#: TMA producer, no ping-pong): a grid of one block per SM slot drawing tiles from a counter,
#: Q loaded by TMA too, so a tile's start and end overlap the next one's loads (opt-in until
#: timed; calls whose Q no tensor map holds run the non-persistent form).
#: Registers a consumer thread: S ``block_n / 2`` + O ``headdim / 2`` fp32 + P ``block_n / 4``.
#: 64: one consumer group, two blocks an SM (each hides the other's start and end, which causal
#: blocks have half the key blocks to hide behind), TMA; its cp.async form spills, so calls that
#: do not copy by TMA take ``WGMMA_CP_ASYNC_CONFIGS``. 128: 128-key blocks (S 64 registers; the
#: consumers get 200 registers, 232 with the TMA producer, see
#: ``_flash_attn_wgmma.maxnreg_split``; no spills, offline), ping-pong (+2-3%), TMA (+7-13%).
#: 256: O alone is 128 registers a thread; three stages of 48 keys (208 KB of shared memory with
#: Q; two of 80 waited on their copies), the TMA producer's 232 consumer registers keep the
#: key-block loop spill-free (the epilogue spills ~270 B; ``WGMMA_TMA_ONLY``), no ping-pong
#: (+2-3% without). benchmarks/NOTES.md, sessions 28-30.
WGMMA_CONFIGS = {64: (1, 128, 3, 2, 1, 0, 1), 128: (2, 128, 3, 1, 1, 1, 1),
                 256: (2, 48, 3, 1, 1, 0, 1)}

#: The configuration a call at these head dimensions takes when it does not copy by TMA (under
#: ``TMA_MIN_WORK``, or K / V no tensor map holds) and none was forced.
WGMMA_CP_ASYNC_CONFIGS = {64: (2, 128, 3, 1, 1)}

#: A call takes the TMA form (``tma`` 1) only from this much work on (heads x query rows x key
#: rows x sequences): a call on operands new to the map cache makes their maps (host work:
#: encoding, an asynchronous upload and an event, ``_tensor_map._upload``), which may cost small
#: calls more than TMA gains them (+1-3% at 2^25-2^27 with the maps cached and replayed,
#: session 31; timed then with a synchronous upload, not yet with this one); and without
#: ``_tensor_map.REPLAY_MAPS`` the maps keep a call off the replayed fast path (~10 us against
#: ~50 of host time).
TMA_MIN_WORK = 2**28

#: Head dimensions whose planned wgmma kernel runs only in the TMA form, at any size: the
#: cp.async producer's register split leaves d256's consumers spilling, slower than the mma.sync
#: kernel, which takes the calls a tensor map cannot serve (benchmarks/NOTES.md, session 29).
WGMMA_TMA_ONLY = frozenset({256})

#: Simulator configuration of the wgmma kernel: one consumer warpgroup, 32-key blocks.
SIMULATOR_WGMMA_CONFIG = (1, 32, 2, 0, 1)

#: SIMT kernel ``(block_m, block_n)`` on the GPU and in the simulator.
SIMT_CONFIG = (_flash_attn_simt.BLOCK_M, _flash_attn_simt.BLOCK_N)
SIMULATOR_SIMT_CONFIG = (16, 16)

#: The kernel forced (None: chosen): ``impl`` "tc" / "simt", ``config`` its configuration;
#: ``tma_min_work`` the work from which a ``tma`` configuration copies by TMA (tests set 0).
TUNING = Knobs("flash_attn", choices={"impl": (None, "wgmma", "tc", "simt")}, impl=None,
               config=None, tma_min_work=TMA_MIN_WORK)

#: Kernel parameters (see ``_flash_attn_tc._tc_kernel_fn``): q, k, v, out, lse, cu_seqlens_q,
#: cu_seqlens_k, block_table, seqlen_q, seqlen_k, the strides of q, k, v, out (3 each), lse and
#: block_table (2 each), group, softmax_scale, scale_log2, window_left, window_right, num_pages,
#: bs_shift. The block table and its numbers serve the paged variant (``ops/paged_prefill.py``).
#: The wgmma kernels take two more: the tensor maps of K and V (``_WGMMA_SIGNATURE``).
_SIGNATURE = (
    (array1d(np.uint16),) * 4
    + (array1d(np.float32), array1d(np.int32), array1d(np.int32), array1d(np.int32))
    + (types.int32, types.int32)
    + (types.int64,) * 16
    + (types.int32, types.float32, types.float32, types.int32, types.int32)
    + (types.int32, types.int32)
)

_WGMMA_SIGNATURE = _SIGNATURE + (array1d(np.uint64),) * 2
#: ... and the persistent ones five: Q's tensor map, the tile counters (a per-stream int32
#: workspace of two), and the query blocks a head, heads and sequences the tiles span.
_WGMMA_PERSISTENT_SIGNATURE = _WGMMA_SIGNATURE + (array1d(np.uint64), array1d(np.int32),
                                                  types.int32, types.int32, types.int32)

_GRID_YZ_LIMIT = 65535
_INT32_MAX = 2**31 - 1


def padded_dim(headdim):
    """Head dimension the Tensor Core kernel computes with (next multiple of 16)."""
    return -(-headdim // 16) * 16


def _register_cap(min_blocks, is_varlen):
    """Launch-bounds blocks per SM for the kernel: the varlen kernel keeps more live values (its
    sequence offsets) and spills 24 B at the d128 cap, so it runs uncapped."""
    return 0 if is_varlen else min_blocks


def wgmma_config(dim):
    """The ``WGMMA_CONFIGS`` entry of the smallest listed head dimension holding ``dim``."""
    for limit in sorted(WGMMA_CONFIGS):
        if dim <= limit:
            return WGMMA_CONFIGS[limit]
    raise ValueError(f"headdim {dim} above {max(WGMMA_CONFIGS)}")


def _wgmma_fields(config):
    """The ten fields of a wgmma configuration (missing trailing ones 0)."""
    config = tuple(config)
    return config + (0,) * (10 - len(config))


def tc_config(headdim):
    dim = padded_dim(headdim)
    for limit in sorted(TC_CONFIGS):
        if dim <= limit:
            return TC_CONFIGS[limit]
    raise ValueError(f"headdim {headdim} above {MAX_HEADDIM}")


# ---- validation ---------------------------------------------------------------------------

def _check_options(causal, softmax_scale, window_size, headdim, return_lse):
    _checks.boolean("causal", causal)
    _checks.boolean("return_lse", return_lse)
    scale = _checks.softmax_scale(softmax_scale, headdim)
    left, right = _checks.window_size(window_size)
    return scale, left, right


def _check_headdim(headdim):
    if headdim % 8 or not 8 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"q: expected headdim a multiple of 8 in [8, {MAX_HEADDIM}], "
                         f"got {headdim}")


def _check_layout(tensors):
    for name, t in tensors.items():
        if t.size == 0:          # nothing is read: any strides (numpy gives 0) will do
            continue
        non_negative_strides(name, t)
        last_dim_contiguous(name, t)


def _normalise_window(causal, left, right, max_seqlen_q, max_seqlen_k):
    """Effective (left, right): causal sets right = 0; a bound that cannot cut (left >=
    seqlen_k, right >= seqlen_q) becomes -1, so its blocks need no mask."""
    if causal:
        right = 0
    if left >= max(max_seqlen_k, 1):
        left = -1
    if right >= max(max_seqlen_q, 1):
        right = -1
    return min(left, _INT32_MAX), min(right, _INT32_MAX)


#: id(torch cu_seqlens) -> (weak reference, (version, address, total, max_seqlen) they were last
#: found valid at): a model passes the same offsets to every layer, and a replayed call repeats
#: the check (``_recording.recheck``), so the host read (a synchronisation) happens once per new
#: or modified tensor. torch bumps ``_version`` on every in-place write through torch; a write by
#: a foreign kernel goes unseen, as any cache of device data would miss it. (Keyed by id with a
#: weak reference: a WeakKeyDictionary compares torch keys with ``==``, elementwise.)
_VALID_OFFSETS: dict = {}


def _check_cu_seqlens(name, t, total, max_seqlen, max_name):
    """cu_seqlens hold non-decreasing offsets within ``total``, no sequence longer than
    ``max_seqlen``: read back and checked, unless this torch tensor passed unmodified."""
    def check(obj, t=None):
        torch_kind = t is None or t.kind == "torch"
        if torch_kind:
            stamp = (obj._version, obj.data_ptr(), total, max_seqlen)
            seen = _VALID_OFFSETS.get(id(obj))
            if seen is not None and seen[0]() is obj and seen[1] == stamp:
                return
        _check_offsets(name, t if t is not None else _checks.tensor(obj, name), total,
                       max_seqlen, max_name)
        if torch_kind:
            if len(_VALID_OFFSETS) > 1024:
                _VALID_OFFSETS.clear()
            _VALID_OFFSETS[id(obj)] = (weakref.ref(obj), stamp)

    check(t.obj, t)
    _recording.recheck(check, t.obj)


def _check_offsets(name, t, total, max_seqlen, max_name):
    values = host_ints(t)
    if values.size and values[0] < 0:
        raise ValueError(f"{name}: expected non-negative offsets, got {name}[0] = {values[0]}")
    diffs = np.diff(values)
    if (diffs < 0).any():
        i = int(np.argmax(diffs < 0))
        raise ValueError(f"{name}: expected non-decreasing offsets, got {name}[{i}] = "
                         f"{values[i]} > {name}[{i + 1}] = {values[i + 1]}")
    if values.size and values[-1] > total:
        raise ValueError(f"{name}: last offset {values[-1]} exceeds the {total} packed tokens")
    longest = int(diffs.max()) if diffs.size else 0
    if longest > max_seqlen:
        raise ValueError(f"{max_name}: expected at least the longest sequence ({longest}), "
                         f"got {max_seqlen}")


def _check_max_seqlen(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return int(value)


# ---- launch -------------------------------------------------------------------------------

def _dummy(like, dtype=np.int32):
    """A one-element array argument the kernel never reads (no offsets, no tensor map)."""
    if SIMULATOR:
        return np.zeros(1, dtype)
    return Buffer(like.ptr, 1, np.dtype(dtype), like.obj)


def _token_map(name, t, strides, batch, seqlen, nheads, box_rows, stream):
    """Tensor map of q, k or v for the wgmma kernel's TMA loads, seen as a 2-D tensor: token
    rows (``sb / sn`` rows a sequence, so the batch must be whole rows apart; varlen passes
    ``sb`` 0 and its packed total as ``seqlen``), head ``h`` at column ``h * sh``, boxes of
    ``box_rows`` rows and 64 columns. None (the call copies with cp.async) when the layout does
    not fit a map, or inside a torch CUDA-graph capture before the map exists."""
    sb, sn, sh = strides
    if sn <= 0 or sb % sn:
        return None
    rows = (batch - 1) * (sb // sn) + seqlen
    cols = (nheads - 1) * sh + t.shape[-1]
    if cols > sn or rows >= 2**31:
        return None
    view = Tensor(t.obj, t.kind, t.ptr, (rows, cols), (sn, 1), t.dtype, t.host)
    try:
        return tensor_map_2d(view, box_rows, _flash_attn_wgmma.PANEL, name=name,
                             make=may_make_map(t, stream), stream=stream)
    except ValueError:
        return None


def _kv_tensor_maps(tk, tv, k_strides, v_strides, batch, seqlen_k, nheads_k, block_n, stream):
    """Tensor maps of K and V for the wgmma kernel's TMA producer (``_token_map``, boxes of
    ``block_n`` rows), or None."""
    k_map = _token_map("k", tk, k_strides, batch, seqlen_k, nheads_k, block_n, stream)
    if k_map is None:
        return None
    v_map = _token_map("v", tv, v_strides, batch, seqlen_k, nheads_k, block_n, stream)
    return None if v_map is None else (k_map, v_map)


def _pick_impl(tensors, headdim=None):
    impl = TUNING.impl
    if impl is not None:
        return impl
    if SIMULATOR or not all(aligned(n, t, 8) for n, t in tensors.items()):
        return "simt"
    return "wgmma" if headdim in WGMMA_CONFIGS and wgmma_supported() else "tc"


def lse_output(tq, shape, return_lse, stream):
    """``(lse, its kernel buffer)``: a new float32 array of ``shape`` when the caller asked for
    it, else (None, a per-stream scratch workspace that nobody reads: the kernel writes it
    anyway, and a fresh allocation a call costs more host time than the kernel at decode sizes)."""
    if return_lse:
        lse = empty(tq, shape, "float32")
        return lse, kernel_buffer(tensor(lse, "lse"))
    n = 1
    for d in shape:
        n *= d
    return None, workspace(tq, stream_handle(stream, (tq,)), "attention_lse", n, np.float32)


def _launch(tq, tk, tv, to, lse_buf, cu_q, cu_k, *, batch, nheads, nheads_k, seqlen_q, seqlen_k,
            max_seqlen_q, q_strides, k_strides, v_strides, o_strides, lse_strides, scale,
            left, right, stream):
    headdim = tq.shape[-1]
    handle = stream_handle(stream, (tq, tk, tv))
    is_bf16 = tq.dtype == "bfloat16"
    is_varlen = cu_q is not None
    impl = _pick_impl({"q": tq, "k": tk, "v": tv, "out": to}, headdim)
    config = TUNING.config
    maps = None
    if impl == "wgmma":
        dim = _flash_attn_wgmma.padded_dim(headdim)
        planned = config is None and TUNING.impl is None
        config = tuple(config or (SIMULATOR_WGMMA_CONFIG if SIMULATOR else wgmma_config(dim)))
        groups, block_n, stages, min_blocks, producer, pingpong, tma, *_ = _wgmma_fields(config)
        work = nheads * max_seqlen_q * seqlen_k * (1 if is_varlen else batch)
        tma_only = planned and dim in WGMMA_TMA_ONLY
        if tma and producer and headdim == dim and (tma_only or work >= TUNING.tma_min_work):
            maps = _kv_tensor_maps(tk, tv, k_strides, v_strides, batch, seqlen_k, nheads_k,
                                   block_n, handle)
        if tma_only and maps is None:
            impl, config = "tc", None
        elif maps is None and TUNING.config is None and not SIMULATOR:
            config = WGMMA_CP_ASYNC_CONFIGS.get(dim, config)
    persistent = None
    if impl == "wgmma":
        groups, block_n, stages, min_blocks, producer, pingpong, tma, lazy, overlap, persist = \
            _wgmma_fields(config)
        block_m = 64 * groups
        if persist and (pingpong or dim > 128 or not (producer and tma)):
            raise ValueError(f"config: the persistent form (field 10) needs the TMA producer "
                             f"without ping-pong and a head dimension up to 128, got {config} "
                             f"at head dimension {headdim}")
        if persist and maps is not None and (   # while the tile numbers fit int32 draws
                -(-max_seqlen_q // block_m) * nheads * batch < _INT32_MAX - (1 << 20)):
            q_map = _token_map("q", tq, q_strides, batch, seqlen_q, nheads, block_m, handle)
            if q_map is not None:   # the tile counters: zero when a launch starts (each leaves
                # them so); a captured graph's own (see ``_workspace``)
                persistent = (q_map, workspace(tq, handle, "attention_tiles", 2, np.int32,
                                               own_in_graph="graph"))
        kernel = _flash_attn_wgmma.wgmma_kernel(
            _WGMMA_PERSISTENT_SIGNATURE if persistent else _WGMMA_SIGNATURE, headdim, dim,
            groups, block_n, stages, min_blocks, bool(producer), bool(pingpong), is_bf16,
            is_varlen, maps is not None, lazy=bool(lazy), overlap=bool(overlap),
            persistent=persistent is not None)
        threads = _flash_attn_wgmma.threads_for(groups, producer)
        shared = _flash_attn_wgmma.shared_bytes(dim, groups, block_n, stages)
    elif impl == "tc":
        config = tuple(config or (SIMULATOR_TC_CONFIG if SIMULATOR else tc_config(headdim)))
        warps, m_tiles, block_n, min_blocks = config + (0,) * (4 - len(config))
        min_blocks = _register_cap(min_blocks, is_varlen)
        dim = padded_dim(headdim)
        block_m = warps * 16 * m_tiles
        kernel = _flash_attn_tc.tc_kernel(_SIGNATURE, headdim, dim, warps, m_tiles, block_n,
                                          min_blocks, is_bf16, is_varlen)
        threads = 32 * warps
        shared = _flash_attn_tc.tc_shared_bytes(dim, warps, m_tiles, block_n)
    else:
        block_m, block_n = config or (SIMULATOR_SIMT_CONFIG if SIMULATOR else SIMT_CONFIG)
        kernel = _flash_attn_simt.simt_kernel(_SIGNATURE, headdim, block_m, block_n, is_bf16,
                                              is_varlen)
        threads = block_m
        shared = 0
    grid = (-(-max_seqlen_q // block_m), nheads, batch)
    if nheads > _GRID_YZ_LIMIT or batch > _GRID_YZ_LIMIT:
        raise NotImplementedError(f"q: at most {_GRID_YZ_LIMIT} heads and sequences, got "
                                  f"{nheads} heads, {batch} sequences")
    dummy = _dummy(tq)
    args = (kernel_buffer(tq), kernel_buffer(tk), kernel_buffer(tv), kernel_buffer(to),
            lse_buf,
            kernel_buffer(cu_q) if is_varlen else dummy,
            kernel_buffer(cu_k) if is_varlen else dummy, dummy,
            seqlen_q, seqlen_k, *q_strides, *k_strides, *v_strides, *o_strides, *lse_strides,
            0, 0, nheads // nheads_k, np.float32(scale), np.float32(scale * LOG2E), left, right,
            0, 0)
    if impl == "wgmma":
        args += maps or (_dummy(tq, np.uint64),) * 2
    if persistent is not None:
        m_blocks = grid[0]
        args += (*persistent, m_blocks, nheads, batch)
        if not SIMULATOR:
            _prefer_shared_memory(kernel)
        slots = sm_count() * max(1, kernel.blocks_per_sm(threads, shared))
        grid = (min(m_blocks * nheads * batch, slots), 1, 1)
    elif impl != "simt" and not SIMULATOR:
        _prefer_shared_memory(kernel)
    kernel(grid, threads, args, handle, shared)


_CARVEOUT_SET = set()


def _prefer_shared_memory(kernel):
    """Ask for the largest shared-memory carveout once per kernel: several blocks of 50-100 KB
    must fit on one SM, and the kernel does not use L1 (cp.async.cg bypasses it). A hint only."""
    if kernel in _CARVEOUT_SET or collecting():
        return
    _CARVEOUT_SET.add(kernel)
    try:
        from cuda.bindings import driver

        from .._env import cuda

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        handle = kernel.handle()
        if isinstance(handle, driver.CUkernel):  # numba-cuda loads modules as libraries
            driver.cuKernelSetAttribute(attr, 100, handle, cuda.get_current_device().id)
        else:
            driver.cuFuncSetAttribute(handle, attr, 100)
    except Exception:  # noqa: BLE001  (a hint: never fail a launch over it)
        pass


def _output(out, tq, expected_shape):
    to = output("out", out, expected_shape, tq.dtype, tq)
    if to is None:
        out = empty(tq, expected_shape, tq.dtype)
        to = tensor(out, "out")
    _check_layout({"out": to})
    return out, to


# ---- public API ---------------------------------------------------------------------------

_FLASH_ATTN_CALLS = OpCalls("flash_attn")


def flash_attn(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
               softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
               return_lse: bool = False, out: ArrayLike | None = None,
               stream: StreamLike = None) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """Attention forward, FlashAttention 2 semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim); fp16 or
    bf16 (all the same), headdim a multiple of 8 up to 256, nheads a multiple of nheads_k. Only
    the last dimension must be contiguous.

    causal: mask aligned to the bottom-right corner (query ``i`` attends keys
    ``j <= i + seqlen_k - seqlen_q``). window_size=(left, right): sliding window, -1 unbounded;
    with causal, right is 0. softmax_scale defaults to ``1 / sqrt(headdim)``.

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype and kind (or ``out=``), and with
    ``return_lse=True`` also lse (batch, nheads, seqlen_q) float32 (natural log; ``-inf`` for a
    row that attends nothing, whose output is 0).

    Raises ``TypeError`` for non-arrays, dtypes other than fp16 / bf16, mixed dtypes and
    options of the wrong type; ``ValueError`` for wrong ranks, shapes that disagree, nheads not a
    multiple of nheads_k, unsupported headdim, non-contiguous last dimensions, window values
    below -1 and a softmax_scale that is not a finite number > 0.
    """
    result = _FLASH_ATTN_CALLS.replay(
        (q, k, v, out), (causal, softmax_scale, window_size, return_lse), stream)
    if result is MISS:
        result = _FLASH_ATTN_CALLS.record(
            _flash_attn_checked, q, k, v, causal, softmax_scale, window_size, return_lse, out,
            stream)
    return result


def _flash_attn_checked(q, k, v, causal, softmax_scale, window_size, return_lse, out, stream):
    """The checked path of ``flash_attn`` (validation, planning, launch)."""
    tq = tensor(q, "q", ndim=4, dtypes=HALF_DTYPES)
    tk = tensor(k, "k", ndim=4, dtypes=HALF_DTYPES)
    tv = tensor(v, "v", ndim=4, dtypes=HALF_DTYPES)
    batch, seqlen_q, nheads, headdim = tq.shape
    shape("k", tk, (batch, None, None, headdim), "to match q's batch and headdim")
    seqlen_k, nheads_k = tk.shape[1], tk.shape[2]
    shape("v", tv, tk.shape, "to match k")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"k: expected nheads_k dividing q's nheads ({nheads}), got {nheads_k}")
    same_dtype("q", tq, k=tk, v=tv)
    _check_layout({"q": tq, "k": tk, "v": tv})
    _check_headdim(headdim)
    scale, left, right = _check_options(causal, softmax_scale, window_size, headdim,
                                        return_lse)
    out, to = _output(out, tq, tq.shape)
    lse, lse_buf = lse_output(tq, (batch, nheads, seqlen_q), return_lse, stream)
    if batch and seqlen_q and nheads:
        left, right = _normalise_window(causal, left, right, seqlen_q, seqlen_k)
        _launch(tq, tk, tv, to, lse_buf, None, None, batch=batch, nheads=nheads,
                nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, max_seqlen_q=seqlen_q,
                q_strides=tq.strides[:3], k_strides=tk.strides[:3], v_strides=tv.strides[:3],
                o_strides=to.strides[:3], lse_strides=(nheads * seqlen_q, seqlen_q),
                scale=scale, left=left, right=right, stream=stream)
    return (out, lse) if return_lse else out


_FLASH_ATTN_VARLEN_CALLS = OpCalls("flash_attn_varlen")


def flash_attn_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                      cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                      causal: bool = False, softmax_scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                      out: ArrayLike | None = None, stream: StreamLike = None,
                      check_bounds: bool | None = None
                      ) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """Attention forward over a packed batch of sequences of different lengths.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); sequence ``b`` is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of
    k / v, each masked on its own (bottom-right aligned, as ``flash_attn``). cu_seqlens_*:
    contiguous int32 (batch + 1), non-decreasing; max_seqlen_*: at least the longest sequence.
    Options as ``flash_attn``.

    Returns out (total_q, nheads, headdim) (rows of q outside every sequence are not written),
    and with ``return_lse=True`` lse (nheads, total_q) float32 (FlashAttention 2's varlen
    layout).

    Bounds: the kernels are memory-safe for any offsets (each sequence's query rows are clamped
    to ``[0, total_q]``; a sequence whose key offsets are not ``0 <= start <= end <= total_k``
    writes no rows), but invalid ones give meaningless results, and rows of a sequence longer
    than ``max_seqlen_q`` are not written. ``check_bounds=True`` reads the offsets back to the
    host (a device synchronisation; once per torch tensor version) and raises ``ValueError``
    for negative, decreasing or out-of-range offsets or a sequence longer than
    ``max_seqlen_*``. Default (``None``): checked when the arrays are host memory (the CUDA
    simulator), unchecked on the GPU, as ``paged_prefill_attention``.
    """
    result = _FLASH_ATTN_VARLEN_CALLS.replay(
        (q, k, v, cu_seqlens_q, cu_seqlens_k, out),
        (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, return_lse,
         check_bounds), stream)
    if result is MISS:
        result = _FLASH_ATTN_VARLEN_CALLS.record(
            _flash_attn_varlen_checked, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, causal, softmax_scale, window_size, return_lse, out, stream,
            check_bounds)
    return result


def _flash_attn_varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, softmax_scale, window_size, return_lse, out, stream,
                               check_bounds):
    """The checked path of ``flash_attn_varlen`` (validation, planning, launch)."""
    tq = tensor(q, "q", ndim=3, dtypes=HALF_DTYPES)
    tk = tensor(k, "k", ndim=3, dtypes=HALF_DTYPES)
    tv = tensor(v, "v", ndim=3, dtypes=HALF_DTYPES)
    tcq = tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1)
    tck = tensor(cu_seqlens_k, "cu_seqlens_k", ndim=1)
    total_q, nheads, headdim = tq.shape
    shape("k", tk, (None, None, headdim), "to match q's headdim")
    total_k, nheads_k = tk.shape[0], tk.shape[1]
    shape("v", tv, tk.shape, "to match k")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"k: expected nheads_k dividing q's nheads ({nheads}), got {nheads_k}")
    if tcq.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q: expected batch + 1 >= 1 offsets, got shape {tcq.shape}")
    shape("cu_seqlens_k", tck, tcq.shape, "to match cu_seqlens_q")
    same_dtype("q", tq, k=tk, v=tv)
    for name, t in (("cu_seqlens_q", tcq), ("cu_seqlens_k", tck)):
        if t.dtype != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    _check_layout({"q": tq, "k": tk, "v": tv})
    contiguous("cu_seqlens_q", tcq)
    contiguous("cu_seqlens_k", tck)
    _check_headdim(headdim)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale, left, right = _check_options(causal, softmax_scale, window_size, headdim,
                                        return_lse)
    if check_bounds is None:
        check_bounds = SIMULATOR or tcq.kind == "numpy"
    else:
        _checks.boolean("check_bounds", check_bounds)
    if check_bounds:
        _check_cu_seqlens("cu_seqlens_q", tcq, total_q, max_seqlen_q, "max_seqlen_q")
        _check_cu_seqlens("cu_seqlens_k", tck, total_k, max_seqlen_k, "max_seqlen_k")
    out, to = _output(out, tq, tq.shape)
    lse, lse_buf = lse_output(tq, (nheads, total_q), return_lse, stream)
    batch = tcq.shape[0] - 1
    if batch and max_seqlen_q and nheads:
        left, right = _normalise_window(causal, left, right, max_seqlen_q, max_seqlen_k)
        _launch(tq, tk, tv, to, lse_buf, tcq, tck, batch=batch, nheads=nheads,
                nheads_k=nheads_k, seqlen_q=total_q, seqlen_k=total_k,
                max_seqlen_q=max_seqlen_q,
                q_strides=(0,) + tq.strides[:2], k_strides=(0,) + tk.strides[:2],
                v_strides=(0,) + tv.strides[:2], o_strides=(0,) + to.strides[:2],
                lse_strides=(0, total_q), scale=scale, left=left, right=right, stream=stream)
    return (out, lse) if return_lse else out


# ---- compile-only check (sm_90a SASS: HMMA / LDSM / LDGSTS, no local memory) --------------

def _compile_target(headdim, is_bf16, is_varlen):
    """The kernel exactly as launched: same closure and the same launch bounds."""
    def build():
        warps, m_tiles, block_n, min_blocks = tc_config(headdim)
        min_blocks = _register_cap(min_blocks, is_varlen)
        fn = _flash_attn_tc._tc_kernel_fn(headdim, padded_dim(headdim), warps, m_tiles, block_n,
                                          is_bf16, is_varlen, min_blocks)
        options = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}
        return fn, _SIGNATURE, options

    return build


for _headdim, _bf16, _varlen in ((64, False, False), (128, False, False), (128, True, True)):
    compile_check.register(
        f"flash_attn_tc_d{_headdim}_{'bf16' if _bf16 else 'f16'}{'_varlen' if _varlen else ''}",
        _compile_target(_headdim, _bf16, _varlen),
        ptx_must_have=("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4",
                       "ldmatrix.sync.aligned.m8n8.x4.trans", "cp.async.cg.shared.global",
                       "ex2.approx"),
        sass_must_have=("HMMA", "LDSM", "LDGSTS", "MUFU.EX2"),
        # ptxas of nvJitLink 13.0 (the H200 image) spills 24-28 B at the 168-register cap that
        # gives 3 blocks an SM (13.5 spills nothing); capped it still ran faster there, 285.6
        # vs 271.8 TFLOP/s uncapped (B4 H32 S4096, non-causal; causal 263.5 vs 266.3), 06b1a55
        allowed_local_bytes=32 if (_headdim, _bf16) == (128, False) else 0,
        why="d128 register cap: faster despite a 24 B spill with older ptxas"
        if (_headdim, _bf16) == (128, False) else "")


def _wgmma_compile_target(headdim, is_bf16, is_varlen, config=None):
    """The wgmma kernel exactly as launched on the H200 (same closure, same launch bounds,
    linked whole-program as numba does there, which setmaxnreg needs)."""
    def build():
        dim = _flash_attn_wgmma.padded_dim(headdim)
        groups, block_n, stages, min_blocks, producer, pingpong, tma, lazy, overlap, persist = \
            _wgmma_fields(config or wgmma_config(dim))
        fn = _flash_attn_wgmma._wgmma_kernel_fn(headdim, dim, groups, block_n, stages, is_bf16,
                                                is_varlen, min_blocks, bool(producer),
                                                bool(pingpong), bool(tma), bool(lazy),
                                                bool(overlap), bool(persist))
        options = _flash_attn_wgmma.launch_options(groups, min_blocks, producer)
        signature = _WGMMA_PERSISTENT_SIGNATURE if persist else _WGMMA_SIGNATURE
        return fn, signature, dict(options, lto=True)

    return build


_WGMMA_PTX = ("wgmma.mma_async.sync.aligned", "cp.async.cg.shared.global", "ex2.approx")
_WGMMA_SASS = ("HGMMA", "LDGSTS", "MUFU.EX2")
# causal and windows are run-time arguments of the same kernel; fp16 and bf16 differ in the
# instruction's type only (bf16 is checked with varlen)
for _headdim, _bf16, _varlen in ((64, False, False), (64, True, True), (128, False, False),
                                 (128, True, True), (256, True, False), (256, True, True)):
    _, _, _, _, _producer, _, _tma, *_ = _wgmma_fields(wgmma_config(_headdim))
    compile_check.register(
        f"flash_attn_wgmma_d{_headdim}_{'bf16' if _bf16 else 'f16'}"
        f"{'_varlen' if _varlen else ''}",
        _wgmma_compile_target(_headdim, _bf16, _varlen),
        ptx_must_have=_WGMMA_PTX + (("setmaxnreg.inc", "mbarrier.try_wait.parity")
                                    if _producer else ())
        + (("cp.async.bulk.tensor.2d",) if _tma else ()),
        sass_must_have=_WGMMA_SASS + (("USETMAXREG.DEALLOC", "USETMAXREG.TRY_ALLOC")
                                      if _producer else ()) + (("UTMALDG",) if _tma else ()),
        # d256: O's 128 registers leave the epilogue (normalise, stage, store) ~270 B of spills;
        # the key-block loop is clean, and the kernel ran 2.0-2.4x the mma.sync kernel
        allowed_local_bytes=320 if _headdim == 256 else 0,
        why="d256 epilogue spills; 574-620 vs 258 TFLOP/s for mma.sync (NOTES, session 30)"
        if _headdim == 256 else "")
# the cp.async producers (the TMA forms' fallback for layouts a tensor map cannot hold and for
# small calls)
for _headdim, _config in ((128, WGMMA_CONFIGS[128][:6] + (0,)), (64, WGMMA_CP_ASYNC_CONFIGS[64])):
    compile_check.register(
        f"flash_attn_wgmma_cp_async_d{_headdim}_bf16",
        _wgmma_compile_target(_headdim, True, False, _config),
        ptx_must_have=_WGMMA_PTX + ("setmaxnreg.inc",),
        sass_must_have=_WGMMA_SASS + ("USETMAXREG.DEALLOC", "USETMAXREG.TRY_ALLOC"))
# the softmax under P V (opt-in ``overlap``): the exponentials must sit between S's wgmma wait
# and P V's, which is all the form is for
compile_check.register(
    "flash_attn_wgmma_d64_bf16_overlap",
    _wgmma_compile_target(64, True, False, WGMMA_CONFIGS[64] + (0, 1)),
    ptx_must_have=_WGMMA_PTX + ("setmaxnreg.inc", "cp.async.bulk.tensor.2d"),
    sass_must_have=_WGMMA_SASS + ("UTMALDG",),
    sass_between=("WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
# the persistent form (opt-in ``persistent``): Q by TMA too, tiles from an atomic counter
for _name, _headdim, _varlen, _persistent_config in (
        ("d64", 64, False, WGMMA_CONFIGS[64] + (0, 0, 1)),
        ("d64_varlen", 64, True, WGMMA_CONFIGS[64] + (0, 0, 1)),
        ("d128", 128, False, WGMMA_CONFIGS[128][:5] + (0, 1, 0, 0, 1))):   # no ping-pong
    compile_check.register(
        f"flash_attn_wgmma_{_name}_bf16_persistent",
        _wgmma_compile_target(_headdim, True, _varlen, _persistent_config),
        ptx_must_have=_WGMMA_PTX[:1] + ("ex2.approx", "setmaxnreg.inc",
                                        "cp.async.bulk.tensor.2d", "atom.global.add"),
        sass_must_have=("HGMMA", "MUFU.EX2", "UTMALDG", "USETMAXREG.TRY_ALLOC"),
        allowed_local_bytes=32 if _headdim == 128 else 0,
        why="d128 persistent (opt-in, to time against ping-pong) spills 20 B at its tile's "
            "start" if _headdim == 128 else "")
# the all-threads-copy form (no producer), kept as the simpler fallback configuration
compile_check.register(
    "flash_attn_wgmma_ring_d128_f16", _wgmma_compile_target(128, False, False, (2, 128, 2, 1, 0)),
    ptx_must_have=_WGMMA_PTX, sass_must_have=_WGMMA_SASS)
