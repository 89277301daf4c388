"""sample: greedy rows equal argmax; reproducible for a seed and independent of the batch layout;
filters never let an excluded token through; drawn frequencies match the exact filtered
distribution (float64 NumPy) and torch's sort-based sampling (chi-square tests on many rows of
the same logits with different seeds); bad inputs raise the documented errors."""

import sys

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.sample import sample
from llmspeed_numba.reference.sample import kept, probabilities, torch_probabilities
from llmspeed_numba.testing import host_copy, random_array, to_device_copy

KIND = "numpy" if SIMULATOR else "torch"
DTYPES = ["float16", "bfloat16", "float32"]
#: Significance of the goodness-of-fit tests: fixed seeds make them deterministic, and a correct
#: sampler fails one only with this probability per test (about 1e-4 * 10 tests a run).
P_VALUE = 1e-4
#: Draws per chi-square test (one row each).
DRAWS = 2000


@pytest.fixture(autouse=True)
def _fast_barriers():
    """The simulator's barriers wait on Python thread switches: a 0.1 ms switch interval makes
    block-wide reductions about 10x faster."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


def _dev(host, offset=0):
    return to_device_copy(host, KIND, offset)


def _draw(x, **params):
    """Token ids drawn for host logits ``x`` (params as host arrays are put on the device)."""
    params = {k: _dev(np.asarray(v)) if isinstance(v, np.ndarray) else v
              for k, v in params.items()}
    out = _dev(np.full(x.shape[0], -1, np.int64))  # poisoned: not a token id
    got = sample(_dev(x), out=out, **params)
    assert got is out
    return host_copy(got)


def _chi2_sf(chi, df):
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi / 2, dtype=torch.float64)))


def _pooled(pairs, enough):
    """Bins of ``pairs`` (columns: per-category values) with ``pairs.sum(1) >= enough`` kept,
    the others merged into one (chi-square wants expected counts of about 5 or more)."""
    big = pairs.sum(axis=1) >= enough
    rows = [pairs[big]]
    if (~big).any():
        rows.append(pairs[~big].sum(axis=0, keepdims=True))
    return np.concatenate(rows)


def _goodness_of_fit(counts, probs):
    """p-value of ``counts`` (one category a token) drawn from ``probs``."""
    n = counts.sum()
    table = _pooled(np.stack([counts, probs * n], axis=1), 5.0)
    table = table[table[:, 1] > 0]
    chi = float(((table[:, 0] - table[:, 1]) ** 2 / table[:, 1]).sum())
    return _chi2_sf(chi, max(len(table) - 1, 1))


def _two_sample(a, b):
    """p-value of the hypothesis that counts ``a`` and ``b`` (equal totals) share a
    distribution."""
    table = _pooled(np.stack([a, b], axis=1).astype(np.float64), 10.0)
    table = table[table.sum(axis=1) > 0]
    chi = float(((table[:, 0] - table[:, 1]) ** 2 / table.sum(axis=1)).sum())
    return _chi2_sf(chi, max(len(table) - 1, 1))


def _midpoint_top_p(row, temperature, top_k=0, rank=3):
    """A top_p in the middle of the gap between two cumulative masses of ``row`` (so fp32
    rounding cannot move the threshold): keeps the ``rank`` most likely tokens."""
    x = row.astype(np.float64)
    p = np.exp((x - x.max()) / temperature)
    if top_k:
        p = np.where(x >= np.sort(x)[::-1][top_k - 1], p, 0.0)
    cum = np.cumsum(np.sort(p / p.sum())[::-1])
    return float((cum[rank - 2] + cum[rank - 1]) / 2)


def _midpoint_min_p(row, temperature, rank=6):
    """A min_p halfway (in ratio) between the ``rank``-th and next most likely tokens."""
    x = np.sort(row.astype(np.float64))[::-1]
    ratios = np.exp((x - x[0]) / temperature)
    return float((ratios[rank - 1] + ratios[rank]) / 2)


# ---- greedy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_temperature_zero_is_argmax_with_ties(dtype):
    rng = np.random.default_rng(3)
    x = random_array((5, 37), dtype, rng)
    x[1, [4, 20, 30]] = x[1].max() + 1  # a tie: the lowest index wins
    x[2, :] = 0.5                        # all equal
    x[3, [0, 36]] = 9.0                  # first and last
    expected = np.argmax(x.astype(np.float32), axis=1)
    np.testing.assert_array_equal(_draw(x, temperature=0.0, seed=5), expected)
    # per-row temperatures: zeros are greedy whatever the other parameters
    temps = np.array([0.0, 0.0, 1.0, 0.0, 2.0], np.float32)
    got = _draw(x, temperature=temps, top_p=0.5, seed=1)
    greedy = temps == 0
    np.testing.assert_array_equal(got[greedy], expected[greedy])


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_one_is_argmax(dtype):
    rng = np.random.default_rng(4)
    x = random_array((6, 45), dtype, rng, scale=3.0)
    x[np.arange(6), rng.integers(0, 45, 6)] = 20.0  # a unique max in every row
    expected = np.argmax(x.astype(np.float32), axis=1)
    seeds = np.arange(6, dtype=np.int64)
    np.testing.assert_array_equal(_draw(x, top_k=1, seed=seeds), expected)
    np.testing.assert_array_equal(_draw(x, top_k=1, temperature=5.0, seed=seeds), expected)


def test_special_rows_return_argmax():
    x = np.zeros((3, 20), np.float32)
    x[0, 7] = np.nan
    x[1, 3] = np.inf
    x[2, :] = -np.inf
    np.testing.assert_array_equal(_draw(x, seed=2), [7, 3, 0])


# ---- reproducibility, per-row parameters -------------------------------------------------------

def test_reproducible_and_seeds_independent():
    rng = np.random.default_rng(5)
    x = np.tile(random_array((1, 24), "bfloat16", rng, scale=0.3), (48, 1))  # nearly flat
    seeds = rng.integers(-2**63, 2**63 - 1, 48, dtype=np.int64)
    first = _draw(x, seed=seeds)
    np.testing.assert_array_equal(_draw(x, seed=seeds), first)
    assert len(set(first.tolist())) >= 12  # 48 draws of a nearly uniform 24-token row
    same = _draw(x, seed=int(seeds[0]))     # a scalar seed is every row's seed
    assert (same == first[0]).all()


@pytest.mark.parametrize("dtype,vocab", [("bfloat16", 40), ("float16", 37), ("float32", 61)])
def test_per_row_arrays_equal_rows_one_by_one(dtype, vocab):
    """Array parameters give each row what that row alone gets with scalars, whatever the
    batch's layout (vocab 37 / 61: unaligned rows in the batch, some aligned alone)."""
    rng = np.random.default_rng(vocab)
    rows = 6
    x = random_array((rows, vocab), dtype, rng, scale=2.0)
    params = dict(
        temperature=np.array([0.7, 0.0, 1.5, 1.0, 0.3, 2.0], np.float32),
        top_k=np.array([0, 5, 3, 0, 10, 0], np.int32),
        top_p=np.array([1.0, 0.8, 0.5, 0.9, 1.0, 0.3], np.float32),
        min_p=np.array([0.0, 0.0, 0.1, 0.05, 0.0, 0.2], np.float32),
        seed=rng.integers(0, 2**40, rows).astype(np.int64))
    batch = _draw(x, **params)
    xd = _dev(x)
    for r in range(rows):
        alone = sample(xd[r:r + 1], temperature=float(params["temperature"][r]),
                       top_k=int(params["top_k"][r]), top_p=float(params["top_p"][r]),
                       min_p=float(params["min_p"][r]), seed=int(params["seed"][r]))
        assert int(host_copy(alone)[0]) == batch[r], f"row {r}"
        keep = kept(x[r], params["temperature"][r] or 1.0, int(params["top_k"][r]),
                    float(params["top_p"][r]), float(params["min_p"][r]))
        assert params["temperature"][r] == 0 or keep[batch[r]], f"row {r}: excluded token"


