"""The Llama-family forward pass on the library's ops.

Covers Llama 2 / 3 / 3.1, Mistral (sliding window) and Qwen2 (q / k / v biases): pre-norm
decoder layers of grouped-query attention with rotary positions and a SiLU-gated MLP.

Weights are fused once at load: q / k / v into one (q + 2 kv heads) x hidden projection, gate and
up into one 2 x intermediate projection (interleaved for the gated GEMM, whose epilogue applies
``silu(gate) * up``), so a layer is four GEMMs. GEMMs read the weights in
their checkpoint layout (out_features, in_features) as the transposed B operand; no copy.

One layer function serves prefill and decode. A step is a packed batch of ``T`` new tokens of
``B`` sequences (prefill: whole prompts or chunks of them; decode: one token each); only attention
differs:

- prefill of a sequence's first tokens: ``flash_attn_varlen`` over the new tokens themselves
  (causal, each sequence alone);
- later prefill chunks (their sequences' earlier tokens are in the cache): the chunks' queries
  over their sequences' pages, one ``paged_prefill_attention`` for all of them;
- decode: ``paged_decode_attention`` over each sequence's pages.

Both write the new keys and values into the paged cache first, in the launch that rotates q
and k (``rotary_kv_append``, one launch for the whole batch: token ``t`` at its own position and
page row).

Weight-only quantization (``quantization``): the four projections of every layer (fused qkv, o,
fused gate_up, down) become ``QuantizedWeight``s (N, K) run by ``quant_gemm`` (same bias and
epilogue, the gated one included: gate and up are interleaved before they are quantized, or,
GGUF blocks, their rows of blocks are; not fp8, whose gated GEMM would go through fp32 sums);
embeddings, norms and the LM head stay in the model dtype.

- "fp8": W8A8 on Hopper (sm_90; the simulator runs its twins): e4m3 weights with one fp32 scale
  per output channel, the activations quantized per token at each projection (``quant_gemm``'s
  fp8_e4m3 path); on another GPU the load fails with NotImplementedError.
- "int8": one scale per output channel; "int4": symmetric, groups of ``INT4_GROUP_SIZE`` (128)
  along K, or of the largest of 64 / 32 that divides K, else one group a row
  (``int4_group_size``; SmolLM2's K = 576 takes 64). Quantized from the model-dtype weights,
  fused first (the scales are per row and group, so fusing commutes with quantizing).
- "gguf": a GGUF's Q4_0 / Q4_1 / Q8_0 projection blocks, kept packed
  (``gguf_loader.GGUFBlocks`` -> ``QuantizedWeight.from_gguf``; q, k, v and gate, up fused by
  concatenating their block rows). A fused group whose parts are not all blocks of one type is
  dequantized to the model dtype and runs as a plain GEMM.
- None: every weight in the model dtype, plain ``gemm`` (the path without any of this).

Norms inside the projections (``PROLOGUE.norm``, off by default until timed): at a decode step
of a 4-bit model on the streaming kernel (``quant_gemm.prologue_norm_fits``) the output and down
projections add themselves into the residual stream in their epilogue (``stream_add_gemm``) and
the next projection norms its input rows in every block (``stream_norm_gemm``): no
``rms_norm`` launch between layers. Elsewhere (and for the LM head) the norms run as calls.

Tensor parallelism (``tp``, a ``distributed.TensorParallel``): the model is one rank's share,
built from that rank's weights and config (``distributed.sharding``: its heads, KV heads,
intermediate and vocabulary slices; the fusing above then gives each rank the fused weights of
its own slices); the forward adds the all-reduces of the vocabulary-parallel embedding and of
the row-parallel o_proj and down_proj, and gathers the logits (``forward``) or only each rank's
greedy winner (``greedy``). Without ``tp`` none of this runs.
"""

from dataclasses import dataclass

import numpy as np

