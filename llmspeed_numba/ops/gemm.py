"""GEMM with a fused epilogue: ``out = activation(alpha * a @ b + beta * c + bias)``.

``a`` is (M, K), ``b`` is (K, N), ``out`` is (M, N). Each operand may be row-major (its last
dimension contiguous, e.g. a C-contiguous array) or column-major (its first dimension contiguous,
e.g. the ``.T`` view of a C-contiguous array), with any leading-dimension stride at least the
contiguous extent (a sliced sub-matrix works too): NN, NT, TN and TT all run without a copy.
``c`` (M, N) may have any non-negative strides and is read only when ``beta != 0`` (BLAS
convention); ``bias`` is a contiguous length-N vector; ``c`` and ``bias`` may be fp16, bf16 or fp32.

Gated activations (``gemm_gated.py``): ``activation="silu_and_mul"`` or ``"gelu_and_mul"`` (tanh
form) computes ``act(a @ b_gate + bias_gate) * (a @ b_up + bias_up)``, out (M, N / 2), from a ``b``
whose gate and up columns are interleaved in blocks of 8 (``interleave_gate_up``): the MLP's gate /
up projection in one kernel.

Precision: fp16 / bf16 inputs run on Tensor Cores (``wgmma`` on Hopper, else ``mma.sync``) with fp32
accumulation (or on the SIMT kernel with ``backend="simt"``); fp32 inputs run on the SIMT kernel in
fp32. The epilogue is computed in fp32 and rounded once to ``out_dtype`` (default: ``out``'s dtype
when given, else the input dtype).

Kernels (one module each): ``_gemm_wgmma`` (Hopper, sm_90: cp.async into 128-byte-swizzled tiles
read by ``wgmma.mma_async``, two warpgroups, the large-problem default there), ``_gemm_tensor_core``
(cp.async multi-stage pipeline, swizzled shared tiles, ldmatrix, ``mma.sync``, warp tiling, grouped
rasterisation, fused epilogue: other GPUs, small problems and operands that are not 16-byte
aligned), ``_gemm_simt`` (register blocked, double buffered), ``_gemv`` (one row of ``a``
against a K-major ``b`` on CUDA cores, streaming the weight: decode at batch 1). Shapes with
few output tiles (decode-time M of 1-16, or small M x N with long K) split K across ``split_k``
blocks: each writes fp32 partial sums to a workspace; on Tensor Cores the last block of each
tile adds them and applies the epilogue in the same launch (``_epilogue.split_tile_finish``), on
SIMT a second kernel does (``_splitk_reduce_kernel``). The tile configuration (``gemm_configs.py``) comes from ``config=``, else from the autotune cache
(``llmspeed_numba.autotune``), else from ``gemm_configs.heuristic``.
"""

import dataclasses
import functools
import math
import os

import numpy as np
from numba import types

from .. import _recording, compile_check
from .._arrays import STORAGE, Tensor, empty, kernel_buffer, stream_handle
from .._checks import (bias_vector, choice, non_negative_strides, output, result_dtype,
                       same_dtype, shape, tensor)
from .._env import cuda
from .._launch import Kernel, array1d, jit, programmatic_launch, sm_count
from .._replay import MISS, OpCalls
from .._tensor_map import may_make_map, tensor_map_2d
from .._typing import ArrayLike, DTypeLike, StreamLike
from .._workspace import unused, workspace
from .. import _tuning_cache
from . import _gemm_simt, _gemm_tensor_core, _gemm_wgmma, _gemv
from ._activations_device import ACTIVATIONS, GATED_ACTIVATIONS
from ._epilogue import epilogue, vector_width
from .gemm_configs import (CONFIGS, LARGE_CONFIG, SIMT_CONFIG, GemmConfig, candidates,
                           gemv_fits, heuristic, resolve_config, split_count)
from .gemm_gated import check_gated, gated_reduce_kernel_fn

INPUT_DTYPES = ("float16", "bfloat16", "float32")
OUTPUT_DTYPES = ("float16", "bfloat16", "float32")
BACKENDS = ("auto", "tensor_core", "simt")


