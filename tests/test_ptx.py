"""Each PTX op against NumPy on random data.

The same tests run the simulator twins (CI) and the inline-PTX intrinsics (GPU suite), so a layout
disagreement between a twin and the hardware fails on the GPU. Kernels here are launched through
numba's dispatcher with host arrays (numba copies them on a GPU).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmspeed_numba import ptx
from llmspeed_numba._env import cuda

BF16 = ml_dtypes.bfloat16


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint16)


# ---- mma -----------------------------------------------------------------------------------

@cuda.jit
def _mma_kernel(a_bits, b_bits, c, d, use_bf16):
    """Each lane builds its fragments from A (16x16), B (16x8, stored k-major), C (16x8)."""
    lane = cuda.threadIdx.x
    g = lane // 4
    t = lane % 4

    def pair(bits, i0, i1):
        return np.uint32(bits[i0]) | (np.uint32(bits[i1]) << np.uint32(16))

    a0 = pair(a_bits, g * 16 + 2 * t, g * 16 + 2 * t + 1)
    a1 = pair(a_bits, (g + 8) * 16 + 2 * t, (g + 8) * 16 + 2 * t + 1)
    a2 = pair(a_bits, g * 16 + 2 * t + 8, g * 16 + 2 * t + 9)
    a3 = pair(a_bits, (g + 8) * 16 + 2 * t + 8, (g + 8) * 16 + 2 * t + 9)
    b0 = pair(b_bits, (2 * t) * 8 + g, (2 * t + 1) * 8 + g)
    b1 = pair(b_bits, (2 * t + 8) * 8 + g, (2 * t + 9) * 8 + g)
    c0 = c[g * 8 + 2 * t]
    c1 = c[g * 8 + 2 * t + 1]
    c2 = c[(g + 8) * 8 + 2 * t]
    c3 = c[(g + 8) * 8 + 2 * t + 1]
    if use_bf16:
        r = ptx.mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    else:
        r = ptx.mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    d[g * 8 + 2 * t] = r[0]
    d[g * 8 + 2 * t + 1] = r[1]
    d[(g + 8) * 8 + 2 * t] = r[2]
    d[(g + 8) * 8 + 2 * t + 1] = r[3]


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_mma_m16n8k16(dtype, rng):
    a = rng.standard_normal((16, 16)).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full(16 * 8, np.nan, np.float32)
    _mma_kernel[1, 32](_bits(a).ravel(), _bits(b).ravel(), c.ravel(), d, dtype is BF16)
    expected = a.astype(np.float64) @ b.astype(np.float64) + c
    # products of halves are exact in fp32; 16 fp32 additions round: |err| <= 16 eps32 sum|.|
    bound = 16 * np.finfo(np.float32).eps * (np.abs(a.astype(np.float64)) @ np.abs(
        b.astype(np.float64)) + np.abs(c))
    assert np.all(np.abs(d.reshape(16, 8) - expected) <= bound)


# ---- ldmatrix ------------------------------------------------------------------------------

def _ldmatrix_kernel(count, trans):
    op = {(1, False): ptx.ldmatrix_x1, (2, False): ptx.ldmatrix_x2, (4, False): ptx.ldmatrix_x4,
          (1, True): ptx.ldmatrix_x1_trans, (2, True): ptx.ldmatrix_x2_trans,
          (4, True): ptx.ldmatrix_x4_trans}[(count, trans)]

    @cuda.jit
    def kernel(src, row_of_lane, out):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(4 * 64, np.uint16, alignment=16)
        for i in range(lane, 4 * 64, 32):
            smem[i] = src[i]
        cuda.syncthreads()
        regs = op(smem, row_of_lane[lane] * 8)
        if count == 1:
            out[lane] = regs
        else:
            for m in range(count):
                out[m * 32 + lane] = regs[m]

    return kernel


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix(count, trans, rng):
    src = rng.integers(0, 2**16, size=4 * 64, dtype=np.uint16)
    rows = rng.permutation(32).astype(np.int32)  # lane -> which 16-byte row it points at
    out = np.zeros(count * 32, np.uint32)
    _ldmatrix_kernel(count, trans)[1, 32](src, rows, out)
    rows_of = src.reshape(32, 8)
    for m in range(count):
        matrix = rows_of[rows[8 * m: 8 * m + 8]]  # lanes 8m..8m+7 address matrix m's rows
        if trans:
            matrix = matrix.T
        for lane in range(32):
            lo = int(matrix[lane // 4, 2 * (lane % 4)])
            hi = int(matrix[lane // 4, 2 * (lane % 4) + 1])
            assert out[m * 32 + lane] == lo | (hi << 16), (m, lane)


# ---- cp.async ------------------------------------------------------------------------------

def _cp_async_kernel(prefetch):
    """One warp: lane l copies 16 bytes (``src_bytes[l]`` of them read) into poisoned shared
    memory; ``prefetch`` None: ``cp_async_16``, else ``cp_async_16_l2`` with that hint."""
    plain = prefetch is None
    hint = 0 if plain else prefetch

    @cuda.jit
    def cp_async_kernel(src, src_bytes, out):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(32 * 8, np.uint16, alignment=16)
        for i in range(lane, 32 * 8, 32):
            smem[i] = 0xFFFF
        cuda.syncthreads()
        if plain:
            ptx.cp_async_16(smem, lane * 8, src, lane * 8, src_bytes[lane])
        else:
            ptx.cp_async_16_l2(smem, lane * 8, src, lane * 8, src_bytes[lane], hint)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        for i in range(lane, 32 * 8, 32):
            out[i] = smem[i]

    return cp_async_kernel


@pytest.mark.parametrize("prefetch", [None, 256], ids=["plain", "l2_prefetch"])
def test_cp_async_zero_fill(rng, prefetch):
    src = rng.integers(1, 2**16, size=32 * 8, dtype=np.uint16)
    src_bytes = rng.choice([0, 2, 4, 8, 14, 16], size=32).astype(np.int32)
    out = np.zeros(32 * 8, np.uint16)
    _cp_async_kernel(prefetch)[1, 32](src, src_bytes, out)
    expected = src.reshape(32, 8).copy()
    for lane, nbytes in enumerate(src_bytes):
        expected[lane, nbytes // 2:] = 0
    np.testing.assert_array_equal(out.reshape(32, 8), expected)


# ---- 16-byte vector access -----------------------------------------------------------------

@cuda.jit
def _vector_kernel(src, dst):
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(32 * 8, np.uint16, alignment=16)
    v = ptx.load_u32x4(src, lane * 8)          # global -> registers
    ptx.store_u32x4(smem, lane * 8, v[0], v[1], v[2], v[3])   # registers -> shared
    cuda.syncthreads()
    w = ptx.load_u32x4(smem, ((lane + 1) % 32) * 8)            # shared -> registers
    ptx.store_u32x4(dst, lane * 8, w[0], w[1], w[2], w[3])     # registers -> global


def test_vector_load_store(rng):
    src = rng.integers(0, 2**16, size=32 * 8, dtype=np.uint16)
    dst = np.zeros_like(src)
    _vector_kernel[1, 32](src, dst)
    np.testing.assert_array_equal(dst.reshape(32, 8), np.roll(src.reshape(32, 8), -1, axis=0))


# ---- conversions ---------------------------------------------------------------------------

@cuda.jit
def _convert_kernel(x, f16_bits, bf16_bits, f16_back, bf16_back, pairs_f16, pairs_bf16,
                    unpacked):
    i = cuda.grid(1)
    if i < x.size:
        f16_bits[i] = ptx.f32_to_f16(x[i])
        bf16_bits[i] = ptx.f32_to_bf16(x[i])
        f16_back[i] = ptx.f16_to_f32(f16_bits[i])
        bf16_back[i] = ptx.bf16_to_f32(bf16_bits[i])
    if 2 * i + 1 < x.size:
        pf = ptx.pack_f16x2(x[2 * i], x[2 * i + 1])
        pb = ptx.pack_bf16x2(x[2 * i], x[2 * i + 1])
        pairs_f16[i] = pf
        pairs_bf16[i] = pb
        lo, hi = ptx.unpack_f16x2(pf)
        unpacked[4 * i] = lo
        unpacked[4 * i + 1] = hi
        lo, hi = ptx.unpack_bf16x2(pb)
        unpacked[4 * i + 2] = lo
        unpacked[4 * i + 3] = hi


def _special_values():
    return np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 70000.0, -1e6, 6e-8, 1e-40, np.inf, -np.inf,
                     1.0009765625, 1.00048828125, 3.0078125], np.float32)  # ties, subnormals


@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_conversions(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([_special_values(),
                        (rng.standard_normal(50) * 10.0 ** rng.integers(-6, 6, 50))
                        .astype(np.float32)])
    if x.size % 2:
        x = x[:-1]
    n = x.size
    outs = [np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.zeros(n, np.float32),
            np.zeros(n, np.float32), np.zeros(n // 2, np.uint32), np.zeros(n // 2, np.uint32),
            np.zeros(2 * n, np.float32)]
    _convert_kernel[1, n](x, *outs)
    f16_bits, bf16_bits, f16_back, bf16_back, pairs_f16, pairs_bf16, unpacked = outs
    with np.errstate(over="ignore"):
        want_f16 = x.astype(np.float16).view(np.uint16)
    want_bf16 = x.astype(BF16).view(np.uint16)
    np.testing.assert_array_equal(f16_bits, want_f16)
    np.testing.assert_array_equal(bf16_bits, want_bf16)
    np.testing.assert_array_equal(f16_back, want_f16.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bf16_back, want_bf16.view(BF16).astype(np.float32))
    np.testing.assert_array_equal(pairs_f16, want_f16.view(np.uint32))
    np.testing.assert_array_equal(pairs_bf16, want_bf16.view(np.uint32))
    quads = unpacked.reshape(-1, 4)
    np.testing.assert_array_equal(quads[:, 0:2].ravel(), f16_back)
    np.testing.assert_array_equal(quads[:, 2:4].ravel(), bf16_back)


@cuda.jit
def _code_to_half_kernel(a, b, sel, permuted, diff_f16, diff_bf16):
    i = cuda.grid(1)
    if i < a.size:
        permuted[i] = ptx.prmt(a[i], b[i], sel[i])
        diff_f16[i] = ptx.sub_f16x2(a[i], b[i])
        diff_bf16[i] = ptx.sub_bf16x2(a[i], b[i])


def _prmt_reference(a, b, sel):
    source = np.stack([a, b], axis=1).view(np.uint8).reshape(-1, 8)   # a's bytes 0-3, b's 4-7
    out = np.zeros((a.size, 4), np.uint8)
    for i in range(4):
        nibble = (sel >> np.uint32(4 * i)) & np.uint32(0xF)
        byte = source[np.arange(a.size), nibble & 7]
        out[:, i] = np.where(nibble & 8, np.where(byte & 0x80, 0xFF, 0), byte)
    return out.view(np.uint32).ravel()


def test_prmt_and_packed_sub(rng):
    """prmt in both modes (byte select, sign replicate) on random words and selectors; the packed
    f16 / bf16 subtraction against NumPy's correctly rounded difference, on the code conversion's
    values (a 4-bit code beside the magic's exponent byte, minus magic + zero point: exact) and on
    finite random halves."""
    n = 256
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    half = n // 2   # first half: the conversion's operands
    codes = rng.integers(0, 16, (half, 2)).astype(np.uint32)
    zero = rng.integers(0, 16, (half, 1)).astype(np.uint32)
    magic_f16, magic_bf16 = 0x6400, 0x4300
    a[:half // 2] = ((magic_f16 | codes[:half // 2]) * [1, 1 << 16]).sum(1)
    b[:half // 2] = ((magic_f16 | zero[:half // 2]) * 0x10001).ravel()
    a[half // 2:half] = ((magic_bf16 | codes[half // 2:]) * [1, 1 << 16]).sum(1)
    b[half // 2:half] = ((magic_bf16 | zero[half // 2:]) * 0x10001).ravel()
    finite = rng.standard_normal((n - half, 2)).astype(np.float32)
    a[half:] = finite.astype(np.float16).view(np.uint32).ravel()
    b[half:] = (finite[:, ::-1] * 0.3).astype(np.float16).view(np.uint32).ravel()
    sel = rng.integers(0, 2**16, n).astype(np.uint32)
    sel[:4] = [0x7250, 0x7351, 0x3210, 0x8888]
    outs = [np.zeros(n, np.uint32) for _ in range(3)]
    _code_to_half_kernel[2, 128](a, b, sel, *outs)
    permuted, diff_f16, diff_bf16 = outs
    np.testing.assert_array_equal(permuted, _prmt_reference(a, b, sel))

    def rounded_diff(dtype):
        x = a.view(dtype).astype(np.float64) - b.view(dtype).astype(np.float64)
        return x.astype(dtype).view(np.uint32)

    f16_rows = np.r_[0:half // 2, half:n]
    np.testing.assert_array_equal(diff_f16[f16_rows], rounded_diff(np.float16)[f16_rows])
    exact = codes[:half // 2].astype(np.float64) - zero[:half // 2]
    np.testing.assert_array_equal(diff_f16[:half // 2].view(np.float16).reshape(-1, 2), exact)
    bf16_rows = np.r_[half // 2:half]
    np.testing.assert_array_equal(diff_bf16[bf16_rows], rounded_diff(BF16)[bf16_rows])
    exact = codes[half // 2:].astype(np.float64) - zero[half // 2:]
    np.testing.assert_array_equal(diff_bf16[half // 2:half].view(BF16).reshape(-1, 2)
                                  .astype(np.float64), exact)


# ---- math and warp collectives -------------------------------------------------------------

@cuda.jit
def _ex2_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = ptx.ex2_approx(x[i])


def test_ex2_approx(rng):
    x = np.concatenate([rng.uniform(-30, 30, 200), [-np.inf, 0.0, -126.5, 10.25]]).astype(
        np.float32)
    y = np.zeros_like(x)
    _ex2_kernel[1, x.size](x, y)
    expected = np.exp2(x.astype(np.float64))
    normal = expected >= np.finfo(np.float32).tiny
    # ex2.approx.ftz: max relative error 2^-22.5 (PTX ISA); subnormal results flush to 0
    assert np.all(np.abs(y[normal] - expected[normal]) <= 2.0 ** -21 * expected[normal])
    assert np.all(y[~normal] <= np.finfo(np.float32).tiny)


@cuda.jit
def _shfl_kernel(xf, xi, mask, yf, yi):
    lane = cuda.threadIdx.x
    yf[lane] = ptx.shfl_xor_f32(xf[lane], mask)
    yi[lane] = ptx.shfl_xor_i32(xi[lane], mask)
    ptx.syncwarp()


@pytest.mark.parametrize("mask", [1, 2, 16, 31])
def test_shfl_xor(mask, rng):
    xf = rng.standard_normal(64).astype(np.float32)
    xi = rng.integers(-2**31, 2**31, size=64).astype(np.int32)
    yf, yi = np.zeros_like(xf), np.zeros_like(xi)
    _shfl_kernel[1, 64](xf, xi, mask, yf, yi)  # two warps: lanes exchange only within a warp
    perm = np.arange(64) ^ mask
    np.testing.assert_array_equal(yf, xf[perm])
    np.testing.assert_array_equal(yi, xi[perm])


@cuda.jit
def _vote_kernel(flags, out):
    lane = cuda.threadIdx.x
    out[lane] = 1 if ptx.vote_any(flags[lane] != 0) else 0


def test_vote_any():
    """True in every lane of a warp where any lane's predicate holds, per warp (three warps:
    one lane set, none, all)."""
    flags = np.zeros(96, np.int32)
    flags[17] = 1
    flags[64:] = 1
    out = np.full(96, -1, np.int32)
    _vote_kernel[1, 96](flags, out)
    np.testing.assert_array_equal(out, np.repeat([1, 0, 1], 32))


# ---- bit casts and fast trigonometry -------------------------------------------------------

@cuda.jit
def _bits_kernel(x, bits, back):
    i = cuda.grid(1)
    if i < x.size:
        b = ptx.f32_bits(x[i])
        bits[i] = b
        back[i] = ptx.f32_from_bits(b)


def test_f32_bit_casts(rng):
    x = np.concatenate([_special_values(), [np.nan], rng.standard_normal(17)]).astype(np.float32)
    bits = np.zeros(x.size, np.uint32)
    back = np.zeros_like(x)
    _bits_kernel[1, x.size](x, bits, back)
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))


@cuda.jit
def _trig_kernel(x, s, c):
    i = cuda.grid(1)
    if i < x.size:
        s[i] = ptx.sin_approx(x[i])
        c[i] = ptx.cos_approx(x[i])


def test_sin_cos_approx(rng):
    x = np.concatenate([rng.uniform(-np.pi, np.pi, 120), [0.0, np.pi, -np.pi, 1e-3]]).astype(
        np.float32)
    s, c = np.zeros_like(x), np.zeros_like(x)
    _trig_kernel[1, x.size](x, s, c)
    # sin/cos.approx.ftz.f32: max absolute error 2^-20.5 on [-pi, pi] (PTX ISA)
    assert np.all(np.abs(s - np.sin(x.astype(np.float64))) <= 2.0 ** -20)
    assert np.all(np.abs(c - np.cos(x.astype(np.float64))) <= 2.0 ** -20)


@cuda.jit
def _rcp_kernel(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = ptx.rcp_approx(x[i])


def test_rcp_approx(rng):
    x = np.concatenate([rng.standard_normal(100) * 10.0 ** rng.integers(-30, 30, 100),
                        [1.0, -3.0, np.inf, -np.inf]]).astype(np.float32)
    y = np.zeros_like(x)
    _rcp_kernel[1, x.size](x, y)
    expected = 1.0 / x.astype(np.float64)
    normal = np.abs(expected) >= np.finfo(np.float32).tiny
    # rcp.approx.ftz.f32: max error 1 ulp (PTX ISA); subnormal results flush to 0
    assert np.all(np.abs(y[normal] - expected[normal]) <= 2.0 ** -22 * np.abs(expected[normal]))
    assert np.all(np.abs(y[~normal]) <= np.finfo(np.float32).tiny)


@cuda.jit
def _div_full_kernel(x, y, z):
    i = cuda.grid(1)
    if i < x.size:
        z[i] = ptx.div_full(x[i], y[i])


def test_div_full(rng):
    x = (rng.standard_normal(120) * 10.0 ** rng.integers(-20, 20, 120)).astype(np.float32)
    y = (rng.standard_normal(120) * 10.0 ** rng.integers(-20, 20, 120)).astype(np.float32)
    x = np.concatenate([x, [3.0, -88.0, 1.0, 0.0]]).astype(np.float32)
    y = np.concatenate([y, [np.inf, np.inf, 2.0 ** 127, 5.0]]).astype(np.float32)
    z = np.full_like(x, np.nan)
    _div_full_kernel[1, x.size](x, y, z)
    expected = x.astype(np.float64) / y.astype(np.float64)
    normal = np.abs(expected) >= np.finfo(np.float32).tiny
    # div.full.f32: full range, max 2 ulp (PTX ISA); silu's x / inf must stay 0
    assert np.all(np.abs(z[normal] - expected[normal]) <= 2.0 ** -22 * np.abs(expected[normal]))
    assert np.all(np.abs(z[~normal]) <= np.finfo(np.float32).tiny)


@cuda.jit
def _shfl_idx_kernel(x, src, y):
    lane = cuda.threadIdx.x
    y[lane] = ptx.shfl_idx_i32(x[lane], src[lane])


def test_shfl_idx(rng):
    x = rng.integers(-2**31, 2**31, size=64).astype(np.int32)
    src = rng.integers(0, 32, size=64).astype(np.int32)  # each lane reads any lane of its warp
    y = np.zeros_like(x)
    _shfl_idx_kernel[1, 64](x, src, y)
    warp_base = (np.arange(64) // 32) * 32
    np.testing.assert_array_equal(y, x[warp_base + src])


# ---- every op in every backend -------------------------------------------------------------

#: The ops the linked backend replaces (CUDA C inline asm linked through LTO): the Tensor Core
#: data path, whose inlining the backend exists to compare.
LINKED_OPS = {"mma_f16", "mma_bf16", "ldmatrix_x1", "ldmatrix_x1_trans", "ldmatrix_x2",
              "ldmatrix_x2_trans", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async_16",
              "cp_async_commit"}
# Every other op is intentionally without a linked twin: under LLMSPEED_NUMBA_PTX_BACKEND=linked
# it stays the intrinsic (ptx/__init__.py imports the intrinsics, then lets _linked override only
# LINKED_OPS); cp_async_wait could not be linked anyway (its N is a literal of the asm text).


def _linked_all():
    """``_linked.__all__`` and its function names, read from the source (linking needs a GPU)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(ptx.__file__).with_name("_linked.py").read_text())
    names, defined = None, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            names = set(ast.literal_eval(node.value))
    return names, defined


