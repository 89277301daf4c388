"""quantize_weight / QuantizedWeight / quant_gemm: dequantize() against the original weight within
each format's rounding bound, GGUF blocks bit for bit against the ``gguf`` package, GPTQ's packing,
quant_gemm against float64 ``x @ qw.dequantize().T`` (every path: the streaming kernel of 4-bit
weights at M <= 16, the decode kernel, planned up to M = 4 / 2 and forced up to 16, and the Tensor
Core kernel, forced at small M under the simulator), and every documented error.

Tolerances are derived (``testing.derived_check``): the plain model sums in float32 with the
dequantized weight as the path uses it (exact on the decode and streaming kernels; rounded to x's
dtype on the Tensor Core kernel), with the Tensor Core accumulator model on a GPU for the
streaming and Tensor Core kernels. Under the simulator shapes are one or
two blocks of the 16 x 16 simulator tile; the GPU suite (``-m gpu``) adds the issue's sizes.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gguf_quants
from hypothesis import given
from hypothesis import strategies as st

import llmspeed_numba as lsn
from llmspeed_numba import SIMULATOR, deinterleave_gate_up, interleave_gate_up
from llmspeed_numba._arrays import numpy_dtype, to_host
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.quant_gemm import (
    DECODE_MAX_M,
    decode_plan,
    on_decode_kernel,
    on_stream_kernel,
    stream_plan,
    tc_plan,
)
from llmspeed_numba.ops.quant_weight import pack_codes, unpack_codes
from llmspeed_numba.reference.gemm import (
    GATE_ACTIVATION,
    gated_gemm_plain,
    gated_gemm_reference,
    gemm_plain,
    gemm_reference,
)
from llmspeed_numba.testing import derived_check, f64, poison, random_array, to_device

X_DTYPES = ("float16", "bfloat16")
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}


# ---- helpers -------------------------------------------------------------------------------

def device(host):
    """The array an op receives: NumPy under the simulator, torch on a GPU."""
    return to_device(host, "torch")


def _empty(shape, dtype):
    if SIMULATOR:
        return np.empty(shape, numpy_dtype(dtype))
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")


def weight(rng, N, K, dtype, scale=0.05):
    return random_array((N, K), dtype, rng, scale=scale)


def check(got, x, qw, *, out_dtype, bias=None, activation=None, tensor_core=False, mma=None):
    """quant_gemm's result against float64 ``x @ qw.dequantize().T`` (+ bias, activation).
    ``tensor_core``: the weight rounded to x's dtype; ``mma``: Tensor Core accumulation
    (default: with ``tensor_core``, on a GPU)."""
    if mma is None:
        mma = tensor_core and not SIMULATOR
    if activation in GATE_ACTIVATION:
        check_gated(got, x, qw, out_dtype=out_dtype, bias=bias, activation=activation,
                    tensor_core=tensor_core, mma=mma)
        return
    w = qw.dequantize()
    bias_h = None if bias is None else np.asarray(bias)
    reference = gemm_reference(np.asarray(x, np.float64), w.astype(np.float64).T,
                               bias=None if bias_h is None else bias_h.astype(np.float64),
                               activation=activation)
    w_plain = w.astype(np.asarray(x).dtype) if tensor_core else w
    plain = gemm_plain(x, np.asarray(w_plain, np.float32).T, bias=bias_h, activation=activation,
                       out_dtype=numpy_dtype(out_dtype), mma=mma)
    derived_check(f64(got), reference, np.asarray(plain, np.float64))


def check_gated(got, x, qw, *, out_dtype, bias, activation, tensor_core, mma):
    """A gated activation's result (M, N / 2) against float64 ``act(x @ Wg^T + bg) * (x @ Wu^T
    + bu)``, Wg / Wu the gate and up rows of ``qw.dequantize()`` (interleaved in blocks of 8)."""
    w_gate, w_up = deinterleave_gate_up(qw.dequantize())
    b_gate, b_up = (None, None) if bias is None else deinterleave_gate_up(np.asarray(bias))
    reference = gated_gemm_reference(
        np.asarray(x, np.float64), w_gate.astype(np.float64).T, w_up.astype(np.float64).T,
        bias_gate=None if bias is None else b_gate.astype(np.float64),
        bias_up=None if bias is None else b_up.astype(np.float64), activation=activation)

    def as_used(w):  # the Tensor Core kernel rounds each weight element to x's dtype
        return np.asarray(w.astype(np.asarray(x).dtype) if tensor_core else w, np.float32).T

    plain = gated_gemm_plain(x, as_used(w_gate), as_used(w_up), bias_gate=b_gate,
                             bias_up=b_up, activation=activation,
                             out_dtype=numpy_dtype(out_dtype), mma=mma)
    derived_check(f64(got), reference, np.asarray(plain, np.float64))


def run(rng, qw, M, x_dtype, *, out_dtype=None, bias_dtype=None, activation=None,
        tensor_core=None, x_pad=0):
    """quant_gemm on random x (rows padded by ``x_pad``: a row stride that is not K) into a
    poisoned ``out``, checked (``tensor_core``: the path's arithmetic the check assumes;
    default: the path planned for M under the active overrides)."""
    N, K = qw.shape
    stream = on_stream_kernel(qw, M)
    if tensor_core is None:
        tensor_core = not stream and not on_decode_kernel(qw, M)
    x_full = random_array((M, K + x_pad), x_dtype, rng)
    x = x_full[:, :K]
    bias = None if bias_dtype is None else random_array((N,), bias_dtype, rng)
    out_dtype = out_dtype or x_dtype
    out = poison(_empty((M, N // 2 if activation in GATE_ACTIVATION else N), out_dtype))
    dx = device(x_full)[:, :K]
    got = lsn.quant_gemm(dx, qw, bias=None if bias is None else device(bias),
                         activation=activation, out=out)
    assert got is out
    check(got, x, qw, out_dtype=out_dtype, bias=bias, activation=activation,
          tensor_core=tensor_core and not stream, mma=(tensor_core or stream) and not SIMULATOR)


def rounding_bound(qw, w):
    """Per-element bound of |dequantize() - w|: half a step, plus what rounding the scale to its
    dtype moves the clamp (16 units of its epsilon times the step)."""
    s = qw._values(qw.scales).T[:, np.arange(qw.K) // qw.group_size]
    return s * (0.5 + 16 * _EPS[qw.scale_dtype]) + 1e-30


def gguf_blocks(rng, N, K, ggml_type):
    w = rng.standard_normal((N, K)).astype(np.float32)
    return gguf_quants.quantize(w, ggml_type)


# ---- quantize_weight / dequantize (host only) ------------------------------------------------

@given(st.data())
def test_int4_dequantize_within_rounding_bound(data):
    group = data.draw(st.sampled_from((32, 64, 128, -1)), "group_size")
    groups = data.draw(st.integers(1, 3), "groups")
    K = groups * (group if group > 0 else 32) + (data.draw(st.sampled_from((0, 8)), "k_tail")
                                                  if group < 0 else 0)
    N = data.draw(st.integers(1, 12), "N")
    dtype = data.draw(st.sampled_from(("float16", "bfloat16", "float32")), "dtype")
    symmetric = data.draw(st.booleans(), "symmetric")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
    w = weight(rng, N, K, dtype)
    if not symmetric:  # an offset range, where a zero point matters
        w = (w.astype(np.float32) + np.float32(0.03)).astype(w.dtype)
    qw = lsn.quantize_weight(w, "int4", group_size=group, symmetric=symmetric)
    assert qw.shape == (N, K) and qw.bits == 4 and qw.scale_dtype == dtype
    assert qw.group_size == (K if group == -1 else group)
    assert qw.mode == ("const" if symmetric else "zeros")
    got = qw.dequantize()
    assert got.dtype == np.float32 and got.shape == (N, K)
    err = np.abs(got.astype(np.float64) - w.astype(np.float64))
    assert np.all(err <= rounding_bound(qw, w)), err.max()
    assert qw.codes().max() <= 15


@given(N=st.integers(1, 9), K=st.sampled_from((16, 40, 96)),
       dtype=st.sampled_from(("float16", "bfloat16", "float32")), seed=st.integers(0, 2**32 - 1))
def test_int8_dequantize_within_rounding_bound(N, K, dtype, seed):
    w = weight(np.random.default_rng(seed), N, K, dtype)
    qw = lsn.quantize_weight(w, "int8")
    assert qw.group_size == K and qw.bits == 8 and qw.zero_point == 128
    err = np.abs(qw.dequantize().astype(np.float64) - w.astype(np.float64))
    assert np.all(err <= rounding_bound(qw, w)), err.max()


@pytest.mark.parametrize("bits,K", [(4, 32), (4, 72), (8, 16), (8, 40)])
def test_private_layout_round_trip(bits, K, rng):
    q = rng.integers(0, 1 << bits, size=(5, K)).astype(np.uint8)
    packed = pack_codes(q, bits)
    assert packed.dtype == np.uint32
    np.testing.assert_array_equal(unpack_codes(packed, bits, 5, K), q)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@given(N=st.integers(1, 6), blocks=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_gguf_dequantize_bit_exact(name, N, blocks, seed):
    K = 32 * blocks
    data = gguf_blocks(np.random.default_rng(seed), N, K, GT[name])
    expected = gguf_quants.dequantize(data, GT[name])
    for qtype in (GT[name], name, name.lower()):
        got = lsn.QuantizedWeight.from_gguf(data, qtype, (N, K)).dequantize()
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    # any leading slice of rows, and the flat byte stream
    got = lsn.QuantizedWeight.from_gguf(data[:1], name, (1, K)).dequantize()
    np.testing.assert_array_equal(got.view(np.uint32), expected[:1].view(np.uint32))
    got = lsn.QuantizedWeight.from_gguf(data.reshape(-1), name, (N, K)).dequantize()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def gptq_tensors(rng, N, K, group, g=None):
    """Random GPTQ ("v1") tensors and the float32 weight they encode; ``g``: each k's group
    (default ``k // group``; act-order checkpoints permute it)."""
    groups = K // group
    q = rng.integers(0, 16, size=(K, N)).astype(np.uint32)
    z = rng.integers(1, 16, size=(groups, N)).astype(np.uint32)   # the zero points in use
    s = (rng.random((groups, N)) * 0.02 + 0.001).astype(np.float16)
    shifts = (np.arange(8, dtype=np.uint32) * 4)
    qweight = (q.reshape(K // 8, 8, N) << shifts[None, :, None]).sum(axis=1, dtype=np.uint32)
    qzeros = ((z - 1).reshape(groups, N // 8, 8) << shifts).sum(axis=2, dtype=np.uint32)
    g = np.arange(K) // group if g is None else g
    w = (q.astype(np.float32) - z[g].astype(np.float32)) * s[g].astype(np.float32)  # (K, N)
    return qweight.view(np.int32), s, qzeros.view(np.int32), w.T


def awq_tensors(rng, N, K, group):
    """Random AWQ ("GEMM" packing) tensors and the float32 (N, K) weight they encode: value
    ``order[i]`` of each group of 8 columns at bits 4i, zero points stored as they are used."""
    groups = K // group
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    q = rng.integers(0, 16, size=(K, N)).astype(np.uint32)
    z = rng.integers(0, 16, size=(groups, N)).astype(np.uint32)
    s = (rng.random((groups, N)) * 0.02 + 0.001).astype(np.float16)

    def pack(v):
        words = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
        for i, j in enumerate(order):
            words |= v[:, j::8] << np.uint32(4 * i)
        return words.view(np.int32)

    g = np.arange(K) // group
    w = (q.astype(np.float32) - z[g].astype(np.float32)) * s[g].astype(np.float32)  # (K, N)
    return pack(q), pack(z), s, w.T


@pytest.mark.parametrize("group", [32, 128])
def test_awq_dequantize(group, rng):
    qweight, qzeros, scales, w = awq_tensors(rng, 24, 256, group)
    qw = lsn.QuantizedWeight.from_awq(qweight, qzeros, scales, group_size=group)
    assert (qw.format, qw.shape, qw.mode) == ("awq", (24, 256), "zeros")
    np.testing.assert_array_equal(qw.dequantize(), w)


@pytest.mark.parametrize("M", [1, 3, 19])
def test_quant_gemm_awq(M, rng):
    """An AWQ weight on the planned path (M = 1, 3: the decode kernel under the simulator's
    defaults; 19: the Tensor Core kernel)."""
    qweight, qzeros, scales, _ = awq_tensors(rng, 16, 128, 32)
    qw = lsn.QuantizedWeight.from_awq(device(qweight), device(qzeros), device(scales),
                                      group_size=32)
    run(rng, qw, M, "float16", bias_dtype="float16")


def act_order_g_idx(rng, K, group):
    """GPTQ act-order's group assignment: k's rank in a random order, divided by the group."""
    return (np.argsort(rng.permutation(K)) // group).astype(np.int32)


@pytest.mark.parametrize("group", [32, 64])
def test_gptq_act_order_dequantize(group, rng):
    g = act_order_g_idx(rng, 256, group)
    qweight, scales, qzeros, w = gptq_tensors(rng, 16, 256, group, g)
    qw = lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, g, group_size=group)
    assert qw.k_perm is not None
    np.testing.assert_array_equal(qw.dequantize(), w)


@pytest.mark.parametrize("M,dequant_min_m", [(1, None), (3, None), (19, None), (5, 1)])
def test_quant_gemm_gptq_act_order(M, dequant_min_m, rng):
    """x's columns gathered into the stored order before every path (M = 19: the Tensor Core
    kernel; dequantize-then-gemm forced at M = 5), against the weight in its own column order;
    a strided x."""
    g = act_order_g_idx(rng, 128, 32)
    qweight, scales, qzeros, _ = gptq_tensors(rng, 16, 128, 32, g)
    qw = lsn.QuantizedWeight.from_gptq(device(qweight), device(scales), device(qzeros),
                                       device(g), group_size=32)
    knobs = {} if dequant_min_m is None else {"dequant_min_m": dequant_min_m,
                                              "stream_max_m": 0, "decode_max_m": 0}
    with overrides(quant_gemm=knobs):
        run(rng, qw, M, "bfloat16" if M == 3 else "float16", bias_dtype="float32", x_pad=8,
            tensor_core=True if dequant_min_m else None)


def test_from_awq_errors(rng):
    qweight, qzeros, scales, _ = awq_tensors(rng, 16, 128, 64)
    with pytest.raises(ValueError, match=r"scales: expected shape \(4, 16\)"):
        lsn.QuantizedWeight.from_awq(qweight, qzeros, scales, group_size=32)
    with pytest.raises(TypeError, match="qweight: expected dtype int32"):
        lsn.QuantizedWeight.from_awq(qweight.astype(np.int64), qzeros, scales, group_size=64)
    with pytest.raises(ValueError, match=r"qzeros: expected shape \(2, 2\)"):
        lsn.QuantizedWeight.from_awq(qweight, qzeros[:1], scales, group_size=64)


@pytest.mark.parametrize("group", [32, 128])
def test_gptq_dequantize(group, rng):
    qweight, scales, qzeros, w = gptq_tensors(rng, 16, 256, group)
    qw = lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, group_size=group)
    np.testing.assert_array_equal(qw.dequantize(), w)
    trivial = np.arange(256, dtype=np.int32) // group
    qw = lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, trivial, group_size=group)
    np.testing.assert_array_equal(qw.dequantize(), w)


@pytest.mark.parametrize("fmt,group,symmetric,dtype,K", [
    ("int4", 128, True, "bfloat16", 256), ("int4", 32, False, "float16", 96),
    ("int4", -1, True, "float32", 72), ("int4", 64, False, "bfloat16", 128),
    ("int8", -1, True, "bfloat16", 40), ("int8", 128, True, "float16", 256)])
def test_torch_quantization_equals_numpy(fmt, group, symmetric, dtype, K, rng):
    """A torch weight is quantized with torch ops where it lives (on a GPU, seconds for an 8B
    model); the codes, scales and zero points equal the NumPy path's bit for bit, including
    groups whose values are all zero and exact rounding ties."""
    torch = pytest.importorskip("torch")
    w = weight(rng, 24, K, dtype)
    w[3, :] = 0                               # a zero scale
    w[5, :8] = np.asarray([0.5, -0.5, 1.5, -2.5, 7, -7, 3.5, 0.25], dtype=w.dtype)  # ties
    t = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else \
        torch.from_numpy(w)
    if not SIMULATOR:
        t = t.cuda()
    got = lsn.quantize_weight(t, fmt, group_size=group, symmetric=symmetric)
    want = lsn.quantize_weight(w, fmt, group_size=group, symmetric=symmetric)
    assert (got.format, got.shape, got.group_size, got.zero_point, got.mode) == \
        (want.format, want.shape, want.group_size, want.zero_point, want.mode)
    np.testing.assert_array_equal(got.codes(), want.codes())
    np.testing.assert_array_equal(got._values(got.scales), want._values(want.scales))
    if want.zeros is not None:
        np.testing.assert_array_equal(to_host(got.zeros), to_host(want.zeros))
    np.testing.assert_array_equal(got.dequantize(), want.dequantize())


# ---- quant_gemm: the decode kernel ---------------------------------------------------------

@given(st.data())
def test_quant_gemm(data):
    """Every path: on a GPU by M (up to 300: the Tensor Core kernel above 16, dequantize and
    gemm from 128); under the
    simulator the decode kernel at M <= 5, or the Tensor Core kernel forced (M up to 17: two
    tile rows)."""
    fmt = data.draw(st.sampled_from(("int4", "int8")), "format")
    group = data.draw(st.sampled_from((32, 64, 128, -1)), "group_size") if fmt == "int4" else -1
    K = data.draw(st.sampled_from((128, 256)), "K")
    N = data.draw(st.integers(1, 40), "N")
    forced_tc = SIMULATOR and data.draw(st.booleans(), "tensor_core")
    M = data.draw(st.integers(1, 300) if not SIMULATOR else
                  st.sampled_from((1, 2, 3, 5, 17) if forced_tc else (1, 2, 3, 5)), "M")
    dtype = data.draw(st.sampled_from(X_DTYPES), "dtype")
    out_dtype = data.draw(st.sampled_from((None, "float32")), "out_dtype")
    bias_dtype = data.draw(st.sampled_from((None, "float32", dtype)), "bias_dtype")
    activation = data.draw(st.sampled_from((None, "silu", "gelu", "relu")), "activation")
    symmetric = data.draw(st.booleans(), "symmetric")
    splits = data.draw(st.sampled_from((None, 2)), "splits")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
    qw = lsn.quantize_weight(device(weight(rng, N, K, dtype)), fmt, group_size=group,
                             symmetric=symmetric)
    decode_max_m = 0 if forced_tc else DECODE_MAX_M
    with overrides(quant_gemm={"splits": splits, "decode_max_m": decode_max_m,
                               "stream_max_m": 0 if forced_tc else None}):
        run(rng, qw, M, dtype, out_dtype=out_dtype, bias_dtype=bias_dtype,
            activation=activation, tensor_core=M > decode_max_m, x_pad=8)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quant_gemm_gguf(name, rng):
    N, K = 24, 96
    qw = lsn.QuantizedWeight.from_gguf(gguf_blocks(rng, N, K, GT[name]), name, (N, K),
                                       kind="torch")
    run(rng, qw, 3, "float16", out_dtype="float32")


@pytest.mark.parametrize("fmt,K", [("int8", 40), ("int4", 72)])
def test_quant_gemm_k_not_a_whole_chunk(fmt, K, rng):
    """One group a row and K not a multiple of the 16-byte chunk: padded codes, x read as zero
    past K."""
    qw = lsn.quantize_weight(device(weight(rng, 20, K, "bfloat16")), fmt, group_size=-1)
    assert qw.K_padded > K
    run(rng, qw, 2, "bfloat16")


@pytest.mark.parametrize("path", ["stream", "decode", "tensor_core"])
def test_quant_gemm_gptq_strided_out(path, rng):
    """A GPTQ weight (zero points per group) into a column slice of a larger output (element-wise
    stores), on each kernel: only the slice is written."""
    tensor_core = path == "tensor_core"
    qweight, scales, qzeros, _ = gptq_tensors(rng, 16, 128, 64)
    qw = lsn.QuantizedWeight.from_gptq(device(qweight), device(scales), device(qzeros),
                                       group_size=64, kind="torch")
    x = random_array((2, 128), "float16", rng)
    big = poison(_empty((2, 40), "float32"))
    with overrides(quant_gemm={"decode_max_m": 0 if tensor_core else DECODE_MAX_M,
                               "stream_max_m": None if path == "stream" else 0}):
        assert on_stream_kernel(qw, 2) == (path == "stream")
        got = lsn.quant_gemm(device(x), qw, out=big[:, 8:24])
    check(got, x, qw, out_dtype="float32", tensor_core=tensor_core,
          mma=path != "decode" and not SIMULATOR)
    rest = f64(big)[:, np.r_[0:8, 24:40]]
    assert np.isnan(rest).all(), "quant_gemm wrote outside out"


@pytest.mark.parametrize("splits", [3, 11])
def test_decode_split_k_in_one_launch(splits, rng):
    """K split over blocks whose last finisher sums the partials (11 splits: more than one
    round of the unrolled loads, a short last split) and applies bias and activation; called
    twice, so the tickets it draws must be left at zero."""
    qw = lsn.quantize_weight(device(weight(rng, 40, 1408, "bfloat16")), "int4", group_size=64)
    for _ in range(2):
        with overrides(quant_gemm={"splits": splits}):
            run(rng, qw, 3, "bfloat16", bias_dtype="float32", activation="silu")


def test_decode_plan_splits_k_for_few_column_blocks():
    qw = lsn.quantize_weight(np.ones((8, 4096), np.float16), "int4")
    with overrides(device={"sm_count": 132}, quant_gemm={"block_n": 128}):
        _, splits, k_split = decode_plan(qw, 1)
        assert splits > 1 and k_split % 128 == 0 and splits * k_split >= 4096
        _, splits16, _ = decode_plan(qw, 16)
        assert splits16 <= splits   # partial sums capped against the codes' bytes


# ---- quant_gemm: the streaming kernel (4-bit, N a multiple of 16, M <= 16) -----------------

@given(st.data())
def test_quant_gemm_stream(data):
    """The streaming kernel on every 4-bit form (symmetric, zero points, one group a row), K
    split or not (a short last split, stages cut short by K), M on one or two 8-token fragments,
    the epilogue's options; under the simulator its blocks are one consumer warp (16 columns)
    and a 2-stage ring."""
    group = data.draw(st.sampled_from((32, 64, 128, -1)), "group_size")
    chunks = data.draw(st.integers(1, 40), "chunks")
    K = 32 * chunks if group == -1 else max(group, 32 * chunks // group * group)
    N = 16 * data.draw(st.integers(1, 4 if SIMULATOR else 40), "N / 16")
    M = data.draw(st.integers(1, 16), "M")
    dtype = data.draw(st.sampled_from(X_DTYPES), "dtype")
    out_dtype = data.draw(st.sampled_from((None, "float32")), "out_dtype")
    bias_dtype = data.draw(st.sampled_from((None, "float32", dtype)), "bias_dtype")
    activation = data.draw(st.sampled_from((None, "silu", "relu", "silu_and_mul",
                                            "gelu_and_mul")), "activation")
    symmetric = data.draw(st.booleans(), "symmetric")
    splits = data.draw(st.sampled_from((None, 1, 2, 3)), "splits")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
    qw = lsn.quantize_weight(device(weight(rng, N, K, dtype)), "int4", group_size=group,
                             symmetric=symmetric)
    with overrides(quant_gemm={"splits": splits, "stream_max_m": 16}):  # forced (groups of 32)
        assert on_stream_kernel(qw, M)
        run(rng, qw, M, dtype, out_dtype=out_dtype, bias_dtype=bias_dtype,
            activation=activation, x_pad=8)


@pytest.mark.parametrize("name,x_dtype,M", [("Q4_0", "float16", 3), ("Q4_1", "bfloat16", 9),
                                            ("Q4_1", "float16", 1)])
def test_quant_gemm_stream_gguf(name, x_dtype, M, rng):
    """GGUF 4-bit blocks on the streaming kernel (Q4_1: the minimum times each scale unit's sum
    of x), K split in three."""
    N, K = 32, 32 * 24
    qw = lsn.QuantizedWeight.from_gguf(gguf_blocks(rng, N, K, GT[name]), name, (N, K),
                                       kind="torch")
    with overrides(quant_gemm={"splits": 3, "stream_max_m": 16}):
        assert on_stream_kernel(qw, M)
        run(rng, qw, M, x_dtype, out_dtype="float32", bias_dtype="float32")


@pytest.mark.parametrize("K,x_pad", [(36, 0), (64, 3)])
def test_quant_gemm_stream_x_element_loads(K, x_pad, rng):
    """x staged element by element: K not a multiple of 8 (a 16-byte run would cross the row's
    end), or a row stride that is not (runs unaligned); zeros past K either way."""
    qw = lsn.quantize_weight(device(weight(rng, 32, K, "float16")), "int4", group_size=-1)
    with overrides(quant_gemm={"splits": 1}):
        assert on_stream_kernel(qw, 3)
        run(rng, qw, 3, "float16", out_dtype="float32", x_pad=x_pad)


def test_quant_gemm_stream_replays_with_tickets_left_zero(rng):
    """Two calls of a split launch: the last block of each column range resets its ticket."""
    qw = lsn.quantize_weight(device(weight(rng, 32, 512, "bfloat16")), "int4", group_size=64)
    for _ in range(2):
        with overrides(quant_gemm={"splits": 2}):
            run(rng, qw, 5, "bfloat16", activation="silu")


# ---- quant_gemm_rms_norm: the projection with the next norm fused -------------------------

def _padded(host, pad):
    """``host`` on the device as the leading columns of rows ``pad`` elements longer (a row
    stride that is not the width); ``pad`` 0: contiguous."""
    M, N = host.shape
    full = np.zeros((M, N + pad), host.dtype)
    full[:, :N] = host
    return device(full)[:, :N]


@pytest.mark.parametrize("path,fmt,M,N,splits,w_dtype,bias,pad,fused_max", [
    ("stream", "int4", 1, 64, 1, "bfloat16", False, 0, 2),
    ("stream", "int4", 3, 64, 2, "float32", True, 8, 16),     # rows 16-byte aligned, strided
    ("stream", "int4", 9, 48, 3, "bfloat16", False, 3, 16),   # ... not aligned: element-wise
    ("stream", "int4", 3, 64, 2, "bfloat16", False, 0, None),  # the default: 2 calls
    ("decode", "int4", 2, 64, None, "bfloat16", True, 0, 2),
    ("decode", "int8", 1, 40, 2, "float32", False, 0, 2),
    ("decode", "int8", 2, 36, 2, "bfloat16", False, 0, 2),    # N = 36: element-wise
    ("decode", "int4", 3, 64, 1, "bfloat16", False, 8, 16),
    ("tensor_core", "int4", 5, 64, None, "bfloat16", True, 0, 16)])
def test_quant_gemm_rms_norm_equals_the_two_calls(path, fmt, M, N, splits, w_dtype, bias, pad,
                                                  fused_max, rng):
    """``quant_gemm_rms_norm`` against ``quant_gemm`` then ``rms_norm(..., residual=...)`` on
    copies of the same operands: the projection and the updated residual bit for bit, the
    normed rows within the norm scale's last bit (its mean square is summed in another order)
    and against float64. Fused on the streaming and the decode kernels (unsplit, K split: only
    a column's last block goes on to the norm's ticket; several column blocks under the
    simulator, one norms), by 16-byte chunks or element by element (rows not 16-byte aligned,
    N not a multiple of 8), with out / residual / normed of row strides of their own; the two
    calls where M is above ``fused_norm_max_m`` and on the Tensor Core kernel."""
    dtype = "bfloat16"
    K = 256
    qw = lsn.quantize_weight(device(weight(rng, N, K, dtype)), fmt,
                             group_size=64 if fmt == "int4" else -1)
    x = device(random_array((M, K), dtype, rng))
    residual_h = random_array((M, N), dtype, rng)
    norm_w = device(random_array((N,), w_dtype, rng, scale=1.0))
    b = device(random_array((N,), dtype, rng)) if bias else None
    poisoned = poison(np.empty((M, N), numpy_dtype(dtype)))
    with overrides(quant_gemm={"splits": splits, "fused_norm_max_m": fused_max,
                               **PATHS[path]}):
        assert on_stream_kernel(qw, M) == (path == "stream")
        if path != "stream":
            assert on_decode_kernel(qw, M) == (path == "decode")
        for _ in range(2):   # a second call: the tickets were left at 0
            residual, residual2 = _padded(residual_h, pad), device(residual_h.copy())
            h, normed = _padded(poisoned, 2 * pad), _padded(poisoned, pad + 16)
            got = lsn.quant_gemm_rms_norm(x, qw, residual, norm_w, 1e-5, bias=b, out=h,
                                          normed=normed)
            assert got is normed
            h2 = lsn.quant_gemm(x, qw, bias=b)
            normed2 = lsn.rms_norm(h2, norm_w, 1e-5, residual=residual2)
            for a, c in ((h, h2), (residual, residual2)):
                np.testing.assert_array_equal(np.asarray(to_host(a)).view(np.uint16),
                                              np.asarray(to_host(c)).view(np.uint16))
            r64 = f64(to_host(residual))
            expected = (r64 / np.sqrt((r64 ** 2).mean(axis=1, keepdims=True) + 1e-5)
                        * f64(to_host(norm_w)))
            derived_check(f64(to_host(normed)), expected, f64(to_host(normed2)))


def test_quant_gemm_rms_norm_bad_inputs(rng):
    qw = lsn.quantize_weight(device(weight(rng, 32, 128, "float16")), "int4", group_size=64)
    x = device(random_array((2, 128), "float16", rng))
    r = device(random_array((2, 32), "float16", rng))
    w = device(random_array((32,), "float16", rng))
    with pytest.raises(ValueError, match="residual"):
        lsn.quant_gemm_rms_norm(x, qw, device(random_array((2, 16), "float16", rng)), w)
    with pytest.raises(TypeError, match="residual"):
        lsn.quant_gemm_rms_norm(x, qw, device(random_array((2, 32), "bfloat16", rng)), w)
    with pytest.raises(TypeError, match="norm_weight"):
        lsn.quant_gemm_rms_norm(x, qw, r, device(random_array((32,), "bfloat16", rng)))
    with pytest.raises(ValueError, match="norm_weight"):
        lsn.quant_gemm_rms_norm(x, qw, r, device(random_array((16,), "float16", rng)))
    with pytest.raises(ValueError, match="normed"):
        lsn.quant_gemm_rms_norm(x, qw, r, w, normed=r)
    with pytest.raises(ValueError, match="eps"):
        lsn.quant_gemm_rms_norm(x, qw, r, w, -1.0)
    with pytest.raises(TypeError, match="qw"):
        lsn.quant_gemm_rms_norm(x, "not a weight", r, w)


#: How each path is forced at small M (``quant_gemm.TUNING``).
PATHS = {"stream": {"stream_max_m": 16},
         "decode": {"stream_max_m": 0, "decode_max_m": 16},
         "tensor_core": {"stream_max_m": 0, "decode_max_m": 0, "dequant_min_m": 1 << 30},
         "dequant": {"stream_max_m": 0, "decode_max_m": 0, "dequant_min_m": 1}}


@pytest.mark.parametrize("M,K,splits,dtype,w_dtype,activation,pad,scale", [
    (1, 512, 2, "bfloat16", "bfloat16", None, 0, 3.0),     # the model's qkv: M = 1, K split
    (3, 512, 2, "float16", "float32", "silu_and_mul", 8, 3.0),   # 16-byte rows, strided
    (2, 524, 2, "bfloat16", "bfloat16", None, 3, 3.0),     # K % 8, rows unaligned: element-wise
    (8, 128, 1, "float16", "float16", "silu_and_mul", 0, 3.0),
    (2, 256, 1, "bfloat16", "bfloat16", None, 0, 0.03)])   # mean square ~ eps: eps counts
def test_stream_norm_gemm_equals_rms_norm_then_quant_gemm(M, K, splits, dtype, w_dtype,
                                                          activation, pad, scale, rng):
    """``stream_norm_gemm`` (x's rows normed in every block of the streaming kernel) against
    float64 ``rms_norm(x) @ W^T`` taken from ``rms_norm``'s own output (its rounding), split
    and unsplit, gated with a bias, x by 16-byte runs or element by element; a second call
    (nothing left behind); outside ``prologue_norm_fits`` a ValueError."""
    from llmspeed_numba.ops.quant_gemm import prologue_norm_fits, stream_norm_gemm

    N = 32
    qw = lsn.quantize_weight(device(weight(rng, N, K, dtype)), "int4",
                             group_size=-1 if K % 64 else 64)
    x_h = random_array((M, K), dtype, rng, scale=scale)
    x = _padded(x_h, pad)
    norm_w = device(random_array((K,), w_dtype, rng, scale=1.0))
    with overrides(quant_gemm={"splits": splits, **PATHS["stream"]}):
        assert prologue_norm_fits(qw, M) and stream_plan(qw, M)[2] == splits
        normed = to_host(lsn.rms_norm(x, norm_w, 1e-5))
        bias = random_array((N,), "float32", rng) if activation else None
        for _ in range(2):
            got = stream_norm_gemm(x, qw, norm_w, 1e-5, activation=activation,
                                   bias=None if bias is None else device(bias))
            check(to_host(got), normed, qw, out_dtype=dtype, bias=bias, activation=activation,
                  mma=not SIMULATOR)
    with overrides(quant_gemm={"stream_max_m": 0}):
        with pytest.raises(ValueError, match="stream_norm_gemm"):
            stream_norm_gemm(x, qw, norm_w)
    nine = device(random_array((9, K), dtype, rng))       # past PROLOGUE_NORM_MAX_M
    assert not prologue_norm_fits(qw, 9)
    with pytest.raises(ValueError, match="stream_norm_gemm"):
        stream_norm_gemm(nine, qw, norm_w)


@pytest.mark.parametrize("M,K,splits,dtype,bias_dtype,pad", [
    (1, 256, 1, "bfloat16", None, 0), (3, 768, 3, "float16", "float32", 8),
    (5, 524, 2, "bfloat16", "bfloat16", 0)])
def test_stream_add_gemm_equals_the_projection_then_the_add(M, K, splits, dtype, bias_dtype,
                                                           pad, rng):
    """``stream_add_gemm``: ``residual`` afterwards holds, bit for bit, ``quant_gemm``'s result
    (same kernel, same split) added to it in fp32 and rounded, split or not, with a bias, into
    a residual of its own row stride; rows that overlap are refused."""
    from llmspeed_numba.ops.quant_gemm import stream_add_gemm

    N = 48
    qw = lsn.quantize_weight(device(weight(rng, N, K, dtype)), "int4",
                             group_size=-1 if K % 64 else 64)
    x = device(random_array((M, K), dtype, rng))
    bias = None if bias_dtype is None else device(random_array((N,), bias_dtype, rng))
    residual_h = random_array((M, N), dtype, rng)
    with overrides(quant_gemm={"splits": splits, **PATHS["stream"]}):
        projection = np.asarray(to_host(lsn.quant_gemm(x, qw, bias=bias)))
        expected = (projection.astype(np.float32) + residual_h.astype(np.float32)).astype(
            residual_h.dtype)
        residual = _padded(residual_h, pad)
        assert stream_add_gemm(x, qw, residual, bias=bias) is residual
    np.testing.assert_array_equal(np.asarray(to_host(residual)).view(np.uint16),
                                  expected.view(np.uint16))
    with pytest.raises(ValueError, match="residual"):
        stream_add_gemm(x, qw, device(residual_h[:, :N - 1].copy()))
    if M > 1:
        row = device(residual_h[:1].copy())
        broadcast = row.expand(M, N) if hasattr(row, "expand") else np.broadcast_to(row, (M, N))
        with pytest.raises(ValueError, match="overlap"):
            stream_add_gemm(x, qw, broadcast)


@pytest.mark.parametrize("path,fmt,M,K,splits,bias_dtype,out_dtype,activation", [
    ("stream", "int4", 3, 128, 1, "float32", None, "silu_and_mul"),
    ("stream", "int4", 9, 512, 2, None, "float32", "gelu_and_mul"),
    ("decode", "int8", 2, 128, None, "bfloat16", None, "silu_and_mul"),
    ("tensor_core", "int4", 5, 128, None, None, None, "silu_and_mul"),
    ("tensor_core", "int8", 5, 128, 2, "float32", None, "gelu_and_mul"),
    ("dequant", "int4", 4, 128, None, "float32", "float32", "silu_and_mul")])
def test_quant_gemm_gated(path, fmt, M, K, splits, bias_dtype, out_dtype, activation, rng):
    """``activation="silu_and_mul"`` / ``"gelu_and_mul"`` on a weight quantized from gate and up
    interleaved (``interleave_gate_up``): on every path, fused (the streaming kernel, unsplit and
    split; dequantize-then-gemm) or through fp32 sums and gemm's reduce (decode, Tensor Core)."""
    dtype = "bfloat16"
    N = 32
    w = interleave_gate_up(weight(rng, N // 2, K, dtype), weight(rng, N // 2, K, dtype))
    qw = lsn.quantize_weight(device(w), fmt, group_size=64 if fmt == "int4" else -1)
    with overrides(quant_gemm={"splits": splits, **PATHS[path]}):
        assert on_stream_kernel(qw, M) == (path == "stream")
        if path == "stream":
            assert stream_plan(qw, M)[2] == splits
        run(rng, qw, M, dtype, out_dtype=out_dtype, bias_dtype=bias_dtype,
            activation=activation, tensor_core=path in ("tensor_core", "dequant"))


def _decode_chain(x, norm_w, gate_up, down):
    """A decode layer's MLP at M rows: rms_norm, the gate/up projection (streaming kernel, K
    split), silu_and_mul, the down projection; every intermediate returned."""
    h = lsn.rms_norm(x, norm_w)
    gu = lsn.quant_gemm(h, gate_up)
    a = lsn.silu_and_mul(gu)
    return h, gu, a, lsn.quant_gemm(a, down)


@pytest.mark.parametrize("M", [5] if SIMULATOR else [1, 5, 16])
def test_programmatic_variants_compute_the_same(M, rng):
    """``launch.programmatic``: the streaming kernel waits for the previous grid after issuing
    its first weight stages, rms_norm and silu_and_mul release the next launch first. Each
    intermediate equals the plain variants' bit for bit, over repeated chains on fresh x (on a
    GPU a read before the wait would see the previous chain's values; the simulator runs one
    chain: its griddepcontrol twins do nothing, it checks the variants' code)."""
    K, I = 256, 128
    dtype = "bfloat16"
    gate_up = lsn.quantize_weight(device(weight(rng, 2 * I, K, dtype)), "int4", group_size=64)
    down = lsn.quantize_weight(device(weight(rng, K, I, dtype)), "int4", group_size=64)
    norm_w = device(random_array((K,), dtype, rng))
    xs = [device(random_array((M, K), dtype, rng)) for _ in range(1 if SIMULATOR else 20)]
    results = {}
    for programmatic in (False, True):
        with overrides(quant_gemm={"splits": 2}, launch={"programmatic": programmatic}):
            assert on_stream_kernel(gate_up, M) and on_stream_kernel(down, M)
            results[programmatic] = [[to_host(r) for r in _decode_chain(x, norm_w, gate_up, down)]
                                     for x in xs]
    for plain, chained in zip(results[False], results[True]):
        for a, b in zip(plain, chained):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_stream_plan():
    """The split of K: whole stages, the most blocks that run at once (resident blocks counted
    by shared memory too), x's staged bytes and the block's shared memory bounded, and only
    4-bit weights with N a multiple of 16 (others take the decode / Tensor Core kernels)."""
    from llmspeed_numba._launch import blocks_by_shared_memory
    from llmspeed_numba.ops import _quant_stream as qs
    from llmspeed_numba.ops.quant_gemm import STREAM_X_BYTES

    qw = lsn.quantize_weight(np.ones((4096, 4096), np.float16), "int4")
    tall = lsn.quantize_weight(np.ones((1792, 4096), np.float16), "int4")
    knobs = {"stream_warps": 8, "stream_stages": 4, "stream_blocks_per_sm": 3}
    with overrides(device={"sm_count": 132}, quant_gemm=knobs):
        for M in (1, 16):
            m_block, group_chunks, splits, kspan = stream_plan(qw, M)
            assert group_chunks == 4 and kspan % qs.STAGE_CHUNKS == 0
            assert splits * kspan >= 4096 // 32 and splits > 1
            assert m_block * kspan * 32 * 2 <= STREAM_X_BYTES * (2 if M > 8 else 1)
            assert qs.shared_bytes(8, 4, m_block, kspan, group_chunks, qw.mode,
                                   qw.scale_dtype) <= 232448 - 1024
    wide = lsn.quantize_weight(np.ones((3584, 4096), np.float16), "int4")
    with overrides(device={"sm_count": 16}, quant_gemm=knobs):
        # 14 column blocks on 48 block slots: 3 splits (one wave of 6 stages), not 4 (a
        # second wave of 8 blocks, 4 stages each)
        assert stream_plan(tall, 1)[2:] == (3, 48)
        # 28 column blocks: unsplit, a block's x and ring fit two an SM, so all 28 run at once;
        # 2 or 3 splits would take two waves (as at 28672 x 4096 on the H200, where 1 split
        # measured fastest)
        m_block, group_chunks, splits, kspan = stream_plan(wide, 1)
        assert splits == 1
        assert blocks_by_shared_memory(qs.shared_bytes(8, 4, m_block, kspan, group_chunks,
                                                       wide.mode, wide.scale_dtype) + 1024) == 2
    # affine weights (GGUF Q4_1) take too many registers for 3 blocks an SM: with a ring short
    # enough for 3 by shared memory, one wave is still 2 an SM, 32 blocks here (4 splits of 8
    # column blocks, where 3 an SM would take 6)
    q4_1 = lsn.QuantizedWeight.from_gguf(gguf_blocks(np.random.default_rng(0), 1024, 4096,
                                                     GT.Q4_1), GT.Q4_1, (1024, 4096))
    with overrides(device={"sm_count": 16}, quant_gemm={**knobs, "stream_stages": 2}):
        assert q4_1.mode == "affine" and on_stream_kernel(q4_1, 4)
        assert stream_plan(q4_1, 4)[2] == 4
    assert not on_stream_kernel(lsn.quantize_weight(np.ones((24, 128), np.float16), "int4"), 1)
    assert not on_stream_kernel(lsn.quantize_weight(np.ones((32, 128), np.float16), "int8"), 1)
    assert not on_stream_kernel(qw, 17)
    g32 = lsn.quantize_weight(np.ones((32, 128), np.float16), "int4", group_size=32)
    assert [on_stream_kernel(g32, M) for M in (1, 3, 4, 8, 9)] == [False, False, True, True, False]


# ---- quant_gemm: the Tensor Core kernel (M > DECODE_MAX_M; forced at small M) ---------------

def _tensor_core(**knobs):
    """The Tensor Core kernel at every M (under the simulator: its 16 x 16 x 32 tile)."""
    return overrides(quant_gemm={"decode_max_m": 0, "stream_max_m": 0,
                                 "dequant_min_m": 1 << 30, **knobs})


@pytest.mark.parametrize("fmt,dtype,group,symmetric,K", [
    ("int4", "float16", 32, False, 96), ("int4", "bfloat16", 128, True, 256),
    ("int4", "bfloat16", -1, False, 72), ("int8", "float16", -1, True, 40),
    ("int4", "float16", -1, True, 70), ("int8", "bfloat16", -1, True, 44)])
def test_quant_gemm_dequant_then_gemm(fmt, dtype, group, symmetric, K, rng):
    """The large-M path (forced at small M): the weight dequantized to x's dtype, then gemm with
    bias and activation; K not a whole chunk (72, 40), a strided x; K not a multiple of 8 (70,
    44): the dequantization's element-wise form instead of its 16-byte stores."""
    qw = lsn.quantize_weight(device(weight(rng, 21, K, dtype)), fmt, group_size=group,
                             symmetric=symmetric)
    with overrides(quant_gemm={"dequant_min_m": 1, "stream_max_m": 0, "decode_max_m": 0}):
        run(rng, qw, 5, dtype, bias_dtype="float32", activation="silu", tensor_core=True,
            x_pad=8)


@pytest.mark.parametrize("name,x_dtype", [("Q4_1", "bfloat16"), ("Q8_0", "float16")])
def test_quant_gemm_dequant_then_gemm_gguf(name, x_dtype, rng):
    """GGUF blocks on the large-M path: Q4_1's minimums (affine), Q8_0's int8 codes."""
    qw = lsn.QuantizedWeight.from_gguf(gguf_blocks(rng, 16, 64, GT[name]), name, (16, 64),
                                       kind="torch")
    with overrides(quant_gemm={"dequant_min_m": 1, "stream_max_m": 0, "decode_max_m": 0}):
        run(rng, qw, 3, x_dtype, out_dtype="float32", tensor_core=True)


@pytest.mark.parametrize("fmt,dtype,group,symmetric", [
    ("int4", "float16", 32, False), ("int4", "bfloat16", 64, True),
    ("int4", "float16", 128, True), ("int4", "bfloat16", -1, False),
    ("int8", "bfloat16", -1, True), ("int8", "float16", -1, True)])
def test_quant_gemm_tensor_core(fmt, dtype, group, symmetric, rng):
    """Each int4 group size, symmetric or with zero points, and int8, with bias and activation;
    M and N not multiples of the tile, three K tiles (two stages: the ring wraps)."""
    M = 19 if SIMULATOR else DECODE_MAX_M + 3
    qw = lsn.quantize_weight(device(weight(rng, 21, 128, dtype)), fmt, group_size=group,
                             symmetric=symmetric)
    with _tensor_core():
        run(rng, qw, M, dtype, bias_dtype="float32", activation="silu", tensor_core=True,
            x_pad=8)


@pytest.mark.parametrize("name,x_dtype", [("Q4_0", "float16"), ("Q4_1", "bfloat16"),
                                          ("Q8_0", "float16")])
def test_quant_gemm_tensor_core_gguf(name, x_dtype, rng):
    """GGUF blocks (fp16 scales; Q4_1 affine) with fp16 and bf16 x."""
    qw = lsn.QuantizedWeight.from_gguf(gguf_blocks(rng, 16, 64, GT[name]), name, (16, 64),
                                       kind="torch")
    with _tensor_core():
        run(rng, qw, 5, x_dtype, out_dtype="float32", tensor_core=True)


@pytest.mark.parametrize("fmt,K", [("int8", 40), ("int4", 72)])
def test_quant_gemm_tensor_core_k_not_a_whole_chunk(fmt, K, rng):
    """K_padded > K: padded codes and x zero-filled past K; a row stride of K + 3 (x not 16-byte
    aligned: the predicated scalar copies)."""
    qw = lsn.quantize_weight(device(weight(rng, 9, K, "bfloat16")), fmt, group_size=-1)
    with _tensor_core():
        run(rng, qw, 3, "bfloat16", tensor_core=True, x_pad=3)


@pytest.mark.parametrize("splits", [2, 3])
def test_quant_gemm_tensor_core_split_k(splits, rng):
    """Split K (fp32 partial sums, gemm's reduce applies bias and activation); 3 splits of 4
    K tiles leave a short last split."""
    qw = lsn.quantize_weight(device(weight(rng, 12, 128, "float16")), "int4", group_size=32,
                             symmetric=False)
    with _tensor_core(splits=splits):
        run(rng, qw, 4, "float16", bias_dtype="float16", activation="gelu", tensor_core=True)


def test_tc_plan_splits_k_for_few_tiles():
    qw = lsn.quantize_weight(np.ones((256, 4096), np.float16), "int4")
    with overrides(device={"sm_count": 132}, quant_gemm={"tc_tile": None}):
        tile, splits, k_split = tc_plan(qw, 64)
        assert tile[0] == 64 and splits > 1 and k_split % tile[2] == 0
        assert splits * k_split >= 4096 > (splits - 1) * k_split
        big = lsn.quantize_weight(np.ones((4096, 256), np.float16), "int4")
        assert tc_plan(big, 300)[1] == 1   # K too short to split


def test_check_rejects_a_wrong_zero_point(rng):
    """The derived check catches a kernel that used zero point 7 instead of 8."""
    w = weight(rng, 16, 128, "float16")
    qw = lsn.quantize_weight(w, "int4", group_size=32)
    x = random_array((2, 128), "float16", rng)
    s = qw._values(qw.scales).T[:, np.arange(128) // 32]
    wrong = (qw.codes().astype(np.float64) - 7) * s
    with pytest.raises(AssertionError):
        check(x.astype(np.float64) @ wrong.T, x, qw, out_dtype="float32")


# ---- errors ----------------------------------------------------------------------------------

def test_quantize_weight_errors():
    w = np.ones((4, 64), np.float16)
    with pytest.raises(ValueError, match="format: expected one of"):
        lsn.quantize_weight(w, "int3")
    with pytest.raises(ValueError, match="group_size: expected K .* multiple"):
        lsn.quantize_weight(np.ones((4, 96), np.float16), "int4", group_size=64)
    with pytest.raises(ValueError, match="group_size: expected one of"):
        lsn.quantize_weight(w, "int4", group_size=48)
    with pytest.raises(TypeError, match="group_size: expected an int"):
        lsn.quantize_weight(w, "int4", group_size=32.0)
    with pytest.raises(TypeError, match="w: expected dtype"):
        lsn.quantize_weight(np.ones((4, 64), np.int32), "int8")
    with pytest.raises(ValueError, match="w: expected 2 dimensions"):
        lsn.quantize_weight(np.ones(64, np.float16), "int8")
    with pytest.raises(TypeError, match="w: expected a NumPy array"):
        lsn.quantize_weight([[1.0]], "int8")
    with pytest.raises(TypeError, match="symmetric: expected a bool"):
        lsn.quantize_weight(w, "int4", symmetric=1)
    with pytest.raises(ValueError, match="kind: expected one of"):
        lsn.quantize_weight(w, "int4", kind="jax")


def test_from_gguf_errors(rng):
    data = gguf_blocks(rng, 2, 64, GT.Q4_0)
    with pytest.raises(ValueError, match=r"ggml_type: expected one of \('Q4_0'"):
        lsn.QuantizedWeight.from_gguf(data, GT.Q6_K, (2, 64))
    with pytest.raises(ValueError, match="ggml_type"):
        lsn.QuantizedWeight.from_gguf(data, 3.5, (2, 64))
    with pytest.raises(ValueError, match="data: expected 108 bytes"):
        lsn.QuantizedWeight.from_gguf(data, "Q4_0", (3, 64))
    with pytest.raises(ValueError, match="shape: expected K a multiple of the GGUF block"):
        lsn.QuantizedWeight.from_gguf(data, "Q4_0", (2, 48))
    with pytest.raises(TypeError, match="data: expected dtype uint8"):
        lsn.QuantizedWeight.from_gguf(data.view(np.int8), "Q4_0", (2, 64))
    with pytest.raises(TypeError, match="shape: expected"):
        lsn.QuantizedWeight.from_gguf(data, "Q4_0", 64)


def test_from_gptq_errors(rng):
    qweight, scales, qzeros, _ = gptq_tensors(rng, 16, 128, 64)
    with pytest.raises(ValueError, match="scales: expected shape"):
        lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, group_size=32)
    with pytest.raises(TypeError, match="qweight: expected dtype int32"):
        lsn.QuantizedWeight.from_gptq(qweight.astype(np.int64), scales, qzeros, group_size=64)
    uneven = np.r_[np.zeros(70), np.ones(58)].astype(np.int32)
    with pytest.raises(ValueError, match="g_idx: expected each of the 2 groups"):
        lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, uneven, group_size=64)
    with pytest.raises(ValueError, match="g_idx: expected each of the 2 groups"):
        lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, np.arange(128) // 32,
                                      group_size=64)
    with pytest.raises(ValueError, match=r"g_idx: expected shape \(128,\)"):
        lsn.QuantizedWeight.from_gptq(qweight, scales, qzeros, np.zeros(64, np.int32),
                                      group_size=64)


def test_quant_gemm_errors(rng):
    qw = lsn.quantize_weight(device(weight(rng, 8, 64, "float16")), "int4", group_size=32)
    x = device(random_array((2, 64), "float16", rng))
    with pytest.raises(TypeError, match="qw: expected a QuantizedWeight"):
        lsn.quant_gemm(x, np.ones((8, 64), np.float16))
    with pytest.raises(ValueError, match=r"x: expected shape \(\*, 64\) to match qw's K"):
        lsn.quant_gemm(device(random_array((2, 32), "float16", rng)), qw)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        lsn.quant_gemm(device(random_array((2, 64), "float32", rng)), qw)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        lsn.quant_gemm(device(random_array((64,), "float16", rng)), qw)
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\)"):
        lsn.quant_gemm(x, qw, bias=device(random_array((4,), "float16", rng)))
    with pytest.raises(ValueError, match="activation: expected one of"):
        lsn.quant_gemm(x, qw, activation="swish")
    with pytest.raises(ValueError, match="activation: 'silu_and_mul' needs qw's N .* a "
                                         "multiple of 16, got N = 8"):
        lsn.quant_gemm(x, qw, activation="silu_and_mul")
    qw16 = lsn.quantize_weight(device(weight(rng, 16, 64, "float16")), "int4", group_size=32)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\)"):   # gated: N / 2
        lsn.quant_gemm(x, qw16, activation="gelu_and_mul", out=_empty((2, 16), "float16"))
    with pytest.raises(TypeError, match="out_dtype: expected one of"):
        lsn.quant_gemm(x, qw, out_dtype="int8")
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        lsn.quant_gemm(x, qw, out=_empty((2, 8), "float32"), out_dtype="float16")
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\)"):
        lsn.quant_gemm(x, qw, out=_empty((2, 9), "float16"))


# ---- GPU only: the sizes, torch in / torch out, repeated calls -----------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16, 17, 64, 300])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("int8", -1)])
def test_quant_gemm_gpu_sizes(M, fmt, group, rng):
    N, K = 1024, 4096
    qw = lsn.quantize_weight(device(weight(rng, N, K, "bfloat16", scale=0.02)), fmt,
                             group_size=group, symmetric=fmt == "int8" or group == 128)
    run(rng, qw, M, "bfloat16", bias_dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [17, 31, 64, 100, 256, 300])
@pytest.mark.parametrize("fmt,group,symmetric", [("int4", 128, True), ("int4", 32, False),
                                                 ("int8", -1, True)])
def test_quant_gemm_gpu_tensor_core_4096(M, fmt, group, symmetric, rng):
    """The Tensor Core kernel at the issue's N x K = 4096 x 4096, M from 17 to 300 (every tile
    size, split K at the smaller M), and at M >= 128 the planned path (dequantize, then gemm)."""
    qw = lsn.quantize_weight(device(weight(rng, 4096, 4096, "bfloat16", scale=0.02)), fmt,
                             group_size=group, symmetric=symmetric)
    with overrides(quant_gemm={"dequant_min_m": 1 << 30}):
        run(rng, qw, M, "bfloat16", bias_dtype="bfloat16", activation="silu", tensor_core=True)
    if M >= 128:
        run(rng, qw, M, "bfloat16", bias_dtype="bfloat16", activation="silu", tensor_core=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16, 17, 300])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int8", -1)])
