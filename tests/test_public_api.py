"""The public API is typed (every parameter and return of the functions in ``__all__`` and of
``PagedKVCache``'s methods annotated; ``py.typed`` shipped)."""

import inspect
import os

import llmspeed_numba
from llmspeed_numba import PagedKVCache


def _unannotated(fn):
    sig = inspect.signature(fn)
    missing = [name for name, p in sig.parameters.items()
               if name != "self" and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_public_functions_are_annotated():
    functions = {name: getattr(llmspeed_numba, name) for name in llmspeed_numba.__all__}
    functions = {n: f for n, f in functions.items() if inspect.isfunction(f)}
    assert {"gemm", "flash_attn", "rms_norm", "paged_kv_append", "have_gpu", "quant_gemm",
            "quantize_weight"} <= set(functions)
    methods = {f"PagedKVCache.{n}": f for n, f in vars(PagedKVCache).items()
               if inspect.isfunction(f) and (not n.startswith("_") or n == "__init__")}
    missing = {n: m for n, f in {**functions, **methods}.items() if (m := _unannotated(f))}
    assert not missing, f"unannotated parameters / returns: {missing}"


def test_py_typed_marker_is_in_the_package():
    assert os.path.isfile(os.path.join(os.path.dirname(llmspeed_numba.__file__), "py.typed"))


def test_no_private_keyword_in_a_public_signature():
    """What a public function takes is what a user may pass: tests force kernel choices through
    ``_overrides.overrides``, not underscore keywords."""
    callables = {name: getattr(llmspeed_numba, name) for name in llmspeed_numba.__all__}
    callables = {n: (f.__init__ if inspect.isclass(f) else f) for n, f in callables.items()
                 if inspect.isfunction(f) or inspect.isclass(f)}
    callables.update({f"PagedKVCache.{n}": f for n, f in vars(PagedKVCache).items()
                      if inspect.isfunction(f) and not n.startswith("_")})
    private = {}
    for name, fn in callables.items():
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin __init__
            continue
        if found := [p for p in params if p.startswith("_")]:
            private[name] = found
    assert {"flash_attn", "paged_decode_attention", "LLM", "QuantizedWeight"} <= set(callables)
    assert not private, f"underscore parameters in public signatures: {private}"
