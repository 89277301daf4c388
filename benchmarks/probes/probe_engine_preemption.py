"""Which engine setting makes greedy tokens leave the plain loop's (GPU; the failure of
``test_engine.py::test_gpu_engine_greedy_equals_each_prompt_alone`` at e86e426: with 8 slots and
a 24-page cache a request's third token differed by a 2.6-logit margin, while 4 slots and a large
cache matched up to ties; the same shapes on a tiny model agree in the simulator, eager and
staged).

Runs SmolLM2 (``LLMSPEED_TEST_GGUF`` or the default model) on 12 chat prompts, 24 tokens each,
under several engine settings, each against the plain loop's tokens for each prompt alone, and
prints per setting the preemptions and each prompt's first differing token with the plain loop's
top-2 margin there (a tie is a margin within a few bf16 steps; a bug is far more).

    python benchmarks/probes/probe_engine_preemption.py
"""

import os

from llmspeed_numba import LLM, SamplingParams
from llmspeed_numba.models import load_model
from llmspeed_numba.models.default import default_model_path

TOKENS = 24
TOPICS = ["the sea", "numbers", "a cat", "Paris", "rain", "music", "trees", "the moon", "bread",
          "trains", "winter", "a robot"]


def main():
    path = os.environ.get("LLMSPEED_TEST_GGUF") or default_model_path()
    model = load_model(path)
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Write two sentences about {t}."}]),
        add_special_tokens=False) for t in TOPICS]
    print("prompt lengths", [len(p) for p in prompts])
    expected = [model.generate_greedy([p], TOKENS, stop_at_eos=False)[0] for p in prompts]
    c = model.config
    page_bytes = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 2
    small, large = 24 * page_bytes, 1 << 30
    settings = {
        "8 slots, small cache, graphs": dict(max_num_seqs=8, kv_cache_memory=small),
        "8 slots, small cache, eager": dict(max_num_seqs=8, kv_cache_memory=small,
                                            cuda_graphs=False),
        "8 slots, large cache, graphs": dict(max_num_seqs=8, kv_cache_memory=large),
        "4 slots, large cache, graphs": dict(max_num_seqs=4, kv_cache_memory=large),
        "8 slots, small cache, graphs, 64-token budget": dict(
            max_num_seqs=8, kv_cache_memory=small, max_num_batched_tokens=64),
        # the first again, after other engines ran in this process (the test ran it second)
        "8 slots, small cache, graphs, again": dict(max_num_seqs=8, kv_cache_memory=small),
    }
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    for name, kwargs in settings.items():
        llm = LLM(path, **kwargs)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        report = []
        for i, (g, e) in enumerate(zip(got, expected)):
            j = next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), None)
            if j is None:
                continue
            top2 = model.prefill_logits([prompts[i] + e[:j]])[0][-1].float().topk(2).values
            report.append(f"p{i}@{j} margin {float(top2[0] - top2[1]):.3g}")
        print(f"{name}: preemptions {llm.num_preemptions}; differ: {report or 'none'}",
              flush=True)
        del llm


if __name__ == "__main__":
    main()