def _cdiv(x, y):
    return -(-x // y)


# ---- tile configurations ----------------------------------------------------------------------

# ---- kernels -------------------------------------------------------------------------------

def _storage(dtype):
    return array1d(STORAGE[dtype])


def _signature(backend, in_dtype, out_dtype, c_dtype, bias_dtype, wgmma=False):
    """Kernel parameters (``_gemm_tensor_core.make_kernel``); the Tensor Core kernels also take
    the split-K workspace and tickets (``_epilogue.split_tile_finish``), the wgmma kernel then
    the tensor maps of a and b (``_gemm_wgmma.tma_mainloop``)."""
    i32, i64, f32 = types.int32, types.int64, types.float32
    params = (_storage(in_dtype), _storage(in_dtype), _storage(out_dtype),
              _storage(c_dtype or out_dtype), _storage(bias_dtype or out_dtype),
              i32, i32, i32, i64, i64, i64, i64, i64, i64, i64, f32, f32, i32, i32, i32, i32)
    if backend == "tensor_core":
        params += (array1d(np.float32), array1d(np.int32))
    if wgmma:
        params += (array1d(np.uint64), array1d(np.uint64))
    return params


def _min_blocks(cfg, a_vec, b_vec, in_dtype):
    """Launch bounds (blocks per SM) of a kernel: ``cfg.min_blocks`` when set. Default: 2 for
    a SIMT kernel with 16-byte loads of both fp32 operands, which then fits 128 registers
    without spilling in every layout (offline SASS: 127-130 registers unbounded, so NT / TT
    would otherwise run one 256-thread block per SM); none otherwise (the scalar-load SIMT
    path would spill under that cap); 1 for the warp-specialised wgmma form, whose extra
    warpgroup would otherwise let ptxas take more registers than the block may hold."""
    if cfg.min_blocks is not None:
        return cfg.min_blocks
    if cfg.producer:
        return 1
    if cfg.backend == "simt" and a_vec and b_vec and in_dtype == "float32":
        return 2
    return 0


def _kernel_fn(cfg, a_k_inner, b_k_inner, a_vec, b_vec, in_dtype, out_dtype, c_dtype,
               bias_dtype, act, split_finish=False, programmatic=False):
    """The kernel function and its ``cuda.jit`` options (launch bounds). ``split_finish``: a
    Tensor Core kernel for a K split finished in its own launch (``split_tile_finish``);
    ``programmatic``: the GEMV's programmatic-dependent form."""
    if cfg.gemv:
        return _gemv.make_kernel(cfg.block_m, cfg.block_n, cfg.warps_n, cfg.stages,
                                 in_dtype == "bfloat16", out_dtype, c_dtype, bias_dtype, act,
                                 programmatic), {}
    min_blocks = _min_blocks(cfg, a_vec, b_vec, in_dtype)
    options = {"launch_bounds": (cfg.threads, min_blocks)} if min_blocks else {}
    if cfg.wgmma:
        return _gemm_wgmma.make_kernel(
            cfg.block_m, cfg.block_n, cfg.stages, cfg.group_m, a_k_inner, b_k_inner,
            in_dtype == "bfloat16", out_dtype, c_dtype, bias_dtype, act,
            split_finish, cfg.producer, cfg.tma), options
    if cfg.backend == "tensor_core":
        return _gemm_tensor_core.make_kernel(
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.warps_m, cfg.warps_n, cfg.stages,
            cfg.group_m, a_k_inner, b_k_inner, a_vec, b_vec, in_dtype == "bfloat16",
            out_dtype, c_dtype, bias_dtype, act, min_blocks, split_finish), options
    return _gemm_simt.make_kernel(
        cfg.block_m, cfg.block_n, cfg.block_k, cfg.thread_m, cfg.thread_n, cfg.group_m,
        a_k_inner, b_k_inner, a_vec, b_vec, in_dtype, out_dtype, c_dtype, bias_dtype, act,
        min_blocks), options


@functools.cache
def _gemm_kernel(cfg, a_k_inner, b_k_inner, a_vec, b_vec, in_dtype, out_dtype, c_dtype,
                 bias_dtype, act, split_finish=False, programmatic=False):
    fn, options = _kernel_fn(cfg.replace(split_k=None), a_k_inner, b_k_inner, a_vec, b_vec,
                             in_dtype, out_dtype, c_dtype, bias_dtype, act, split_finish,
                             programmatic)
    return Kernel(jit(fn, **options),
                  _signature(cfg.backend, in_dtype, out_dtype, c_dtype, bias_dtype, cfg.wgmma),
                  f"gemm_{cfg.backend}", programmatic=programmatic)


def _splitk_reduce_kernel_fn(out_dtype, c_dtype, bias_dtype, act):
    apply_epilogue = epilogue(out_dtype, c_dtype, bias_dtype, act)

    def splitk_reduce_kernel(ws, out, c, bias, M, N, splits, so_m, so_n, sc_m, sc_n, alpha,
                             beta):
        """``out[m, n] = epilogue(sum_z ws[z, m, n])``; ws is (splits, M, N) contiguous fp32.
        With ``splits == 0`` it computes the K = 0 result ``act(beta * c + bias)``."""
        mn = M * N
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        while i < mn:
            m = i // N
            n = i - m * N
            s = np.float32(0.0)
            for z in range(splits):
                s += ws[z * mn + i]
            apply_epilogue(s, n, out, m * so_m + n * so_n, c, m * sc_m + n * sc_n, bias, alpha,
                           beta)
            i += step

    return splitk_reduce_kernel


def _reduce_fn(out_dtype, c_dtype, bias_dtype, act):
    if act in GATED_ACTIVATIONS:
        return gated_reduce_kernel_fn(out_dtype, bias_dtype, act)
    return _splitk_reduce_kernel_fn(out_dtype, c_dtype, bias_dtype, act)


def _reduce_signature(out_dtype, c_dtype, bias_dtype):
    i32, i64, f32 = types.int32, types.int64, types.float32
    return (array1d(np.float32), _storage(out_dtype), _storage(c_dtype or out_dtype),
            _storage(bias_dtype or out_dtype), i64, i64, i32, i64, i64, i64, i64, f32, f32)


@functools.cache
def _splitk_reduce_kernel(out_dtype, c_dtype, bias_dtype, act):
    return Kernel(jit(_reduce_fn(out_dtype, c_dtype, bias_dtype, act)),
                  _reduce_signature(out_dtype, c_dtype, bias_dtype), "gemm_splitk_reduce")


_REDUCE_THREADS = 256


# ---- validation helpers -------------------------------------------------------------------

def _layout(t, name):
    """(k_inner, leading stride) of a 2-D operand: which dimension is contiguous.

    For ``a`` (M, K) ``k_inner`` means row-major; for ``b`` (K, N) it means column-major. A
    dimension of size 1 has no meaningful stride and is ignored, and so are the strides of an
    empty operand."""
    rows, cols = t.shape
    s_rows, s_cols = t.strides
    is_a = name == "a"
    if rows == 0 or cols == 0:  # no elements: any strides, never read
        return is_a, max(cols, 1)
    row_major = (cols == 1 or s_cols == 1) and (rows == 1 or s_rows >= cols)
    col_major = (rows == 1 or s_rows == 1) and (cols == 1 or s_cols >= rows)
    if not (row_major or col_major) or min(t.strides) < 0:
        raise ValueError(
            f"{name}: expected a row-major or column-major matrix (one dimension of stride 1, "
            f"the other at least its extent), got shape {t.shape} with strides {t.strides}; "
            "make it contiguous first")
    if row_major and (not col_major or cols > 1):
        ld = s_rows if rows > 1 else cols
        return is_a, max(ld, 1)
    ld = s_cols if cols > 1 else rows
    return not is_a, max(ld, 1)


def _vector_ok(t, ld):
    """16-byte loads (cp.async, LDG.128) are allowed: aligned base pointer and leading
    stride."""
    return t.ptr % 16 == 0 and ld % (16 // t.itemsize) == 0


def _scalar(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value


def shape_class(M, N, K, dtype, out_dtype, a_k_inner, b_k_inner, aligned):
    """Autotune key: shapes within a factor of two along each dimension share a winner."""
    def bucket(x):
        return 1 << max(0, (x - 1).bit_length())

    layout = ("N" if a_k_inner else "T") + ("T" if b_k_inner else "N")
    return (f"{dtype}->{out_dtype} {layout} M{bucket(M)} N{bucket(N)} K{bucket(K)}"
            f"{'' if aligned else ' unaligned'}")


@dataclasses.dataclass
class _Problem:
    """A validated call, ready to launch: everything but the tile configuration."""
    ta: object
    tb: object
    to: object
    tc: object
    tbias: object
    out: object
    M: int
    N: int
    K: int
    a_k_inner: bool
    b_k_inner: bool
    lda: int
    ldb: int
    a_vec: bool
    b_vec: bool
    alpha: float
    beta: float
    act: object
    out_dtype: str
    backend: str
    stream: int

    @property
    def gated(self):
        return self.act in GATED_ACTIVATIONS

    @property
    def out_shape(self):
        """(M, N / 2) for a gated activation, else (M, N)."""
        return (self.M, self.N // 2 if self.gated else self.N)

    @property
    def key(self):
        return shape_class(self.M, self.N, self.K, self.ta.dtype, self.out_dtype,
                           self.a_k_inner, self.b_k_inner, self.a_vec and self.b_vec)


def prepare(a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, stream):
    # type and rank, shape agreement, dtype, strides, supported combinations (_checks order)
    ta = tensor(a, "a", ndim=2)
    tb = tensor(b, "b", ndim=2)
    M, K = ta.shape
    shape("b", tb, (K, None), "to match a's K")
    N = tb.shape[1]
    alpha = _scalar("alpha", alpha)
    beta = _scalar("beta", beta)
    choice("activation", activation, ACTIVATIONS + tuple(GATED_ACTIVATIONS))
    gated = activation in GATED_ACTIVATIONS
    if gated:  # no beta * c; whole gate / up block pairs in b
        check_gated(activation, tb, N, c, beta)
    out_shape = (M, N // 2 if gated else N)   # gated: act(gate) * up, N / 2 columns
    if ta.dtype not in INPUT_DTYPES:
        raise TypeError(f"a: expected dtype in {INPUT_DTYPES}, got {ta.dtype}")
    same_dtype("a", ta, b=tb)
    tc = tensor(c, "c", ndim=2, dtypes=OUTPUT_DTYPES) if c is not None else None
    if tc is not None:
        shape("c", tc, out_shape, "(M, N // 2)" if gated else "(M, N)")
        non_negative_strides("c", tc)
    tbias = bias_vector(bias, N, OUTPUT_DTYPES)
    choice("backend", backend, BACKENDS)
    out_dtype = result_dtype(out_dtype, out, ta.dtype, OUTPUT_DTYPES)
    a_k_inner, lda = _layout(ta, "a")
    b_k_inner, ldb = _layout(tb, "b")
    if backend == "auto":
        backend = "simt" if ta.dtype == "float32" else "tensor_core"
    if backend == "tensor_core" and ta.dtype == "float32":
        raise NotImplementedError("backend='tensor_core' needs fp16 or bf16 inputs; fp32 inputs "
                                  "run on backend='simt'")
    to = output("out", out, out_shape, out_dtype, ta)
    if to is None:
        out = empty(ta, out_shape, out_dtype)
        to = tensor(out, "out")
    return _Problem(ta, tb, to, tc if beta != 0.0 else None, tbias, out, M, N, K, a_k_inner,
                    b_k_inner, lda, ldb, _vector_ok(ta, lda), _vector_ok(tb, ldb), alpha, beta,
                    activation, out_dtype, backend, stream_handle(stream, (ta, tb)))


# ---- launch --------------------------------------------------------------------------------

def _address(buf):
    """Device address of a kernel buffer (the host address of its numpy view in the
    simulator, which checks alignment the same way)."""
    return buf.ptr if hasattr(buf, "ptr") else buf.ctypes.data


def launch_splitk_reduce(ws, to, tc, tbias, M, N, out_cols, splits, out_dtype, act, alpha,
                         beta, stream):
    """``out = epilogue(sum_z ws[z])`` for fp32 partial sums ``ws`` (splits, M, N) contiguous
    (a kernel buffer): ``to`` / ``tc`` / ``tbias`` the output, c (or None) and bias (or None)
    ``Tensor``s, ``out_cols`` the output's columns (N, or N / 2 for a gated ``act``). Also the
    split-K reduce of ``quant_gemm``."""
    c_dtype = tc.dtype if tc is not None else None
    bias_dtype = tbias.dtype if tbias is not None else None
    kernel = _splitk_reduce_kernel(out_dtype, c_dtype, bias_dtype, act)
    total = M * out_cols
    blocks = max(1, min(_cdiv(total, _REDUCE_THREADS), 8 * sm_count()))
    sc = tc.strides if tc is not None else (0, 0)
    kernel(blocks, _REDUCE_THREADS,
           (ws, kernel_buffer(to), kernel_buffer(tc if tc is not None else to),
            kernel_buffer(tbias if tbias is not None else to),
            M, N, splits, to.strides[0], to.strides[1], sc[0], sc[1], alpha, beta),
           stream)


def _launch_reduce(p, ws, splits):
    launch_splitk_reduce(ws, p.to, p.tc, p.tbias, p.M, p.N, p.out_shape[1], splits, p.out_dtype,
                         p.act, p.alpha, p.beta, p.stream)


def splitk_partials(like, stream, n):
    """Kernel buffer of ``n`` fp32 split-K partial sums for a call whose input is ``like``: the
    stream's workspace, shared as the split tickets are (calls on one stream run in order; an
    allocation a call would cost more host time than a decode-size GEMM)."""
    return workspace(like, stream, "gemm_split_k", n, np.float32)


def _run(p, cfg):
    """Launch ``cfg`` for problem ``p`` (M, N, K >= 1)."""
    if cfg.gemv and not gemv_fits(p, cfg):
        cfg = heuristic(p.backend, p.M, p.N, p.K, gemv=False)
    if cfg.wgmma and not (p.a_vec and p.b_vec):   # wgmma tiles are filled by 16-byte copies
        cfg = heuristic(p.backend, p.M, p.N, p.K, wgmma=False).replace(split_k=cfg.split_k)
    maps = _tensor_maps(p, cfg) if cfg.tma and p.a_k_inner and p.b_k_inner else None
    if cfg.tma and maps is None:   # an operand N- / M-major, or no map inside a capture
        cfg = cfg.replace(tma=False)
    splits = split_count(cfg, p.M, p.N, p.K)
    k_split = _cdiv(_cdiv(p.K, splits), cfg.block_k) * cfg.block_k  # whole K tiles per split
    splits = _cdiv(p.K, k_split)
    tiles_m = _cdiv(p.M, cfg.block_m)
    tiles_n = _cdiv(p.N, cfg.block_n)
    a_vec, b_vec = p.a_vec, p.b_vec
    if cfg.backend == "simt":
        # SIMT: 16-byte loads for fp32 operands only (fp16 / bf16 SIMT inputs, the broad-test
        # path, stay scalar); along M or N they need whole chunks (the kernel clamps edge rows
        # chunk by chunk)
        fp32 = p.ta.dtype == "float32"
        a_vec = a_vec and fp32 and (p.a_k_inner or p.M % 4 == 0)
        b_vec = b_vec and fp32 and (p.b_k_inner or p.N % 4 == 0)
    c_dtype = p.tc.dtype if p.tc is not None else None
    bias_dtype = p.tbias.dtype if p.tbias is not None else None
    out_buf = kernel_buffer(p.to)
    extra = ()
    split_finish = False
    if cfg.backend == "simt":
        # SIMT: fp32 partial sums and the reduce kernel for a K split, and for a gated epilogue
        # (its threads never hold a gate block and its up block: gemm_gated)
        partials = splits > 1 or p.gated
    else:
        # Tensor Cores: a K split is finished in the same launch, by the last block of a tile
        partials = False
        split_finish = splits > 1
        ws, counters = unused(p.ta, np.float32), unused(p.ta, np.int32)
        if split_finish:
            ws = splitk_partials(p.ta, p.stream, splits * p.M * p.N)
            counters = workspace(p.ta, p.stream, "gemm_split_tickets", tiles_m * tiles_n,
                                 np.int32, own_in_graph="graph")
        extra = (ws, counters)
        if cfg.wgmma:
            extra += maps if cfg.tma else (unused(p.ta, np.uint64),) * 2
    if not partials:
        kernel = _gemm_kernel(cfg, p.a_k_inner, p.b_k_inner, a_vec, b_vec, p.ta.dtype,
                              p.out_dtype, c_dtype, bias_dtype, p.act, split_finish,
                              cfg.gemv and programmatic_launch())
        c_buf = kernel_buffer(p.tc if p.tc is not None else p.to)
        bias_buf = kernel_buffer(p.tbias if p.tbias is not None else p.to)
        so_m, so_n = p.to.strides
        sc = p.tc.strides if p.tc is not None else (0, 0)
        alpha, beta = p.alpha, p.beta
    else:
        # partial sums: (splits, M, N) fp32, epilogue in the reduce kernel
        kernel = _gemm_kernel(cfg, p.a_k_inner, p.b_k_inner, a_vec, b_vec, p.ta.dtype,
                              "float32", None, None, None)
        out_buf = c_buf = bias_buf = splitk_partials(p.ta, p.stream, splits * p.M * p.N)
        so_m, so_n = p.N, 1
        sc = (0, 0)
        alpha, beta = 1.0, 0.0
    width = vector_width("float32" if partials else p.out_dtype)
    # 16-byte epilogue stores: unit column stride, 16-byte aligned rows (and split offsets,
    # which are whole rows of the workspace)
    out_vec = int(so_n == 1 and so_m % width == 0 and _address(out_buf) % 16 == 0)
    kernel((tiles_m * tiles_n, splits), cfg.threads,
           (kernel_buffer(p.ta), kernel_buffer(p.tb), out_buf, c_buf, bias_buf,
            p.M, p.N, p.K, p.lda, p.ldb, so_m, so_n, p.M * p.N, sc[0], sc[1], alpha, beta,
            k_split, tiles_m, tiles_n, out_vec) + extra,
           p.stream, cfg.shared_bytes())
    if partials:
        _launch_reduce(p, out_buf, splits)


def _tensor_maps(p, cfg):
    """The maps of a (M x K) and of b's K-major storage (N x K) with the boxes of ``cfg``'s
    tiles (``_gemm_wgmma.tma_mainloop``), made on the call's stream, or None inside a torch
    CUDA-graph capture when one has not landed yet (the call then runs the cp.async form; an
    eager call first makes them). A map
    holds the operands' addresses: a call with maps is replayed only with
    ``_tensor_map.REPLAY_MAPS`` (each replay then finds the maps of its own operands)."""
    ta, tb = p.ta, p.tb
    a_rows = Tensor(ta.obj, ta.kind, ta.ptr, (p.M, p.K), (p.lda, 1), ta.dtype, ta.host)
    b_rows = Tensor(tb.obj, tb.kind, tb.ptr, (p.N, p.K), (p.ldb, 1), tb.dtype, tb.host)
    make = may_make_map(ta, p.stream)
    maps = (tensor_map_2d(a_rows, cfg.block_m, cfg.block_k, name="a", make=make,
                          stream=p.stream),
            tensor_map_2d(b_rows, cfg.block_n, cfg.block_k, name="b", make=make,
                          stream=p.stream))
    return None if maps[0] is None or maps[1] is None else maps


_CHOICES = {}  # memo of _choose by shape, layout, dtypes and autotune cache state
_recording.on_clear(_CHOICES.clear)  # the heuristic reads the SM count (``_overrides``)


def _choose(p, config):
    """The configuration to run: ``config=``, else the cached autotune winner for the shape
    class, else (when ``LLMSPEED_NUMBA_AUTOTUNE=1``) a fresh autotune, else the heuristic."""
    if config is not None:
        return config
    memo = (p.M, p.N, p.K, p.ta.dtype, p.out_dtype, p.a_k_inner, p.b_k_inner,
            p.a_vec and p.b_vec, p.backend, _tuning_cache.generation(),
            os.environ.get("LLMSPEED_NUMBA_CACHE"))
    cfg = _CHOICES.get(memo)
    if cfg is None:
        found = _tuning_cache.lookup("gemm", p.key)
        if found is not None and found.get("backend") == p.backend:
            cfg = GemmConfig(**found)
        elif _tuning_cache.enabled():
            cfg = tune(p)
        else:
            cfg = heuristic(p.backend, p.M, p.N, p.K)
        if len(_CHOICES) > 4096:
            _CHOICES.clear()
        _CHOICES[memo] = cfg
    return cfg


def tune(p, configs=None, warmup=2, rep=10):
    """Time ``configs`` (default: ``gemm_configs.candidates(p)``) for a validated problem ``p``
    (``prepare``); record the fastest ``GemmConfig`` in the autotune cache and return it. Runs
    into a scratch output, so ``out`` / ``c`` are untouched."""
    scratch = empty(p.ta, p.out_shape, p.out_dtype)
    trial = dataclasses.replace(p, to=tensor(scratch, "scratch"), out=scratch)
    timings = {}
    best, best_ms = None, float("inf")
    for cfg in configs or candidates(p):
        try:
            cfg.check()
            ms = _tuning_cache.time_ms(lambda cfg=cfg: _run(trial, cfg), p.stream, warmup, rep)
        except (ValueError, RuntimeError) as exc:  # does not fit / fails to launch here
            timings[cfg.name] = f"skipped: {exc}"
            continue
        timings[cfg.name] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"autotune: no candidate ran for {p.key}: {timings}")
    _tuning_cache.record("gemm", p.key, dataclasses.asdict(best), timings)
    return best


_GEMM_CALLS = OpCalls("gemm")


def gemm(a: ArrayLike, b: ArrayLike, *, c: ArrayLike | None = None, alpha: float = 1.0,
         beta: float = 0.0, bias: ArrayLike | None = None, activation: str | None = None,
         out: ArrayLike | None = None, out_dtype: DTypeLike | None = None,
         backend: str = "auto", config: "GemmConfig | str | dict | None" = None,
         stream: StreamLike = None) -> ArrayLike:
    """``out = activation(alpha * a @ b + beta * c + bias)``.

    a: (M, K), b: (K, N): fp16, bf16 (Tensor Cores, fp32 accumulation) or fp32 (SIMT), the same
    dtype; row- or column-major each (strides decide; other strides raise ``ValueError``).
    c: optional (M, N), read only when ``beta != 0``. bias: optional (N,). c and bias: fp16, bf16
    or fp32. activation: None, "relu", "gelu" (tanh form) or "silu"; or gated, "silu_and_mul"
    or "gelu_and_mul" (tanh form): ``out = act(alpha * a @ b_gate + bias_gate) * (alpha * a @
    b_up + bias_up)``, (M, N / 2), where b (and bias) hold the gate and up columns interleaved
    in blocks of 8 (``interleave_gate_up``, layout in ``gemm_gated``; N a multiple of 16), the
    bias added before the activation; ``beta * c`` is not supported there.
    out: optional (M, N) (gated: (M, N / 2)), any non-negative strides, may be ``c`` itself.
    out_dtype: fp16, bf16 or fp32; default: ``out``'s dtype when given, else the input dtype.
    backend: "auto" (Tensor Cores for fp16 / bf16, SIMT for fp32),
    "tensor_core" or "simt". config: a ``GemmConfig``, a name in ``CONFIGS`` or a dict; default:
    the autotuned winner for this shape class if one is cached, else a heuristic.
    stream: None (the caller's torch / CuPy current stream, else the default stream), an int
    handle, or a numba / torch / CuPy / cuda.core stream.

    Any M, N, K >= 0: M or N = 0 returns an empty result; K = 0 returns
    ``activation(beta * c + bias)`` (the main kernel is not launched in either case).
    Returns ``out`` (allocated in the kind of ``a`` when not given).
    Raises ``TypeError`` for non-arrays, unsupported or mixed dtypes; ``ValueError`` for wrong
    ranks, mismatched shapes, unsupported strides, a bad config, or a gated activation with
    ``beta * c`` or N not a multiple of 16; ``NotImplementedError`` for fp32 inputs with
    ``backend="tensor_core"``.
    """
    result = _GEMM_CALLS.replay(
        (a, b, c, bias, out),
        (alpha, beta, activation, out_dtype, backend, config), stream)
    if result is MISS:
        result = _GEMM_CALLS.record(
            _gemm_checked, a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, config,
            stream)
    return result


def _gemm_checked(a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, config, stream):
    """The checked path of ``gemm`` (validation, planning, launch)."""
    cfg = None if config is None else resolve_config(config)
    if cfg is not None:
        if backend == "auto":
            backend = cfg.backend
        elif backend != cfg.backend:
            raise ValueError(f"config: a {cfg.backend} configuration with "
                             f"backend={backend!r}")
    p = prepare(a, b, c, alpha, beta, bias, activation, out, out_dtype, backend, stream)
    if p.M == 0 or p.N == 0:
        return p.out
    if p.K == 0:
        _launch_reduce(p, kernel_buffer(p.to), 0)  # sums nothing: act(beta * c + bias)
        return p.out
    _run(p, _choose(p, cfg))
    return p.out


# ---- compile-only check ----------------------------------------------------------------------

def _compile_target(cfg, a_k_inner, b_k_inner, in_dtype, out_dtype, c_dtype=None,
                    bias_dtype=None, act=None, vec=True, split_finish=False, programmatic=False):
    def build():
        fn, options = _kernel_fn(cfg, a_k_inner, b_k_inner, vec, vec, in_dtype, out_dtype,
                                 c_dtype, bias_dtype, act, split_finish, programmatic)
        return fn, _signature(cfg.backend, in_dtype, out_dtype, c_dtype, bias_dtype,
                              cfg.wgmma), options

    return build


_TC_PTX = ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4", "cp.async.cg.shared")
_TC_SASS = ("HMMA", "LDSM", "LDGSTS")
_WGMMA_PTX = ("wgmma.mma_async.sync.aligned", "cp.async.cg.shared")
_WGMMA_SASS = ("HGMMA", "LDGSTS")
for _name, _cfg, _a_k, _b_k, _in, _out, _extra in (
        ("gemm_tc_f16_nn", "tc_128x128x32_w2x2_s4", True, False, "float16", "float16", {}),
        # the heuristic's large tile (follows the LARGE_CONFIG switch) and its fallback
        ("gemm_tc_f16_nn_default", LARGE_CONFIG, True, False, "float16", "float16", {}),
        ("gemm_tc_f16_nn_128x128x64", "tc_128x128x64_w2x2_s3", True, False, "float16", "float16",
         {}),
        ("gemm_tc_bf16_nt", "tc_128x128x32_w2x2_s4", True, True, "bfloat16", "bfloat16", {}),
        ("gemm_tc_f16_tn_epilogue", "tc_128x128x32_w2x2_s4", False, False, "float16", "float16",
         {"c_dtype": "float16", "bias_dtype": "float16", "act": "gelu"}),
        ("gemm_tc_f16_tt", "tc_128x128x32_w2x2_s4", False, True, "float16", "float32", {}),
        ("gemm_tc_f16_128x256", "tc_128x256x32_w2x4_s3", True, False, "float16", "float16", {}),
        ("gemm_tc_f16_decode_nt", "tc_16x128x64_w1x4_s4", True, True, "float16", "float32", {}),
        ("gemm_tc_f16_decode_nn", "tc_16x128x64_w1x4_s4", True, False, "float16", "float32", {}),
        # Hopper
        ("gemm_wgmma_bf16_nn", "wg_128x256x64_s4", True, False, "bfloat16", "bfloat16", {}),
        ("gemm_wgmma_f16_nt", "wg_128x256x64_s4", True, True, "float16", "float16", {}),
        ("gemm_wgmma_f16_tn_epilogue", "wg_128x128x64_s5", False, False, "float16", "float32",
         {"c_dtype": "float16", "bias_dtype": "float32", "act": "silu"}),
        # gated gate / up projections (b: a Linear weight's .T), beside plain twins
        ("gemm_tc_bf16_nt_silu_and_mul", "tc_128x128x32_w2x2_s4", True, True, "bfloat16",
         "bfloat16", {"act": "silu_and_mul"}),
        ("gemm_tc_f16_nt_default_gelu_and_mul", LARGE_CONFIG, True, True, "float16", "float16",
         {"bias_dtype": "float32", "act": "gelu_and_mul"}),
        ("gemm_tc_f16_nt_64x128", "tc_64x128x64_w1x4_s4", True, True, "float16", "float16", {}),
        ("gemm_tc_f16_nt_64x128_gelu_and_mul", "tc_64x128x64_w1x4_s4", True, True, "float16",
         "float16", {"bias_dtype": "float16", "act": "gelu_and_mul"}),
        ("gemm_tc_bf16_decode_nt_silu_and_mul", "tc_16x128x64_w1x4_s4", True, True, "bfloat16",
         "bfloat16", {"act": "silu_and_mul"}),
        ("gemm_wgmma_f16_nt_silu_and_mul", "wg_128x256x64_s4", True, True, "float16", "float16",
         {"act": "silu_and_mul"}),
        ("gemm_wgmma_bf16_nt_gelu_and_mul", "wg_128x256x64_s4", True, True, "bfloat16",
         "bfloat16", {"bias_dtype": "bfloat16", "act": "gelu_and_mul"}),
        # K split finished in the same launch (split_tile_finish); few-row Hopper tiles
        ("gemm_tc_bf16_decode_nt_split", "tc_16x128x64_w1x4_s4", True, True, "bfloat16",
         "bfloat16", {"split_finish": True}),
        ("gemm_tc_bf16_decode_nt_silu_and_mul_split", "tc_16x128x64_w1x4_s4", True, True,
         "bfloat16", "bfloat16", {"act": "silu_and_mul", "split_finish": True}),
        ("gemm_wgmma_bf16_nt_64x128", "wg_64x128x64_s6", True, True, "bfloat16", "bfloat16",
         {}),
        ("gemm_wgmma_bf16_nt_64x128_split", "wg_64x128x64_s6", True, True, "bfloat16",
         "bfloat16", {"bias_dtype": "bfloat16", "act": "silu", "split_finish": True}),
        ("gemm_wgmma_bf16_nt_64x256_split", "wg_64x256x64_s4", True, True, "bfloat16",
         "bfloat16", {"split_finish": True}),
        # warp-specialised (producer warpgroup, mbarriers)
        ("gemm_wgmma_bf16_nt_64x128_producer", "wg_64x128x64_s6_p", True, True, "bfloat16",
         "bfloat16", {}),
        ("gemm_wgmma_f16_tn_128x128_producer_split", "wg_128x128x64_s5_p", False, False,
         "float16", "float16", {"bias_dtype": "float16", "act": "silu", "split_finish": True}),
        ("gemm_wgmma_bf16_nt_64x256_silu_and_mul_split", "wg_64x256x64_s4", True, True,
         "bfloat16", "bfloat16", {"act": "silu_and_mul", "split_finish": True}),
        # copies by the Tensor Memory Accelerator
        ("gemm_wgmma_bf16_nt_64x128_tma", "wg_64x128x64_s8_p_tma", True, True, "bfloat16",
         "bfloat16", {}),
):
    _cfg_of = CONFIGS[_cfg]
    # the cp.async producer announces stages by the copies' own mbarrier arrival; the TMA one
    # issues box copies (no cp.async at all)
    _noinc = _cfg_of.producer and not _cfg_of.tma
    _ptx = (_WGMMA_PTX if _cfg_of.wgmma else _TC_PTX) + (
        ("cp.async.mbarrier.arrive.noinc",) if _noinc else ())
    _sass = (_WGMMA_SASS if _cfg_of.wgmma else _TC_SASS) + (
        ("ARRIVES.LDGSTSBAR",) if _noinc else ())
    if _cfg_of.tma:
        _ptx = ("wgmma.mma_async.sync.aligned", "cp.async.bulk.tensor.2d")
        _sass = ("HGMMA", "UTMALDG")
    compile_check.register(
        _name, _compile_target(_cfg_of, _a_k, _b_k, _in, _out, **_extra),
        ptx_must_have=_ptx, sass_must_have=_sass)
# the few-row CUDA-core kernel: 16-byte loads of both operands, no local memory
for _name, _cfg, _in, _out, _extra in (
        ("gemm_gemv_bf16_1x4", "gemv_1x4_w4_u2", "bfloat16", "bfloat16", {}),
        ("gemm_gemv_f16_4x4_epilogue", "gemv_4x4_w4_u2", "float16", "float32",
         {"c_dtype": "float16", "bias_dtype": "float16", "act": "silu"}),
        ("gemm_gemv_bf16_1x4_silu_and_mul", "gemv_1x4_w4_u2", "bfloat16", "bfloat16",
         {"act": "silu_and_mul"}),
        ("gemm_gemv_bf16_1x4_programmatic", "gemv_1x4_w4_u2", "bfloat16", "bfloat16",
         {"programmatic": True})):
    compile_check.register(_name, _compile_target(CONFIGS[_cfg], True, True, _in, _out, **_extra),
                           sass_must_have=("LDG.E.128", "FFMA")
                           + ("ACQBULK",) * bool(_extra.get("programmatic")))
for _name, _out, _bias, _act in (("gemm_splitk_reduce_bf16_silu_and_mul", "bfloat16", None,
                                   "silu_and_mul"),
                                  ("gemm_splitk_reduce_f16_gelu_and_mul", "float16", "float32",
                                   "gelu_and_mul")):
    compile_check.register(
        _name, lambda o=_out, b=_bias, act=_act: (_reduce_fn(o, None, b, act),
                                                  _reduce_signature(o, None, b)))
# (the default SIMT tile with 16-byte global and shared loads, the fp32 path the benchmark
# times; two blocks per SM: 128 registers through the launch bounds, and the no-spill check)
# ptxas of nvJitLink 13.0 (the GPU image) spills 4 B (8 B stack) at the 128-register cap
# (13.5 spills nothing); the kernel was measured with that spill (benchmarks/NOTES.md, "GEMM
# tile defaults"), so it is tolerated up to 8 B.
compile_check.register(
    "gemm_simt_f32_nn", _compile_target(CONFIGS[SIMT_CONFIG], True, False, "float32", "float32"),
    sass_must_have=("FFMA", "LDS.128", "LDG.E.128"), allowed_local_bytes=8,
    why="2-blocks/SM register cap: 0.91x cuBLAS as measured with 13.0's 4 B spill")
# the heuristic's SIMT tile up to 512 x 512 outputs (a fraction of the large tile's compile time)
compile_check.register(
    "gemm_simt_f32_nn_64x64", _compile_target(CONFIGS["simt_64x64x8_t4x4"], True, False,
                                              "float32", "float32"),
    sass_must_have=("FFMA", "LDS.128", "LDG.E.128"))