# ---- filters: exact kept sets ------------------------------------------------------------------

@pytest.mark.parametrize("config", ["simulator_sizes", "gpu_sizes"])
def test_filters_exact_on_flat_rows(config):
    """Nearly flat rows, where a wrong threshold lets many excluded tokens through; with ties at
    the top-k boundary (all kept). ``gpu_sizes``: the GPU's histogram sizes (512 bins, 11-bit
    digits), and a block of 64 threads (warp-shuffle reductions)."""
    sizes = {"bins": 512, "digit_bits": 11} if config == "gpu_sizes" else {}
    with overrides(sample=sizes):
        _flat_rows_case(config)


def _flat_rows_case(config):
    rng = np.random.default_rng(6)
    vocab = 1100 if config == "gpu_sizes" else 150
    rows = 4 if config == "gpu_sizes" else 16
    row = (rng.standard_normal(vocab) * 0.05).astype(np.float32)
    row[rng.choice(vocab, 6, replace=False)] = 1.0  # a 6-way tie across the top-5 boundary
    x = np.tile(row, (rows, 1))
    seeds = np.arange(rows, dtype=np.int64) * 7919
    cases = [dict(top_k=5), dict(top_k=40), dict(top_p=0.3), dict(top_k=50, top_p=0.5),
             dict(min_p=0.96)]
    for params in cases:
        got = _draw(x, seed=seeds, **params)
        keep = kept(row, 1.0, **params)
        assert keep[got].all(), f"{params}: drew excluded tokens {got[~keep[got]]}"
        if params == dict(top_k=5):
            assert keep.sum() == 6


