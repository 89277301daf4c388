"""Rotary position embedding (RoPE), in place on q and k, in one pass over memory.

For token ``t`` at position ``p = positions[t]`` and frequency ``j < rotary_dim / 2``, each head's
pair ``(x1, x2)`` is rotated by the angle ``p * inv_freq[j]``:

    x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin

``style="neox"`` (GPT-NeoX, Llama): the pair is ``(x[j], x[j + rotary_dim / 2])``;
``style="gptj"`` (GPT-J, interleaved): ``(x[2j], x[2j + 1])``. Elements ``rotary_dim:headdim`` of
each head are left untouched (partial rotary, e.g. GPT-NeoX's 25%, ChatGLM's 50%).

cos / sin come from
- ``cos_sin_cache`` (max_position, rotary_dim), vLLM's layout: ``cache[p, :rotary_dim/2]`` is
  cos, ``cache[p, rotary_dim/2:]`` is sin (fp16 / bf16 / fp32); or
- when it is None, ``base``: ``inv_freq[j] = base ** (-2j / rotary_dim)`` (computed in float64,
  rounded to fp32, kept on the device per (base, rotary_dim)), the angle ``fp32(p) * inv_freq[j]``
  in fp32 as torch / vLLM / HF build their caches, reduced to [-pi, pi] with a two-constant
  Cody-Waite step and evaluated with the SFU's sin / cos (absolute error below 1e-6 beyond the
  fp32 angle's own rounding; positions up to 2^22 * 2pi / inv_freq).

Positions beyond the cache: with ``check_bounds=True`` (default) positions are checked against
``[0, max_position)`` on the host, which reads their min and max back from the device (a
synchronisation: pass ``check_bounds=False`` inside CUDA-graph capture and hot loops). Without the
check, or if positions change afterwards, a token whose position is out of range is left
unrotated: the kernel never reads outside the cache.

Layout: ``q`` (tokens, nheads, headdim) and ``k`` (tokens, nheads_k, headdim) (or None), same
dtype (fp16 / bf16 / fp32), last dimension contiguous, any token and head strides (slices of a
packed qkv tensor work); ``positions`` (tokens,) int32 or int64. Arithmetic in fp32, one rounding
per element.

Kernel: one block per token; each thread owns a group of frequencies (computes or loads their
cos / sin once) and walks the q heads, then the k heads, with 16-byte loads and stores of 8 halves
/ 4 floats (neox: both halves of the rotary part; gptj: 4 / 2 interleaved pairs) when q and k are
16-byte aligned with strides and the rotary halves multiples of 8 / 4 elements; one pair per
thread step (scalar access) otherwise.
"""

import functools
import math

import numpy as np
from numba import types

from .. import _recording, compile_check, ptx
from .._arrays import as_tensor, host_ints, kernel_buffer, stream_handle
from .._checks import choice, same_dtype, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
STYLES = ("neox", "gptj")
#: Most threads of a block (one token); each holds the cos / sin of its frequency group.
MAX_BLOCK_THREADS = 128
#: What the launcher reads, overridable (scope ``rotary`` of ``_overrides.overrides``).
TUNING = Knobs("rotary", max_block_threads=MAX_BLOCK_THREADS)

MODE_NEOX_VEC, MODE_GPTJ_VEC, MODE_NEOX_SCALAR, MODE_GPTJ_SCALAR = 0, 1, 2, 3

_INV_2PI = np.float32(1.0 / (2.0 * math.pi))
_TWO_PI_HI = np.float32(2.0 * math.pi)
_TWO_PI_LO = np.float32(2.0 * math.pi - float(np.float32(2.0 * math.pi)))
_ROUND_MAGIC = np.float32(1.5 * 2.0 ** 23)  # (x + M) - M rounds x to an integer, |x| < 2^22


