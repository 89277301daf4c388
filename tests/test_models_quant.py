"""The Llama forward with weight-only quantized projections (``quantization=`` of ``Model``,
``load_model`` and ``LLM``), on tiny models in the simulator.

- int4 / int8 at load: logits against the float64 forward of ``test_models`` run on the
  DEQUANTIZED weights (the bound derived as there: twice the plain bf16 forward's error, plus a
  small allowance), and against the float64 forward of the original weights (loose: the format's
  own cost, bounded per format from measured values with a margin).
- "gguf": a tiny GGUF with Q4_0 / Q8_0 projections (and a fused group of mixed types, which runs
  dense) run from its blocks equals the dequantized load of the same file within the same
  derived bound, both checked against the float64 forward of the file's dequantized weights;
  a wrong order of the packed Q / K rows (the loader's un-permutation) would show here.
- The engine generates with a quantized model; bad values fail with clear errors.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q
from gguf_fixtures import small_tokenizer, write_gguf
from test_engine import KV_CACHE_MEMORY
from test_models import _bf16, _check_logits, _config, _weights, reference_logits

from llmspeed_numba import (
    LLM,
    QuantizedWeight,
    SamplingParams,
    deinterleave_gate_up,
    interleave_gate_up,
)
from llmspeed_numba._fp8_codec import decode_e4m3, quantize_rows
from llmspeed_numba._overrides import overrides
from llmspeed_numba.models.gguf_loader import GGUFBlocks, load_gguf_weights
from llmspeed_numba.models.llama import int4_group_size
from llmspeed_numba.models.model import Model, load_model
from llmspeed_numba.models.random_model import preset_config

PROMPTS = [[3, 17, 42, 8, 61, 5, 29], [11, 2, 50]]
#: max |logits - float64 forward of the original weights| / max |those logits| allowed: about
#: twice what was measured on this model (int8 0.032, int4 0.45: random weights of std 0.25
#: in groups of 32 / 64, two layers; fp8 0.15: weights and activations in e4m3).
FORMAT_COST = {"int8": 0.08, "int4": 0.9, "fp8": 0.3}


def fp8_activations(x):
    """What the fp8 (W8A8) projections compute with instead of their input: each token's row
    quantized to e4m3 with its own scale, as ``quant_gemm`` does, in float64."""
    x = np.asarray(x, np.float64)
    codes, scales = quantize_rows(x.astype(np.float32))
    return decode_e4m3(codes).astype(np.float64) * scales.astype(np.float64)[:, None]


def dequantized_weights(model, weights):
    """``weights`` with each layer's projections replaced by what the model's quantized weights
    stand for (``QuantizedWeight.dequantize``, split back into q / k / v and gate / up)."""
    llama, c = model.llama, model.config
    out = dict(weights)
    for i, layer in enumerate(llama.layers):
        p = f"model.layers.{i}."
        parts = {"self_attn.q_proj": None, "self_attn.k_proj": None, "self_attn.v_proj": None}
        qkv = layer.qkv_t.dequantize()
        bounds = np.cumsum([0, llama.q_size, llama.kv_size, llama.kv_size])
        for (name, _), lo, hi in zip(parts.items(), bounds[:-1], bounds[1:]):
            out[p + name + ".weight"] = torch.from_numpy(qkv[lo:hi])
        gate_up = layer.gate_up_t.dequantize()
        f = c.intermediate_size
        gate, up = (deinterleave_gate_up(gate_up) if llama.gated_mlp
                    else (gate_up[:f], gate_up[f:]))
        out[p + "mlp.gate_proj.weight"] = torch.from_numpy(np.ascontiguousarray(gate))
        out[p + "mlp.up_proj.weight"] = torch.from_numpy(np.ascontiguousarray(up))
        out[p + "self_attn.o_proj.weight"] = torch.from_numpy(layer.o_t.dequantize())
        out[p + "mlp.down_proj.weight"] = torch.from_numpy(layer.down_t.dequantize())
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_logits_match_float64_forward_of_dequantized_weights(quantization):
    """fp8 quantizes the projections' inputs too: its float64 forward does the same
    (``fp8_activations``)."""
    c = _config()
    weights = _weights(c)
    model = Model(c, None, weights, quantization=quantization)
    layer = model.llama.layers[0]
    fmt = "fp8_e4m3" if quantization == "fp8" else quantization
    inputs = fp8_activations if quantization == "fp8" else (lambda a: a)
    for w in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t):
        assert isinstance(w, QuantizedWeight) and w.format == fmt
    assert isinstance(model.llama.embed, torch.Tensor) and model.llama.embed.dtype == torch.bfloat16
    if quantization == "int4":  # K = 32 (hidden) and 64 (intermediate): no group of 128 fits
        assert (layer.qkv_t.group_size, layer.down_t.group_size) == (32, 64)
    deq = dequantized_weights(model, weights)
    logits = model.prefill_logits(PROMPTS)
    for b, prompt in enumerate(PROMPTS):
        got = logits[b].cpu().numpy()
        _check_logits(got, c, deq, prompt, f"{quantization} prefill of prompt {b}",
                      project_input=inputs)
        exact = reference_logits(c, weights, prompt)
        cost = np.abs(got - exact).max() / np.abs(exact).max()
        assert cost <= FORMAT_COST[quantization], (
            f"{quantization}: logits {cost:.3g} (relative) from the unquantized float64 forward, "
            f"more than {FORMAT_COST[quantization]}")
    # a decode step over the paged cache (quant_gemm at M = 2)
    prompts = [np.array(p) for p in PROMPTS]
    cache, seqs = model._new_cache(prompts, 1)
    model.llama.forward(model._prefill_step(cache, seqs, prompts), cache)
    step = model._decode_step(cache, seqs, [7, 60])
    got = model.llama.forward(step, cache).cpu().numpy()
    for b, prompt in enumerate(PROMPTS):
        _check_logits(got[b], c, deq, prompt + [[7, 60][b]], f"{quantization} decode of {b}",
                      rows=-1, project_input=inputs)
    # its output and down projections with the next norm fused (off by default; int4: the
    # streaming kernel, int8: the decode kernel): the same step as the two calls gives the
    # same logits, within the norms' last bit (their mean squares summed in another order)
    with overrides(quant_gemm={"fused_norm_max_m": 2}):
        fused = model.llama.forward(step, cache).cpu().numpy()   # rewrites the same k, v
    scale = np.abs(got).max()
    assert np.abs(fused - got).max() <= 2e-2 * scale, (
        f"{quantization}: fused norms {np.abs(fused - got).max():.3g} from the two calls")
    if quantization == "int4":
        # the norms inside the projections (llama.PROLOGUE): every projection of the step on
        # the streaming kernel, no rms_norm call before the final one
        from llmspeed_numba.ops.quant_gemm import prologue_norm_fits

        assert all(prologue_norm_fits(w, 2)
                   for w in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t))
        ops, calls = model.llama.ops, []
        rms_norm = ops.rms_norm
        ops.rms_norm = lambda *args, **kwargs: calls.append(1) or rms_norm(*args, **kwargs)
        try:
            with overrides(llama={"norm": True}):
                inside = model.llama.forward(step, cache).cpu().numpy()
        finally:
            ops.rms_norm = rms_norm
        assert len(calls) == 1      # the final norm, before the LM head
        for b, prompt in enumerate(PROMPTS):
            _check_logits(inside[b], c, deq, prompt + [[7, 60][b]],
                          f"int4 decode of {b}, norms inside the projections", rows=-1)


def test_int8_mlp_without_the_gated_epilogue():
    """An intermediate width that is not whole interleave blocks (36): gate and up stacked, the
    quantized projection, then a separate silu_and_mul."""
    c = _config(num_hidden_layers=1, intermediate_size=36)
    weights = _weights(c, seed=3)
    model = Model(c, None, weights, quantization="int8")
    assert not model.llama.gated_mlp
    logits = model.prefill_logits(PROMPTS[:1])[0].cpu().numpy()
    _check_logits(logits, c, dequantized_weights(model, weights), PROMPTS[0],
                  "int8 without the gated epilogue")


@pytest.mark.parametrize("path,min_m", [("tensor core", 1 << 30), ("dequantize + gemm", 1)])
def test_int4_prefill_on_the_large_m_paths(path, min_m):
    """M = 18 > 16 rows: quant_gemm's Tensor Core kernel, or (forced at this M) the weight
    dequantized and run by gemm, as prefill's M >= ``DEQUANT_GEMM_MIN_M`` is (the others above
    run its decode kernel)."""
    c = _config(num_hidden_layers=1, sliding_window=None)
    weights = _weights(c, seed=5)
    model = Model(c, None, weights, quantization="int4")
    prompt = list(range(1, 19))
    with overrides(quant_gemm={"dequant_min_m": min_m}):
        got = model.prefill_logits([prompt])[0].numpy()
    _check_logits(got, c, dequantized_weights(model, weights), prompt,
                  f"int4 prefill on the {path} path, M = 18")


def test_int4_group_size():
    assert [int4_group_size(k) for k in (4096, 576, 1536, 96, 48)] == [128, 64, 128, 32, -1]


# ---- GGUF blocks -----------------------------------------------------------------------------

def _gguf_config():
    vocab = len(small_tokenizer()[0])
    return preset_config("tiny", vocab_size=vocab, max_position_embeddings=32, eos_token_id=())


#: Layer 0: q / k / v Q4_0, o Q8_0, gate / up Q8_0, down Q4_0. Layer 1: q Q4_0 but k Q8_0 (a
#: fused group of two types: dense), v F32, gate Q4_0 but up F32 (the gated MLP's weight
#: dense, interleaved from a dequantized and a plain part), down Q4_0.
QTYPES = {
    **{f"model.layers.0.self_attn.{n}_proj.weight": Q.Q4_0 for n in "qkv"},
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.o_proj.weight": Q.Q4_0,
    **{f"model.layers.1.mlp.{n}_proj.weight": Q.Q4_0 for n in ("gate", "down")},
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    c = _gguf_config()
    path = tmp_path_factory.mktemp("quant") / "tiny.gguf"
    weights = {k: v.float() for k, v in _weights(c, seed=7).items()}
    write_gguf(path, c, weights, qtypes=QTYPES)
    return path


def test_gguf_blocks_concatenate_by_rows(tiny_gguf):
    """Fusing packed weights = concatenating their block rows: the packed fused weight stands for
    the dequantized parts stacked, bit for bit, Q / K rows in the dequantized load's order."""
    blocks = load_gguf_weights(tiny_gguf, torch.float32, keep_blocks=True)
    dense = load_gguf_weights(tiny_gguf, torch.float32)
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"]
    assert all(isinstance(blocks[n], GGUFBlocks) for n in names)
    fused = GGUFBlocks.concat([blocks[n] for n in names])
    qw = QuantizedWeight.from_gguf(fused.data, fused.ggml_type, fused.shape)
    want = torch.cat([dense[n] for n in names]).numpy()
    assert np.array_equal(qw.dequantize(), want)
    assert not isinstance(blocks["model.layers.1.self_attn.v_proj.weight"], GGUFBlocks)  # F32
    with pytest.raises(ValueError, match="one block type"):
        GGUFBlocks.concat([blocks["model.layers.1.self_attn.q_proj.weight"],
                           blocks["model.layers.1.self_attn.k_proj.weight"]])


