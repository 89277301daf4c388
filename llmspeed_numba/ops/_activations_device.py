"""Activation functions as inline float32 device helpers, shared by every op with a fused epilogue.

``relu(x) = max(x, 0)``; ``gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (the tanh
form used by GPT-2 and ``torch.nn.functional.gelu(approximate="tanh")``); ``silu(x) = x / (1 +
exp(-x))``. All take and return float32, with float32 constants so nothing is promoted to float64.

They are ``@cuda.jit(device=True, inline="always")``: inlined at Numba-IR level, so kernels that
call them still compile offline (``compile_check``) and stay cacheable; the simulator runs them as
plain Python. Pick one at kernel-factory time with ``activation(name)`` (a closure constant of
the factory), never by a runtime flag in the inner loop.
"""

import math

import numpy as np

from .._env import cuda

#: Names accepted by ``activation=`` of the public ops (None: identity).
ACTIVATIONS = (None, "relu", "gelu", "silu")

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
    # exp(-x) overflows to inf for x < -88: x / inf = -0, the right limit.
    return x / (_ONE + math.exp(-x))


_BY_NAME = {None: identity, "relu": relu, "gelu": gelu_tanh, "silu": silu}


def activation(name):
    """The device function for ``name`` (one of ``ACTIVATIONS``)."""
    if name not in _BY_NAME:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    return _BY_NAME[name]


__all__ = ["ACTIVATIONS", "activation", "identity", "relu", "gelu_tanh", "silu"]


_SQRT1_2 = np.float32(1.0 / math.sqrt(2.0))


@cuda.jit(device=True, inline="always")
def gelu_erf(x):
    """The exact GELU, ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`` (torch's default,
    ``approximate="none"``), evaluated as ``0.5 x erfc(-x / sqrt(2))``: the same value without
    the cancellation of ``1 + erf`` for negative x (accurate down to the underflow of Phi)."""
    return _HALF * x * math.erfc(-x * _SQRT1_2)


__all__ += ["gelu_erf"]