@pytest.mark.parametrize("dtype", DTYPES)
def test_thresholds_in_one_bin_and_far_bin(dtype):
    """Logits closer together than a histogram bin (the radix select separates them) and beyond
    the last bin (the catch-all), top-k and top-p."""
    rng = np.random.default_rng(8)
    vocab = 60
    row = np.full(vocab, -40.0, np.float32)                      # the catch-all bin
    top = rng.choice(vocab, 12, replace=False)
    row[top] = 3.0 + np.arange(12, dtype=np.float32) * 2.0**-6   # 12 values in 1/5 of a bin
    row = row.astype(random_array((1,), dtype, rng).dtype)
    x = np.tile(row, (24, 1))
    seeds = np.arange(24, dtype=np.int64)
    for params in [dict(top_k=4, temperature=0.01), dict(top_k=30), dict(top_k=20, top_p=0.9),
                   dict(top_p=0.6, temperature=0.005)]:
        got = _draw(x, seed=seeds, **params)
        keep = kept(row, params.get("temperature", 1.0), params.get("top_k", 0),
                    params.get("top_p", 1.0))
        assert keep[got].all(), f"{params}: drew excluded tokens"


# ---- statistics --------------------------------------------------------------------------------

def _stat_row():
    rng = np.random.default_rng(11)
    return (rng.standard_normal(16) * 1.5).astype(np.float32)


def _stat_cases():
    row = _stat_row()
    return {
        "plain": dict(temperature=0.8),
        "top_k": dict(temperature=1.3, top_k=5),
        "top_p": dict(temperature=1.0, top_p=_midpoint_top_p(row, 1.0, rank=4)),
        "min_p": dict(temperature=0.9, min_p=_midpoint_min_p(row, 0.9, rank=7)),
        "all": dict(temperature=1.1, top_k=8, top_p=_midpoint_top_p(row, 1.1, top_k=8, rank=6),
                    min_p=_midpoint_min_p(row, 1.1, rank=5)),
    }


@pytest.mark.parametrize("case", list(_stat_cases()))
def test_distribution_matches_reference_and_torch(case):
    """``DRAWS`` rows of the same logits with different seeds: the token frequencies fit the
    exact float64 distribution, and torch.multinomial's on vLLM's sort-based filtering."""
    import torch

    params = _stat_cases()[case]
    row = _stat_row()
    x = np.tile(row, (DRAWS, 1))
    seeds = np.random.default_rng(12).integers(0, 2**63 - 1, DRAWS, dtype=np.int64)
    got = _draw(x, seed=seeds, **params)
    probs = probabilities(row[None], **params)[0]
    assert (probs[got] > 0).all(), "drew a token outside the kept set"
    counts = np.bincount(got, minlength=row.size)
    assert _goodness_of_fit(counts, probs) > P_VALUE

    reference = torch_probabilities(row[None], **params)
    np.testing.assert_allclose(reference[0].numpy(), probs, atol=1e-12)
    generator = torch.Generator().manual_seed(13)
    theirs = torch.multinomial(reference, DRAWS, replacement=True, generator=generator)
    their_counts = np.bincount(theirs[0].numpy(), minlength=row.size)
    assert _two_sample(counts, their_counts) > P_VALUE


