"""Tensor parallelism (``llmspeed_numba/distributed/``, ``engine/tp.py``).

CPU (CI, simulator):
- sharding: every weight of a tiny Llama (GQA; fewer KV heads than ranks; q / k / v and o
  biases; tied and untied embeddings) split over ranks, each rank's model fused from its shards,
  and the ranks' fused weights reassembled into the one-GPU model's, element for element; each
  rank's KV cache holds its KV heads only;
- a 2-rank model in two processes over gloo (the simulator runs our kernels in each): the
  collectives; prefill and decode logits against the float64 forward with the bound
  ``test_models`` derives; the greedy winners' exchange equal to the argmax of the gathered
  logits; greedy tokens equal to the 1-rank model's (wherever the float64 forward has a clear
  winner: tensor parallelism rounds the row-parallel partial sums to bf16 before their sum);
- ``LLM(..., tensor_parallel_size=2)``: its tokens those of ``tensor_parallel_size=1``;
- bad arguments.

GPU suite (two GPUs or more): the same equalities over NCCL, with CUDA-graph decode.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_models import _bf16, _check_logits, _config, _weights, reference_logits  # noqa: E402

from llmspeed_numba import LLM, SIMULATOR, SamplingParams, have_gpu  # noqa: E402
from llmspeed_numba.distributed import (check_tensor_parallel, run, shard_config,  # noqa: E402
                                        shard_tensor, shard_weights)
from llmspeed_numba.distributed.launch import env_rank  # noqa: E402
from llmspeed_numba.distributed.sharding import kv_heads  # noqa: E402
from llmspeed_numba.models.llama import LlamaModel  # noqa: E402
from llmspeed_numba.models.model import Model  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402
from llmspeed_numba.ops.gemm_gated import deinterleave_gate_up  # noqa: E402

GPUS = 0 if SIMULATOR or not have_gpu() else torch.cuda.device_count()
#: tests that start two ranks: on the CPU over gloo (the simulator) or on two GPUs
two_ranks = pytest.mark.skipif(not SIMULATOR and GPUS < 2,
                               reason="starts 2 ranks: the CPU's (simulator) or 2 GPUs")
PROMPTS = [[3, 17, 42, 8, 61, 5, 29], [11, 2, 50]]
FED = [7, 60]


# ---- sharding ---------------------------------------------------------------------------------

def _dense(w):
    return w.T if isinstance(w, torch.Tensor) else w


def _fused(llama):
    """The fused weights of a ``LlamaModel``'s first layer, as (out_features, in_features)."""
    layer = llama.layers[0]
    return dict(qkv=layer.qkv_t.T, qkv_bias=layer.qkv_bias, o=layer.o_t.T, o_bias=layer.o_bias,
                gate_up=layer.gate_up_t.T, down=layer.down_t.T, embed=llama.embed,
                lm_head=llama.lm_head_t.T, norm=llama.norm, input_norm=layer.input_norm)


def _gate_up(llama, w):
    """(gate, up) of a fused gate_up weight, interleaved or not as ``llama`` fused it."""
    if llama.gated_mlp:
        return deinterleave_gate_up(w)
    half = w.shape[0] // 2
    return w[:half], w[half:]