def _fused_multiply_add_twin(a, b, c):
    """fp32 a * b + c rounded once (the simulator's ``cuda.fma`` rounds the product first,
    which is exactly what the range reduction must not do). Products of two fp32 are exact in
    float64."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


if SIMULATOR:
    _fma = _fused_multiply_add_twin
else:
    @cuda.jit(device=True, inline="always")
    def _fma(a, b, c):
        return cuda.fma(a, b, c)


def _pairs_per_group(mode, q_kind):
    width = 4 if q_kind == rw.KIND_F32 else 8
    return {MODE_NEOX_VEC: width, MODE_GPTJ_VEC: width // 2}.get(mode, 1)


def _rotary_kernel_fn(q_kind, c_kind, mode, has_cache, append=False):
    """Kernel for q/k storage ``q_kind``, cache storage ``c_kind`` (when ``has_cache``), access
    ``mode`` (``MODE_*``); the positions' dtype is the signature's. ``append``: the kernel of
    ``rotary_kv_append`` (``_append_signature``), which also writes each token's rotated k and
    its v into the paged caches."""
    pairs = _pairs_per_group(mode, q_kind)
    vector = mode in (MODE_NEOX_VEC, MODE_GPTJ_VEC)
    neox = mode in (MODE_NEOX_VEC, MODE_NEOX_SCALAR)
    vec = 2 * pairs if mode == MODE_GPTJ_VEC else pairs   # elements per 16-byte access
    load = rw.chunk_words_loader(q_kind, vec if vector else 1)
    store = rw.chunk_words_storer(q_kind, vec if vector else 1)
    unpack = rw.chunk_unpacker(q_kind, vec if vector else 1)
    pack = rw.chunk_packer(q_kind, vec if vector else 1)
    c_conv = rw.to_f32(c_kind)
    elems = 2 * pairs
    chunk = vec if vector else 1      # elements a copy moves (append: v, k past rotary_dim)

    @cuda.jit(device=True, inline="always")
    def rotate(buf, base, f0, half, cs, sn, w1, w2, a, b):
        """Rotate the pairs of group ``f0`` of the head starting at ``buf[base]``."""
        if neox:
            o1 = base + f0
            o2 = o1 + half
            load(buf, o1, w1, 0)
            load(buf, o2, w2, 0)
            unpack(w1, 0, a)
            unpack(w2, 0, b)
            for i in range(pairs):
                x1 = a[i]
                x2 = b[i]
                a[i] = x1 * cs[i] - x2 * sn[i]
                b[i] = x2 * cs[i] + x1 * sn[i]
            pack(a, w1, 0)
            pack(b, w2, 0)
            store(buf, o1, w1, 0)
            store(buf, o2, w2, 0)
        else:
            o1 = base + 2 * f0
            load(buf, o1, w1, 0)
            if vector:
                unpack(w1, 0, a)
            else:
                load(buf, o1 + 1, w2, 0)
                unpack(w1, 0, a)
                unpack(w2, 0, b)
                a[1] = b[0]
            for i in range(pairs):
                x1 = a[2 * i]
                x2 = a[2 * i + 1]
                a[2 * i] = x1 * cs[i] - x2 * sn[i]
                a[2 * i + 1] = x2 * cs[i] + x1 * sn[i]
            if vector:
                pack(a, w1, 0)
                store(buf, o1, w1, 0)
            else:
                b[0] = a[1]
                pack(a, w1, 0)
                pack(b, w2, 0)
                store(buf, o1, w1, 0)
                store(buf, o1 + 1, w2, 0)

    @cuda.jit(device=True, inline="always")
    def store_rotated(buf, base, f0, half, w1, w2):
        """Store the words ``rotate`` left in ``w1`` / ``w2`` at the head starting at
        ``buf[base]`` (the same places it stored them in its own head)."""
        if neox:
            store(buf, base + f0, w1, 0)
            store(buf, base + f0 + half, w2, 0)
        else:
            store(buf, base + 2 * f0, w1, 0)
            if not vector:
                store(buf, base + 2 * f0 + 1, w2, 0)

    @cuda.jit(device=True, inline="always")
    def angles(cs, sn, f0, pos, cache, inv_freq, cache_stride, half):
        """cos / sin of the thread's frequencies ``f0 ..`` at position ``pos``."""
        for i in range(pairs):
            f = f0 + i
            if has_cache:
                cs[i] = c_conv(cache[pos * cache_stride + f])
                sn[i] = c_conv(cache[pos * cache_stride + half + f])
            else:
                angle = np.float32(pos) * inv_freq[f]
                turns = (angle * _INV_2PI + _ROUND_MAGIC) - _ROUND_MAGIC
                r = _fma(-turns, _TWO_PI_HI, angle)
                r = _fma(-turns, _TWO_PI_LO, r)
                cs[i] = ptx.cos_approx(r)
                sn[i] = ptx.sin_approx(r)

    @cuda.jit(device=True, inline="always")
    def rotate_heads(q, k, token, pos, cache, inv_freq, nh_q, nh_k, half, groups, q_tok,
                     q_head, k_tok, k_head, cache_stride, kc, k_row, ckh):
        """The thread's share of the token's heads: its frequency group's cos / sin, then the
        q heads, then the k heads (separate loops: each sees one array, so loads stay LDG);
        with ``append`` each rotated k chunk is stored in the cache too (``kc`` at ``k_row``
        when it is not negative)."""
        g = cuda.threadIdx.x % groups
        slot = cuda.threadIdx.x // groups
        slots = cuda.blockDim.x // groups
        if slot >= slots:
            return
        cs = cuda.local.array(pairs, np.float32)
        sn = cuda.local.array(pairs, np.float32)
        w1 = cuda.local.array(4, np.uint32)
        w2 = cuda.local.array(4, np.uint32)
        a = cuda.local.array(elems, np.float32)
        b = cuda.local.array(elems, np.float32)
        f0 = g * pairs
        angles(cs, sn, f0, pos, cache, inv_freq, cache_stride, half)
        h = slot
        while h < nh_q:
            rotate(q, token * q_tok + np.int64(h) * q_head, f0, half, cs, sn, w1, w2, a, b)
            h += slots
        h -= nh_q
        while h < nh_k:
            rotate(k, token * k_tok + np.int64(h) * k_head, f0, half, cs, sn, w1, w2, a, b)
            if append and k_row >= 0:
                store_rotated(kc, k_row + np.int64(h) * ckh, f0, half, w1, w2)
            h += slots

    def rotary_kernel(q, k, positions, cache, inv_freq, nh_q, nh_k, half, groups, pos_stride,
                      q_tok, q_head, k_tok, k_head, cache_stride, max_pos):
        token = np.int64(cuda.blockIdx.x)
        pos = np.int64(positions[token * pos_stride])
        if has_cache:
            if pos < 0 or pos >= max_pos:
                return  # out of the cache: leave the token unrotated, read nothing
        rotate_heads(q, k, token, pos, cache, inv_freq, nh_q, nh_k, half, groups, q_tok, q_head,
                     k_tok, k_head, cache_stride, k, np.int64(-1), np.int64(0))

    def rotary_append_kernel(q, k, positions, cache, inv_freq, nh_q, nh_k, half, groups,
                             pos_stride, q_tok, q_head, k_tok, k_head, cache_stride, max_pos,
                             v, kc, vc, table, v_tok, v_head, ckb, ckt, ckh, cvb, cvt, cvh,
                             table_row, table_col, max_slots, num_blocks, bs_shift, headdim,
                             rotary_dim):
        words = cuda.local.array(4, np.uint32)
        token = np.int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        pos = np.int64(positions[token * pos_stride])
        if has_cache:
            if pos < 0 or pos >= max_pos:
                return  # out of the cache: neither rotated nor appended, nothing read
        # the token's page (-1: its position has no page in range: the caches are not written)
        page = np.int64(-1)
        if pos >= 0 and (pos >> bs_shift) < max_slots:
            found = np.int64(table[token * table_row + (pos >> bs_shift) * table_col])
            if found >= 0 and found < num_blocks:
                page = found
        in_page = pos & ((np.int64(1) << bs_shift) - 1)
        k_row = np.int64(-1)
        if page >= 0:
            k_row = page * ckb + in_page * ckt
            v_row = page * cvb + in_page * cvt
            # v whole, and k's elements past rotary_dim (they do not rotate), chunk by chunk
            per_head = headdim // chunk
            for c in range(tid, nh_k * per_head, cuda.blockDim.x):
                h = c // per_head
                d = (c - h * per_head) * chunk
                load(v, token * v_tok + h * v_head + d, words, 0)
                store(vc, v_row + h * cvh + d, words, 0)
            tail = (headdim - rotary_dim) // chunk
            for c in range(tid, nh_k * tail, cuda.blockDim.x):
                h = c // tail
                d = rotary_dim + (c - h * tail) * chunk
                load(k, token * k_tok + h * k_head + d, words, 0)
                store(kc, k_row + h * ckh + d, words, 0)
        rotate_heads(q, k, token, pos, cache, inv_freq, nh_q, nh_k, half, groups, q_tok, q_head,
                     k_tok, k_head, cache_stride, kc, k_row, ckh)

    return rotary_append_kernel if append else rotary_kernel