from .._overrides import Knobs
from ..ops._fp8_gemm import require_fp8_support
from ..ops.gemm_gated import GATE_BLOCK, interleave_gate_up
from ..ops.quant_gemm import prologue_norm_fits
from ..ops.quant_weight import QuantizedWeight, quantize_weight
from . import _ops
from .rope import cos_sin_cache

#: tokens per page of the KV cache.
BLOCK_SIZE = 16
#: ``quantization`` values: None (the model dtype), int4 / int8 / fp8 at load, a GGUF's own
#: blocks.
QUANTIZATIONS = (None, "int4", "int8", "fp8", "gguf")
#: int4's group along K where K allows (``int4_group_size``).
INT4_GROUP_SIZE = 128


#: ``norm``: a quantized model's decode step runs its norms inside the projections (module
#: docstring); off until timed against the calls (benchmarks/probes/probe_decode_variants.py).
PROLOGUE = Knobs("llama", norm=False)


class _Deferred:
    """The residual stream whose next RMSNorm (``weight``) the projection that reads it applies
    (``LlamaModel._normed_linear``); ``normed()`` runs it as a call."""

    __slots__ = ("residual", "weight", "eps", "ops")

    def __init__(self, residual, weight, eps, ops):
        self.residual, self.weight, self.eps, self.ops = residual, weight, eps, ops

    @property
    def shape(self):
        return self.residual.shape

    def normed(self):
        return self.ops.rms_norm(self.residual, self.weight, self.eps)


def check_quantization(quantization):
    """``quantization`` itself, or ValueError naming the allowed values."""
    if not isinstance(quantization, (str, type(None))) or quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {quantization!r}")
    return quantization


def int4_group_size(k):
    """int4's group along a K: 128, else the largest of 64 / 32 dividing K, else -1 (a row)."""
    for group in (INT4_GROUP_SIZE, 64, 32):
        if k % group == 0:
            return group
    return -1


@dataclass
class Step:
    """The device tensors describing one forward step (see the module docstring).

    token_ids (T,) int64 and positions (T,) int32: the new tokens. token_tables (T, W) int32:
    each new token's sequence's page row. cu_seqlens (B + 1,) int32 and max_seqlen: the packed
    prompts starting at position 0 (prefill), rows ``0 .. fresh_tokens`` (``fresh_tokens`` =
    ``cu_seqlens[-1]``, on the host). Later prefill chunks (sequences with tokens in the cache)
    take the rows after them: chunk_cu_seqlens (C + 1,) int32 (offsets from row
    ``fresh_tokens``) and chunk_max_seqlen, chunk_block_table (C, W) int32 and chunk_seq_lens
    (C,) int32 (each chunk's sequence's pages and its length after the step); None without
    chunks. block_table (B, W) int32 and seq_lens (B,) int32: each sequence's pages and its
    length after the step (decode). last_rows (B,) int64: each sequence's last token.
    """

    token_ids: object
    positions: object
    token_tables: object
    last_rows: object
    cu_seqlens: object = None
    max_seqlen: int = 0
    fresh_tokens: int = 0
    chunk_cu_seqlens: object = None
    chunk_max_seqlen: int = 0
    chunk_block_table: object = None
    chunk_seq_lens: object = None
    block_table: object = None
    seq_lens: object = None

    @property
    def is_decode(self):
        return self.block_table is not None