@pytest.mark.parametrize("heads, kv, inter, size, tied", [
    (4, 2, 64, 2, False),      # GQA: a KV head per rank
    (4, 1, 64, 4, True),       # fewer KV heads than ranks: each rank keeps a copy of one
    (8, 2, 64, 4, False),      # two query heads a rank sharing a KV head kept by two ranks
    (4, 4, 48, 2, False),      # 24 intermediate features a rank: not whole gate blocks of 8
])
def test_shards_reassemble_into_the_fused_weights(heads, kv, inter, size, tied):
    c = _config(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                num_hidden_layers=1, tie_word_embeddings=tied)
    weights = _weights(c)
    assert ("lm_head.weight" in weights) != tied
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.randn(
        c.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    full_model = LlamaModel(c, weights, torch.bfloat16)
    full = _fused(full_model)
    d, nq_r = c.head_dim, heads // size
    q_rows, kv_rows = heads * d, kv * d
    ranks, parts = [], []
    for r in range(size):
        rc = shard_config(c, size)
        assert (rc.num_attention_heads, rc.num_key_value_heads, rc.intermediate_size,
                rc.vocab_size) == (nq_r, max(kv // size, 1), inter // size, c.vocab_size // size)
        shards = shard_weights(weights, c, r, size)
        assert ("model.layers.0.self_attn.o_proj.bias" in shards) == (r == 0)
        model = LlamaModel(rc, shards, torch.bfloat16)
        ranks.append(model)
        parts.append(_fused(model))
        cache = model.new_cache(2)
        assert tuple(cache.k_cache[0].shape[2:]) == (rc.num_key_value_heads, d)

    # q / k / v: each rank's fused rows are its q heads, then its KV heads' k, then v
    first_kv = {}
    for r, p in enumerate(parts):
        k_first, k_count = kv_heads(c, r, size)
        nk_r = k_count * d
        for name in ("qkv", "qkv_bias"):
            w, f = p[name], full[name]
            assert w.shape[0] == nq_r * d + 2 * nk_r
            assert torch.equal(w[:nq_r * d], f[r * nq_r * d:(r + 1) * nq_r * d])
            assert torch.equal(w[nq_r * d:nq_r * d + nk_r],
                               f[q_rows + k_first * d:q_rows + k_first * d + nk_r])
            assert torch.equal(w[nq_r * d + nk_r:],
                               f[q_rows + kv_rows + k_first * d:
                                 q_rows + kv_rows + k_first * d + nk_r])
        # the rank's query heads all read KV heads it holds
        for h in range(r * nq_r, (r + 1) * nq_r):
            assert k_first <= h // (heads // kv) < k_first + k_count
        first_kv.setdefault(k_first, p["qkv"][nq_r * d:])
    kv_parts = [first_kv[k] for k in sorted(first_kv)]
    k_count = kv_heads(c, 0, size)[1] * d
    assert torch.equal(torch.cat([w[:k_count] for w in kv_parts]), full["qkv"][q_rows:q_rows
                                                                              + kv_rows])
    assert torch.equal(torch.cat([w[k_count:] for w in kv_parts]),
                       full["qkv"][q_rows + kv_rows:])

    # o_proj / down_proj: columns; o_proj's bias on rank 0 alone
    assert torch.equal(torch.cat([p["o"] for p in parts], 1), full["o"])
    assert torch.equal(torch.cat([p["down"] for p in parts], 1), full["down"])
    assert torch.equal(parts[0]["o_bias"], full["o_bias"])
    assert all(p["o_bias"] is None for p in parts[1:])

    # gate / up: rows of the intermediate; stacked, the interleaved weights are the full one
    gates, ups = zip(*(_gate_up(m, p["gate_up"]) for m, p in zip(ranks, parts)))
    full_gate, full_up = _gate_up(full_model, full["gate_up"])
    assert torch.equal(torch.cat(gates), full_gate) and torch.equal(torch.cat(ups), full_up)
    if all(m.gated_mlp for m in ranks):
        assert torch.equal(torch.cat([p["gate_up"] for p in parts]), full["gate_up"])
    else:
        assert (inter // size) % 8 and full_model.gated_mlp

    # vocabulary slices; norms whole
    assert torch.equal(torch.cat([p["embed"] for p in parts]), full["embed"])
    assert torch.equal(torch.cat([p["lm_head"] for p in parts]), full["lm_head"])
    for p in parts:
        assert torch.equal(p["norm"], full["norm"])
        assert torch.equal(p["input_norm"], full["input_norm"])


def test_random_weights_drawn_as_shards_are_the_shards_of_the_whole():
    c = preset_config("tiny", num_hidden_layers=1, vocab_size=64)
    whole = random_weights(c, seed=4)
    for r in range(2):
        drawn = random_weights(c, seed=4, keep=lambda n, t: shard_tensor(n, t, c, r, 2))
        expected = shard_weights(whole, c, r, 2)
        assert drawn.keys() == expected.keys()
        assert all(torch.equal(drawn[n], expected[n]) for n in drawn)
        assert all(drawn[n].is_contiguous() for n in drawn)


def test_bad_tensor_parallel_arguments():
    c = _config(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(TypeError, match="tensor_parallel_size: expected an int, got float"):
        check_tensor_parallel(c, 2.0)
    with pytest.raises(TypeError, match="tensor_parallel_size: expected an int, got bool"):
        check_tensor_parallel(c, True)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected an int >= 1, got 0"):
        check_tensor_parallel(c, 0)
    with pytest.raises(ValueError, match="3 does not divide the model's num_attention_heads 4"):
        check_tensor_parallel(c, 3)
    with pytest.raises(ValueError, match="4 does not divide the model's intermediate_size 66"):
        check_tensor_parallel(_config(num_attention_heads=4, intermediate_size=66), 4)
    with pytest.raises(ValueError, match="4 does not divide the model's vocab_size 66"):
        check_tensor_parallel(_config(num_attention_heads=4, vocab_size=66), 4)
    with pytest.raises(ValueError, match="must divide num_key_value_heads 3, or be a multiple"):
        check_tensor_parallel(_config(num_attention_heads=12, num_key_value_heads=3), 2)
    with pytest.raises(NotImplementedError, match="quantization='gguf'"):
        check_tensor_parallel(c, 2, "gguf")
    assert check_tensor_parallel(c, 1, "gguf") == 1
    with pytest.raises(ValueError, match="no tensor-parallel sharding rule for tensor 'x.w'"):
        shard_tensor("x.w", torch.zeros(2), c, 0, 2)
    with pytest.raises(ValueError, match="MASTER_PORT not set"):
        env_rank({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"})
    with pytest.raises(ValueError, match="RANK must be in"):
        env_rank({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                  "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE must be an int, got 'two'"):
        env_rank({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                  "MASTER_PORT": "1"})
    for bad, error in ((0, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="tensor_parallel_size"):
            LLM(_config(), load_format="dummy", tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide the model's "
                                         "num_attention_heads 3"):
        LLM(_config(num_attention_heads=3, num_key_value_heads=1), load_format="dummy",
            tensor_parallel_size=2)


# ---- a 2-rank model over gloo -------------------------------------------------------------------

def _tp_config():
    return _config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)


def _model_steps(model, prompts, fed, greedy=True):
    """A packed prefill of ``prompts`` (every position's logits), then one decode step fed
    ``fed``: its logits, and with ``greedy`` its greedy tokens (the same step run again)."""
    arrays = [np.asarray(p) for p in prompts]
    cache, seqs = model._new_cache(arrays, 1)
    prefill = model.llama.forward(model._prefill_step(cache, seqs, arrays), cache,
                                  all_logits=True)
    step = model._decode_step(cache, seqs, fed)
    decode = model.llama.forward(step, cache)
    return prefill, decode, model.llama.greedy(step, cache) if greedy else None, cache


def _rank_job(comm, config, seed, prompts, fed, new_tokens):
    """One rank's share of the checks (run by ``distributed.run`` in each process)."""
    import torch

    from llmspeed_numba.distributed import TensorParallel

    dev = comm.device

    def host(t):
        return t.cpu().numpy()

    out = {}
    # the collectives, on values that differ by rank
    x = torch.arange(6, dtype=torch.float32, device=dev).reshape(2, 3) * (comm.rank + 1)
    out["all_reduce"] = host(comm.all_reduce(x.clone()))
    out["all_gather"] = host(comm.all_gather(x))
    tp = TensorParallel(comm, 8)
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [-1.0, -2.0, -3.0, -4.0],
                           [0.0, 2.0, float("nan"), 0.0], [3.0, 1.0, 0.0, 3.0]])
    logits[1] += comm.rank                                          # rank 1 wins row 1
    if comm.rank == 1:
        logits[2] = torch.tensor([9.0, 9.0, 9.0, 9.0])              # NaN on rank 0 wins
        logits[3] = torch.tensor([3.0, 3.0, 0.0, 0.0])              # a tie: rank 0's wins
    logits = logits.to(dev)
    out["winners"] = host(tp.argmax(logits, torch.argmax(logits, dim=1)))
    out["gathered"] = host(tp.gather_logits(logits))
    out["local_ids"] = host(tp.local_ids(torch.arange(8, device=dev)))

    model = Model(config, None, _weights(config, seed), tp=comm)
    prefill, decode, greedy, cache = _model_steps(model, prompts, fed)
    out.update(prefill=host(prefill), decode=host(decode), greedy=host(greedy),
               kv_heads=cache.k_cache[0].shape[2])
    if new_tokens:
        out["generated"] = model.generate_greedy(prompts, new_tokens)
    return out


def _agree_where_clear(got, expected, config, weights, prompt, what):
    """``got`` and ``expected`` (greedy continuations of ``prompt``) equal, or first differing
    where the float64 forward's top two logits are closer than the bf16 rounding can move."""
    ids = list(prompt)
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            exact = reference_logits(config, weights, ids)[-1]
            plain = reference_logits(config, weights, ids, _bf16)[-1]
            noise = 2 * np.abs(plain - exact).max() + 1e-3 * np.abs(exact).max()
            top2 = np.sort(exact)[-2:]
            assert top2[1] - top2[0] <= 2 * noise, (
                f"{what}: token {i} is {a}, expected {b}, and the float64 forward's winner "
                f"leads by {top2[1] - top2[0]:.3g} (rounding moves logits by {noise:.3g})")
            return
        ids.append(b)
    assert len(got) == len(expected), f"{what}: {len(got)} tokens, expected {len(expected)}"


@two_ranks
def test_two_ranks_over_gloo():
    """One spawn of two ranks for every check of the model split over them (an xdist worker
    each would start its own): the collectives, the logits, the greedy tokens."""
    c = _tp_config()
    results = run(_rank_job, 2, c, 0, PROMPTS, FED, 0)
    weights = _weights(c)
    one = _model_steps(Model(c, None, weights), PROMPTS, FED, greedy=False)[1].cpu().numpy()

    # the collectives
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for r, out in enumerate(results):
        np.testing.assert_array_equal(out["all_reduce"], 3 * x)
        np.testing.assert_array_equal(out["all_gather"], np.stack([x, 2 * x]))
        assert out["local_ids"].tolist() == [t - 4 * r for t in range(8)]
    whole = np.concatenate([out["gathered"][:, 4 * r:4 * (r + 1)]
                            for r, out in enumerate(results)], axis=1)
    for out in results:
        np.testing.assert_array_equal(out["gathered"], whole)
        # the winners' exchange is one argmax over the whole row (NaN first, ties to the lowest)
        assert out["winners"].tolist() == torch.argmax(torch.from_numpy(whole), 1).tolist()
        assert out["winners"].tolist() == [1, 4, 2, 0]

    # the model: logits against the float64 forward, greedy tokens against one rank's
    bounds = np.cumsum([0] + [len(p) for p in PROMPTS])
    for r, out in enumerate(results):
        assert out["kv_heads"] == 1
        for b, prompt in enumerate(PROMPTS):
            _check_logits(out["prefill"][bounds[b]:bounds[b + 1]], c, weights, prompt,
                          f"rank {r}: prefill of prompt {b}")
            _check_logits(out["decode"][b], c, weights, prompt + [FED[b]],
                          f"rank {r}: decode of prompt {b}", rows=-1)
            _agree_where_clear([int(out["greedy"][b])], [int(np.argmax(one[b]))], c, weights,
                               prompt + [FED[b]], f"rank {r}, prompt {b}")
        # the greedy winners' exchange picks the argmax of the gathered logits, exactly
        assert out["greedy"].tolist() == np.argmax(out["decode"], axis=1).tolist()
    np.testing.assert_array_equal(results[0]["prefill"], results[1]["prefill"])


@two_ranks
def test_engine_with_two_ranks_equals_one():
    c = preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    prompt, sampling = [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)
    llm = LLM(c, load_format="dummy", tensor_parallel_size=2, max_model_len=32, seed=0)
    try:
        assert llm.cache.k_cache[0].shape[2] == 1          # tiny: 1 KV head, kept by both
        got = llm.generate([prompt], sampling)[0].token_ids
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()
    expected = LLM(c, load_format="dummy", max_model_len=32, seed=0).generate(
        [prompt], sampling)[0].token_ids
    weights = random_weights(c, seed=0, dtype=torch.bfloat16,  # drawn where the engine draws
                             device="cpu" if SIMULATOR else "cuda")
    _agree_where_clear(got, expected, c, weights, prompt, "LLM(tensor_parallel_size=2)")


@two_ranks
def test_engine_start_failure_leaves_no_group():
    with pytest.raises(TypeError, match="kv_cache_memory: expected a fraction"):
        LLM(_tp_config(), load_format="dummy", tensor_parallel_size=2, kv_cache_memory="all")
    assert not torch.distributed.is_initialized()


def test_cli_tensor_parallel_size(capsys):
    from llmspeed_numba.cli import main

    cases = [(["generate", "hi", "--tensor-parallel-size", "0"], "expected at least 1, got 0")]
    if SIMULATOR:
        cases.append((["generate", "hi", "--tensor-parallel-size", "2"], "needs GPUs"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


# ---- GPU suite ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs or more")
def test_gpu_two_ranks_match_one():
    """Over NCCL on 2 GPUs: logits against the float64 forward, greedy winners, and the
    generated tokens (decode replayed from CUDA graphs with the collectives captured)."""
    c = _tp_config()
    results = run(_rank_job, 2, c, 0, PROMPTS, FED, 8)
    weights = _weights(c)
    one = Model(c, None, weights).generate_greedy(PROMPTS, 8)
    for r, out in enumerate(results):
        for b, prompt in enumerate(PROMPTS):
            _check_logits(out["decode"][b], c, weights, prompt + [FED[b]],
                          f"rank {r}: decode of prompt {b}", rows=-1)
            _agree_where_clear(out["generated"][b], one[b], c, weights, prompt,
                               f"rank {r}, prompt {b}")
        assert out["greedy"].tolist() == np.argmax(out["decode"], axis=1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs or more")
@pytest.mark.parametrize("size", [2, 4, 8])
def test_gpu_engine_greedy_tokens_equal_one_gpu(size):
    """``LLM(tensor_parallel_size=size)`` against one GPU on Llama-3-8B layer shapes (two
    layers, 2 KV heads: replicated at 4 and 8 GPUs), prompts of several lengths together."""
    if size > GPUS:
        pytest.skip(f"needs {size} GPUs")
    c = preset_config("llama-3-8b", num_hidden_layers=2, num_key_value_heads=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (17, 100)]
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    kwargs = dict(load_format="dummy", max_model_len=256, seed=0, kv_cache_memory=0.2)
    llm = LLM(c, tensor_parallel_size=size, **kwargs)
    try:
        got = [o.token_ids for o in llm.generate(prompts, sampling)]
        assert llm.decode_stats.steps > 0                   # decodes replayed from graphs
    finally:
        llm.close()
    del llm
    expected = [o.token_ids for o in LLM(c, **kwargs).generate(prompts, sampling)]
    # the dummy weights, as the engine drew them on the GPU, for the float64 forward
    weights = {k: v.cpu() for k, v in random_weights(c, seed=0, dtype=torch.bfloat16,
                                                      device="cuda").items()}
    for b, prompt in enumerate(prompts):
        _agree_where_clear(got[b], expected[b], c, weights, prompt, f"{size} GPUs, prompt {b}")
