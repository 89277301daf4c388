"""The engine (``llmspeed_numba/engine/llm.py``, ``runner.py``) on a tiny random model.

Simulator (CI): continuous batching with chunked prefill (a token budget smaller than a prompt,
so a chunk continues over the paged cache) gives each prompt the tokens of the plain greedy loop
(``Model.generate_greedy``) on the same weights; bad requests are refused alone; the CLI's
``generate`` runs the whole path. GPU suite: the same equality on SmolLM2 with many requests
(admissions as others finish, preemption from a small cache, CUDA-graph decode), sampling
reproducibility, and streaming.
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from llmspeed_numba import LLM, SIMULATOR, SamplingParams, have_gpu  # noqa: E402
from llmspeed_numba.models.model import Model  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402

GPU = not SIMULATOR and have_gpu()
#: KV cache for the tests' engines on a GPU: plenty for their prompts, where the default (90 %
#: of the free memory) would starve the GPU suite's other processes running beside them; the
#: simulator's default is already small
KV_CACHE_MEMORY = (1 << 30) if GPU else 0.9


def _tiny():
    return preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)


def test_chunked_continuous_batching_equals_the_plain_loop():
    config = _tiny()
    llm = LLM(config, load_format="dummy", max_num_seqs=2, max_num_batched_tokens=4, seed=0,
              kv_cache_memory=KV_CACHE_MEMORY)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2))
    # the engine draws its dummy weights on its device (CUDA's generator on a GPU): the same here
    weights = random_weights(config, seed=0, device="cuda" if GPU else "cpu")
    expected = Model(config, None, weights).generate_greedy(prompts, 2)
    assert [o.token_ids for o in outs] == expected
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert not llm.has_unfinished() and llm.cache.num_free_pages == llm.cache.num_blocks - 1


def test_bad_requests_fail_alone():
    llm = LLM(_tiny(), load_format="dummy", max_num_seqs=2, max_model_len=16, seed=0,
              kv_cache_memory=KV_CACHE_MEMORY)
    outs = llm.generate([[1, 2], [], [3] * 20, [4], [5, 64], "text"],
                        [SamplingParams(max_tokens=1), SamplingParams(),
                         SamplingParams(), SamplingParams(top_p=2.0), SamplingParams(),
                         SamplingParams()])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 1
    errors = [o.error for o in outs[1:]]
    assert all(o.finish_reason == "error" and not o.token_ids for o in outs[1:])
    assert "empty prompt" in errors[0]
    assert "longer than max_model_len 16" in errors[1]
    assert "top_p: expected a number in (0, 1]" in errors[2]
    assert "token ids must be ints in [0, 64)" in errors[3]
    assert "no tokenizer" in errors[4]
    with pytest.raises(ValueError, match="max_tokens"):
        llm.add_request([1], SamplingParams(max_tokens=0))
    with pytest.raises(TypeError, match="sampling: expected SamplingParams"):
        llm.add_request([1], {"max_tokens": 1})
    with pytest.raises(ValueError, match="load_format"):
        LLM(_tiny(), load_format="pt")
    with pytest.raises(ValueError, match="max_model_len: expected an int in"):
        LLM(_tiny(), load_format="dummy", max_model_len=10**6)


def test_cli_generate_runs_the_tiny_model(tmp_path):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the command restarts itself in the simulator
    if GPU:
        pytest.skip("on a GPU the command loads the real model (test_models_gpu covers it)")
    run = subprocess.run([sys.executable, "-m", "llmspeed_numba", "generate", "Hi",
                          "--max-new-tokens", "1"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert "tiny random-weight model" in run.stderr
    assert "time to first token" in run.stderr


# ---- GPU suite -------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


def _smollm2_prompts(tokenizer, n):
    topics = ["the sea", "numbers", "a cat", "Paris", "rain", "music", "trees", "the moon",
              "bread", "trains", "winter", "a robot"]
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write two sentences about {topics[i % len(topics)]}."}]),
        add_special_tokens=False) for i in range(n)]


def _gguf():
    from test_models_gpu import _smollm2_gguf

    return _smollm2_gguf()


def _check_same_or_tie(model, prompt, got, want, what):
    """``got`` equals ``want`` (the plain loop's greedy tokens), or first differs where the plain
    loop's own top-2 logits are within 4 bf16 steps: batches of other sizes take other GEMM
    tiles, which round differently. Returns the tokens compared."""
    import math

    for i, (a, w) in enumerate(zip(got, want)):
        if a != w:
            logits = model.prefill_logits([prompt + want[:i]])[0][-1]
            top2 = logits.topk(2).values.tolist()
            ulp = 2.0 ** (math.floor(math.log2(abs(top2[0]))) - 7)
            assert top2[0] - top2[1] <= 4 * ulp, (
                f"{what}: token {i} is {a}, the plain loop's {w}, whose top-2 logits {top2} "
                f"are {top2[0] - top2[1]:.4g} apart, more than 4 bf16 steps ({4 * ulp:.4g})")
            return i
    assert len(got) == len(want), what
    return len(got)


@pytest.mark.gpu
@gpu
def test_gpu_engine_greedy_equals_each_prompt_alone():
    """12 requests through 4 slots and a small token budget (chunked prefill, admissions as
    others finish), then with a cache so small that sequences are preempted and recomputed:
    every request's greedy tokens equal the plain loop's for that prompt alone (up to a tie)."""
    from llmspeed_numba.models import load_model

    path = _gguf()
    model = load_model(path)
    prompts = _smollm2_prompts(model.tokenizer, 12)
    expected = [model.generate_greedy([p], 24, stop_at_eos=False)[0] for p in prompts]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    c = model.config
    page_bytes = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 2
    for kwargs in (dict(max_num_seqs=4, max_num_batched_tokens=64,
                        kv_cache_memory=KV_CACHE_MEMORY),
                   # 24 pages of 16 tokens for 8 sequences of about 55 tokens: preemptions
                   dict(max_num_seqs=8, kv_cache_memory=24 * page_bytes)):
        llm = LLM(path, **kwargs)
        outs = llm.generate(prompts, params)
        compared = [_check_same_or_tie(model, p, o.token_ids, e, f"{kwargs} prompt {i}")
                    for i, (p, o, e) in enumerate(zip(prompts, outs, expected))]
        print(kwargs, "pages", llm.cache.num_blocks, "preemptions", llm.num_preemptions,
              "tokens equal", sum(compared), "of", 24 * len(prompts))
        assert sum(compared) >= 0.75 * 24 * len(prompts)
    assert llm.num_preemptions > 0  # the small cache did preempt


@pytest.mark.gpu
@gpu
def test_gpu_engine_sampling_is_reproducible_and_streams():
    llm = LLM(_gguf(), max_num_seqs=8, kv_cache_memory=KV_CACHE_MEMORY)
    prompts = _smollm2_prompts(llm.tokenizer, 6)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=s)
              for s in range(6)]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.decode_stats  # decode-only steps replayed from graphs, and the host's share
    assert stats.steps > 0 and 0 <= stats.host_share < 1, stats
    assert stats.idle_steps > 0 and 0 <= stats.gpu_idle_share < 1, stats  # timing marks
    print("host share of a graph-decode step:", stats.host_share, "GPU idle share:",
          stats.gpu_idle_share)
    again = [o.token_ids for o in llm.generate(prompts[::-1], params[::-1])][::-1]
    assert first == again  # a request's tokens do not depend on its batch
    other = [o.token_ids for o in llm.generate(
        prompts, [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=100 + s)
                  for s in range(6)])]
    assert other != first
    text = "".join(llm.stream(prompts[0], SamplingParams(max_tokens=12)))
    assert text == llm.generate(prompts[0], SamplingParams(max_tokens=12))[0].text


def test_decode_stats_host_share():
    from llmspeed_numba.engine.llm import DecodeStats

    stats = DecodeStats()
    assert stats.host_share == 0.0
    stats.add(0.010, 0.009)
    stats.add(0.030, 0.027)
    assert stats.steps == 2 and abs(stats.host_share - 0.1) < 1e-12
    assert stats.gpu_idle_share is None  # no idle time measured
    stats.add(0.020, 0.020, idle=0.0006)
    # idle time per measured step over the mean step: 0.0006 / 0.020
    assert stats.idle_steps == 1 and abs(stats.gpu_idle_share - 0.03) < 1e-12


@pytest.mark.gpu
@gpu
def test_gpu_engine_captures_every_decode_graph_at_start(monkeypatch):
    """``LLM`` makes every kernel ready and captures the decode graph of every (batch bucket,
    table width) at start-up, so a load of growing and shrinking batches, prompts of many
    lengths and sequences crossing table widths compiles no kernel and neither captures nor
    replaces a graph (the tokens against the plain loop: the tests above)."""
    from llmspeed_numba import _launch

    config = preset_config("tiny", num_hidden_layers=1, vocab_size=64,
                           max_position_embeddings=600)
    llm = LLM(config, load_format="dummy", max_num_seqs=8, seed=0,
              kv_cache_memory=KV_CACHE_MEMORY)
    compiled, compile = [], _launch.Kernel.compiled
    monkeypatch.setattr(_launch.Kernel, "compiled",
                        lambda self: compiled.append(self.name) or compile(self))
    graphs = dict(llm.runner.graphs)
    assert set(graphs) == set(llm.runner.decode_shapes(8)) and len(graphs) == 4 * 3
    assert all(g.graph is not None for g in graphs.values())
    prompts = [[1 + i] * (5 + 40 * i) for i in range(8)]   # tables of 1 .. 21 pages
    outs = llm.generate(prompts, [SamplingParams(max_tokens=8 + 30 * (i % 3), ignore_eos=True)
                                  for i in range(8)])
    assert llm.runner.graphs == graphs  # the same graph objects: none made or replaced
    assert compiled == []  # every kernel came from the machine-code store
    assert [len(o.token_ids) for o in outs] == [8 + 30 * (i % 3) for i in range(8)]
    assert llm.decode_stats.steps > 0  # decode-only steps replayed the captured graphs
