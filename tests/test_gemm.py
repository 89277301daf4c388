"""gemm against its float64 reference: shapes, layouts, dtypes, the fused epilogue, split-K, the
autotune cache, and every documented error.

Under the simulator the kernels run with the small tile configurations of ``CONFIGS`` (same kernel
code, tiles of 16); the GPU suite (``-m gpu``) runs the real configurations and many more
hypothesis examples. Tolerances are derived from a plain fp32-accumulating NumPy implementation
(``reference.gemm.gemm_plain``), never guessed.
"""

import importlib
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba._arrays import numpy_dtype
from llmspeed_numba.ops.gemm import gemm
from llmspeed_numba.ops.gemm_configs import CONFIGS, GemmConfig, resolve_config, wgmma_supported
from llmspeed_numba.reference.gemm import gemm_plain, gemm_reference
from llmspeed_numba.testing import derived_check, f64, poison, random_array, to_device

SIM_TC = "tc_16x16x16_w1x1_s2"
SIM_SIMT = "simt_16x16x8_t2x2"
GPU_TC = [n for n, c in CONFIGS.items() if c.backend == "tensor_core"]
GPU_SIMT = [n for n, c in CONFIGS.items() if c.backend == "simt"]
# the module (the package may export the function ``autotune`` under the same name)
autotune_mod = importlib.import_module("llmspeed_numba.autotune")
LAYOUTS = ("NN", "NT", "TN", "TT")   # first letter: a, second: b; T = column-major


# ---- helpers -------------------------------------------------------------------------------

def place(host, col_major):
    """The array the op receives: column-major means a transposed view (no copy)."""
    if SIMULATOR:
        return np.asfortranarray(host) if col_major else np.ascontiguousarray(host)
    if col_major:
        return to_device(np.ascontiguousarray(host.T), "torch").T
    return to_device(host, "torch")


def operands(rng, M, N, K, dtype, layout="NN"):
    a = random_array((M, K), dtype, rng)
    b = random_array((K, N), dtype, rng)
    return a, b, place(a, layout[0] == "T"), place(b, layout[1] == "T")


def host_or_none(x):
    return None if x is None else np.asarray(x)


def on_tensor_cores(config, dtype):
    """Whether the hardware's Tensor Core accumulator produced the result: it truncates where
    the simulator's twin (numpy float32) rounds to nearest, so the plain model must too."""
    if SIMULATOR:
        return False
    if config is None:
        return dtype in ("float16", "bfloat16")   # backend="auto"
    cfg = resolve_config(config)
    return cfg.backend == "tensor_core" and not cfg.gemv   # gemv: fp32 FMA, rounded


def check(got, a, b, *, out_dtype, c=None, alpha=1.0, beta=0.0, bias=None, activation=None,
          factor=2.0, mma=False):
    """Derived-tolerance check of ``got`` against the float64 reference (host inputs); ``mma``:
    the plain model accumulates as a Tensor Core does (``gemm_plain``)."""
    kw = dict(c=host_or_none(c), alpha=alpha, beta=beta, bias=host_or_none(bias),
              activation=activation)
    reference = gemm_reference(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               **{k: (np.asarray(v, np.float64) if k in ("c", "bias") and
                                      v is not None else v) for k, v in kw.items()})
    plain = gemm_plain(a, b, out_dtype=numpy_dtype(out_dtype), mma=mma, **kw)
    derived_check(f64(got), reference, np.asarray(plain, np.float64), factor=factor)


def run_and_check(M, N, K, dtype, layout, config, rng, out_dtype=None, **epilogue):
    a, b, da, db = operands(rng, M, N, K, dtype, layout)
    out_dtype = out_dtype or dtype
    out = poison(_empty((M, N), out_dtype))
    host_epi = dict(epilogue)
    dev_epi = dict(epilogue)
    for name in ("c", "bias"):
        if epilogue.get(name) is not None:
            dev_epi[name] = place(epilogue[name], False)
    got = gemm(da, db, out=out, out_dtype=out_dtype, config=config, **dev_epi)
    assert got is out
    check(got, a, b, out_dtype=out_dtype, mma=on_tensor_cores(config, dtype), **host_epi)


def _empty(shape, dtype):
    if SIMULATOR:
        return np.empty(shape, numpy_dtype(dtype))
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")


# ---- named odd cases (simulator: small configs; GPU: every configuration) --------------------

ODD_CASES = [  # (M, N, K): 1, primes, non-multiples of every tile size, K % 8 != 0
    (1, 1, 1), (1, 24, 40), (17, 1, 16), (5, 7, 3), (13, 29, 37), (33, 20, 40), (16, 16, 16),
]


@pytest.mark.parametrize("M,N,K", ODD_CASES, ids=lambda v: str(v))
def test_odd_shapes_tensor_core(M, N, K, rng):
    run_and_check(M, N, K, "float16", "NN", SIM_TC, rng, out_dtype="float32")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_tensor_core(layout, rng):
    run_and_check(19, 24, 40, "bfloat16", layout, SIM_TC, rng)   # N = 24: 16-byte stores


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_simt(layout, rng):
    run_and_check(23, 18, 19, "float32", layout, SIM_SIMT, rng)


def test_larger_simulator_tile(rng):
    """Two warps, three stages, a 32 x 32 block: the multi-warp / multi-stage code paths."""
    run_and_check(40, 36, 72, "float16", "TN", "tc_32x32x16_w2x1_s3", rng, out_dtype="bfloat16")


@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_two_k_steps_tensor_core(layout, rng):
    """block_k = 32: fragments double-buffered across the two k16 steps and across K tiles;
    16 x 16 is one interior block, so the unpredicated main loop runs before the edge tiles
    (K = 80: two full tiles and a partial one)."""
    run_and_check(16, 16, 80, "float16", layout, "tc_16x16x32_w1x1_s2", rng, out_dtype="float32")


