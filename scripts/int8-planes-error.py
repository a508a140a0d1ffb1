#!/usr/bin/env python3
"""How much the decode products' input encodings (kernels/matvec_tc.cu) move a q4 matvec's result,
without a GPU: x̂ encoded as the bf16 form (hi = bf16(x), lo = bf16(x − hi)) and as the int8 form
(TcInt8: X = rint(x/σ''), σ'' = max|x| of the group of 64 / (127·2^16); and the two-plane form,
/ (127·254), that failed a kernel test), each dotted in float64 with
the same q4 rows (codes 0..15, bf16 scale and bias per group of 64), against x itself. Only the
encoding's error is measured (the products are exact here; on the GPU the int8 sums are exact and
the bf16 ones accumulate in f32). Inputs: Gaussian x with one "outlier" channel per 512 scaled by F.
  usage: .venv-nvrtc/bin/python scripts/int8-planes-error.py
"""
import numpy as np

rng = np.random.default_rng(17)
K, ROWS, G = 2048, 512, 64


def bf16(v):
    b = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000  # round to nearest even
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def enc_bf16(x):
    hi = bf16(x)
    return hi + bf16(x - hi)


def enc_int8(x, unit=127 * 65536):
    """unit 127·2^16: TcInt8's three planes; 127·254: the two-plane form that was not kept."""
    g = x.reshape(-1, G)
    m = np.abs(g).max(axis=1, keepdims=True).astype(np.float32)
    inv = np.where(m > 1e-30, np.float32(unit) / np.maximum(m, 1e-30), 0).astype(np.float32)
    X = np.rint((g.astype(np.float32) * inv)).astype(np.float64)
    return (X * (m.astype(np.float64) / unit)).reshape(-1)


codes = rng.integers(0, 16, size=(ROWS, K)).astype(np.float64)
scale = bf16(rng.normal(0, 0.01, size=(ROWS, K // G)))
bias = bf16(rng.normal(0, 0.05, size=(ROWS, K // G)))
W = codes * np.repeat(scale, G, axis=1) + np.repeat(bias, G, axis=1)

print(f"q4 rows {ROWS} × K {K}, groups of {G}; relative error of y = W·enc(x) against W·x:")
print("  outlier ×F  |  bf16 hi+lo: max / median  |  int8, 3 planes: max / median  |  int8, 2 planes: max / median")
for F in [1, 10, 100, 1000, 10000]:
    x = rng.normal(0, 1, size=K)
    x[::512] *= F
    x = x.astype(np.float32).astype(np.float64)
    y = W @ x
    scale_y = np.sqrt(np.mean(y * y))
    eb = np.abs(W @ enc_bf16(x) - y) / scale_y
    ei = np.abs(W @ enc_int8(x) - y) / scale_y
    e2 = np.abs(W @ enc_int8(x, 127 * 254) - y) / scale_y
    print(f"  {F:>10}  |  {eb.max():.2e} / {np.median(eb):.2e}      |  {ei.max():.2e} / {np.median(ei):.2e}         "
          f"|  {e2.max():.2e} / {np.median(e2):.2e}")
