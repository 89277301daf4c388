"""GPU suite: real checkpoints through our forward pass against transformers on the same weights.

- SmolLM2-135M-Instruct from its Q4_1 GGUF (the embedded default; or the file named by
  ``LLMSPEED_TEST_GGUF``, e.g. its first 8 layers written by ``gguf_fixtures.truncate_gguf`` for
  machines that cannot receive the whole file), loaded by both from the same file, ours both
  dequantized to bf16 and kept in its packed blocks (``quantization="gguf"``);
- a random-weight Llama with Llama-3-8B's shapes (4 layers, llama3 rope scaling), saved by
  transformers as safetensors and loaded by us from that directory.

For each: prefill logits of four prompts against transformers in bf16, the error bound derived
from transformers' own bf16 error against its float32 forward (ours may be at most twice as far
from float32, plus a small allowance); then 64 greedy tokens of the four prompts decoded as one
batch, token for token equal to transformers' ``generate`` of each prompt, except that a
divergence is allowed at a step where transformers' own top-2 logits (bf16 values) are at most
two bf16 steps apart at their magnitude (a tie within bf16 rounding); the comparison of that
prompt ends there.
"""

import math
import os

import pytest

from llmspeed_numba import SIMULATOR, have_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(SIMULATOR or not have_gpu(), reason="needs a CUDA GPU")]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Question: What is 17 times 23?\nAnswer:",
]


def _smollm2_gguf():
    path = os.environ.get("LLMSPEED_TEST_GGUF")
    if path:
        return path
    try:
        from llmspeed_numba.models.default import default_model_path

        return default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no SmolLM2 GGUF: {exc}")


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0].float()


def _bf16_ulp(x):
    """Spacing of bf16 values at magnitude ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def _compare(ours, hf_bf16, hf_f32, prompts_ids):
    """Prefill logits, then greedy decoding; returns a summary line."""
    got = ours.prefill_logits(prompts_ids)
    bound = 0.0
    for b, ids in enumerate(prompts_ids):
        exact = _hf_logits(hf_f32, ids)
        hf_err = (_hf_logits(hf_bf16, ids) - exact).abs().max().item()
        err = (got[b].cuda() - exact).abs().max().item()
        limit = 2 * hf_err + 1e-3 * exact.abs().max().item()
        assert err <= limit, (f"prompt {b}: prefill logits max |ours - fp32| {err:.4g} > "
                              f"{limit:.4g} (2 x transformers bf16's {hf_err:.4g} + allowance)")
        bound = max(bound, limit)

    new = ours.generate_greedy(prompts_ids, NEW_TOKENS, stop_at_eos=False)
    matched, ties = 0, []
    for b, ids in enumerate(prompts_ids):
        with torch.no_grad():
            ref = hf_bf16.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS,
                                   do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
        want = ref.sequences[0, len(ids):].tolist()
        for step, (a, w) in enumerate(zip(new[b], want)):
            if a == w:
                matched += 1
                continue
            top2 = ref.logits[step][0].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            tie = 2 * _bf16_ulp(top2[0].item())
            assert gap <= tie, (
                f"prompt {b}, step {step}: ours {a}, transformers {w}; transformers' top-2 "
                f"logits {top2.tolist()} differ by {gap:.4g}, more than two bf16 steps "
                f"({tie:.4g}): a real divergence, not a tie")
            ties.append((b, step, gap))
            break
    return (f"{matched} tokens equal, divergences at bf16 ties (prompt, step, gap): {ties}; "
            f"prefill bound {bound:.4g}")


def _hf_pair(load):
    """transformers' model in bf16 and in float32 (the reference) from ``load(dtype)``."""
    return load(torch.bfloat16).cuda().eval(), load(torch.float32).cuda().eval()


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_gguf_matches_transformers(quantization):
    """Dequantized to bf16 at load (None) and run from the file's own Q4_1 / Q8_0 blocks
    ("gguf"): both against transformers' dequantized model."""
    from llmspeed_numba.models import load_model

    path = _smollm2_gguf()
    ours = load_model(path, quantization=quantization)
    folder, name = os.path.split(os.path.abspath(path))
    hf_bf16, hf_f32 = _hf_pair(lambda dt: transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dt))
    tok = ours.tokenizer
    prompts_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                              add_special_tokens=False) for p in PROMPTS]
    print(_compare(ours, hf_bf16, hf_f32, prompts_ids))


def test_llama3_shapes_safetensors_matches_transformers(tmp_path):
    from llmspeed_numba.models import load_model

    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    del hf
    from llmspeed_numba.models.tokenizer import Tokenizer

    # any real tokenizer will do: the prompts are token ids
    Tokenizer.from_gguf(_smollm2_gguf()).backend.save(str(tmp_path / "tokenizer.json"))
    ours = load_model(str(tmp_path))
    hf_bf16, hf_f32 = _hf_pair(lambda dt: transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=dt))
    gen = torch.Generator().manual_seed(1)
    prompts_ids = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
                   for n in (5, 37, 130, 300)]
    print(_compare(ours, hf_bf16, hf_f32, prompts_ids))


def test_cuda_graph_decode_equals_eager():
    """The decode step replayed from CUDA graphs gives the eager step's tokens, bit for bit, also
    when the batch shrinks (a sequence stopping at its end-of-sequence token)."""
    from llmspeed_numba.models import load_model

    ours = load_model(_smollm2_gguf())
    tok = ours.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in PROMPTS]
    prompts.append(tok.encode("Say nothing.", add_special_tokens=False))
    for stop in (False, True):
        eager = ours.generate_greedy(prompts, 40, stop_at_eos=stop, cuda_graphs=False)
        graphed = ours.generate_greedy(prompts, 40, stop_at_eos=stop, cuda_graphs=True)
        assert graphed == eager, (stop, graphed, eager)
    print("lengths with eos:", [len(o) for o in graphed])


def test_repeated_graphed_generation_does_not_grow_device_memory():
    """Each ``generate_greedy`` captures new decode graphs; their own workspaces (tickets,
    counters) must go with them, not stay for the life of the process."""
    import gc

    from llmspeed_numba.models import load_model

    ours = load_model(_smollm2_gguf())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    allocated = []
    for _ in range(4):
        ours.generate_greedy(prompts, 8, stop_at_eos=False, cuda_graphs=True)
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[2] == allocated[3], allocated