@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_interior_fast_path_simt(layout, rng):
    """An interior block (16 x 16) with several full K tiles: the unpredicated loop, then a
    partial last tile."""
    run_and_check(16, 16, 28, "float32", layout, SIM_SIMT, rng)


@pytest.mark.parametrize("config", [SIM_TC + "_k3", SIM_TC + "_k5", SIM_SIMT + "_k2"])
def test_split_k(config, rng):
    """9 ragged rows and a 4-column edge tile; five splits: the finishing block's batched sums
    take two rounds of loads (``_epilogue.SUM_SPLITS`` splits a round)."""
    run_and_check(9, 20, 70, "float16", "NT", config, rng, c=random_array((9, 20), "float32", rng),
                  beta=0.5, bias=random_array((20,), "float16", rng), activation="silu")


@pytest.mark.parametrize("config", [SIM_TC + "_k3", "wg_64x64x64_s3_k3"])
def test_split_k_bitwise_repeatable(config, rng):
    """A K split is finished by whichever block of a tile draws the last ticket, adding the
    splits' sums in split order: repeated calls give the same bits, and each leaves the tickets
    at zero (a later call with a different tile grid is still right)."""
    a = random_array((20, 192), "bfloat16", rng)
    b = random_array((192, 24), "bfloat16", rng)
    da, db = place(a, True), place(b, False)
    first = f64(gemm(da, db, config=config, out_dtype="float32"))
    check(first, a, b, out_dtype="float32", mma=on_tensor_cores(config, "bfloat16"))
    assert np.array_equal(f64(gemm(da, db, config=config, out_dtype="float32")), first)
    run_and_check(40, 20, 136, "float16", "NT", config, rng, out_dtype="float32")


def test_unaligned_operands(rng):
    """Views that start off a 16-byte boundary with padded leading dims: the predicated scalar
    copy path of the Tensor Core kernel (no cp.async)."""
    M, N, K = 18, 17, 24
    a_big = random_array((M, K + 3), "float16", rng)
    b_big = random_array((K + 1, N + 5), "float16", rng)
    a_dev = place(a_big, False)[:, 1:K + 1]
    b_dev = place(b_big, False)[1:, 2:N + 2]
    got = gemm(a_dev, b_dev, config=SIM_TC, out_dtype="float32")
    check(got, a_big[:, 1:K + 1], b_big[1:, 2:N + 2], out_dtype="float32")


def test_padded_leading_dimension_vectorised(rng):
    """Sub-matrices whose rows start 16-byte aligned (leading dim a multiple of 8) keep the
    cp.async path; edges inside the parent array must still not be read."""
    M, N, K = 20, 12, 24
    a_big = random_array((M, 40), "float16", rng)
    b_big = random_array((K, 32), "float16", rng)
    got = gemm(place(a_big, False)[:, :K], place(b_big, False)[:, :N], config=SIM_TC,
               out_dtype="float32")
    check(got, a_big[:, :K], b_big[:, :N], out_dtype="float32")


# ---- Hopper wgmma kernel (simulator: the twins decode the descriptors and swizzled tiles) ----

SIM_WG = "wg_64x64x64_s3"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_wgmma(layout, rng):
    """Every operand orientation (K-major and M- / N-major tiles, descriptors, transpose bits);
    edge blocks along M and N (72 = 64 + 8), K = 136: two full K tiles and a partial one."""
    run_and_check(72, 72, 136, "bfloat16", layout, SIM_WG, rng)


def test_wgmma_one_k_tile(rng):
    """K inside one tile: only the peeled first tile runs (no main loop)."""
    run_and_check(8, 64, 40, "float16", "NT", SIM_WG, rng, out_dtype="float32")


def test_wgmma_split_k_epilogue(rng):
    M, N = 64, 80
    run_and_check(M, N, 200, "float16", "NT", SIM_WG + "_k2", rng,
                  c=random_array((M, N), "float32", rng), beta=0.5,
                  bias=random_array((N,), "float16", rng), activation="gelu")


@pytest.mark.parametrize("M, N, K, layout, split", [
    (72, 72, 392, "NT", ""),     # 7 K tiles over 3 stages: every stage reused, edge tiles
    (8, 64, 40, "TN", ""),       # one K tile: only the peeled first one
    (64, 80, 200, "NN", "_k2"),  # K split: each split's producer and consumers alone
])
def test_wgmma_producer(M, N, K, layout, split, rng):
    """The warp-specialised form (a producer warpgroup copying, mbarriers handing the stages
    over): every stage's parities through more than one round, partial K and edge tiles, a K
    split finished in the launch with the epilogue."""
    extra = {} if not split else dict(c=random_array((M, N), "float32", rng), beta=0.5,
                                      bias=random_array((N,), "float16", rng),
                                      activation="silu")
    run_and_check(M, N, K, "float16", layout, SIM_WG + "_p" + split, rng, out_dtype="float32",
                  **extra)


@pytest.mark.parametrize("M, N, K, layout, split", [
    (72, 72, 392, "NT", ""),      # ragged M, N (zero-filled box rows), 7 K tiles over 3 stages
    (8, 64, 40, "NT", ""),        # one K tile, shorter than the box (K zero-filled)
    (64, 80, 200, "NT", "_k2"),   # K split: the last split's last tile crosses K
    (40, 24, 136, "NN", ""),      # b N-major: runs as the cp.async producer form
])
def test_wgmma_tma(M, N, K, layout, split, rng):
    """The producer form with copies by the Tensor Memory Accelerator (tensor maps of a and of
    b's K-major storage, one box a tile an operand), through its twin: edges, a K split with the
    fused epilogue, and the fallback of an N-major b."""
    extra = {} if not split else {"c": random_array((M, N), "float32", rng), "beta": 0.5,
                                  "bias": random_array((N,), "bfloat16", rng),
                                  "activation": "silu"}
    run_and_check(M, N, K, "bfloat16", layout, SIM_WG + "_p_tma" + split, rng,
                  out_dtype="float32", **extra)