def test_gguf_gate_up_blocks_interleave_by_rows(tiny_gguf):
    """The gated MLP's packed gate / up weight: the parts' block rows interleaved in blocks of 8
    stand for the dequantized parts interleaved (``interleave_gate_up``), bit for bit."""
    packed = load_model(tiny_gguf, quantization="gguf")
    dense = load_gguf_weights(tiny_gguf, torch.float32)
    p = "model.layers.0.mlp."
    want = interleave_gate_up(dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"])
    assert packed.llama.gated_mlp
    assert np.array_equal(packed.llama.layers[0].gate_up_t.dequantize(), want.numpy())


def test_gguf_blocks_equal_the_dequantized_load(tiny_gguf):
    c = _gguf_config()
    packed = load_model(tiny_gguf, quantization="gguf")
    plain = load_model(tiny_gguf)
    layers = packed.llama.layers
    assert [layers[0].qkv_t.format, layers[0].o_t.format, layers[0].gate_up_t.format,
            layers[0].down_t.format] == ["Q4_0", "Q8_0", "Q8_0", "Q4_0"]
    assert isinstance(layers[1].qkv_t, torch.Tensor)  # mixed types: dense
    assert isinstance(layers[1].gate_up_t, torch.Tensor)
    reference = load_gguf_weights(tiny_gguf, torch.float32)
    got = packed.prefill_logits(PROMPTS)
    want = plain.prefill_logits(PROMPTS)
    for b, prompt in enumerate(PROMPTS):
        _check_logits(got[b].numpy(), c, reference, prompt, f"gguf blocks, prompt {b}")
        _check_logits(want[b].numpy(), c, reference, prompt, f"dequantized gguf, prompt {b}")
        bound = _bound(c, reference, prompt)
        diff = np.abs(got[b].numpy() - want[b].numpy()).max()
        assert diff <= 2 * bound, (f"prompt {b}: blocks vs dequantized load differ by "
                                   f"{diff:.3g} > {2 * bound:.3g}")


def _bound(c, weights, ids):
    """``_check_logits``'s bound: twice the plain bf16 forward's error plus the allowance."""
    exact = reference_logits(c, weights, ids)
    plain = reference_logits(c, weights, ids, _bf16)
    return 2 * np.abs(plain - exact).max() + 1e-3 * np.abs(exact).max()


# ---- engine and errors ----------------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_engine_generates_with_quantized_weights(quantization):
    c = preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    llm = LLM(c, load_format="dummy", quantization=quantization, max_num_seqs=2, seed=0,
              kv_cache_memory=KV_CACHE_MEMORY)
    assert isinstance(llm.llama.layers[0].down_t, QuantizedWeight)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert [len(o.token_ids) for o in outs] == [2, 2]
    assert all(o.finish_reason == "length" for o in outs)


def test_generate_text_runs_int4_in_the_simulator():
    import io

    from llmspeed_numba import SIMULATOR
    from llmspeed_numba.models.textgen import generate_text

    if not SIMULATOR:
        pytest.skip("on a GPU generate_text loads the real model")
    out, log = io.StringIO(), io.StringIO()
    generate_text("Hi", max_new_tokens=1, quantization="int4", out=out, log=log)
    assert "time to first token" in log.getvalue()


def test_bad_quantization_values(tmp_path):
    c = _config(num_hidden_layers=1)
    weights = _weights(c)
    for bad in ("int3", "INT4", 4, "fp8_e4m3"):
        with pytest.raises(ValueError, match=r"quantization: expected one of \(None, 'int4', "
                                             r"'int8', 'fp8', 'gguf'\)"):
            Model(c, None, weights, quantization=bad)
    with pytest.raises(ValueError, match="quantization: expected one of"):
        LLM(c, load_format="dummy", quantization="q4")
    with pytest.raises(ValueError, match="no GGUF Q4_0 / Q4_1 / Q8_0 blocks"):
        Model(c, None, weights, quantization="gguf")
    with pytest.raises(ValueError, match="load_format='dummy' draws unquantized"):
        LLM(c, load_format="dummy", quantization="gguf")
    with pytest.raises(ValueError, match="is a Hugging Face directory, not a .gguf"):
        load_model(tmp_path, quantization="gguf")
    unquantized = tmp_path / "f32.gguf"
    gc = _gguf_config()
    write_gguf(unquantized, gc, {k: v.float() for k, v in _weights(gc).items()})
    with pytest.raises(ValueError, match=r"f32\.gguf: quantization='gguf' .* stores them as "
                                         r"F32; use quantization='int4' or 'int8'"):
        load_model(unquantized, quantization="gguf")
