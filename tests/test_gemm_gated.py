"""The gated gemm (``activation="silu_and_mul"`` / ``"gelu_and_mul"``) against a float64 reference
of ``act(x @ W_gate + b_gate) * (x @ W_up + b_up)`` from the separate weights; the interleaved
operand's helpers; every documented error.

Under the simulator the kernels run with the small tile configurations (mma.sync, wgmma, split-K
and SIMT, whose gated epilogue is the reduce kernel's); the GPU suite (``-m gpu``) runs the
heuristic's real tiles at MLP shapes. Tolerances are derived from ``gated_gemm_plain`` (each
product accumulated in fp32 as the kernels do, the epilogue in fp32, one rounding).
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_gemm import SIM_SIMT, SIM_TC, SIM_WG, _empty, on_tensor_cores, place

from llmspeed_numba import SIMULATOR, deinterleave_gate_up, interleave_gate_up
from llmspeed_numba._arrays import numpy_dtype
from llmspeed_numba.ops.gemm import gemm
from llmspeed_numba.reference.gemm import gated_gemm_plain, gated_gemm_reference
from llmspeed_numba.testing import derived_check, f64, poison, random_array

GATED = ("silu_and_mul", "gelu_and_mul")


# ---- helpers -------------------------------------------------------------------------------

def gated_weights(rng, K, I, dtype, bias_dtype=None):
    """Separate gate and up weights in a Linear layer's layout (I, K), and biases (I,)."""
    w_gate = random_array((I, K), dtype, rng)
    w_up = random_array((I, K), dtype, rng)
    if bias_dtype is None:
        return w_gate, w_up, None, None
    return w_gate, w_up, random_array((I,), bias_dtype, rng), random_array((I,), bias_dtype, rng)


def check_gated(got, x, w_gate, w_up, *, out_dtype, activation, alpha=1.0, bias_gate=None,
                bias_up=None, mma=False):
    """Derived-tolerance check of ``got`` (M, I) against the float64 reference (host weights in
    the Linear layout (I, K))."""
    kw = dict(alpha=alpha, bias_gate=bias_gate, bias_up=bias_up, activation=activation)
    reference = gated_gemm_reference(x, w_gate.T, w_up.T, **kw)
    plain = gated_gemm_plain(x, w_gate.T, w_up.T, out_dtype=numpy_dtype(out_dtype), mma=mma, **kw)
    derived_check(f64(got), reference, np.asarray(plain, np.float64))


def gated_operands(rng, M, K, I, dtype, layout, bias_dtype):
    """Host inputs and the device operands of the gated call: ``layout`` "NT" passes the
    interleaved (2 I, K) weight transposed (the model's layout), "NN" a row-major (K, 2 I) one
    interleaved along dim 1."""
    x = random_array((M, K), dtype, rng)
    w_gate, w_up, b_gate, b_up = gated_weights(rng, K, I, dtype, bias_dtype)
    if layout == "NT":
        b = place(interleave_gate_up(w_gate, w_up).T, True)
    else:
        b = place(interleave_gate_up(w_gate.T, w_up.T, dim=1), False)
    bias = None if b_gate is None else place(interleave_gate_up(b_gate, b_up), False)
    return (x, w_gate, w_up, b_gate, b_up), (place(x, False), b, bias)


def run_gated(M, K, I, dtype, config, rng, *, activation="silu_and_mul", out_dtype=None,
              bias_dtype=None, alpha=1.0, layout="NT"):
    host, (x, b, bias) = gated_operands(rng, M, K, I, dtype, layout, bias_dtype)
    out_dtype = out_dtype or dtype
    out = poison(_empty((M, I), out_dtype))
    got = gemm(x, b, bias=bias, alpha=alpha, activation=activation, out=out,
               out_dtype=out_dtype, config=config)
    assert got is out
    x_h, w_gate, w_up, b_gate, b_up = host
    check_gated(got, x_h, w_gate, w_up, out_dtype=out_dtype, activation=activation, alpha=alpha,
                bias_gate=b_gate, bias_up=b_up, mma=on_tensor_cores(config, dtype))
    return got