def test_wgmma_unaligned_falls_back(rng):
    """N = 17 (b's rows are not 16-byte multiples): no 16-byte copies, so the call runs on the
    mma.sync kernel, still correct."""
    run_and_check(20, 17, 24, "float16", "NN", SIM_WG, rng, out_dtype="float32")


# ---- few-row CUDA-core kernel (gemv_*) ------------------------------------------------------

#: one warp, 3 columns a block, two chunk steps an iteration: few simulated threads, and K = 560
#: (70 chunks) gives a lane a full iteration and a partial one
SIM_GEMV = {"backend": "tensor_core", "block_m": 2, "block_n": 3, "block_k": 8, "warps_n": 1,
            "stages": 2, "gemv": True}


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_epilogue(M, rng):
    """M up to the kernel's rows, N = 6 (a partial last block of 4 columns), K = 72 split
    over 4 warps (the last one shorter), every epilogue input."""
    N = 6
    run_and_check(M, N, 72, "float16", "NT", "gemv_4x4_w4_u2", rng,
                  c=random_array((M, N), "float32", rng), beta=0.5,
                  bias=random_array((N,), "float16", rng), activation="silu")


@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "float32"), ("float16", "float16")])
def test_gemv_unrolled_steps_and_tail(dtype, out_dtype, rng):
    run_and_check(2, 7, 560, dtype, "NT", SIM_GEMV, rng, out_dtype=out_dtype)


def test_gemv_bitwise_repeatable(rng):
    a = random_array((2, 560), "bfloat16", rng)
    b = random_array((560, 7), "bfloat16", rng)
    da, db = place(a, False), place(b, True)
    first = f64(gemm(da, db, config=SIM_GEMV, out_dtype="float32"))
    assert np.array_equal(f64(gemm(da, db, config=SIM_GEMV, out_dtype="float32")), first)


def test_gemv_programmatic_form_equals_the_plain_one(rng):
    """``launch.programmatic`` (the default where supported): the GEMV's programmatic form
    (release, then wait, at its start) gives bit for bit the plain kernel's result."""
    from llmspeed_numba._overrides import overrides

    a = random_array((2, 560), "bfloat16", rng)
    b = random_array((560, 7), "bfloat16", rng)
    da, db = place(a, False), place(b, True)
    got = {}
    for programmatic in (False, True):
        with overrides(launch={"programmatic": programmatic}):
            got[programmatic] = f64(gemm(da, db, config=SIM_GEMV, out_dtype="float32"))
    assert np.array_equal(got[False], got[True])


@pytest.mark.parametrize("M,K,layout", [(3, 72, "NT"), (2, 36, "NT"), (2, 72, "NN"),
                                        (2, 72, "TT")])
def test_gemv_out_of_reach_runs_another_kernel(M, K, layout, rng):
    """More rows than the config's, K not a multiple of 8, b or a not K-major: the call runs on
    the heuristic's Tensor Core tile instead, still right."""
    run_and_check(M, 9, K, "float16", layout, "gemv_2x4_w4_u2", rng, out_dtype="float32")


@pytest.mark.parametrize("M,N,K,want", [
    (1024, 1024, 1024, "wg_64x128x64_s8_p_tma"),    # one wave of 64 x 128, under half of larger
    (512, 2048, 4096, "wg_64x128x64_s8_p_tma"), (384, 1024, 1024, "wg_64x128x64_s8_p_tma"),
    (2048, 1024, 1024, "wg_128x128x64_s5"), (1024, 2048, 2048, "wg_128x128x64_s5"),
    (512, 4096, 4096, "wg_128x128x64_s5"),      # one wave of 128 x 128, two of 64 x 128
    (768, 4096, 4096, "wg_128x256x64_s4"),      # one wave of 128 x 256, two of 128 x 128
    (2048, 2048, 2048, "wg_128x256x64_s4"), (4096, 4096, 4096, "wg_128x256x64_s4"),
    (1024, 14336, 4096, "wg_128x256x64_s4")])
