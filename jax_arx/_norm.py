"""``jax_arx.psum_add_norm``: an all-reduce sum fused with the residual add
and the norm that follow it in a tensor-parallel transformer.

Laid out as ``jax_arx/_psum.py``: the public function, the unfused formula
(the reference, the fallback and the gradient), then the primitive's rules
and its registration. One primitive, ``psum_add_norm_p``, typed as jax's
psum is under the ``shard_map``'s discipline (``invariant``: check_vma);
it lowers to one call of the FFI target ``jax_arx_psum_add_norm``, one psum
collective whose kernels (or host side) run the norm in their epilogue
(ffi/base/norm.h).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_arx import _compat, _ordering, _policy, _psum

FFI_TARGET = "jax_arx_psum_add_norm"
OP = _policy.Op("psum_add_norm", "jax.lax.psum, then the add and the norm in jax", _policy.reducing_dtype_refusal)

KINDS = {"rms": 0, "layer": 1}


### public function


def psum_add_norm(x, residual, weight, axis_name, *, kind="rms", bias=None, eps=1e-6):
    """``jax_arx.psum(x, axis_name) + residual``, then its norm over the last
    axis, in one collective: the all-reduce, residual add and RMSNorm /
    LayerNorm of a tensor-parallel decoder or encoder layer.

    Returns ``(normed, hidden)`` with ``hidden = psum(x) + residual`` and
    ``normed = norm(hidden) * weight (+ bias)``, both of ``x``'s shape and
    dtype, where per row (the last axis, of width W):

    .. code-block:: text

        rms:   normed = hidden / sqrt(mean(hidden^2) + eps) * weight (+ bias)
        layer: normed = (hidden - mean) / sqrt(var + eps) * weight (+ bias)

    (``var`` the mean of ``(hidden - mean)^2``.) The contract:

    - every rank gets the same bits, on every route and algorithm;
    - ``hidden`` equals ``jax_arx.psum(x, axis_name) + residual`` bit for
      bit (the sum in float32 in rank order rounded once, then the add in
      float32 rounded once);
    - ``normed`` is computed in float32 from ``hidden`` as stored, each
      operation rounded once (no fused multiply-add), the row's sums in a
      fixed order: lane ``j`` of 256 adds elements ``j, j + 256, ...`` in
      order, then the lanes are added pairwise, halving (the same bits on
      the CPU and the GPU). It is within half a unit in the last place of
      the dtype (its one rounding) plus 4 float32 units in the last place
      of the row's largest ``|normed|`` (the float32 sums; for ``layer``
      the cancellation in ``hidden - mean``) of the formula in float64.
      That is the fused call's. By default the plan steps aside for
      ``jax_arx.psum``, then the add and the norm in jax, which measured
      faster on every route, GPU and CPU (``jax_arx.stats()["plans"]``
      says so; no fallback): ``hidden`` keeps its bits and ``normed`` is
      XLA's formula from it, the same bits on every rank.

    Inside ``jax.jit`` + ``jax.shard_map``, where ``jax_arx.psum`` runs
    with jax_arx (same axes, dtypes and size envelope), the call runs with
    jax_arx; elsewhere it computes the unfused formula with
    ``jax.lax.psum`` (logged once per reason on the ``"jax_arx"`` logger, or
    ``JaxArxFallbackError`` with ``JAX_ARX_FALLBACK=error``), whose normed
    may differ from the fused one in the last bits. ``jax.vmap`` and
    ``jax.grad`` work; the gradient is the unfused formula's, with
    ``jax_arx.psum`` for its sums.

    Args:
      x: the partial sums, float32, bfloat16 or float16, at least one axis.
      residual: added to the sum: ``x``'s shape and dtype.
      weight: the norm's scale, shape ``(x.shape[-1],)``, ``x``'s dtype.
      axis_name: a mesh axis name (or a tuple of them), as for ``psum``.
      kind: ``"rms"`` (RMSNorm, the default) or ``"layer"`` (LayerNorm).
      bias: None, or the norm's shift, like ``weight``.
      eps: added to the mean square (rms) or the variance (layer); a
        float >= 0, taken as float32.

    Returns:
      ``(normed, hidden)``.

    Raises:
      TypeError: an argument is not an array, or of a dtype other than x's
        (which must be float32, bfloat16 or float16).
      ValueError: a shape that does not fit (names the argument), an
        unknown ``kind``, a negative or non-finite ``eps``.
      NameError, JaxArxFallbackError: as ``jax_arx.psum``.
    """
    if kind not in KINDS:
        raise ValueError(f"jax_arx.psum_add_norm: kind must be 'rms' or 'layer', got {kind!r}")
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"jax_arx.psum_add_norm: eps must be a float, got {type(eps).__name__}") from None
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"jax_arx.psum_add_norm: eps must be finite and >= 0, got {eps}")
    _check_operands(x, residual, weight, bias)
    axes = _compat.axes_tuple(axis_name)
    if axes:
        _policy.check_axes_bound(OP, axes)
    operands = (x, residual, weight) + (() if bias is None else (bias,))
    decision = _decide(jax.typeof(x), axes) if axes and isinstance(x, _compat.Tracer) else None
    if decision is None:
        return tuple(_unfused(*operands, axes=axes, kind=kind, eps=eps, psum=_lax_psum))
    if decision is _policy.UNFUSED:
        return tuple(_unfused(*operands, axes=axes, kind=kind, eps=eps, psum=_arx_psum))
    params = dict(axes=axes, comm_id=decision.comm_id, kind=kind, eps=eps, bias=bias is not None)
    return tuple(_bind(operands, params))


def _check_operands(x, residual, weight, bias):
    named = [("x", x), ("residual", residual), ("weight", weight)] + ([] if bias is None else [("bias", bias)])
    for name, a in named:
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"jax_arx.psum_add_norm: {name} must be an array, got {type(a).__name__}")
    if np.dtype(x.dtype) not in _policy.REDUCING_DTYPES:
        raise TypeError(
            f"jax_arx.psum_add_norm: x has dtype {x.dtype}; it takes float32, bfloat16 or float16: "
            f"cast x, residual, weight and bias to one of them"
        )
    for name, a in named[1:]:
        if a.dtype != x.dtype:
            raise TypeError(
                f"jax_arx.psum_add_norm: {name} has dtype {a.dtype}, x has {x.dtype}: pass {name} "
                f"as {x.dtype} (.astype)"
            )
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"jax_arx.psum_add_norm: x of shape {tuple(x.shape)} has no last axis to norm over: give "
            f"x and residual at least one axis, of at least one element"
        )
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(
            f"jax_arx.psum_add_norm: residual has shape {tuple(residual.shape)}, x has "
            f"{tuple(x.shape)}: they must be equal"
        )
    for name, a in named[2:]:
        if tuple(a.shape) != (x.shape[-1],):
            raise ValueError(
                f"jax_arx.psum_add_norm: {name} has shape {tuple(a.shape)}; it must be ({x.shape[-1]},), x's last axis"
            )


def _lax_psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _unfused(x, residual, weight, bias=None, *, axes, kind, eps, psum):
    """The formula in jax ops: ``psum`` (jax.lax's or jax_arx's), the add in
    the input dtype, the norm in float32 (jax's own reduction order)."""
    hidden = psum(x, axes) + residual
    return _norm(hidden, weight, bias, kind=kind, eps=eps), hidden


def _norm(hidden, weight, bias, *, kind, eps):
    """normed of the unfused formula: no collective."""
    h = hidden.astype(jnp.float32)
    if kind == "layer":
        mean = jnp.mean(h, axis=-1, keepdims=True)
        d = h - mean
    else:
        d = h
    r = jax.lax.rsqrt(jnp.mean(d * d, axis=-1, keepdims=True) + np.float32(eps))
    y = d * r * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(hidden.dtype)


### what jax_arx runs


class _Decision(NamedTuple):
    comm_id: int


def _decide(aval, axes) -> _Decision | str | None:
    """The plan's decision for this partial (jax_arx.psum's envelope): run
    fused, ``_policy.UNFUSED`` (jax_arx.psum, then the add and the norm in
    jax), or None (jax.lax)."""
    partial_bytes = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    comm = _policy.decide(OP, aval, axes, None, lane_bytes=lambda world: partial_bytes, announce=True)
    if isinstance(comm, _policy.Notice):
        # Outside the envelope: jax_arx.psum falls back too, after its
        # notice (jax_arx/_notice.py), then the add and the norm in jax.
        return _policy.UNFUSED
    return comm if comm is None or comm is _policy.UNFUSED else _Decision(comm.comm_id)


def _arx_psum(x, axes):
    return _psum.psum(x, axes)


def _bind(operands, params):
    invariant = _compat.check_vma_enabled()
    x, *rest = operands
    return psum_add_norm_p.bind(_compat.pvary_to(x, params["axes"]), *rest, invariant=invariant, **params)


### rules


def _psum_add_norm_abstract_eval(x, residual, *rest, axes, comm_id, kind, eps, bias, invariant):
    # psum's own type for the sum (shape checks, effects, vma), then the
    # add: a value varies where any of its operands does.
    out, effects = _compat.lax_psum_abstract_eval(x, axes, invariant=invariant)
    varying = _compat.varying_axes(out)
    for a in (residual, *rest):
        varying |= _compat.varying_axes(a)
    y = _compat.aval_like(out, out.shape, out.dtype, varying)
    return [y, y], set(effects)


def _psum_add_norm_lowering(ctx, *operands, axes, comm_id, kind, eps, bias, invariant):
    why = _policy.lowering_refusal(ctx, comm_id, axes)
    if why is not None:
        _policy.fallback(OP, *why)
        return _compat.lower_fun(lambda *o: _unfused(*o, axes=axes, kind=kind, eps=eps, psum=_lax_psum), ctx, *operands)
    attributes = dict(
        comm_id=comm_id, site=_ordering.call_site_tag(ctx), kind=KINDS[kind], eps=float(np.float32(eps)), bias=int(bias)
    )
    return _ordering.emit_ordered_call(ctx, FFI_TARGET, list(operands), attributes)


def _psum_add_norm_jvp(primals, tangents, *, axes, comm_id, kind, eps, bias, invariant):
    # The primal is the fused call's; the tangent the unfused formula's
    # derivative at its hidden (the same bits), its sum on jax_arx.psum
    # (one call for x's tangent), the norm's derivative in jax ops.
    from jax_arx._psum import psum

    outs = psum_add_norm_p.bind(
        *primals, axes=axes, comm_id=comm_id, kind=kind, eps=eps, bias=bias, invariant=invariant
    )
    normed, hidden = outs
    x, residual, weight, *b = primals
    dx, dres, dw, *db = [
        jnp.zeros(jax.typeof(p).shape, jax.typeof(p).dtype) if type(t) is _compat.Zero else t
        for p, t in zip(primals, tangents, strict=True)
    ]
    dhidden = psum(dx, axes) + dres
    if bias:
        f = lambda h, w, bb: _norm(h, w, bb, kind=kind, eps=eps)  # noqa: E731
        _, dnormed = jax.jvp(f, (hidden, weight, b[0]), (dhidden, dw, db[0]))
    else:
        _, dnormed = jax.jvp(lambda h, w: _norm(h, w, None, kind=kind, eps=eps), (hidden, weight), (dhidden, dw))
    return [normed, hidden], [dnormed, dhidden]


def _psum_add_norm_batcher(axis_data, vals_in, dims_in, *, axes, comm_id, kind, eps, bias, invariant):
    x, residual, *rest = vals_in
    dx, dr, *drest = dims_in
    if axis_data.name not in axes and all(d is None for d in drest) and (dx is not None or dr is not None):
        # The rows gain a leading axis: the same op on the stacked rows,
        # decided again for its size.
        size = axis_data.size
        x = jnp.moveaxis(x, dx, 0) if dx is not None else jnp.broadcast_to(x, (size, *x.shape))
        residual = (
            jnp.moveaxis(residual, dr, 0) if dr is not None else jnp.broadcast_to(residual, (size, *residual.shape))
        )
        decision = _decide(jax.typeof(x), axes)
        if decision is _policy.UNFUSED:
            return list(_unfused(x, residual, *rest, axes=axes, kind=kind, eps=eps, psum=_arx_psum)), [0, 0]
        if decision is not None:
            outs = psum_add_norm_p.bind(
                x,
                residual,
                *rest,
                axes=axes,
                comm_id=decision.comm_id,
                kind=kind,
                eps=eps,
                bias=bias,
                invariant=invariant,
            )
            return list(outs), [0, 0]
        vals_in, dims_in = [x, residual, *rest], [0, 0, *drest]
    # A vmap over the summed axis (jax.lax's semantics, silently, as for
    # psum), or a batched weight: the unfused formula under the same vmap.
    if axis_data.name not in axes and any(d is not None for d in drest):
        _policy.fallback(OP, ("vmap_weight",), "a weight or bias batched by jax.vmap is not supported")
    outs = jax.vmap(
        lambda *o: _unfused(*o, axes=axes, kind=kind, eps=eps, psum=_lax_psum),
        in_axes=tuple(dims_in),
        axis_name=axis_data.name,
        axis_size=axis_data.size,
    )(*vals_in)
    return list(outs), [0, 0]


### registration
#
# cacheable=False, as for psum: the ordering and the site tag need the
# lowering rule to run for every call, in place.

psum_add_norm_p = _compat.Primitive("jax_arx_psum_add_norm")
psum_add_norm_p.multiple_results = True
psum_add_norm_p.def_impl(lambda *a, **p: _compat.apply_primitive(psum_add_norm_p, *a, **p))
psum_add_norm_p.def_effectful_abstract_eval(_psum_add_norm_abstract_eval)
_compat.register_lowering(psum_add_norm_p, _psum_add_norm_lowering, cacheable=False)
_compat.register_batcher(psum_add_norm_p, _psum_add_norm_batcher)
_compat.register_jvp(psum_add_norm_p, _psum_add_norm_jvp)