def test_every_ptx_op_has_a_simulator_twin():
    """Each op of ``ptx/_intrinsics/<family>.py`` has its twin in ``ptx/_twins/<family>.py``;
    every family module is in ``FAMILIES`` and has its twin module; no op is listed twice."""
    import importlib
    import pathlib

    from llmspeed_numba.ptx import _intrinsics, _twins

    def family_modules(package):
        return {path.stem for path in pathlib.Path(package.__file__).parent.glob("*.py")} - {
            "__init__", "common"}

    names = [family.__name__.rsplit(".", 1)[1] for family in _intrinsics.FAMILIES]
    assert set(names) == family_modules(_intrinsics), "a family module missing from FAMILIES"
    assert family_modules(_twins) == set(names), "twin modules not named as the families"
    assert len(set(_intrinsics.__all__)) == len(_intrinsics.__all__), "an op listed twice"
    missing = []
    for name, family in zip(names, _intrinsics.FAMILIES):
        twins = importlib.import_module(f"{_twins.__name__}.{name}")
        missing += [f"{name}.{op}" for op in family.__all__
                    if not callable(getattr(twins, op, None))]
    assert not missing, f"ops without a twin in ptx/_twins/<family>.py: {missing}"


def test_linked_backend_twins_are_the_listed_ones():
    from llmspeed_numba.ptx import _intrinsics

    linked, defined = _linked_all()
    assert linked == LINKED_OPS, (
        "ptx/_linked.py's __all__ changed: update LINKED_OPS (and the reason for the others)")
    assert linked <= set(_intrinsics.__all__), linked - set(_intrinsics.__all__)
    assert linked <= defined, linked - defined