def test_heuristic_tiles_above_256_rows_on_an_h200(M, N, K, want, monkeypatch):
    """The heuristic's tile by shape on Hopper (132 SMs): the wgmma tile of least waves times
    the cost of a wave (``WGMMA_WAVE_COSTS``), no K split where the tiles fill a wave."""
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops import gemm_configs

    monkeypatch.setattr(gemm_configs, "SIMULATOR", False)
    monkeypatch.setattr(gemm_configs, "wgmma_supported", lambda: True)
    with overrides(device={"sm_count": 132}):
        cfg = gemm_configs.heuristic("tensor_core", M, N, K)
        assert cfg.name == want
        if -(-M // cfg.block_m) * -(-N // cfg.block_n) > 66:   # over half a wave
            assert gemm_configs.split_count(cfg, M, N, K) == 1


@pytest.mark.parametrize("M,N,K,want", [
    (192, 4096, 4096, "wg_64x128x64_s8_p_tma"), (256, 4096, 14336, "wg_64x128x64_s8_p_tma"),
    (200, 4096, 1088, "wg_64x128x64_s8_p_tma"), (128, 4096, 14336, "wg_64x64x64_s8"),
    (256, 14336, 4096, "wg_128x256x64_s4")])
def test_heuristic_few_rows_on_an_h200(M, N, K, want, monkeypatch):
    """The heuristic's few-row tile by shape on Hopper (132 SMs): past 128 rows, short of a wave
    of 128-row tiles, the warp-specialised 64 x 128 tile in its TMA form; a wave of 128 x 256
    tiles where N gives one; 64 x 64 tiles while 64 x 128 ones would fill under half the GPU."""
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops import gemm_configs

    monkeypatch.setattr(gemm_configs, "SIMULATOR", False)
    monkeypatch.setattr(gemm_configs, "wgmma_supported", lambda: True)
    with overrides(device={"sm_count": 132}):
        assert gemm_configs.heuristic("tensor_core", M, N, K).name == want


def test_heuristic_splits_above_256_rows_on_an_h200(monkeypatch):
    """A wgmma tile above 256 rows splits K only up to one wave (at least 3072 of K a split),
    and a problem of under a quarter wave of tiles keeps the two-wave rule."""
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops import gemm_configs

    monkeypatch.setattr(gemm_configs, "SIMULATOR", False)
    monkeypatch.setattr(gemm_configs, "wgmma_supported", lambda: True)
    with overrides(device={"sm_count": 132}):
        for (M, N, K), splits in (((300, 1000, 14344), 3), ((512, 1024, 14336), 2),
                                  ((257, 128, 4096), 3), ((512, 4096, 16384), 1)):
            cfg = gemm_configs.heuristic("tensor_core", M, N, K)
            assert gemm_configs.split_count(cfg, M, N, K) == splits, (M, N, K, cfg.name)


def test_gemv_config_checked():
    with pytest.raises(ValueError, match="gemv needs"):
        resolve_config(dict(SIM_GEMV, block_m=3))
    with pytest.raises(ValueError, match="gemv needs"):
        resolve_config(dict(SIM_GEMV, split_k=2))
    assert resolve_config("gemv_1x4_w4_u2").threads == 128


# ---- epilogue ------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
def test_epilogue_simt(activation, rng):
    M, N, K = 12, 20, 16
    run_and_check(M, N, K, "float16", "NN", SIM_SIMT, rng, out_dtype="float16",
                  c=random_array((M, N), "bfloat16", rng), alpha=0.75, beta=-1.25,
                  bias=random_array((N,), "float32", rng), activation=activation)


def test_epilogue_tensor_core(rng):
    M, N, K = 20, 24, 32
    run_and_check(M, N, K, "bfloat16", "TT", SIM_TC, rng, out_dtype="float32",
                  c=random_array((M, N), "float16", rng), alpha=-2.0, beta=0.5,
                  bias=random_array((N,), "bfloat16", rng), activation="gelu")


def test_beta_zero_ignores_c(rng):
    """BLAS convention: with beta == 0, c is not read (NaNs in it do not propagate)."""
    a, b, da, db = operands(rng, 8, 8, 8, "float32")
    c = place(np.full((8, 8), np.nan, np.float32), False)
    got = gemm(da, db, c=c, beta=0.0, config=SIM_SIMT)
    check(got, a, b, out_dtype="float32")


def test_in_place_accumulate(rng):
    """out may be c itself: out = a @ b + out."""
    M, N, K = 10, 12, 8
    a, b, da, db = operands(rng, M, N, K, "float32", "TN")
    c_host = random_array((M, N), "float32", rng)
    c = place(c_host.copy(), False)
    got = gemm(da, db, c=c, beta=1.0, out=c, config=SIM_SIMT)
    assert got is c
    check(got, a, b, out_dtype="float32", c=c_host, beta=1.0)


def test_strided_output(rng):
    """out may be any strided view, e.g. the transpose of a contiguous array."""
    M, N, K = 9, 14, 16
    a, b, da, db = operands(rng, M, N, K, "float16")
    out = place(np.zeros((N, M), np.float32), False).T
    gemm(da, db, out=out, config=SIM_TC)
    check(out, a, b, out_dtype="float32")


# ---- degenerate sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("M,N", [(0, 5), (4, 0), (0, 0)])
def test_empty_output(M, N, rng):
    da, db = operands(rng, M, N, 8, "float16")[2:]
    got = gemm(da, db)
    assert tuple(got.shape) == (M, N)


def test_k_zero(rng):
    """K = 0: out = activation(beta * c + bias), no main kernel."""
    M, N = 6, 10
    da, db = operands(rng, M, N, 0, "float16")[2:]
    c_host = random_array((M, N), "float16", rng)
    bias_host = random_array((N,), "float32", rng)
    got = gemm(da, db, c=place(c_host, False), beta=2.0, bias=place(bias_host, False),
               activation="relu", out_dtype="float32")
    expected = np.maximum(2.0 * c_host.astype(np.float64) + bias_host[None, :], 0.0)
    np.testing.assert_allclose(f64(got), expected, rtol=1e-6, atol=1e-6)
    plain = gemm(da, db)
    assert np.all(f64(plain) == 0.0)


# ---- hypothesis ----------------------------------------------------------------------------

_SIZE = 40 if SIMULATOR else 300


# On the GPU nearly every new epilogue (dtype x layout x out dtype x beta != 0 x bias x
# activation) is a new kernel specialisation, a compile of seconds: examples draw it from this
# fixed list, which holds every value of each (the input dtype cycles through the test's
# dtypes), and each entry also runs once as an explicit example (``_gpu_examples``). Shapes,
# alpha and beta's non-zero value stay free. (layout, out_dtype, beta != 0, bias, activation)
_GPU_EPILOGUES = (("NN", None, False, False, None), ("NT", "float16", True, True, "relu"),
                  ("TN", "bfloat16", True, False, "gelu"), ("TT", "float32", False, True, "silu"))
# one shape per heuristic class (M <= 16 with split-K, <= 32, <= 64, large), mixed alignment
_GPU_EXAMPLE_SHAPES = ((7, 300, 296), (29, 64, 40), (61, 257, 136), (200, 131, 77))


def _gpu_epilogues(dtypes):
    return [(dtypes[i % len(dtypes)],) + e for i, e in enumerate(_GPU_EPILOGUES)]


def _gpu_examples(dtypes):
    """On the GPU, each ``_gpu_epilogues`` entry once as an explicit example, so every value is
    covered whatever hypothesis draws; under the simulator the test is returned unchanged."""
    def decorate(test):
        if SIMULATOR:
            return test
        for i, (dtype, layout, out_dtype, beta_on, bias, activation) in enumerate(
                _gpu_epilogues(dtypes)):
            M, N, K = _GPU_EXAMPLE_SHAPES[i]
            test = example({"M": M, "N": N, "K": K, "dtype": dtype, "layout": layout,
                            "out_dtype": out_dtype, "alpha": 0.5,
                            "beta": 1.0 if beta_on else 0.0, "bias": bias,
                            "activation": activation, "seed": i})(test)
        return test

    return decorate


@st.composite
def problems(draw, dtypes, max_size=_SIZE):
    M = draw(st.integers(1, max_size))
    N = draw(st.integers(1, max_size))
    K = draw(st.integers(1, max_size))
    if not SIMULATOR:
        dtype, layout, out_dtype, beta_on, bias, activation = draw(
            st.sampled_from(_gpu_epilogues(dtypes)))
        return {"M": M, "N": N, "K": K, "dtype": dtype, "layout": layout,
                "out_dtype": out_dtype, "alpha": draw(st.sampled_from([1.0, 0.5, -1.5])),
                "beta": draw(st.sampled_from([1.0, -0.25])) if beta_on else 0.0,
                "bias": bias, "activation": activation, "seed": draw(st.integers(0, 2**31))}
    return dict(
        M=M, N=N, K=K, dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(LAYOUTS)),
        out_dtype=draw(st.sampled_from([None, "float16", "bfloat16", "float32"])),
        alpha=draw(st.sampled_from([1.0, 0.5, -1.5])),
        beta=draw(st.sampled_from([0.0, 1.0, -0.25])),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from([None, "relu", "gelu", "silu"])),
        seed=draw(st.integers(0, 2**31)))


