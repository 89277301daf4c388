"""``warm``: listing a model's kernels without running them, rebuilding each in a worker process
from its factory, reporting progress and failures (simulator: compiling is a no-op there, the
listing, the rebuild in fresh processes and the bookkeeping are the real thing)."""

import importlib
import pickle

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR, warm
from llmspeed_numba._kernel_cache import function_digest
from llmspeed_numba._launch import Kernel, collecting_kernels

pytest.importorskip("torch")

#: every op of a Llama forward (prefill through flash_attn_varlen, decode through paged decode;
#: "rotary" rotates q, k and appends k, v to the cache: rotary_kv_append)
MODEL_OPS = {"embedding", "rms_norm", "gemm", "rotary", "flash_attn",
             "argmax", "paged_decode"}


@pytest.fixture(scope="module")
def tiny_model():
    from llmspeed_numba.models.model import Model
    from llmspeed_numba.models.random_model import ByteTokenizer, preset_config, random_weights

    config = preset_config("tiny")
    return Model(config, ByteTokenizer(), random_weights(config, seed=0))


def test_model_kernels_lists_every_op_of_the_forward_pass(tiny_model):
    kernels = warm.model_kernels(loaded=tiny_model, prefill_lengths=(16, 64),
                                 decode_batches=(1, 4))
    assert len({id(k) for k in kernels}) == len(kernels)
    # the gated MLP runs silu_and_mul in gemm's epilogue; otherwise a separate activations op
    expected = MODEL_OPS | (set() if tiny_model.llama.gated_mlp else {"activations"})
    assert {warm.op_of(k) for k in kernels} == expected
    for k in kernels:
        assert k.origin is not None, k.name
        module, name, args = pickle.loads(pickle.dumps(k.origin))
        rebuilt = getattr(importlib.import_module(module), name)(*args)
        # the same kernel (a factory called with a default spelled out is another lru_cache
        # entry, so identity is too strict): name, signature and specialised source equal
        assert (rebuilt.name, rebuilt.signature) == (k.name, k.signature)
        assert (function_digest(rebuilt.dispatcher.py_func)
                == function_digest(k.dispatcher.py_func)), k.name


def test_collecting_runs_no_kernel():
    from numba import cuda

    from llmspeed_numba import rms_norm

    x = cuda.to_device(np.ones((4, 64), np.float32))
    weight = cuda.to_device(np.ones(64, np.float32))
    out = cuda.to_device(np.full((4, 64), np.nan, np.float32))
    with collecting_kernels() as found:
        rms_norm(x, weight, out=out)
    assert len(found) == 1 and isinstance(found[0], Kernel)
    assert np.isnan(out.copy_to_host()).all()  # nothing ran
    rms_norm(x, weight, out=out)  # and outside, it runs
    assert np.isfinite(out.copy_to_host()).all()


def test_compile_kernels_in_workers_reports_each_kernel_once(tiny_model):
    kernels = warm.model_kernels(loaded=tiny_model, prefill_lengths=(16,), decode_batches=(1,))
    started, done = [], []
    ok = warm.compile_kernels(kernels, workers=2, on_start=started.append,
                              on_done=lambda name, good, why: done.append((name, good, why)))
    assert ok == len(kernels), [d for d in done if not d[1]]
    assert sorted(started) == sorted(k.name for k in kernels)
    assert sorted(d[0] for d in done) == sorted(k.name for k in kernels)
    assert all(good for _, good, _ in done), done


def test_a_kernel_that_cannot_be_rebuilt_is_reported_not_fatal(tiny_model):
    good = warm.model_kernels(loaded=tiny_model, prefill_lengths=(16,), decode_batches=())[0]
    bad = Kernel(None, good.signature, "missing_kernel")
    bad.origin = ("llmspeed_numba.no_such_module", "factory", ())
    done = []
    ok = warm.compile_kernels([good, bad], workers=2,
                              on_done=lambda name, g, why: done.append((name, g, why)))
    assert ok == 1
    (name, g, why), = [d for d in done if d[0] == "missing_kernel"]
    assert not g and "ModuleNotFoundError" in why


def test_marker_is_keyed_by_model_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSPEED_NUMBA_CACHE", str(tmp_path))
    assert not warm.is_warm(None, "bfloat16")
    warm._mark_warm(None, "bfloat16")
    assert warm.is_warm(None, "bfloat16")
    assert not warm.is_warm(None, "float16")
    assert not warm.is_warm(tmp_path / "model.gguf", "bfloat16")
    assert not warm.is_warm(None, "bfloat16", "int4")  # a quantized model: other kernels
    warm._mark_warm(None, "bfloat16", "int4")
    assert warm.is_warm(None, "bfloat16", "int4") and not warm.is_warm(None, "bfloat16", "int8")


@pytest.mark.skipif(not SIMULATOR, reason="needs a machine without a GPU")
def test_cli_warm_without_a_gpu_says_so(capsys):
    from llmspeed_numba.cli import main

    assert main(["warm"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