def test_quant_gemm_gpu_gated(M, fmt, group, rng):
    """The gated MLP projection at a model's size (gate / up 2 x 1024 rows interleaved, K 4096)
    on each path M picks: int4 streams at M <= 16 (split K at M = 1), the decode kernel (int8,
    M <= 2) and the Tensor Core kernel pair through the reduce, dequantize-then-gemm at 300."""
    w = interleave_gate_up(weight(rng, 1024, 4096, "bfloat16", scale=0.02),
                           weight(rng, 1024, 4096, "bfloat16", scale=0.02))
    qw = lsn.quantize_weight(device(w), fmt, group_size=group)
    run(rng, qw, M, "bfloat16", bias_dtype="bfloat16", activation="silu_and_mul")


@pytest.mark.gpu
def test_quant_gemm_gpu_replay_and_kinds(rng):
    """Torch in, torch out; a second call with the same signature (the replay path) gives the
    same bits; numba device arrays work as well."""
    import torch
    from numba import cuda

    qw = lsn.quantize_weight(device(weight(rng, 512, 1024, "float16")), "int4")
    x = device(random_array((4, 1024), "float16", rng))
    first = lsn.quant_gemm(x, qw)
    assert isinstance(first, torch.Tensor) and first.dtype == torch.float16
    again = lsn.quant_gemm(x, qw)
    assert torch.equal(first, again)
    qn = lsn.quantize_weight(weight(rng, 64, 256, "float16"), "int8", kind="numba")
    xn = cuda.to_device(random_array((2, 256), "float16", rng).view(np.uint16)).view(np.float16)
    got = lsn.quant_gemm(xn, qn, out_dtype="float32")
    check(got, xn.view(np.uint16).copy_to_host().view(np.float16), qn, out_dtype="float32")