def _run_problem(pr, config):
    rng = np.random.default_rng(pr["seed"])
    M, N = pr["M"], pr["N"]
    epi = dict(alpha=pr["alpha"], beta=pr["beta"], activation=pr["activation"])
    if pr["beta"] != 0.0:
        epi["c"] = random_array((M, N), "float32", rng)
    if pr["bias"]:
        epi["bias"] = random_array((N,), pr["dtype"], rng)
    run_and_check(M, N, pr["K"], pr["dtype"], pr["layout"], config, rng,
                  out_dtype=pr["out_dtype"], **epi)


@settings(max_examples=6 if SIMULATOR else 8)  # GPU: + 4 explicit examples
@_gpu_examples(("float16", "bfloat16", "float32"))
@given(problems(("float16", "bfloat16", "float32"), max_size=24 if SIMULATOR else _SIZE))
def test_hypothesis_simt(pr):
    _run_problem(pr, SIM_SIMT if SIMULATOR else None if pr["dtype"] == "float32"
                 else "simt_64x64x8_t4x4")


@settings(max_examples=6 if SIMULATOR else 8)  # GPU: + 4 explicit examples
@_gpu_examples(("float16", "bfloat16"))
@given(problems(("float16", "bfloat16"), max_size=24 if SIMULATOR else _SIZE))
def test_hypothesis_tensor_core(pr):
    _run_problem(pr, SIM_TC if SIMULATOR else None)


# ---- the check itself ----------------------------------------------------------------------

@pytest.mark.parametrize("mma", [False, True])
def test_check_rejects_fp16_accumulation(mma, rng):
    """A deliberately wrong implementation (fp16 accumulation) fails the derived tolerance."""
    M, N, K = 16, 16, 512
    a = random_array((M, K), "float16", rng)
    b = random_array((K, N), "float16", rng)
    acc = np.zeros((M, N), np.float16)
    for k in range(K):
        acc = (acc + np.outer(a[:, k], b[k, :]).astype(np.float16)).astype(np.float16)
    with pytest.raises(AssertionError):
        check(acc.astype(np.float32), a, b, out_dtype="float32", mma=mma)


@pytest.mark.parametrize("mma", [False, True])
def test_check_rejects_edge_off_by_one(mma, rng):
    """Dropping the last K element (an off-by-one K edge) fails the check."""
    a = random_array((8, 9), "float16", rng)
    b = random_array((9, 8), "float16", rng)
    wrong = a[:, :8].astype(np.float32) @ b[:8].astype(np.float32)
    with pytest.raises(AssertionError):
        check(wrong, a, b, out_dtype="float32", mma=mma)


# ---- errors --------------------------------------------------------------------------------

def _pair(rng, dtype="float16", M=4, N=5, K=6):
    return operands(rng, M, N, K, dtype)[2:]


def test_error_not_an_array(rng):
    a, b = _pair(rng)
    with pytest.raises(TypeError, match="a:"):
        gemm([[1.0, 2.0]], b)
    with pytest.raises(TypeError, match="b:"):
        gemm(a, "b")


def test_error_rank(rng):
    a, b = _pair(rng)
    with pytest.raises(ValueError, match="a: expected 2 dimensions"):
        gemm(a[0], b)
    with pytest.raises(ValueError, match="b: expected 2 dimensions"):
        gemm(a, b[None])


def test_error_mismatched_k(rng):
    a, _ = _pair(rng)
    _, b = _pair(rng, K=7)
    with pytest.raises(ValueError, match="b: expected shape"):
        gemm(a, b)


