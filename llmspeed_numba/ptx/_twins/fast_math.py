"""Twins of ``_intrinsics/fast_math.py``: the SFU's approximate exp2, sin / cos, reciprocal, and
division without the IEEE slow path."""

import numpy as np


def ex2_approx(x):
    # Python floats: an np.errstate a call dominated simulated softmax / sampling
    x = float(np.float32(x))
    if x >= 128.0:
        return np.float32(np.inf)
    return np.float32(2.0 ** x)


def sin_approx(x):
    return np.float32(np.sin(np.float32(x)))


def cos_approx(x):
    return np.float32(np.cos(np.float32(x)))


def rcp_approx(x):
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1.0) / np.float32(x))


def div_full(x, y):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.float32(np.float32(x) / np.float32(y))