def _signature(q_kind, c_kind, pos_int64):
    qs = array1d(np.float32 if q_kind == rw.KIND_F32 else np.uint16)
    cs = array1d(np.float32 if c_kind == rw.KIND_F32 else np.uint16)
    ps = array1d(np.int64 if pos_int64 else np.int32)
    return (qs, qs, ps, cs, array1d(np.float32), types.int32, types.int32, types.int32,
            types.int32, types.int64, types.int64, types.int64, types.int64, types.int64,
            types.int64, types.int64)


def _append_signature(q_kind, c_kind, pos_int64):
    """``_signature`` and ``rotary_append_kernel``'s own: v, k_cache, v_cache, the page table
    (int32), the strides of v (token, head), of the caches (page, slot, head) and of the table
    (row, column), max_slots, num_blocks, log2(block_size), headdim, rotary_dim."""
    plain = _signature(q_kind, c_kind, pos_int64)
    return (plain + (plain[0],) * 3 + (array1d(np.int32),) + (types.int64,) * 10
            + (types.int32,) * 5)


@functools.lru_cache(maxsize=None)
def _rotary_kernel(q_kind, c_kind, mode, has_cache, pos_int64, append=False):
    fn = _rotary_kernel_fn(q_kind, c_kind, mode, has_cache, append)
    if append:
        return Kernel(jit(fn), _append_signature(q_kind, c_kind, pos_int64),
                      "rotary_append_kernel")
    return Kernel(jit(fn), _signature(q_kind, c_kind, pos_int64), "rotary_kernel")