def to_device(array, device):
    """A host NumPy array as a torch tensor on ``device`` (one copy)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def decode_step(device, tokens, positions, table, seq_lens):
    """The ``Step`` of a decode from host arrays: ``tokens`` (B,) fed at ``positions``, each
    sequence's pages ``table`` (B, W) and its length after the step ``seq_lens``. The table is
    copied once and serves both the append and the attention."""
    table = to_device(table, device)
    return Step(token_ids=to_device(np.asarray(tokens, np.int64), device),
                positions=to_device(positions, device), token_tables=table,
                last_rows=to_device(np.arange(len(tokens), dtype=np.int64), device),
                block_table=table, seq_lens=to_device(seq_lens, device))


class _Layer:
    # qkv_t, o_t, gate_up_t, down_t: (K, N) transposed views of the weights, or, in a quantized
    # model, QuantizedWeights (N, K) (``LlamaModel.linear`` picks gemm or quant_gemm)
    __slots__ = ("input_norm", "qkv_t", "qkv_bias", "o_t", "o_bias", "post_norm", "gate_up_t",
                 "down_t")


def _is_blocks(w):
    from .gguf_loader import GGUFBlocks

    return isinstance(w, GGUFBlocks)


def _fused(parts, gated):
    """One weight of ``parts`` (CPU tensors, (N_i, K)): gate and up interleaved (``gated``),
    else concatenated."""
    import torch

    return interleave_gate_up(*parts) if gated else torch.cat(parts)


def _dense(w):
    """A projection part as a CPU tensor (``GGUFBlocks`` dequantized to float32)."""
    import torch

    return torch.from_numpy(w.dequantize()) if _is_blocks(w) else w


def _expect(weights, name, shape):
    w = weights.get(name)
    if w is None:
        raise ValueError(f"checkpoint: missing tensor {name!r}")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"checkpoint: tensor {name!r} has shape {tuple(w.shape)}, expected "
                         f"{tuple(shape)} from the config")
    return w


class LlamaModel:
    """The weights of a Llama-family model on the device, fused, and its forward step."""

    def __init__(self, config, weights, dtype, quantization=None, tp=None):
        """``weights``: transformers' names to CPU tensors (``models.checkpoint``; with
        ``quantization="gguf"`` projections may be ``GGUFBlocks``); every tensor's shape is
        checked against ``config`` before anything is moved to the device. ``quantization``:
        see the module docstring; "gguf" without any ``GGUFBlocks`` raises ValueError. ``tp``:
        None, or this rank's ``distributed.TensorParallel`` (``config`` and ``weights`` are then
        the rank's shards; see the module docstring)."""
        import torch

        self.quantization = check_quantization(quantization)
        self.tp = tp
        c = config
        self.config = c
        self.dtype = dtype
        self.device = _ops.device()
        self.ops = _ops.Ops()
        hidden, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
        # the MLP's gate / up GEMM applies silu_and_mul in its epilogue (interleaved weights)
        # unless the width is not whole interleave blocks, or the weights are fp8: that GEMM
        # pairs gate and up through fp32 sums (``quant_gemm``), twice the bytes of the bf16
        # intermediate a separate silu_and_mul reads (prefill)
        self.gated_mlp = inter % GATE_BLOCK == 0 and quantization != "fp8"
        nq, nk = c.num_attention_heads, c.num_key_value_heads
        self.q_size, self.kv_size = nq * d, nk * d
        if nq % nk:
            raise ValueError(f"config: num_attention_heads {nq} is not a multiple of "
                             f"num_key_value_heads {nk}")
        host_layers = []
        embed = _expect(weights, "model.embed_tokens.weight", (c.vocab_size, hidden))
        head = embed if c.tie_word_embeddings else _expect(weights, "lm_head.weight",
                                                           (c.vocab_size, hidden))
        norm = _expect(weights, "model.norm.weight", (hidden,))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [_expect(weights, p + "self_attn.q_proj.weight", (self.q_size, hidden)),
                   _expect(weights, p + "self_attn.k_proj.weight", (self.kv_size, hidden)),
                   _expect(weights, p + "self_attn.v_proj.weight", (self.kv_size, hidden))]
            biases = [weights.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            if c.attention_bias and any(b is None for b in biases):
                raise ValueError(f"checkpoint: attention_bias is set but layer {i} lacks q / k / "
                                 f"v biases")
            host_layers.append(dict(
                input_norm=_expect(weights, p + "input_layernorm.weight", (hidden,)),
                qkv=qkv, qkv_bias=None if biases[0] is None else biases,
                o=_expect(weights, p + "self_attn.o_proj.weight", (hidden, self.q_size)),
                o_bias=weights.get(p + "self_attn.o_proj.bias"),
                post_norm=_expect(weights, p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=[_expect(weights, p + "mlp.gate_proj.weight", (inter, hidden)),
                         _expect(weights, p + "mlp.up_proj.weight", (inter, hidden))],
                down=_expect(weights, p + "mlp.down_proj.weight", (hidden, inter))))

        def put(t):
            return t.to(dtype=dtype).to(self.device).contiguous()

        if quantization == "fp8":
            require_fp8_support()
        if quantization is None:
            self.linear = self.ops.gemm
        else:
            self.linear = self._linear
            if quantization == "gguf" and not any(
                    _is_blocks(w) for h in host_layers
                    for key in ("qkv", "o", "gate_up", "down")
                    for w in (h[key] if isinstance(h[key], list) else [h[key]])):
                raise ValueError("quantization='gguf': the weights hold no GGUF Q4_0 / Q4_1 / "
                                 "Q8_0 blocks (load a .gguf with keep_blocks=True, or use "
                                 "'int4' / 'int8')")
        project = self._projection if quantization is not None else None

        try:
            self.embed = put(embed)
            self.lm_head_t = self.embed.T if head is embed else put(head).T
            self.norm = put(norm)
            self.layers = []
            for h in host_layers:
                layer = _Layer()
                layer.input_norm = put(h["input_norm"])
                if project is not None:
                    layer.qkv_t = project(h["qkv"], put)
                else:
                    layer.qkv_t = put(torch.cat(h["qkv"])).T
                layer.qkv_bias = None if h["qkv_bias"] is None else put(torch.cat(h["qkv_bias"]))
                layer.o_t = put(h["o"]).T if project is None else project([h["o"]], put)
                layer.o_bias = None if h["o_bias"] is None else put(h["o_bias"])
                layer.post_norm = put(h["post_norm"])
                if project is not None:
                    layer.gate_up_t = project(h["gate_up"], put, gated=self.gated_mlp)
                    layer.down_t = project([h["down"]], put)
                else:
                    # gate and up interleaved for the gated GEMM (silu_and_mul in its epilogue)
                    layer.gate_up_t = put(_fused(h["gate_up"], self.gated_mlp)).T
                    layer.down_t = put(h["down"]).T
                self.layers.append(layer)
            self.max_position = c.max_position_embeddings
            self.cos_sin = cos_sin_cache(c, self.max_position, dtype, self.device)
        except BaseException:
            self.release()
            raise

    def _projection(self, parts, put, gated=False):
        """One (fused) projection of a quantized model: ``parts`` (each (N_i, K), CPU tensors or
        ``GGUFBlocks``) as one ``QuantizedWeight`` (N, K), or as a dense transposed weight where
        a "gguf" group is not all blocks of one type. ``gated``: ``parts`` are gate and up, fused
        interleaved (``interleave_gate_up``) for the gated epilogue, not concatenated."""
        kind = "numba" if self.device == "cpu" else "torch"
        if self.quantization == "gguf":
            from .gguf_loader import GGUFBlocks

            if all(_is_blocks(p) for p in parts) and len({p.ggml_type for p in parts}) == 1:
                if gated:   # rows of blocks interleaved as the rows they stand for
                    gate, up = parts
                    blocks = GGUFBlocks(interleave_gate_up(gate.data, up.data), gate.ggml_type,
                                        (2 * gate.shape[0], gate.shape[1]))
                else:
                    blocks = GGUFBlocks.concat(parts)
                return QuantizedWeight.from_gguf(blocks.data, blocks.ggml_type, blocks.shape,
                                                 kind=kind, device=self.device)
            return put(_fused([_dense(p).float() for p in parts], gated)).T
        w = _fused([_dense(p).to(self.dtype) for p in parts], gated)
        if self.quantization in ("int8", "fp8"):   # one scale per output channel
            fmt = {"int8": "int8", "fp8": "fp8_e4m3"}[self.quantization]
            return quantize_weight(w, fmt, kind=kind, device=self.device)
        return quantize_weight(w, "int4", group_size=int4_group_size(w.shape[1]), kind=kind,
                               device=self.device)

    def _linear(self, x, w, bias=None, activation=None):
        """``activation(x @ W^T + bias)`` for a projection of a quantized model (``quant_gemm``,
        or ``gemm`` for a projection left dense)."""
        if isinstance(w, QuantizedWeight):
            return self.ops.quant_gemm(x, w, bias=bias, activation=activation)
        return self.ops.gemm(x, w, bias=bias, activation=activation)

    def _normed_linear(self, h, w, bias=None, activation=None):
        """``linear`` of ``h``, a tensor or a ``_Deferred`` norm: normed in the projection's
        blocks where ``stream_norm_gemm`` takes it, else by a call first."""
        if not isinstance(h, _Deferred):
            return self.linear(h, w, bias=bias, activation=activation)
        if prologue_norm_fits(w, h.shape[0]):
            return self.ops.stream_norm_gemm(h.residual, w, h.weight, h.eps, bias=bias,
                                             activation=activation)
        return self.linear(h.normed(), w, bias=bias, activation=activation)

    def _linear_norm(self, x, w, bias, residual, norm_weight, fuse):
        """A projection whose result goes into the residual stream, then the next RMSNorm:
        ``residual += x @ W^T + bias``, returns its norm. ``fuse`` (a decode step of a quantized
        model without tensor parallelism): with ``PROLOGUE.norm`` where it fits, the add in the
        projection and the norm left to the next one (a ``_Deferred``); else one
        ``quant_gemm_rms_norm`` (one launch where its ``FUSED_NORM_MAX_M`` allows); else the
        projection, the ranks' sum, then ``rms_norm``."""
        eps = self.config.rms_norm_eps
        if fuse and PROLOGUE.norm and prologue_norm_fits(w, x.shape[0]):
            self.ops.stream_add_gemm(x, w, residual, bias=bias)
            return _Deferred(residual, norm_weight, eps, self.ops)
        if fuse and isinstance(w, QuantizedWeight):
            return self.ops.quant_gemm_rms_norm(x, w, residual, norm_weight, eps, bias=bias)
        y = self.linear(x, w, bias=bias)
        if self.tp is not None:      # row-parallel: each rank holds a partial sum
            self.tp.all_reduce(y)
        return self.ops.rms_norm(y, norm_weight, eps, residual=residual, out=y)

    def release(self):
        """Drop every device tensor (after a failed load, or to free the GPU)."""
        for name in ("embed", "lm_head_t", "norm", "layers", "cos_sin"):
            self.__dict__.pop(name, None)
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def new_cache(self, num_blocks):
        """A paged KV cache of ``num_blocks`` pages shared by every layer."""
        from ..paged_cache import PagedKVCache

        c = self.config
        return PagedKVCache(num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim,
                            self.dtype, kind="torch",
                            num_layers=c.num_hidden_layers)

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, step, cache, *, all_logits=False):
        """Run ``step`` (a ``Step``) through every layer, writing its keys and values into
        ``cache``; returns float32 logits of each sequence's last token (B, vocab), or of every
        new token (T, vocab) with ``all_logits`` (under tensor parallelism gathered from the
        ranks: the whole vocabulary on each)."""
        logits = self._logits(step, cache, all_logits)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def greedy(self, step, cache):
        """Each sequence's greedy next token (int64 (B,), on the device) after ``step``: the
        argmax of ``forward``'s logits (under tensor parallelism of each rank's slice, the
        ranks exchanging only their winners)."""
        logits = self._logits(step, cache, False)
        index = self.ops.argmax(logits)
        return index if self.tp is None else self.tp.argmax(logits, index)

    def _logits(self, step, cache, all_logits):
        """``forward``'s logits; under tensor parallelism this rank's vocabulary slice."""
        ops, c, tp = self.ops, self.config, self.tp
        eps = c.rms_norm_eps
        if tp is None:
            residual = ops.embedding(step.token_ids, self.embed)
        else:       # each rank looks up its vocabulary slice (zeros elsewhere), then the sum
            residual = tp.all_reduce(ops.embedding(tp.local_ids(step.token_ids), self.embed))
        # a decode step of a quantized model runs each projection into the residual stream with
        # the next norm fused (``_linear_norm``); other steps norm only the last rows at the end
        fuse = step.is_decode and tp is None and self.quantization is not None
        if fuse and PROLOGUE.norm:
            h = _Deferred(residual, self.layers[0].input_norm, eps, ops)
        else:
            h = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            attn = self._attention(index, layer, h, step, cache)
            h = self._linear_norm(attn, layer.o_t, layer.o_bias, residual, layer.post_norm, fuse)
            if self.gated_mlp:
                a = self._normed_linear(h, layer.gate_up_t, activation="silu_and_mul")
            else:
                a = ops.silu_and_mul(self._normed_linear(h, layer.gate_up_t))
            last = index == len(self.layers) - 1
            if last and not all_logits and not step.is_decode:
                x = self.linear(a, layer.down_t)
                if tp is not None:
                    tp.all_reduce(x)
                x = ops.embedding(step.last_rows, x)    # the final norm of the last rows only
                residual = ops.embedding(step.last_rows, residual)
                h = ops.rms_norm(x, self.norm, eps, residual=residual, out=x)
            else:
                norm = self.norm if last else self.layers[index + 1].input_norm
                h = self._linear_norm(a, layer.down_t, None, residual, norm, fuse)
        if isinstance(h, _Deferred):
            h = h.normed()
        return ops.gemm(h, self.lm_head_t, out_dtype="float32")

    def _attention(self, index, layer, h, step, cache):
        """Layer ``index``'s attention of the new tokens ``h`` (T, hidden): (T, heads x dim)."""
        ops, c = self.ops, self.config
        tokens, d = h.shape[0], c.head_dim
        nq, nk = c.num_attention_heads, c.num_key_value_heads
        qkv = self._normed_linear(h, layer.qkv_t, bias=layer.qkv_bias)
        q = qkv[:, :self.q_size].view(tokens, nq, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, nk, d)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, nk, d)
        k_cache, v_cache = cache.k_cache[index], cache.v_cache[index]
        ops.rotary_kv_append(q, k, v, k_cache, v_cache, step.token_tables, step.positions,
                             cos_sin_cache=self.cos_sin, style="neox")
        window = (-1, -1) if c.sliding_window is None else (c.sliding_window - 1, 0)
        if step.is_decode:
            out = ops.paged_decode_attention(q, k_cache, v_cache, step.block_table,
                                             step.seq_lens, window_size=window)
        elif step.chunk_cu_seqlens is None:
            out = ops.flash_attn_varlen(q, k, v, step.cu_seqlens, step.cu_seqlens,
                                        step.max_seqlen, step.max_seqlen, causal=True,
                                        window_size=window)
        else:
            import torch

            out = torch.empty((tokens, nq, d), dtype=q.dtype, device=q.device)
            fresh = step.fresh_tokens
            if fresh:
                ops.flash_attn_varlen(q[:fresh], k[:fresh], v[:fresh], step.cu_seqlens,
                                      step.cu_seqlens, step.max_seqlen, step.max_seqlen,
                                      causal=True, window_size=window, out=out[:fresh])
            ops.paged_prefill_attention(q[fresh:], k_cache, v_cache, step.chunk_block_table,
                                        step.chunk_cu_seqlens, step.chunk_seq_lens,
                                        step.chunk_max_seqlen, causal=True, window_size=window,
                                        out=out[fresh:])
        return out.view(tokens, nq * d)