def test_error_dtypes(rng):
    a, _ = _pair(rng, "float16")
    _, b32 = _pair(rng, "float32")
    with pytest.raises(TypeError, match="b: expected dtype float16"):
        gemm(a, b32)
    ai = place(np.ones((4, 6), np.int32), False)
    bi = place(np.ones((6, 5), np.int32), False)
    with pytest.raises(TypeError, match="a: expected dtype"):
        gemm(ai, bi)
    _, b = _pair(rng)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm(a, b, out_dtype="int8")


def test_error_strides(rng):
    big = place(random_array((8, 12), "float16", rng), False)
    _, b = _pair(rng, K=6)
    with pytest.raises(ValueError, match="a: expected a row-major or column-major"):
        gemm(big[::2, ::2], b)   # (4, 6), neither dimension contiguous
    a, _ = _pair(rng)
    with pytest.raises(ValueError, match="b: expected a row-major or column-major"):
        gemm(a, place(random_array((12, 10), "float16", rng), False)[::2, ::2])


def test_error_epilogue_arguments(rng):
    a, b = _pair(rng)
    with pytest.raises(ValueError, match="c: expected shape"):
        gemm(a, b, c=place(np.zeros((5, 4), np.float16), False), beta=1.0)
    with pytest.raises(ValueError, match="bias: expected shape"):
        gemm(a, b, bias=place(np.zeros(4, np.float16), False))
    with pytest.raises(ValueError, match="bias: expected 1 dimensions"):
        gemm(a, b, bias=place(np.zeros((1, 5), np.float16), False))
    with pytest.raises(TypeError, match="bias: expected dtype"):
        gemm(a, b, bias=place(np.zeros(5, np.int32), False))
    with pytest.raises(ValueError, match="activation"):
        gemm(a, b, activation="tanh")
    with pytest.raises(TypeError, match="alpha"):
        gemm(a, b, alpha="1")
    with pytest.raises(ValueError, match="beta"):
        gemm(a, b, beta=float("nan"))


def test_error_out(rng):
    a, b = _pair(rng)
    with pytest.raises(ValueError, match="out: expected shape"):
        gemm(a, b, out=_empty((5, 4), "float16"))
    with pytest.raises(TypeError, match="out: expected dtype"):
        gemm(a, b, out=_empty((4, 5), "float32"), out_dtype="float16")
    with pytest.raises(TypeError, match=r"^out: expected dtype in .*, got int32$"):
        gemm(a, b, out=place(np.zeros((4, 5), np.int32), False))   # out names out, not out_dtype
    with pytest.raises(TypeError, match="out_dtype: expected a dtype"):
        gemm(a, b, out_dtype=object())


def test_error_backend_and_config(rng):
    a, b = _pair(rng)
    a32, b32 = _pair(rng, "float32")
    with pytest.raises(ValueError, match="backend"):
        gemm(a, b, backend="cublas")
    with pytest.raises(NotImplementedError, match="tensor_core"):
        gemm(a32, b32, backend="tensor_core")
    with pytest.raises(NotImplementedError, match="tensor_core"):
        gemm(a32, b32, config=SIM_TC)
    with pytest.raises(ValueError, match="config: unknown name"):
        gemm(a, b, config="fastest")
    with pytest.raises(TypeError, match="config"):
        gemm(a, b, config=3)
    with pytest.raises(ValueError, match="config"):
        gemm(a, b, config=dict(block_m=24))
    with pytest.raises(ValueError, match="config: a simt configuration"):
        gemm(a, b, config=SIM_SIMT, backend="tensor_core")


# ---- configurations and autotune -----------------------------------------------------------

def test_configs_are_valid():
    for cfg in CONFIGS.values():
        assert resolve_config(cfg.name) is cfg
        if cfg.wgmma and not wgmma_supported():   # a GPU other than Hopper
            with pytest.raises(ValueError, match="sm_90"):
                cfg.check()
            continue
        cfg.check()
    assert resolve_config(SIM_TC + "_k4").split_k == 4
    assert resolve_config({"backend": "simt", "block_m": 16, "block_n": 16, "block_k": 8,
                           "thread_m": 2, "thread_n": 2}) == CONFIGS[SIM_SIMT]