# ---- the interleaved operand ---------------------------------------------------------------

def test_interleave_layout_and_round_trip(rng):
    """Blocks of 8: b's columns 16 i .. 16 i + 7 are gate features 8 i .., the next 8 up
    features 8 i ..; deinterleave_gate_up undoes it, along either dimension and for biases."""
    I, K = 24, 5
    w_gate = random_array((I, K), "float16", rng)
    w_up = random_array((I, K), "float16", rng)
    w = interleave_gate_up(w_gate, w_up)
    assert w.shape == (2 * I, K) and w.flags.c_contiguous
    for i in range(I // 8):
        np.testing.assert_array_equal(w[16 * i:16 * i + 8], w_gate[8 * i:8 * i + 8])
        np.testing.assert_array_equal(w[16 * i + 8:16 * i + 16], w_up[8 * i:8 * i + 8])
    for got, want in zip(deinterleave_gate_up(w), (w_gate, w_up)):
        np.testing.assert_array_equal(got, want)
    w_t = interleave_gate_up(w_gate.T, w_up.T, dim=-1)
    np.testing.assert_array_equal(w_t, w.T)
    for got, want in zip(deinterleave_gate_up(w_t, dim=1), (w_gate.T, w_up.T)):
        np.testing.assert_array_equal(got, want)
    b_gate, b_up = w_gate[:, 0].copy(), w_up[:, 0].copy()
    np.testing.assert_array_equal(interleave_gate_up(b_gate, b_up), w[:, 0])
    gate, _ = deinterleave_gate_up(w[:16])   # one block: a copy all the same, not a view
    gate[...] = 0
    np.testing.assert_array_equal(w[:8], w_gate[:8])


def test_interleave_torch_bf16(rng):
    torch = pytest.importorskip("torch")
    w_gate = torch.randn(16, 3, dtype=torch.bfloat16)
    w_up = torch.randn(16, 3, dtype=torch.bfloat16)
    w = interleave_gate_up(w_gate, w_up)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous()
    assert torch.equal(w[8:16], w_up[:8]) and torch.equal(w[16:24], w_gate[8:])
    gate, up = deinterleave_gate_up(w)
    assert torch.equal(gate, w_gate) and torch.equal(up, w_up)


def test_interleave_errors(rng):
    w = random_array((16, 4), "float16", rng)
    with pytest.raises(TypeError, match="w_gate: expected a NumPy array"):
        interleave_gate_up([[1.0]], w)
    with pytest.raises(TypeError, match="w_up: expected a ndarray"):
        interleave_gate_up(w, w.tolist())
    with pytest.raises(ValueError, match=r"w_up: expected shape \(16, 4\)"):
        interleave_gate_up(w, w[:8])
    with pytest.raises(TypeError, match="w_up: expected dtype float16"):
        interleave_gate_up(w, w.astype(np.float32))
    with pytest.raises(ValueError, match="w_gate: expected dimension 1 .* multiple of 8"):
        interleave_gate_up(w, w, dim=1)
    with pytest.raises(ValueError, match="w_gate: expected 1 or 2 dimensions"):
        interleave_gate_up(w[None], w[None])
    with pytest.raises(ValueError, match="dim: expected a dimension"):
        interleave_gate_up(w, w, dim=2)
    with pytest.raises(TypeError, match="dim: expected an int"):
        interleave_gate_up(w, w, dim=0.0)
    with pytest.raises(ValueError, match="w_gate_up: expected dimension 0 .* multiple of 16"):
        deinterleave_gate_up(w[:8])


# ---- named cases (simulator: small tiles) ---------------------------------------------------

@pytest.mark.parametrize("M,K,I", [(1, 16, 8), (7, 33, 16), (17, 40, 24), (16, 16, 8)],
                         ids=str)
def test_gated_tensor_core(M, K, I, rng):
    """M = 1, odd M and K (K = 33: no 16-byte copies of a), edge tiles along M and N."""
    run_gated(M, K, I, "float16", SIM_TC, rng, out_dtype="float32")


@pytest.mark.parametrize("layout", ["NT", "NN"])
@pytest.mark.parametrize("activation", GATED)
def test_gated_layouts_bias(layout, activation, rng):
    run_gated(19, 40, 16, "bfloat16", SIM_TC, rng, activation=activation, bias_dtype="bfloat16",
              layout=layout, alpha=0.75)


def test_gated_two_warps(rng):
    """Two warps, three stages, a 32 x 32 block: a warp tile of 16 x 32 (two gate/up pairs)."""
    run_gated(40, 72, 32, "float16", "tc_32x32x16_w2x1_s3", rng, activation="gelu_and_mul",
              bias_dtype="float32", out_dtype="bfloat16")


def test_gated_wgmma(rng):
    """The wgmma kernel's staging: edges along M and N (N = 80 = 64 + 16), three K tiles."""
    run_gated(72, 136, 40, "bfloat16", SIM_WG, rng, bias_dtype="float16")


@pytest.mark.parametrize("M,K,I,config,dtype,bias_dtype,activation", [
    (1, 72, 16, "gemv_1x4_w4_u2", "float16", "float32", "silu_and_mul"),
    (2, 560, 24, {"backend": "tensor_core", "block_m": 2, "block_n": 4, "block_k": 8,
                  "warps_n": 1, "stages": 2, "gemv": True}, "bfloat16", None, "gelu_and_mul")])
def test_gated_gemv(M, K, I, config, dtype, bias_dtype, activation, rng):
    """The few-row kernel reads each output's gate row and up row (8 further) of W: two outputs
    a block of 4 columns; K = 560 gives one warp's lanes a full and a partial unrolled step."""
    run_gated(M, K, I, dtype, config, rng, activation=activation, bias_dtype=bias_dtype)


@pytest.mark.parametrize("config, K", [(SIM_TC + "_k3", 48), (SIM_WG + "_k2", 136)])
def test_gated_split_k(config, K, rng):
    """Split K (three and two splits of whole K tiles): the last block of each tile adds the
    partial sums and runs the gated epilogue, in the same launch."""
    run_gated(9, 150, K, "float16", config, rng, activation="gelu_and_mul",
              bias_dtype="float32", alpha=-1.5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gated_simt(dtype, rng):
    """SIMT: fp32 partial sums, the gated epilogue in the reduce kernel (gemm_gated)."""
    run_gated(13, 19, 16, dtype, SIM_SIMT, rng, bias_dtype=dtype, layout="NN")


def test_gated_default_config_and_bitwise_repeat(rng):
    """The heuristic's choice; two runs of the same call give the same bits."""
    host, (x, b, bias) = gated_operands(rng, 5, 24, 16, "bfloat16", "NT", "bfloat16")
    runs = [f64(gemm(x, b, bias=bias, activation="silu_and_mul")) for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])
    check_gated(runs[0], host[0], host[1], host[2], out_dtype="bfloat16",
                activation="silu_and_mul", bias_gate=host[3], bias_up=host[4],
                mma=on_tensor_cores(None, "bfloat16"))


def test_gated_strided_output(rng):
    """out a transposed view (column stride != 1): the element-by-element store path."""
    host, (x, b, _) = gated_operands(rng, 9, 16, 16, "float16", "NT", None)
    out = place(np.zeros((16, 9), np.float32), False).T
    gemm(x, b, activation="silu_and_mul", out=out, config=SIM_TC)
    check_gated(out, host[0], host[1], host[2], out_dtype="float32", activation="silu_and_mul")


def test_gated_k_zero(rng):
    """K = 0: out = act(bias_gate) * bias_up (zeros without a bias)."""
    M, I = 3, 8
    b_gate = random_array((I,), "float32", rng)
    b_up = random_array((I,), "float32", rng)
    x = place(np.zeros((M, 0), np.float16), False)
    b = place(np.zeros((0, 2 * I), np.float16), False)
    got = gemm(x, b, bias=place(interleave_gate_up(b_gate, b_up), False),
               activation="silu_and_mul", out_dtype="float32")
    silu = b_gate.astype(np.float64) / (1 + np.exp(-b_gate.astype(np.float64)))
    np.testing.assert_allclose(f64(got), np.broadcast_to(silu * b_up, (M, I)), rtol=1e-6)
    assert np.all(f64(gemm(x, b, activation="gelu_and_mul")) == 0.0)


@pytest.mark.parametrize("M,I", [(0, 8), (4, 0)])
def test_gated_empty(M, I, rng):
    x = place(random_array((M, 8), "float16", rng), False)
    b = place(random_array((8, 2 * I), "float16", rng), False)
    assert tuple(gemm(x, b, activation="silu_and_mul").shape) == (M, I)


# ---- hypothesis ----------------------------------------------------------------------------

_CONFIGS = (SIM_TC, SIM_TC + "_k2", SIM_WG, SIM_SIMT) if SIMULATOR else (None,)


# On the GPU each new (dtypes, activation, bias, layout) is a kernel compile of seconds: examples
# draw it from this fixed list, which holds every value of each; shapes, alpha and the seed stay
# free. (dtype, activation, out_dtype, bias_dtype, layout)
_GPU_EPILOGUES = (("bfloat16", "silu_and_mul", None, None, "NT"),
                  ("float16", "gelu_and_mul", "float32", "float16", "NN"),
                  ("bfloat16", "gelu_and_mul", None, "float32", "NT"),
                  ("float16", "silu_and_mul", None, "float16", "NT"))


@st.composite
def gated_problems(draw):
    size = 24 if SIMULATOR else 300
    if SIMULATOR:
        dtype = draw(st.sampled_from(["float16", "bfloat16"]))
        epilogue = (dtype, draw(st.sampled_from(GATED)),
                    draw(st.sampled_from([None, "float32"])),
                    draw(st.sampled_from([None, dtype, "float32"])),
                    draw(st.sampled_from(["NT", "NN"])))
    else:
        epilogue = draw(st.sampled_from(_GPU_EPILOGUES))
    dtype, activation, out_dtype, bias_dtype, layout = epilogue
    return dict(M=draw(st.integers(1, size)), K=draw(st.integers(1, 2 * size)),
                I=8 * draw(st.integers(1, 3 if SIMULATOR else 40)), dtype=dtype,
                config=draw(st.sampled_from(_CONFIGS)), activation=activation,
                out_dtype=out_dtype, bias_dtype=bias_dtype,
                alpha=draw(st.sampled_from([1.0, 0.5])), layout=layout,
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=8 if SIMULATOR else 16)
# M = 1 (split-K on the GPU) and the SIMT kernel's reduce path (simulator); both epilogues
# are in _GPU_EPILOGUES
@example(dict(M=1, K=37, I=16, dtype="bfloat16", config=_CONFIGS[0], activation="gelu_and_mul",
              out_dtype=None, bias_dtype="float32", alpha=1.0, layout="NT", seed=1))
@example(dict(M=3, K=48, I=8, dtype="float16", config=_CONFIGS[-1], activation="gelu_and_mul",
              out_dtype="float32", bias_dtype="float16", alpha=0.5, layout="NN", seed=2))
@given(gated_problems())
def test_hypothesis_gated(pr):
    rng = np.random.default_rng(pr["seed"])
    run_gated(pr["M"], pr["K"], pr["I"], pr["dtype"], pr["config"], rng,
              activation=pr["activation"], out_dtype=pr["out_dtype"],
              bias_dtype=pr["bias_dtype"], alpha=pr["alpha"], layout=pr["layout"])


# ---- the check itself ----------------------------------------------------------------------

def test_check_rejects_wrong_gated(rng):
    """Deliberately wrong implementations fail the derived tolerance: gate and up swapped, and
    the bias added after the activation instead of before."""
    M, K, I = 8, 32, 16
    x = random_array((M, K), "float16", rng)
    w_gate, w_up, b_gate, b_up = gated_weights(rng, K, I, "float16", "float32")
    swapped = gated_gemm_reference(x, w_up.T, w_gate.T)
    with pytest.raises(AssertionError):
        check_gated(swapped, x, w_gate, w_up, out_dtype="float32", activation="silu_and_mul")
    gate = f64(x) @ f64(w_gate).T
    up = f64(x) @ f64(w_up).T + b_up[None, :]
    late_bias = (gate / (1.0 + np.exp(-gate)) + b_gate[None, :]) * up
    with pytest.raises(AssertionError):
        check_gated(late_bias, x, w_gate, w_up, out_dtype="float32", activation="silu_and_mul",
                    bias_gate=b_gate, bias_up=b_up)


# ---- errors --------------------------------------------------------------------------------

def test_gated_errors(rng):
    x = place(random_array((4, 6), "float16", rng), False)
    b = place(random_array((6, 32), "float16", rng), False)
    with pytest.raises(ValueError, match=r"b: activation='silu_and_mul' expects N.*multiple "
                                         r"of 16, got shape \(6, 24\)"):
        gemm(x, place(random_array((6, 24), "float16", rng), False), activation="silu_and_mul")
    with pytest.raises(ValueError, match="b: activation='gelu_and_mul'.*got shape"):
        gemm(x, place(random_array((6, 17), "float16", rng), False), activation="gelu_and_mul")
    c = place(random_array((4, 16), "float16", rng), False)
    with pytest.raises(ValueError, match="beta: beta \\* c is not supported with "
                                         "activation='silu_and_mul'"):
        gemm(x, b, c=c, beta=1.0, activation="silu_and_mul")
    gemm(x, b, c=c, beta=0.0, activation="silu_and_mul", config=SIM_TC)  # c not read
    with pytest.raises(ValueError, match=r"c: expected shape \(4, 16\) \(M, N // 2\)"):
        gemm(x, b, c=place(random_array((4, 32), "float16", rng), False),
             activation="silu_and_mul")
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 16\)"):
        gemm(x, b, out=_empty((4, 32), "float16"), activation="silu_and_mul")
    with pytest.raises(ValueError, match=r"bias: expected shape \(32,\)"):
        gemm(x, b, bias=place(np.ones(16, np.float16), False), activation="silu_and_mul")
    with pytest.raises(ValueError, match="activation: expected one of"):
        gemm(x, b, activation="swiglu")


