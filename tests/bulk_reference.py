"""The numpy references of the bulk collectives' tests: independent of jax
and of jax_arx (numpy and ml_dtypes only), each what its op's docstring
promises, bit for bit:

- all_gather: the ranks' blocks stacked / concatenated along the axis;
- psum_scatter: ``acc = x_0 as float32; for r in ranks 1..: acc += x_r``
  rounded once, this rank's block of it;
- the fused MoE combine: each rank's rows ``shared + sum_k w * y[pos]``
  (float32, rounded once to bfloat16, zero past T), then the rank-order sum
  above; each weight (e4m3: weight times scale) split in two as the fused
  op's docstring says, so that every product is exact.
"""

from __future__ import annotations

import numpy as np


def _dtypes():
    import ml_dtypes

    return {
        "float32": np.dtype(np.float32),
        "bfloat16": np.dtype(ml_dtypes.bfloat16),
        "float16": np.dtype(np.float16),
        "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
        "int8": np.dtype(np.int8),
        "uint8": np.dtype(np.uint8),
        "int16": np.dtype(np.int16),
        "int32": np.dtype(np.int32),
        "uint32": np.dtype(np.uint32),
        "bool": np.dtype(np.bool_),
        "complex64": np.dtype(np.complex64),
    }


def random_array(rng, shape, dt):
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)
    if np.issubdtype(dt, np.complexfloating):
        return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(dt)
    return (rng.normal(size=shape) * 2).astype(np.float32).astype(dt)


def reference_gather(parts, axis, tiled):
    return np.concatenate(parts, axis=axis) if tiled else np.stack(parts, axis=axis)


def reference_sum(parts):
    """The float32 rank-order sum of ``parts``, rounded once (what psum gives):
    from rank 0's element, not from +0.0, so that negative zeros sum to -0.0."""
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc += p.astype(np.float32)
    return acc.astype(parts[0].dtype)


def reference_scatter(parts, dim, tiled, rank):
    """This rank's block of the float32 rank-order sum of ``parts``."""
    block = np.split(reference_sum(parts), len(parts), axis=dim)[rank]
    return block if tiled else np.squeeze(block, axis=dim)


def _split(f):
    """float32 ``f`` as ``hi + lo``: ``hi`` with the 8 lowest significand
    bits cleared, ``lo`` the rest; a non-finite ``f`` whole in ``hi``."""
    f = np.asarray(f, np.float32)
    finite = np.isfinite(f)
    hi = np.where(finite, (f.view(np.uint32) & np.uint32(0xFFFFFF00)).view(np.float32), f)
    with np.errstate(invalid="ignore"):
        return hi, np.where(finite, f - hi, np.float32(0)).astype(np.float32)


def reference_combine(y, pos, w, shared, y_scale, tpad):
    """One rank's combined rows: float32, rounded once to bfloat16, each
    weight (e4m3: weight times scale, rounded) split in two so that every
    product is exact (jax_arx.moe_combine_psum_scatter's docstring): numpy's
    separate multiply and add are the fused op's multiply-adds too."""
    import ml_dtypes

    T, topk = pos.shape
    p = np.clip(pos, 0, y.shape[0] - 1)
    rows = y.astype(np.float32)[p]  # [T, topk, H]
    if y_scale is not None:
        hi, lo = (np.repeat(v, 128, axis=2) for v in _split(w[:, :, None] * y_scale[p]))
    else:
        hi, lo = (v[:, :, None] for v in _split(w))
    acc = shared.astype(np.float32)
    for k in range(topk):
        acc = (acc + hi[:, k] * rows[:, k]).astype(np.float32)
        acc = np.where(lo[:, k] != 0, acc + lo[:, k] * rows[:, k], acc).astype(np.float32)
    out = np.zeros((tpad, y.shape[1]), ml_dtypes.bfloat16)
    out[:T] = acc.astype(ml_dtypes.bfloat16)
    return out


# A token whose combined row tells the documented arithmetic from a single
# rounding of each shared + w * y: shared 1, y 145 * 2^-7 (bfloat16), and a
# weight whose top 16 significant bits times y put 1 + hi * y exactly on a
# float32 tie (1 + 109 * 2^-8 + 2^-24, which rounds to even, down), while its
# low bits lift w * y just above it. Added in two roundings (hi, then lo) the
# row is 1 + 109 * 2^-8, a bfloat16 tie that rounds down to 1.421875; in one,
# just above it, which rounds up to 1.4296875.
TIE_Y, TIE_W = 145 * 2.0**-7, 49265 * 2.0**-17 + 2.0**-25


def tie_token(y, pos, wt, shared):
    """Makes token 0 (bfloat16 ``y``) that token, from row 0 of ``y``."""
    y[0], shared[0], pos[0], wt[0] = TIE_Y, 1.0, 0, 0.0
    wt[0, 0] = TIE_W


def _moe_inputs(rng, w, T, R, H, topk, e4m3):
    """Each of ``w.world`` ranks' inputs of a fused combine of T tokens, R
    rows of H, topk experts (bfloat16 ``y`` holding the tie token, or e4m3
    with scales): (ys, scales or None, positions, weights, shared rows)."""
    import ml_dtypes

    n = w.world
    ys, scales, poss, ws, shareds = [], [], [], [], []
    for _ in range(n):
        if e4m3:
            y = (rng.normal(size=(R, H)) * 4).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            scales.append(rng.uniform(0.01, 0.5, size=(R, H // 128)).astype(np.float32))
        else:
            y = rng.normal(size=(R, H)).astype(np.float32).astype(ml_dtypes.bfloat16)
        ys.append(y)
        pos = rng.integers(0, R, size=(T, topk), dtype=np.int32)
        pos[rng.random((T, topk)) < 0.03] = R + 3  # a few out of range: clamped
        poss.append(pos)
        wt = (rng.random((T, topk)) / topk).astype(np.float32)  # full float32 precision
        wt[rng.random((T, topk)) < 0.1] = 0.0  # experts that do not count
        ws.append(wt)
        shareds.append(rng.normal(size=(T, H)).astype(np.float32).astype(ml_dtypes.bfloat16))
        if not e4m3:
            tie_token(ys[-1], poss[-1], ws[-1], shareds[-1])
    return ys, (scales if e4m3 else None), poss, ws, shareds