_INV_FREQ = {}


def _inv_freq_table(base, rotary_dim):
    """Device float32 ``base ** (-2j / rotary_dim)``, j < rotary_dim / 2, cached per device."""
    device = 0 if SIMULATOR else cuda.get_current_device().id
    key = (device, float(base), rotary_dim)
    table = _INV_FREQ.get(key)
    if table is None:
        host = (1.0 / (float(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float64)
                                       / rotary_dim))).astype(np.float32)
        table = host if SIMULATOR else cuda.to_device(host)
        _INV_FREQ[key] = table
    _recording.note_persistent(table)  # kept for the life of the process
    return table


def _positions_range(tp):
    """(min, max) of a positions tensor, read back to the host (synchronises)."""
    values = host_ints(tp)
    return int(values.min()), int(values.max())


def _check_head_tensor(name, t, q_shape=None):
    if t.ndim != 3:
        raise ValueError(f"{name}: expected 3 dimensions (tokens, nheads, headdim), got shape "
                         f"{t.shape}")
    if q_shape is not None and (t.shape[0] != q_shape[0] or t.shape[2] != q_shape[2]):
        raise ValueError(f"{name}: expected shape ({q_shape[0]}, *, {q_shape[2]}) to match q's "
                         f"tokens and headdim, got {t.shape}")
    if t.shape[2] > 1 and t.strides[2] != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), "
                         f"got strides {t.strides}")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")




_ROTARY_EMBEDDING_CALLS = OpCalls("rotary_embedding")


def rotary_embedding(q: ArrayLike, k: ArrayLike | None, positions: ArrayLike, *,
                     base: float = 10000.0, cos_sin_cache: ArrayLike | None = None,
                     style: str = "neox", rotary_dim: int | None = None,
                     check_bounds: bool = True,
                     stream: StreamLike = None) -> tuple[ArrayLike, ArrayLike | None]:
    """Rotate ``q`` and ``k`` in place by the rotary embedding of ``positions``.

    Args:
        q: (tokens, nheads, headdim) fp16 / bf16 / fp32, last dimension contiguous.
        k: (tokens, nheads_k, headdim), q's dtype, or None.
        positions: (tokens,) int32 or int64.
        base: the RoPE base (``theta``), used when ``cos_sin_cache`` is None (a finite number
            > 0).
        cos_sin_cache: optional (max_position, rotary_dim) table, cos then sin in the last
            dimension (vLLM's layout), fp16 / bf16 / fp32.
        style: ``"neox"`` (rotate halves) or ``"gptj"`` (rotate interleaved pairs).
        rotary_dim: leading elements of each head that rotate (even, <= headdim; default
            headdim).
        check_bounds: with a cache, check ``0 <= positions < max_position`` on the host (a
            device-to-host read: synchronises). Out-of-range tokens are skipped when unchecked.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``(q, k)``, the same arrays, rotated in place.

    Raises:
        TypeError: non-arrays; q / k / cache not fp16, bf16 or fp32; k's dtype differs from q's;
            positions not int32 / int64; base or rotary_dim of the wrong type.
        ValueError: shapes that disagree; rotary_dim odd, < 2 or > headdim (without
            rotary_dim: headdim odd or < 2); a cache whose last dimension is not rotary_dim;
            positions outside the cache (``check_bounds``); base <= 0 or not finite; an
            unknown style; a non-contiguous last dimension.
    """
    result = _ROTARY_EMBEDDING_CALLS.replay(
        (q, k, positions, cos_sin_cache),
        (base, style, rotary_dim, check_bounds), stream)
    if result is MISS:
        result = _ROTARY_EMBEDDING_CALLS.record(
            _rotary_embedding_checked, q, k, positions, base, cos_sin_cache, style, rotary_dim,
            check_bounds, stream)
    return result