def test_autotune_remembers_winner(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("LLMSPEED_NUMBA_CACHE", str(tmp_path))
    autotune_mod.forget()
    a, b, da, db = operands(rng, 8, 8, 16, "float16")
    best = autotune_mod.autotune(da, db, candidates=[SIM_TC, SIM_TC + "_k1"], warmup=0, rep=1)
    assert isinstance(best, GemmConfig)
    assert os.path.exists(autotune_mod.cache_path())
    autotune_mod.forget()  # read back from disk
    from llmspeed_numba.ops.gemm import prepare

    p = prepare(da, db, None, 1.0, 0.0, None, None, None, None, "auto", None)
    assert GemmConfig(**autotune_mod.lookup("gemm", p.key)) == best
    got = gemm(da, db, out_dtype="float32")   # runs the cached winner
    check(got, a, b, out_dtype="float32")
    autotune_mod.forget()


# ---- GPU suite: real configurations ------------------------------------------------------
# Every distinct (configuration, layout, dtypes, epilogue) is a kernel compile (seconds each):
# the cases below are chosen to cover the code paths with a bounded number of them.

@pytest.mark.gpu
@pytest.mark.parametrize("config", [n for n in GPU_TC if CONFIGS[n].block_n >= 64])
def test_gpu_every_tensor_core_config(config, rng):
    """Each real configuration, no split: edges in M, N and K (K % 64 != 0), cp.async path."""
    run_and_check(257, 200, 328, "float16", "NN", config + "_k1", rng, out_dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [n for n in GPU_TC if CONFIGS[n].tma])
def test_gpu_tma_configs(config, rng):
    """The TMA producer form on the hardware (the driver's tensor maps, box copies into the
    swizzled stages): edges in M, N and K (K a multiple of 8, as a map's row stride must be),
    then a K split with the fused epilogue."""
    run_and_check(257, 200, 328, "bfloat16", "NT", config + "_k1", rng, out_dtype="float32")
    run_and_check(100, 264, 4104, "bfloat16", "NT", config + "_k3", rng, out_dtype="float32",
                  c=random_array((100, 264), "float32", rng), beta=0.5,
                  bias=random_array((264,), "bfloat16", rng), activation="silu")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_layouts_fused_epilogue(layout, rng):
    M, N, K = 296, 264, 520
    run_and_check(M, N, K, "bfloat16", layout, "tc_128x128x32_w2x2_s4_k1", rng,
                  c=random_array((M, N), "bfloat16", rng), alpha=0.5, beta=0.75,
                  bias=random_array((N,), "float32", rng), activation="gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_wgmma_layouts_fused_epilogue(layout, rng):
    """The Hopper kernel's default tile in every orientation, with edges along M, N and K and
    the whole epilogue."""
    M, N, K = 296, 264, 520
    run_and_check(M, N, K, "bfloat16", layout, "wg_128x256x64_s4_k1", rng,
                  c=random_array((M, N), "bfloat16", rng), alpha=0.5, beta=0.75,
                  bias=random_array((N,), "float32", rng), activation="gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_gpu_unaligned(layout, rng):
    """Leading dimensions that are not multiples of 8: the predicated scalar copy path."""
    run_and_check(131, 97, 77, "float16", layout, "tc_128x128x32_w2x2_s4_k1", rng,
                  out_dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_SIMT)
def test_gpu_simt_configs(config, rng):
    run_and_check(257, 193, 301, "float32", "NN", config + "_k1", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_simt_layouts(layout, rng):
    run_and_check(130, 250, 99, "float32", layout, "simt_128x128x8_t8x8_k1", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_simt_vector_loads(layout, rng):
    """Leading dimensions that are multiples of 4: the 16-byte fp32 load path (both operands),
    with edge blocks in M and N and a partial last K tile; then M = 258 (for TN / TT a's
    leading dimension is M: a falls back to scalar loads while b stays vectorised); then
    split-K."""
    run_and_check(260, 196, 300, "float32", layout, "simt_128x128x16_t8x8_k1", rng)
    run_and_check(258, 196, 300, "float32", layout, "simt_128x128x16_t8x8_k1", rng)
    run_and_check(260, 196, 300, "float32", layout, "simt_128x128x8_t8x8_k3", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, want", [(384, 1000, 1032, "wg_64x128x64_s8_p_tma"),
                                           (300, 1000, 14344, "wg_64x128x64_s8_p_tma"),
                                           (777, 4096, 4104, "wg_128x256x64_s4")])
def test_gpu_wave_tiles_through_the_heuristic(M, N, K, want, rng):
    """Above 256 rows the heuristic's wave-cost pick through ``gemm``'s own choice: ragged row,
    column and K tiles, and a K split (300 x 1000 x 14344: 40 tiles, three splits)."""
    from llmspeed_numba.ops.gemm_configs import heuristic, sm_count, wgmma_supported

    if wgmma_supported() and sm_count() == 132:
        assert heuristic("tensor_core", M, N, K).name == want
    run_and_check(M, N, K, "bfloat16", "NT", None, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [(64, 28672, 1024), (256, 4096, 2048), (200, 4096, 1088),
                                     (256, 4096, 14336)])
def test_gpu_few_row_producer_tiles_through_the_heuristic(M, N, K, rng):
    """Few-row shapes for which the heuristic picks the warp-specialised tile on an H200 (64
    rows by a wave of 64 x 256 tiles; 64 x 128 past 128 rows), with a ragged row tile and K
    tail, through ``gemm``'s own choice."""
    from llmspeed_numba.ops.gemm_configs import heuristic, sm_count, wgmma_supported

    if wgmma_supported() and sm_count() == 132:
        assert heuristic("tensor_core", M, N, K).producer, heuristic("tensor_core", M, N, K)
    run_and_check(M, N, K, "bfloat16", "NT", None, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7, 16, 31, 128])
@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_gpu_llm_shapes(M, layout, rng):
    """Decode / prefill shapes through the heuristic (split-K for few output tiles)."""
    run_and_check(M, 4096, 4096, "bfloat16", layout, None, rng, out_dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("M,config", [(1, "gemv_1x4_w4_u2"), (2, "gemv_2x4_w4_u2"),
                                      (3, "gemv_4x4_w4_u2"), (4, "gemv_4x4_w4_u2")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_gemv(M, config, dtype, rng):
    """The few-row kernel on the hardware: N = 1001 (a partial last block), K = 4104 split
    over the block's warps, bias + silu + beta * c, and the same bits on a second call."""
    N, K = 1001, 4104
    c, bias = random_array((M, N), "float32", rng), random_array((N,), dtype, rng)
    run_and_check(M, N, K, dtype, "NT", config, rng, out_dtype="float32", c=c, beta=0.5,
                  bias=bias, activation="silu")
    a, b, da, db = operands(rng, M, N, K, dtype, "NT")
    first = f64(gemm(da, db, config=config))
    assert np.array_equal(f64(gemm(da, db, config=config)), first)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1024, 1024, 1024), (2048, 1536, 1000), (1, 14336, 4096)])
def test_gpu_large(M, N, K, rng):
    run_and_check(M, N, K, "float16", "NN", None, rng, out_dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 5, 16])
def test_gpu_split_k(split, rng):
    run_and_check(48, 300, 2048, "float16", "TN", f"tc_16x128x64_w1x4_s4_k{split}", rng,
                  c=random_array((48, 300), "float16", rng), beta=1.0, activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tc_16x128x64_w1x4_s4_k16", "wg_64x128x64_s4_k8", None])
def test_gpu_split_k_bitwise_repeatable(config, rng):
    """Many splits race for the last ticket of each tile; the sum order, and so the bits, do
    not depend on which block wins (16 x 4096 x 14336: the heuristic splits K too)."""
    import torch

    a, b, da, db = operands(rng, 16, 4096, 14336, "bfloat16")
    first = gemm(da, db, config=config).clone()
    check(first, a, b, out_dtype="bfloat16", mma=True)
    for _ in range(5):
        assert torch.equal(gemm(da, db, config=config), first)


@pytest.mark.gpu
def test_gpu_array_kinds_and_stream(rng):
    """numba device arrays and CuPy arrays in, same kind out; an explicit stream."""
    from numba import cuda

    a = random_array((64, 48), "float16", rng)
    b = random_array((48, 40), "float16", rng)
    da, db = cuda.to_device(a), cuda.to_device(b)
    s = cuda.stream()
    got = gemm(da, db, out_dtype="float32", stream=s)
    s.synchronize()
    assert type(got).__module__.startswith("numba")
    check(got, a, b, out_dtype="float32", mma=True)
    cupy = pytest.importorskip("cupy")
    got = gemm(cupy.asarray(a), cupy.asarray(b))
    assert isinstance(got, cupy.ndarray)
    check(got, a, b, out_dtype="float16", mma=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(rng):
    """gemm (split-K: a workspace and tickets) can be captured in a torch CUDA graph."""
    import torch

    a, b, da, db = operands(rng, 16, 512, 1024, "float16")
    out = torch.empty(16, 512, dtype=torch.float16, device="cuda")
    gemm(da, db, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(da, db, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, a, b, out_dtype="float16", mma=True)


@pytest.mark.gpu
def test_gpu_tma_in_cuda_graph(rng):
    """A TMA configuration inside a torch CUDA-graph capture: with its maps made by an eager
    call first it captures the box copies; for operands never seen outside the capture it runs
    the cp.async form (no map can be made there). Both replay right, and again after eager
    calls overflowed the map cache (the capture's maps are pinned)."""
    import torch

    config = "wg_64x128x64_s8_p_tma_k1"
    a, b, da, db = operands(rng, 72, 392, 1032, "bfloat16", "NT")
    a2, b2, da2, db2 = operands(rng, 72, 392, 1032, "bfloat16", "NT")
    out = torch.empty(72, 392, dtype=torch.float32, device="cuda")
    out2 = torch.empty_like(out)
    gemm(da, db, out=out, config=config)
    torch.cuda.synchronize()
    from llmspeed_numba import _tensor_map

    cache = _tensor_map._DEVICE_MAPS
    pinned_before = set(cache.pinned)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(da, db, out=out, config=config)
        gemm(da2, db2, out=out2, config=config)
    out.fill_(float("nan"))
    out2.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, a, b, out_dtype="float32", mma=True)
    check(out2, a2, b2, out_dtype="float32", mma=True)
    # the maps the capture found are pinned: eager calls on new operands overflow a cache of
    # two (their dropped maps' buffers freed and reused) and the graph still reads its own
    captured = {key: cache.pinned[key].ptr for key in set(cache.pinned) - pinned_before}
    assert len(captured) == 2, "the capture's maps of a and b were not pinned"
    capacity = cache.capacity
    cache.capacity = 2
    try:
        kept = []   # alive, so each pair has new addresses and new maps
        for _ in range(12):
            kept.append(operands(rng, 72, 392, 1032, "bfloat16", "NT")[2:])
            gemm(*kept[-1], out=out2, config=config)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, a, b, out_dtype="float32", mma=True)
        assert {key: cache.pinned[key].ptr for key in captured} == captured
    finally:
        cache.capacity = capacity


@pytest.mark.gpu
def test_gpu_new_tensor_maps_wait_for_nothing_and_serve_other_streams(rng):
    """A call on operands new to the map cache makes their maps on its own stream: with ~0.2 s
    of work queued there before it, the call returns long before that work ends (a synchronous
    upload would wait for it). The same operands used at once from a second stream read the
    maps only after they have landed (that stream waits on the upload's event): both results
    right, none read a map before it was written."""
    import time

    import torch

    config = "wg_64x128x64_s8_p_tma_k1"
    a, b, da, db = operands(rng, 72, 392, 1032, "bfloat16", "NT")
    out = torch.empty(72, 392, dtype=torch.float32, device="cuda")
    out2 = torch.empty_like(out)
    gemm(da, db, out=out, config=config)       # compiled, recorded
    a, b, da, db = operands(rng, 72, 392, 1032, "bfloat16", "NT")   # operands with no maps yet
    torch.cuda.synchronize()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        torch.cuda._sleep(500_000_000)         # ~0.25 s of GPU clock cycles
        start = time.perf_counter()
        gemm(da, db, out=out, config=config)
        host_s = time.perf_counter() - start
    with torch.cuda.stream(second):
        gemm(da, db, out=out2, config=config)
    torch.cuda.synchronize()
    assert host_s < 0.05, f"the call waited {host_s:.3f} s for work queued before it"
    check(out, a, b, out_dtype="float32", mma=True)
    check(out2, a, b, out_dtype="float32", mma=True)


@pytest.mark.gpu
@settings(max_examples=8)  # + 4 explicit examples; each new specialisation is a compile
@_gpu_examples(("float16", "bfloat16"))
@given(problems(("float16", "bfloat16"), max_size=300))
def test_gpu_hypothesis_small_tiles_on_hardware(pr):
    """The simulator's tile configuration on the hardware: ties the twins to the GPU."""
    _run_problem(pr, SIM_TC)
