"""Demo of gemm: Tensor Core (fp16, bf16, any layout, fused epilogue, split-K decode) and SIMT
fp32, each checked against the float64 reference with a tolerance derived from a plain fp32
implementation."""

import numpy as np

from .._arrays import numpy_dtype
from ._case import DemoCase, time_call
from ..ops.gemm import gemm
from ..reference.gemm import gemm_plain, gemm_reference
from ..testing import f64, random_array, to_device


def _place(host, col_major, on_gpu):
    if not on_gpu:
        return np.asfortranarray(host) if col_major else np.ascontiguousarray(host)
    if col_major:
        return to_device(np.ascontiguousarray(host.T), "torch").T
    return to_device(host, "torch")


def cases(on_gpu):
    rng = np.random.default_rng(0)
    sim_tc = None if on_gpu else "tc_16x16x16_w1x1_s2"
    sim_simt = None if on_gpu else "simt_16x16x8_t2x2"

    def run(M, N, K, dtype, layout, config, out_dtype=None, epilogue=False):
        a = random_array((M, K), dtype, rng)
        b = random_array((K, N), dtype, rng)
        da, db = _place(a, layout[0] == "T", on_gpu), _place(b, layout[1] == "T", on_gpu)
        kw = {}
        if epilogue:
            kw = dict(c=random_array((M, N), dtype, rng), beta=0.5,
                      bias=random_array((N,), "float32", rng), activation="silu")
        dev_kw = dict(kw)
        for name in ("c", "bias"):
            if name in kw:
                dev_kw[name] = _place(kw[name], False, on_gpu)
        out_dtype = out_dtype or dtype

        def call():
            return gemm(da, db, out_dtype=out_dtype, config=config, **dev_kw)

        got = f64(call())
        host64 = {k: (np.asarray(v, np.float64) if k in ("c", "bias") else v)
                  for k, v in kw.items()}
        expected = gemm_reference(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                  **host64)
        plain = np.asarray(gemm_plain(a, b, out_dtype=numpy_dtype(out_dtype), **kw),
                           np.float64)
        tol = 2 * np.abs(plain - expected).max() + 1e-6 * max(np.abs(expected).max(), 1.0)
        seconds = time_call(call, on_gpu)
        return float(np.abs(got - expected).max()), float(tol), seconds

    big = 4096 if on_gpu else 40
    k_decode = 4096 if on_gpu else 48
    specs = [
        ("gemm fp16 NN", (big, big, big, "float16", "NN", sim_tc)),
        ("gemm bf16 TN + epilogue", (big // 2, big, big // 2, "bfloat16", "TN", sim_tc,
                                     "bfloat16", True)),
        ("gemm fp16 decode M=16 NT", (16, 4 * k_decode if on_gpu else 24, k_decode, "float16",
                                      "NT", sim_tc and sim_tc + "_k2")),
        ("gemm fp32 SIMT NN", (big // 2, big // 2, big // 2, "float32", "NN", sim_simt)),
    ]
    return [DemoCase(label, "x".join(str(v) for v in spec[:3]) + f" {spec[4]}",
                     lambda spec=spec: run(*spec)) for label, spec in specs]
