"""Activation functions as inline float32 device helpers, shared by every op with a fused epilogue.

``relu(x) = max(x, 0)``; ``gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (the tanh
form used by GPT-2 and ``torch.nn.functional.gelu(approximate="tanh")``); ``silu(x) = x / (1 +
exp(-x))``. All take and return float32, with float32 constants so nothing is promoted to float64.

``silu_fast`` and ``gelu_tanh_fast`` are the same functions on the SFU (``ex2.approx``,
``rcp.approx``): relative error below 3e-5, under a tenth of an fp16 ulp and a hundredth of a bf16
one, for results rounded to fp16 / bf16 (``activation(name, fast=True)``); they cost a fraction of
libdevice's ``expf`` / ``tanhf`` and IEEE division, in instructions and in registers.

They are ``@cuda.jit(device=True, inline="always")``: inlined at Numba-IR level, so kernels that
call them still compile offline (``compile_check``) and stay cacheable; the simulator runs them as
plain Python. Pick one at kernel-factory time with ``activation(name)`` (a closure constant of
the factory), never by a runtime flag in the inner loop.
"""

import math

import numpy as np

from .. import ptx
from .._env import cuda

#: Names accepted by ``activation=`` of the public ops (None: identity).
ACTIVATIONS = (None, "relu", "gelu", "silu")
#: ``gemm``'s gated activations, ``act(gate) * up`` from one interleaved gate / up operand, and
#: the activation each applies to the gate: "gelu_and_mul" takes the tanh form, as "gelu" does
#: (``activations.gelu_and_mul(approximate="tanh")``).
GATED_ACTIVATIONS = {"silu_and_mul": "silu", "gelu_and_mul": "gelu"}

_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = np.float32(0.044715)


@cuda.jit(device=True, inline="always")
def identity(x):
    return x


@cuda.jit(device=True, inline="always")
def relu(x):
    return max(x, _ZERO)


@cuda.jit(device=True, inline="always")
def gelu_tanh(x):
    inner = _GELU_C * (x + _GELU_CUBIC * x * x * x)
    return _HALF * x * (_ONE + math.tanh(inner))


@cuda.jit(device=True, inline="always")
def silu(x):
    # exp(-x) overflows to inf for x < -88: x / inf = -0, the right limit. div.full, not ``/``:
    # IEEE division's slow-path call serialises every wgmma of a GEMM with this epilogue.
    return ptx.div_full(x, _ONE + math.exp(-x))


_NEG_LOG2E = np.float32(-math.log2(math.e))
# gelu_tanh(v) = 0.5 v (1 + tanh(u)) = v * sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3)
_GT_K1 = np.float32(-2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e))
_GT_K3 = np.float32(-2.0 * math.sqrt(2.0 / math.pi) * 0.044715 * math.log2(math.e))


@cuda.jit(device=True, inline="always")
def silu_fast(v):
    return v * ptx.rcp_approx(_ONE + ptx.ex2_approx(v * _NEG_LOG2E))


@cuda.jit(device=True, inline="always")
def gelu_tanh_fast(v):
    return v * ptx.rcp_approx(_ONE + ptx.ex2_approx(v * (_GT_K1 + _GT_K3 * v * v)))


_BY_NAME = {None: identity, "relu": relu, "gelu": gelu_tanh, "silu": silu}
_FAST_BY_NAME = {**_BY_NAME, "gelu": gelu_tanh_fast, "silu": silu_fast}


def activation(name, fast=False):
    """The device function for ``name`` (one of ``ACTIVATIONS``); ``fast``: the SFU form, for
    results rounded to fp16 / bf16."""
    if name not in _BY_NAME:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    return (_FAST_BY_NAME if fast else _BY_NAME)[name]


__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "activation", "identity", "relu", "gelu_tanh",
           "silu", "silu_fast", "gelu_tanh_fast"]


_SQRT1_2 = np.float32(1.0 / math.sqrt(2.0))


@cuda.jit(device=True, inline="always")
def gelu_erf(x):
    """The exact GELU, ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`` (torch's default,
    ``approximate="none"``), evaluated as ``0.5 x erfc(-x / sqrt(2))``: the same value without
    the cancellation of ``1 + erf`` for negative x (accurate down to the underflow of Phi)."""
    return _HALF * x * math.erfc(-x * _SQRT1_2)


__all__ += ["gelu_erf"]