def test_chi_square_rejects_a_wrong_sampler():
    """The goodness-of-fit check has power: draws from the unfiltered distribution fail the
    top-k test, and draws at temperature 1 fail the 0.8 test."""
    row = _stat_row()
    rng = np.random.default_rng(14)
    for wrong, right in [(dict(temperature=1.3), dict(temperature=1.3, top_k=5)),
                         (dict(temperature=1.0), dict(temperature=0.8))]:
        draws = rng.choice(row.size, DRAWS, p=probabilities(row[None], **wrong)[0])
        counts = np.bincount(draws, minlength=row.size)
        assert _goodness_of_fit(counts, probabilities(row[None], **right)[0]) < P_VALUE


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_input():
    rng = np.random.default_rng(15)
    x = _dev(random_array((3, 16), "float32", rng))
    with pytest.raises(TypeError, match="logits"):
        sample([[1.0, 2.0]])
    with pytest.raises(TypeError, match="logits: expected dtype"):
        sample(_dev(np.zeros((2, 4), np.int32)))
    with pytest.raises(ValueError, match="logits: expected 2 dimensions"):
        sample(_dev(np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        sample(_dev(np.zeros((2, 0), np.float32)))
    with pytest.raises(ValueError, match="contiguous"):
        sample(_dev(np.zeros((4, 6), np.float32))[:, ::2])
    with pytest.raises(ValueError, match="temperature: expected a finite float >= 0, got -1"):
        sample(x, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        sample(x, temperature=float("inf"))
    with pytest.raises(TypeError, match="temperature"):
        sample(x, temperature="1")
    with pytest.raises(ValueError, match=r"top_p: expected a float in \(0, 1\], got 0"):
        sample(x, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sample(x, top_p=1.5)
    with pytest.raises(ValueError, match=r"min_p: expected a float in \[0, 1\], got -0.1"):
        sample(x, min_p=-0.1)
    with pytest.raises(ValueError, match="min_p"):
        sample(x, min_p=1.01)
    with pytest.raises(ValueError, match="top_k: expected an int >= 0"):
        sample(x, top_k=-1)
    with pytest.raises(TypeError, match="top_k: expected an int"):
        sample(x, top_k=2.0)
    with pytest.raises(TypeError, match="top_k"):
        sample(x, top_k=True)
    with pytest.raises(TypeError, match="seed: expected an int"):
        sample(x, seed=1.5)
    with pytest.raises(TypeError, match="top_k: expected dtype int32, got int64"):
        sample(x, top_k=_dev(np.zeros(3, np.int64)))
    with pytest.raises(TypeError, match="temperature: expected dtype float32, got float64"):
        sample(x, temperature=_dev(np.ones(3, np.float64)))
    with pytest.raises(TypeError, match="seed: expected dtype int64"):
        sample(x, seed=_dev(np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match=r"top_p: expected shape \(3,\)"):
        sample(x, top_p=_dev(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match=r"out: expected shape \(3,\)"):
        sample(x, out=_dev(np.zeros(2, np.int64)))
    with pytest.raises(TypeError, match="out: expected dtype int64"):
        sample(x, out=_dev(np.zeros(3, np.int32)))


def test_out_of_range_arrays_stay_in_bounds():
    """Array parameters are not checked: out-of-range values still give in-vocabulary ids."""
    rng = np.random.default_rng(16)
    x = random_array((6, 21), "float32", rng)
    got = _draw(x, temperature=np.array([-1, np.nan, np.inf, 1, 1, 1], np.float32),
                top_k=np.array([2**31 - 1, -5, 100, 0, 21, 3], np.int32),
                top_p=np.array([2.0, -1.0, np.nan, 0.0, 1e-9, 1.0], np.float32),
                min_p=np.array([5.0, -1.0, np.nan, 1.0, 0.0, 2.0], np.float32),
                seed=np.arange(6, dtype=np.int64))
    assert ((got >= 0) & (got < 21)).all()


def test_zero_rows_and_allocation():
    empty = sample(_dev(np.zeros((0, 8), np.float32)))
    assert host_copy(empty).shape == (0,)
    rng = np.random.default_rng(17)
    got = sample(_dev(random_array((2, 8), "float16", rng)), temperature=0.0)
    assert host_copy(got).dtype == np.int64


# ---- GPU ---------------------------------------------------------------------------------------

VOCAB = 128256


@pytest.mark.gpu
def test_gpu_llama_vocab():
    """64 x 128256 bf16 (Llama-3's vocabulary): greedy equals argmax; the same seeds give the
    same tokens; a peaked distribution's draws fit the exact probabilities; filters hold."""
    import torch

    from llmspeed_numba import argmax

    rows = 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    assert torch.equal(sample(x, temperature=0.0), argmax(x))
    assert torch.equal(sample(x, temperature=0.0), x.float().argmax(dim=-1))
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 1000003
    a = sample(x, temperature=1.0, top_p=0.9, seed=seeds)
    b = sample(x, temperature=1.0, top_p=0.9, seed=seeds)
    assert torch.equal(a, b)
    for params in [dict(top_k=50), dict(top_p=0.9), dict(top_k=100, top_p=0.8, min_p=0.01)]:
        got = sample(x, seed=seeds, **params).cpu().numpy()
        host = x.float().cpu().numpy()
        for r in range(0, rows, 8):
            assert kept(host[r], 1.0, **params)[got[r]], params

    # a peaked row: 20 tokens above a 128k-token floor, drawn 4096 times (one row each)
    draws = 4096
    row = torch.full((VOCAB,), -8.0, device="cuda")
    top = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:20].cuda()
    row[top] = torch.linspace(0.0, 3.0, 20, device="cuda")
    row = row.to(torch.bfloat16)
    xs = row.expand(draws, VOCAB).contiguous()
    seeds = torch.arange(draws, device="cuda", dtype=torch.int64)
    for params in [dict(temperature=1.0), dict(temperature=0.7, top_k=10),
                   dict(temperature=1.0, top_p=0.8)]:
        got = sample(xs, seed=seeds, **params).cpu().numpy()
        probs = probabilities(row.float().cpu().numpy()[None], **params)[0]
        assert (probs[got] > 0).all()
        counts = np.bincount(got, minlength=VOCAB)
        assert _goodness_of_fit(counts, probs) > P_VALUE, params