def _rotary_embedding_checked(q, k, positions, base, cos_sin_cache, style, rotary_dim,
                              check_bounds, stream):
    """The checked path of ``rotary_embedding`` (validation, planning, launch)."""
    plan = plan_rotary(q, k, positions, base, cos_sin_cache, style, rotary_dim, check_bounds)
    if plan is not None:
        plan.kernel(plan.tokens, plan.threads, plan.args, stream_handle(stream, (plan.tq,)))
    return q, k


class RotaryPlan:
    """A checked rotary call: q's and the positions' tensors, the tokens (blocks), rotary_dim,
    the kernel, its block size and its first arguments (``args``)."""

    __slots__ = ("tq", "tp", "tokens", "rotary_dim", "threads", "kernel", "args")


def plan_rotary(q, k, positions, base, cos_sin_cache, style, rotary_dim, check_bounds,
                append_to=()):
    """Validate a rotary call and plan its launch: a ``RotaryPlan``, or None when there is
    nothing to rotate. ``append_to``: for ``rotary_kv_append``, the tensors its kernel also
    copies (v, the caches), which must allow 16-byte chunks too for the vector form."""
    tq = tensor(q, "q", dtypes=FLOAT_DTYPES)
    _check_head_tensor("q", tq)
    tokens, nh_q, headdim = tq.shape
    tk = None
    if k is not None:
        tk = tensor(k, "k", dtypes=FLOAT_DTYPES)
        _check_head_tensor("k", tk, tq.shape)
    tp = tensor(positions, "positions", ndim=1, dtypes=("int32", "int64"))
    if tp.shape[0] != tokens:
        raise ValueError(f"positions: expected shape ({tokens},) to match q's tokens, got "
                         f"{tp.shape}")
    same_dtype("q", tq, k=tk)
    choice("style", style, STYLES)
    if rotary_dim is None:
        if headdim < 2 or headdim % 2:
            raise ValueError(f"q: expected an even headdim >= 2 (every element rotates when "
                             f"rotary_dim is not given), got shape {tq.shape}")
        rotary_dim = headdim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"rotary_dim: expected an int, got {type(rotary_dim).__name__}")
    rotary_dim = int(rotary_dim)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > headdim:
        raise ValueError(f"rotary_dim: expected an even int in [2, headdim={headdim}], got "
                         f"{rotary_dim}")
    half = rotary_dim // 2
    tc = None
    if cos_sin_cache is not None:
        tc = tensor(cos_sin_cache, "cos_sin_cache", ndim=2, dtypes=FLOAT_DTYPES)
        if tc.shape[1] != rotary_dim:
            raise ValueError(f"cos_sin_cache: expected shape (max_position, {rotary_dim}) "
                             f"(cos | sin of rotary_dim={rotary_dim}), got {tc.shape}")
        if rotary_dim > 1 and tc.strides[1] != 1:
            raise ValueError(f"cos_sin_cache: expected the last dimension to be contiguous, got "
                             f"strides {tc.strides}")
        max_pos = tc.shape[0]
        if check_bounds and tokens:
            lo, hi = _positions_range(tp)
            if lo < 0 or hi >= max_pos:
                raise ValueError(f"positions: expected values in [0, {max_pos}) (the rows of "
                                 f"cos_sin_cache), got min {lo}, max {hi}")
    else:
        if isinstance(base, bool) or not isinstance(base, (int, float, np.floating)):
            raise TypeError(f"base: expected a float, got {type(base).__name__}")
        if not (math.isfinite(base) and base > 0):
            raise ValueError(f"base: expected a finite float > 0, got {base}")
        max_pos = 0
    nh_k = 0 if tk is None else tk.shape[1]
    if tokens == 0 or (nh_q == 0 and nh_k == 0):
        return None

    q_kind = rw.kind(tq.dtype)
    width = rw.vector_width(tq.dtype)
    # 16-byte accesses: every array's address and strides allow them (and, appending, whole
    # chunks of a head for the copies of v and of k past rotary_dim)
    chunks = all(_chunks_ok(t, width) for t in (tq, tk, *append_to)) and (
        not append_to or headdim % width == 0)
    if style == "neox":
        vector = half % width == 0 and chunks
        mode = MODE_NEOX_VEC if vector else MODE_NEOX_SCALAR
    else:
        vector = rotary_dim % width == 0 and chunks
        mode = MODE_GPTJ_VEC if vector else MODE_GPTJ_SCALAR
    groups = half // _pairs_per_group(mode, q_kind)
    if groups > 1024:
        raise NotImplementedError(f"rotary_dim: at most 2048 supported, got {rotary_dim}")
    # enough threads for every (group, head) up to MAX_BLOCK_THREADS, and at least one per group
    round32 = lambda n: -(-n // 32) * 32  # noqa: E731
    threads = max(round32(groups),
                  min(round32(groups * (nh_q + nh_k)), TUNING.max_block_threads))

    c_kind = rw.KIND_F32 if tc is None else rw.kind(tc.dtype)
    qb = kernel_buffer(tq)
    kb = qb if tk is None else kernel_buffer(tk)
    if tc is None:
        table = _inv_freq_table(base, rotary_dim)
        fb = kernel_buffer(as_tensor(table, "inv_freq"))
        cb = fb
        cache_stride = 0
    else:
        cb = kernel_buffer(tc)
        fb = kernel_buffer(as_tensor(_inv_freq_table(1.0, 2), "inv_freq"))  # unused
        cache_stride = tc.strides[0]
    k_tok, k_head = (0, 0) if tk is None else tk.strides[:2]
    plan = RotaryPlan()
    plan.tq, plan.tp, plan.tokens, plan.rotary_dim, plan.threads = (tq, tp, tokens, rotary_dim,
                                                                     threads)
    plan.kernel = _rotary_kernel(q_kind, c_kind, mode, tc is not None, tp.dtype == "int64",
                                 bool(append_to))
    plan.args = (qb, kb, kernel_buffer(tp), cb, fb, nh_q, nh_k, half, groups, tp.strides[0],
                 tq.strides[0], tq.strides[1], k_tok, k_head, cache_stride, max_pos)
    return plan


def _chunks_ok(t, width):
    """Whether ``t`` (None, or last dimension contiguous) allows 16-byte chunks of ``width``
    elements."""
    return t is None or (t.ptr % 16 == 0 and all(s % width == 0 for s in t.strides[:-1]))


def _register():
    f16, bf16, f32 = rw.KIND_F16, rw.KIND_BF16, rw.KIND_F32
    for name, (qk, ck, mode, cache, p64, vec) in {
        "rotary_neox_f16_computed": (f16, f32, MODE_NEOX_VEC, False, True, True),
        "rotary_neox_bf16_cache_f32": (bf16, f32, MODE_NEOX_VEC, True, True, True),
        "rotary_gptj_f16_cache_f16": (f16, f16, MODE_GPTJ_VEC, True, False, True),
        "rotary_gptj_bf16_scalar": (bf16, bf16, MODE_GPTJ_SCALAR, False, True, False),
    }.items():
        compile_check.register(
            name, lambda qk=qk, ck=ck, mode=mode, cache=cache, p64=p64: (
                _rotary_kernel_fn(qk, ck, mode, cache), _signature(qk, ck, p64)),
            sass_must_have=("LDG.E.128", "STG.E.128") if vec else ())
    compile_check.register(      # rotary_kv_append's kernel: the model's decode and prefill
        "rotary_append_neox_bf16_cache_bf16",
        lambda: (_rotary_kernel_fn(bf16, bf16, MODE_NEOX_VEC, True, True),
                 _append_signature(bf16, bf16, False)),
        sass_must_have=("LDG.E.128", "STG.E.128"))


_register()