# ---- GPU suite: the heuristic's tiles at MLP shapes --------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_mlp_shapes_bitwise_repeat(M, dtype, rng):
    """Decode and prefill M through the heuristic (split-K for the small ones, wgmma at 256),
    K = 1024, I = 1536 (SmolLM2-360M's MLP is 960 -> 2560); a repeated call (the replay path)
    gives the same bits."""
    host, (x, b, bias) = gated_operands(rng, M, 1024, 1536, dtype, "NT", dtype)
    runs = [f64(gemm(x, b, bias=bias, activation="silu_and_mul")) for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])
    check_gated(runs[0], host[0], host[1], host[2], out_dtype=dtype, activation="silu_and_mul",
                bias_gate=host[3], bias_up=host[4], mma=True)


@pytest.mark.gpu
def test_gpu_gated_wide_few_rows_producer_tile(rng):
    """64 rows by Llama-3-8B's gate / up width (2 x 14336): the heuristic's warp-specialised
    64 x 256 tile on an H200, with the gated epilogue."""
    host, (x, b, bias) = gated_operands(rng, 64, 1024, 14336, "bfloat16", "NT", "bfloat16")
    got = f64(gemm(x, b, bias=bias, activation="silu_and_mul"))
    check_gated(got, host[0], host[1], host[2], out_dtype="bfloat16", activation="silu_and_mul",
                bias_gate=host[3], bias_up=host[4], mma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["wg_128x256x64_s4_k1", "wg_128x128x64_s5_k1",
                                    "wg_64x128x64_s8_p_tma_k1",
                                    "tc_128x256x64_w2x4_s3_k1", "tc_64x128x64_w1x4_s4_k1",
                                    "tc_16x128x64_w1x4_s4_k4"])
@pytest.mark.parametrize("activation", GATED)
def test_gpu_gated_configs(config, activation, rng):
    """Each large tile's gated staging, with edges along M, N and K."""
    run_gated(296, 520, 136, "bfloat16", config, rng, activation=activation,
              bias_dtype="float32", alpha=0.5)
