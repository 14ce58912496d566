"""The reference of ``jax_arx.psum_add_norm`` for its tests
(tests/test_norm_cpu.py, tests/test_gpu_norm.py): numpy, with ml_dtypes for
bfloat16, independent of jax and of jax_arx.

- ``hidden``: the float32 sum of the partials in rank order, rounded once
  to the dtype, plus the residual in float32, rounded once. The fused
  call's hidden must equal it bit for bit.
- ``normed_f64``: the formula in float64 from hidden as stored,

      rms:   h / sqrt(mean(h^2) + eps) * w (+ b)
      layer: (h - mean) / sqrt(mean((h - mean)^2) + eps) * w (+ b)

  (eps taken as float32, as the call takes it). The fused call's normed
  must be within ``close_report``'s tolerance of it: half a unit in the
  last place of the dtype at the value (the one rounding to the dtype),
  plus ``ROW_ULPS`` float32 units in the last place of the row's largest
  |value| (what float32 arithmetic loses: the row's sums, and for layer
  the cancellation in h - mean, which is absolute, not relative).
- ``normed_lanes``: normed as ffi/base/norm.h computes it, every operation
  in float32 rounded once, each of the row's sums in its order (lane j of
  256 adds elements j, j + 256, ... in order from 0, then the lanes are
  added pairwise, halving). The fused call must equal it bit for bit, on
  the CPU and on the GPU: it pins the order the docstring states.
"""

from __future__ import annotations

import zlib

import numpy as np

LANES = 256  # ffi/base/norm.h, kNormLanes
ROW_ULPS = 4  # float32 ulps of the row's largest |normed| (see the module docstring)


def dtypes():
    """The reducing dtypes by name."""
    import ml_dtypes

    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def hidden(parts, residual, dtype):
    """psum(parts) + residual as jax_arx computes it (see the module docstring)."""
    acc = np.zeros(residual.shape, np.float32)
    for p in parts:
        acc += p.astype(np.float32)
    return (acc.astype(dtype).astype(np.float32) + residual.astype(np.float32)).astype(dtype)


def normed_f64(h, weight, bias, kind, eps):
    """The formula in float64 from ``h`` as stored (not rounded)."""
    x = h.astype(np.float64)
    d = x - x.mean(-1, keepdims=True) if kind == "layer" else x
    y = d / np.sqrt((d * d).mean(-1, keepdims=True) + float(np.float32(eps))) * weight.astype(np.float64)
    return y + bias.astype(np.float64) if bias is not None else y


def lane_sum(t):
    """Each row's sum of ``t`` [rows, W] (float32) in ffi/base/norm.h's order."""
    f32 = np.float32
    rows, width = t.shape
    k = -(-width // LANES)
    pad = np.zeros((rows, k * LANES), f32)  # + 0 leaves a lane's sum as it is (it is never -0)
    pad[:, :width] = t
    m = pad.reshape(rows, k, LANES)
    acc = np.zeros((rows, LANES), f32)
    for i in range(k):
        acc = acc + m[:, i]
    s = LANES // 2
    while s:
        acc[:, :s] = acc[:, :s] + acc[:, s : 2 * s]
        s //= 2
    return acc[:, 0]


def normed_lanes(h, weight, bias, kind, eps):
    """normed as the fused call must give it, bit for bit (see the module
    docstring), from ``h`` as stored; in h's dtype."""
    f32 = np.float32
    width = h.shape[-1]
    x = h.astype(f32).reshape(-1, width)
    if kind == "layer":
        mean = (lane_sum(x) / f32(width)).astype(f32)
        d = x - mean[:, None]
    else:
        d = x
    r = (f32(1) / np.sqrt(lane_sum(d * d) / f32(width) + f32(eps))).astype(f32)
    y = (d * r[:, None]) * weight.astype(f32)
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(h.dtype).reshape(h.shape)


def ulp(v, dtype):
    """The spacing of ``dtype`` at |v| (rounded to it), as float64. Of |v|:
    numpy's float16 spacing of a negative power of two is the ulp below it,
    not that of the values that round to it."""
    return np.spacing(np.abs(v).astype(dtype)).astype(np.float64)


def close_report(got, ref, dtype, *, ulps=0.5, row_ulps=ROW_ULPS):
    """None when every element of ``got`` is within ``ulps`` units in the
    last place of ``dtype`` at the float64 ``ref`` plus ``row_ulps`` float32
    units of the row's largest |ref|; else what is wrong, and where."""
    got64 = got.astype(np.float64)
    row_max = np.abs(ref).max(-1, keepdims=True)
    tol = ulps * ulp(ref, dtype) + row_ulps * 2.0**-23 * row_max
    err = np.abs(got64 - ref)
    bad = ~(err <= tol)
    if not bad.any():
        return None
    i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(tol, 1e-300), 0)), bad.shape)
    return (
        f"{int(bad.sum())} of {got.size} beyond tolerance; worst at {tuple(int(k) for k in i)}: "
        f"got {got64[i]!r}, ref {ref[i]!r}, tol {tol[i]:.3g}"
    )


def inputs(world, spec):
    """(parts [world, *shape], residual, weight, bias or None) of ``spec``
    = (shape, dtype name, kind, has_bias): every process draws the same
    values; each rank's partial differs."""
    shape, name, kind, has_bias = spec
    dt = dtypes()[name]
    rng = np.random.default_rng(zlib.crc32(repr(spec).encode()))
    parts = np.stack([(rng.standard_normal(shape) * 2).astype(dt) for _ in range(world)])
    residual = rng.standard_normal(shape).astype(dt)
    weight = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(dt)
    bias = rng.standard_normal(shape[-1]).astype(dt) if has_bias else None
    return parts, residual, weight, bias
