"""The fused MoE combine: ``jax_arx.moe_combine_psum_scatter`` (each rank's
expert outputs combined per token and scattered-summed over the axis in one
bulk collective) and ``jax_arx.moe_combine``, its unfused local half. It
decides, falls back and orders its call as the other bulk collectives do
(``jax_arx/_bulk.py``); ``moe_combine_p`` lowers to one call of its own FFI
target.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_arx import _bulk, _compat, _ordering, _policy
from jax_arx._bulk import psum_scatter
from jax_arx.errors import JaxArxFallbackError

MOE_COMBINE_TARGET = "jax_arx_moe_combine_psum_scatter"
# Its element types are _check_moe_shapes' (y's, before any decision); the
# sum is of bfloat16 rows.
OP = _policy.Op("moe_combine_psum_scatter", "jax.lax.psum_scatter", lambda aval: None)
MAX_TOPK = 16  # experts per token the fused combine takes (the CUDA kernel keeps them in shared memory)


def moe_combine_psum_scatter(y, pos, w, shared, axis_name, *, y_scale=None, padded_tokens=None):
    """The last step of a mixture-of-experts layer in sequence-parallel
    prefill, fused: combine each token's expert outputs, add the shared
    expert's, and reduce-scatter the result over ``axis_name`` so that each
    device keeps its slice of the sequence.

    Each device holds a partial of every token (its experts' outputs, or its
    tensor-parallel share of them). For token ``t`` the combined row is

    .. code-block:: text

        shared[t] + sum over k of w[t, k] * y[pos[t, k]]      (in float32)

    rounded once to bfloat16; rows ``T <= t < Tpad`` are zero. The result is
    the rank-order float32 sum of every device's combined rows, rows
    ``[i * Tpad / n, (i + 1) * Tpad / n)`` on device ``i`` of ``n``: what
    ``jax_arx.psum_scatter(moe_combine(...), axis_name, tiled=True)`` gives
    (``moe_combine`` in this module is that plain-JAX reference), bit for
    bit. Fused, jax_arx writes the rows straight into the reduce-scatter's
    send buffer and sends them piece by piece while computing the rest; the
    C++ core's plan runs that pair instead where the fused kernel is slower
    (today on every route: it steps aside, counted in
    ``jax_arx.stats()["plans"]``, which is no fallback).

    The float32 arithmetic is exactly: ``acc = shared[t]``, then for k in
    order, with ``f = w[t, k]`` (e4m3 ``y``: ``f = w[t, k] *
    y_scale[pos[t, k], c // 128]``, rounded), split into ``hi`` (``f`` with
    its 8 lowest significand bits cleared) and ``lo = f - hi``:
    ``acc = acc + hi * y[pos[t, k]]``, then, where ``lo != 0``,
    ``acc = acc + lo * y[pos[t, k]]``, each rounded. Every product is then
    exact in float32, so whether a compiler fuses a multiply and an add
    changes no bit: the fused op equals ``moe_combine`` for any float32
    weights, as long as no nonzero ``|w * y|`` is below 2^-100 (float32's
    subnormals, which backends may flush to zero, start at 2^-126). With
    bfloat16-valued weights ``lo`` is 0 and each term is the one rounding of
    ``acc + w * y``.

    Args:
      y: ``[R, H]`` bfloat16, or ``jnp.float8_e4m3fn`` with ``y_scale``: the
        expert outputs, one row per (token, expert) routed to this device's
        experts, in whatever order the dispatch produced them.
      pos: ``[T, topk]`` int32: ``pos[t, k]`` is the row of ``y`` that holds
        token ``t``'s output from its ``k``-th expert. Out-of-range rows are
        clamped into ``[0, R)``, as ``jnp.take(..., mode="clip")`` does; a
        (token, expert) pair handled on another device should point at a
        row of zeros or carry weight 0.
      w: ``[T, topk]`` float32: the routing weights, with any scaling (the
        routed scaling factor, a normalization) already folded in.
      shared: ``[T, H]`` bfloat16: added to every token's sum, e.g. the shared
        expert's output or the residual; zeros if there is none.
      axis_name: the mesh axis of the sequence parallelism.
      y_scale: ``[R, H / 128]`` float32, with e4m3 ``y`` only: one scale per
        row and 128 columns (``H`` a multiple of 128).
      padded_tokens: ``Tpad``, the padded token count, a multiple of the
        number of devices and at least ``T``; default: ``T`` rounded up to
        one.

    Returns:
      ``[Tpad / n, H]`` bfloat16: this device's rows of the summed combine.

    jax_arx runs it with ``T`` up to what the prefill slot holds
    (``Tpad * H * 2 <= JAX_ARX_PREFILL_SLOT_BYTES``), ``topk`` up to 16 and
    ``H`` a multiple of 8, on CPUs or NVIDIA GPUs over any carrier (shm,
    tcp, verbs), setting up as ``all_gather`` does; otherwise
    (logged once per reason) it computes ``moe_combine`` with jax ops and
    reduce-scatters it with ``jax_arx.psum_scatter``. No ``jax.grad`` or
    ``jax.vmap`` rules: it is meant for inference.
    """
    axes = _compat.axes_tuple(axis_name)
    T, topk = (int(d) for d in np.shape(pos)) if np.ndim(pos) == 2 else (None, None)
    R, H = (int(d) for d in np.shape(y)) if np.ndim(y) == 2 else (None, None)
    _check_moe_shapes(y, pos, w, shared, y_scale)  # the arguments' own errors first, wherever it is called
    _policy.check_axes_bound(OP, axes)
    world = _bulk.axis_size(axes)
    tpad = _padded(T, world, padded_tokens)

    def unfused():
        rows = moe_combine(y, pos, w, shared, y_scale=y_scale, padded_tokens=tpad)
        return psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)

    if len(axes) != 1 or not all(isinstance(v, _compat.Tracer) for v in (y, pos, w, shared)):
        return unfused()
    aval = jax.typeof(y)
    why = None
    if topk < 1 or topk > MAX_TOPK:
        why = (("moe_topk", topk), f"topk {topk} is outside 1..{MAX_TOPK}")
    elif H % 8:
        why = (("moe_hidden", H), f"hidden size {H} is not a multiple of 8")
    elif R == 0 or T == 0:
        return unfused()  # nothing to combine, or no rows to point at
    if why is not None:
        _policy.fallback(OP, *why)
        return unfused()
    decision = _bulk.decide(OP, aval, axes, None, gathered=False, nbytes=tpad * H * 2)
    if _policy.falls_back(decision):
        # A fallback (whose psum_scatter decides again, and announces its
        # own fallback), or the plan's choice of the unfused pair (_policy.planned).
        return unfused()
    operands = [y] + ([y_scale] if y_scale is not None else []) + [pos, w, shared]
    return moe_combine_p.bind(
        *[_compat.pvary_to(v, axes) for v in operands],
        axis_name=axes,
        axis_size=decision.world,
        padded_tokens=tpad,
        scaled=y_scale is not None,
        comm_id=decision.comm_id,
    )


def moe_combine(y, pos, w, shared, *, y_scale=None, padded_tokens=None):
    """The combine of ``moe_combine_psum_scatter`` on one device, in plain jax
    ops: ``[Tpad, H]`` bfloat16 rows, ``shared[t] + sum_k w[t, k] * y[pos[t, k]]``
    in float32 rounded once, zero past ``T``, each term added as the fused
    op's docstring says (its bits, for any float32 weights). The reference
    the fused op is tested against, and its fallback."""
    T, topk = pos.shape
    tpad = T if padded_tokens is None else int(padded_tokens)
    rows = jnp.take(y, pos, axis=0, mode="clip").astype(jnp.float32)  # [T, topk, H]
    if y_scale is not None:
        scale = jnp.take(y_scale, pos, axis=0, mode="clip")  # [T, topk, H / 128]
        # w * scale, rounded once, split, then per column.
        hi, lo = (jnp.repeat(v, 128, axis=2) for v in _split_weights(w[:, :, None] * scale))
    else:
        hi, lo = (v[:, :, None] for v in _split_weights(w))
    acc = shared.astype(jnp.float32)
    for k in range(topk):
        # Exact products (ffi/base/combine.h): a fused multiply-add or not, the same bits.
        acc = acc + hi[:, k] * rows[:, k]
        acc = jnp.where(lo[:, k] != 0, acc + lo[:, k] * rows[:, k], acc)
    out = acc.astype(jnp.bfloat16)
    return jnp.pad(out, ((0, tpad - T), (0, 0))) if tpad > T else out


def _split_weights(f):
    """``f`` (float32) as ``hi + lo`` exactly: ``hi`` is ``f`` with its 8
    lowest significand bits cleared (at most 16 significant bits), ``lo``
    the rest (at most 8); a non-finite ``f`` stays whole in ``hi``."""
    bits = jax.lax.bitcast_convert_type(f, jnp.uint32)
    hi = jnp.where(jnp.isfinite(f), jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFFF00), jnp.float32), f)
    return hi, jnp.where(jnp.isfinite(f), f - hi, jnp.float32(0))


def _check_moe_shapes(y, pos, w, shared, y_scale):
    """Raises ValueError / TypeError naming the numbers, as jax's shape errors do."""

    def shape(v):
        return tuple(int(d) for d in np.shape(v))

    if len(shape(y)) != 2 or len(shape(pos)) != 2:
        raise ValueError(
            f"moe_combine_psum_scatter: y must be [R, H] and pos [T, topk]; got y {shape(y)}, pos {shape(pos)}"
        )
    (R, H), (T, topk) = shape(y), shape(pos)
    if shape(w) != (T, topk) or shape(shared) != (T, H):
        raise ValueError(
            f"moe_combine_psum_scatter: with y {shape(y)} and pos {shape(pos)}, w must be "
            f"{(T, topk)} and shared {(T, H)}; got w {shape(w)}, shared {shape(shared)}"
        )
    dt = {n: np.dtype(jax.typeof(v).dtype) for n, v in (("y", y), ("pos", pos), ("w", w), ("shared", shared))}
    want_y = np.dtype(jnp.float8_e4m3fn) if y_scale is not None else np.dtype(jnp.bfloat16)
    want = {"y": want_y, "pos": np.dtype(np.int32), "w": np.dtype(np.float32), "shared": np.dtype(jnp.bfloat16)}
    wrong = [f"{n} is {dt[n]} (want {want[n]})" for n in want if dt[n] != want[n]]
    if wrong:
        raise TypeError(
            "moe_combine_psum_scatter: "
            + ", ".join(wrong)
            + ("" if y_scale is not None else "; float8_e4m3fn y needs y_scale")
        )
    if y_scale is not None:
        if H % 128 or shape(y_scale) != (R, H // 128) or np.dtype(jax.typeof(y_scale).dtype) != np.float32:
            raise ValueError(
                f"moe_combine_psum_scatter: e4m3 y {shape(y)} needs H a multiple of 128 and y_scale "
                f"float32 {(R, H // 128 if H % 128 == 0 else None)}; "
                f"got {jax.typeof(y_scale).str_short()}"
            )


def _padded(T, world, padded_tokens):
    tpad = -(-T // world) * world if padded_tokens is None else int(padded_tokens)
    if tpad < T or tpad % world:
        raise ValueError(
            f"moe_combine_psum_scatter: padded_tokens {tpad} must be at least T = {T} and a multiple "
            f"of the {world} devices along the axis"
        )
    return tpad


def _moe_abstract_eval(y, *rest, axis_name, axis_size, padded_tokens, scaled, comm_id):
    # The result of a psum_scatter: varying over the axis (and whatever the
    # operands vary over).
    varying = frozenset(axis_name) if _compat.check_vma_enabled() else frozenset()
    for v in (y, *rest):
        varying |= _compat.varying_axes(v)
    out = _compat.aval_like(y, (padded_tokens // axis_size, y.shape[1]), jnp.dtype(jnp.bfloat16), varying)
    return out, {_compat.NamedAxisEffect(a) for a in axis_name}


def _moe_lowering(ctx, *operands, axis_name, axis_size, padded_tokens, scaled, comm_id):
    why = _policy.lowering_refusal(ctx, comm_id, axis_name)
    if why is not None:
        # The unfused computation cannot be built here without the tracing
        # context; such a program must be traced again.
        raise JaxArxFallbackError(f"jax_arx.moe_combine_psum_scatter: {why[1]}; trace the function again")
    attributes = dict(comm_id=comm_id, site=_ordering.call_site_tag(ctx, padded_tokens, scaled), scaled=int(scaled))
    return _ordering.emit_ordered_call(ctx, MOE_COMBINE_TARGET, list(operands), attributes)


# cacheable=False, as for psum: the ordering and the site tag need the
# lowering rule to run for every call, in place.
moe_combine_p = _compat.Primitive("jax_arx_moe_combine_psum_scatter")
moe_combine_p.def_impl(partial(_compat.apply_primitive, moe_combine_p))
moe_combine_p.def_effectful_abstract_eval(_moe_abstract_eval)
_compat.register_lowering(moe_combine_p, _moe_lowering, cacheable=False)
