"""The bulk collectives: ``jax_arx.all_gather``, ``jax_arx.psum_scatter`` and
the fused MoE combine ``jax_arx.moe_combine_psum_scatter`` -- tens of MB per
call (sequence-parallel prefill), sent in pieces.

Laid out like jax's ``jax/_src/lax/parallel.py``: the public functions, then
what jax_arx runs and what it leaves to jax.lax, then the rules, then one
registration block per primitive.

``all_gather_p`` and ``psum_scatter_p`` carry the params of jax's own
``all_gather_p`` / ``reduce_scatter_p`` (so jax's typing rules type them,
errors included) plus the communicator id. Each lowers to one call of an XLA
FFI target, ordered after the program's previous jax_arx call
(``jax_arx/_ordering.py``), with attributes: the communicator id, the call
site's tag, and the gathered / scattered dimension (the handler does the
strided copies a dimension other than the first needs: no transposes around
the call). They transpose to each other, as jax's do.

Each call is one bulk collective (ffi/base/layout.h), with its own sequence
numbers, up to ``JAX_ARX_PREFILL_SLOT_BYTES`` per call (the gathered output,
or the scattered input), on the axis's bulk endpoints, which the first one
traced makes (``jax_arx/_bulk_endpoints.py``: every process must trace the
same program). What jax_arx does not run falls back to ``jax.lax`` as
``jax_arx/_policy.py`` says, as for psum; whatever the carrier (shm, tcp,
verbs), jax_arx runs what is within that envelope.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_arx import _bulk_endpoints
from jax_arx import _compat
from jax_arx import _ordering
from jax_arx import _policy
from jax_arx.errors import JaxArxFallbackError

ALL_GATHER_TARGET = "jax_arx_all_gather"
PSUM_SCATTER_TARGET = "jax_arx_psum_scatter"
MOE_COMBINE_TARGET = "jax_arx_moe_combine_psum_scatter"

SCATTER_DTYPES = _policy.REDUCING_DTYPES  # the reducing ops: float32, bfloat16, float16
MAX_TOPK = 16  # experts per token the fused combine takes (the CUDA kernel keeps them in shared memory)


### public functions

def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying"):
    """Gathers ``x`` from every device along the mesh axis ``axis_name``, run
    by jax_arx: a drop-in replacement for ``jax.lax.all_gather`` inside
    ``jax.jit`` + ``jax.shard_map``.

    Same contract as ``jax.lax.all_gather``: ``x`` may be a pytree (each leaf
    is gathered on its own); with ``tiled=False`` the pieces are stacked
    along a new axis at position ``axis``, with ``tiled=True`` concatenated
    along the existing axis ``axis``; piece ``i`` is device ``i``'s ``x``.
    ``jax.grad`` transposes it to ``jax_arx.psum_scatter``.

    jax_arx runs a gather over one axis that ``jax_arx.initialize(mesh)`` set
    up, of any element type of at least one byte (the bytes are copied as
    they are), whose gathered output fits ``JAX_ARX_PREFILL_SLOT_BYTES``, on
    CPUs or NVIDIA GPUs, over any carrier (shm, tcp, verbs). The first bulk
    collective traced on an axis sets up its buffers, on every process
    together: every process must trace the same program. Anything else is
    computed by
    ``jax.lax.all_gather`` (logged once per reason on the ``"jax_arx"``
    logger, or raising ``JaxArxFallbackError`` if ``JAX_ARX_FALLBACK=error``).

    Args:
      x: array or pytree of arrays.
      axis_name: a mesh axis name (or a 1-tuple of one).
      axis_index_groups: as in ``jax.lax.all_gather``; not run by jax_arx.
      axis: where the gathered axis goes (``tiled=False``) or which axis is
        concatenated (``tiled=True``).
      tiled: stack (False) or concatenate (True).
      to: as in ``jax.lax.all_gather``; anything but ``"varying"`` is left to
        jax.

    Returns:
      The gathered array(s), shaped as ``jax.lax.all_gather`` shapes them.
    """
    if to != "varying":
        return jax.lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to)
    axes = _axes(axis_name)
    if not axes:
        return x
    _policy.check_axes_bound("all_gather", axes)

    def leaf_fn(leaf):
        lax = partial(jax.lax.all_gather, leaf, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                      tiled=tiled)
        if not isinstance(leaf, _compat.Tracer):
            return lax()
        aval = jax.typeof(leaf)
        dim = _canonical_axis(axis, aval.ndim if tiled else aval.ndim + 1)
        if dim is None:
            return lax()  # jax's error message
        decision = _decide("all_gather", aval, axes, axis_index_groups, gathered=True)
        if decision is None:
            return lax()
        return all_gather_p.bind(_pvary(leaf, axes), all_gather_dimension=dim, axis_name=axes, axis_index_groups=None,
                                 axis_size=decision.world, tiled=bool(tiled), comm_id=decision.comm_id)

    return jax.tree.map(leaf_fn, x)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False):
    """Sums ``x`` over the mesh axis ``axis_name`` and leaves each device its
    part, run by jax_arx: a drop-in replacement for ``jax.lax.psum_scatter``
    inside ``jax.jit`` + ``jax.shard_map``.

    Same contract as ``jax.lax.psum_scatter``: device ``i`` gets block ``i``
    along ``scatter_dimension`` of the sum (``tiled=False``: that dimension's
    size equals the number of devices and is dropped; ``tiled=True``: it is
    divided by it). The sum is taken in float32 in rank order and rounded
    once, so it is the same bits whichever device computes a block, and the
    bits ``jax_arx.psum`` gives. ``jax.grad`` transposes it to
    ``jax_arx.all_gather``.

    jax_arx runs a sum over one axis that ``jax_arx.initialize(mesh)`` set
    up, of float32, bfloat16 or float16, whose input fits
    ``JAX_ARX_PREFILL_SLOT_BYTES``, on CPUs or NVIDIA GPUs over any carrier
    (shm, tcp, verbs), setting up as ``all_gather`` does; anything else
    falls back to ``jax.lax.psum_scatter`` as ``all_gather`` does.

    Args:
      x: array or pytree of arrays.
      axis_name: a mesh axis name (or a 1-tuple of one).
      scatter_dimension: the dimension that is split over the devices.
      axis_index_groups: as in ``jax.lax.psum_scatter``; not run by jax_arx.
      tiled: see above.

    Returns:
      Each device's block of the sum.
    """
    axes = _axes(axis_name)
    if not axes:
        return x
    _policy.check_axes_bound("psum_scatter", axes)

    def leaf_fn(leaf):
        lax = partial(jax.lax.psum_scatter, leaf, axis_name, scatter_dimension=scatter_dimension,
                      axis_index_groups=axis_index_groups, tiled=tiled)
        if not isinstance(leaf, _compat.Tracer):
            return lax()
        aval = jax.typeof(leaf)
        dim = _canonical_axis(scatter_dimension, aval.ndim)
        if dim is None:
            return lax()
        decision = _decide("psum_scatter", aval, axes, axis_index_groups, gathered=False)
        if decision is None:
            return lax()
        return psum_scatter_p.bind(_pvary(leaf, axes), scatter_dimension=dim, axis_name=axes, axis_index_groups=None,
                                   axis_size=decision.world, tiled=bool(tiled), comm_id=decision.comm_id)

    return jax.tree.map(leaf_fn, x)


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
    bit. jax_arx writes the rows straight into the reduce-scatter's send
    buffer and sends them piece by piece while computing the rest.

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
    axes = _axes(axis_name)
    T, topk = (int(d) for d in np.shape(pos)) if np.ndim(pos) == 2 else (None, None)
    R, H = (int(d) for d in np.shape(y)) if np.ndim(y) == 2 else (None, None)
    _check_moe_shapes(y, pos, w, shared, y_scale)  # the arguments' own errors first, wherever it is called
    _policy.check_axes_bound("moe_combine_psum_scatter", axes)
    world = _axis_size(axes)
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
        _policy.fallback("moe_combine_psum_scatter", *why)
        return unfused()
    decision = _decide("moe_combine_psum_scatter", aval, axes, None, gathered=False, nbytes=tpad * H * 2)
    if decision is None:
        return unfused()
    operands = [y] + ([y_scale] if y_scale is not None else []) + [pos, w, shared]
    return moe_combine_p.bind(*[_pvary(v, axes) for v in operands], axis_name=axes, axis_size=decision.world,
                              padded_tokens=tpad, scaled=y_scale is not None, comm_id=decision.comm_id)


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
        raise ValueError(f"moe_combine_psum_scatter: y must be [R, H] and pos [T, topk]; got y {shape(y)}, "
                         f"pos {shape(pos)}")
    (R, H), (T, topk) = shape(y), shape(pos)
    if shape(w) != (T, topk) or shape(shared) != (T, H):
        raise ValueError(f"moe_combine_psum_scatter: with y {shape(y)} and pos {shape(pos)}, w must be "
                         f"{(T, topk)} and shared {(T, H)}; got w {shape(w)}, shared {shape(shared)}")
    dt = {n: np.dtype(jax.typeof(v).dtype) for n, v in (("y", y), ("pos", pos), ("w", w), ("shared", shared))}
    want_y = np.dtype(jnp.float8_e4m3fn) if y_scale is not None else np.dtype(jnp.bfloat16)
    want = {"y": want_y, "pos": np.dtype(np.int32), "w": np.dtype(np.float32), "shared": np.dtype(jnp.bfloat16)}
    wrong = [f"{n} is {dt[n]} (want {want[n]})" for n in want if dt[n] != want[n]]
    if wrong:
        raise TypeError("moe_combine_psum_scatter: " + ", ".join(wrong)
                        + ("" if y_scale is not None else "; float8_e4m3fn y needs y_scale"))
    if y_scale is not None:
        if H % 128 or shape(y_scale) != (R, H // 128) or np.dtype(jax.typeof(y_scale).dtype) != np.float32:
            raise ValueError(f"moe_combine_psum_scatter: e4m3 y {shape(y)} needs H a multiple of 128 and y_scale "
                             f"float32 {(R, H // 128 if H % 128 == 0 else None)}; "
                             f"got {jax.typeof(y_scale).str_short()}")


def _padded(T, world, padded_tokens):
    tpad = -(-T // world) * world if padded_tokens is None else int(padded_tokens)
    if tpad < T or tpad % world:
        raise ValueError(f"moe_combine_psum_scatter: padded_tokens {tpad} must be at least T = {T} and a multiple "
                         f"of the {world} devices along the axis")
    return tpad


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _axis_size(axes) -> int:
    size = 1
    for a in axes:
        size *= jax.lax.axis_size(a)
    return size


def _canonical_axis(axis, ndim) -> int | None:
    try:
        axis = int(axis)
    except TypeError:
        return None
    if not -ndim <= axis < ndim:
        return None
    return axis % ndim


def _pvary(x, axes):
    """What jax's collectives do to their input under ``check_vma``: a value
    not typed as varying over the axis is made so (jax's
    ``insert_collective_pvary``)."""
    if not (_compat.check_vma_enabled() and _compat.auto_pcast_enabled()):
        return x
    missing = tuple(a for a in axes if a not in _compat.varying_axes(jax.typeof(x)))
    return _compat.pvary(x, missing) if missing else x


### what jax_arx runs, and what it leaves to jax.lax

class _Decision(NamedTuple):
    comm_id: int
    world: int


def _decide(op, aval, axes, axis_index_groups, *, gathered, nbytes=None) -> _Decision | None:
    """How to run ``op`` on ``aval`` over ``axes``: a decision to run it with
    jax_arx, or None for jax.lax (``_policy.decide``). ``gathered``: the op's
    buffer is world times ``aval`` (all_gather), else ``aval`` itself;
    ``nbytes`` overrides. The plan's envelope is about one rank's lane: its
    slice of the gathered output, or of the scattered input."""

    def dtype_refusal(aval):
        if op == "moe_combine_psum_scatter":
            return None  # _check_moe_shapes has checked y's dtype; the sum is bfloat16 rows
        if op != "all_gather":
            return _policy.reducing_dtype_refusal(aval)
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) or jax.dtypes.itemsize_bits(aval.dtype) < 8:
            return f"dtype {aval.dtype} is not supported (it is not whole bytes)"
        return None

    def lane_bytes(world):
        total = nbytes if nbytes is not None else int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(
            aval.dtype).itemsize * (world if gathered else 1)
        return total // world

    comm = _policy.decide(op, aval, axes, axis_index_groups, dtype_refusal=dtype_refusal, lane_bytes=lane_bytes)
    if comm is None:
        return None
    # The first bulk collective of the axis makes its endpoints (collective:
    # every process traces it; see _bulk_endpoints.py).
    bulk = _bulk_endpoints.communicator_for(comm, op)
    return _Decision(bulk.comm_id, bulk.endpoints[0].world)


### rules

def _lax_params(params):
    """The params of jax's own primitive: ours without the communicator."""
    return {k: v for k, v in params.items() if k != "comm_id"}


def _all_gather_abstract_eval(aval, **params):
    return _compat.lax_collective_abstract_eval(_compat.lax_all_gather_p, aval, **_lax_params(params))


def _psum_scatter_abstract_eval(aval, **params):
    return _compat.lax_collective_abstract_eval(_compat.lax_reduce_scatter_p, aval, **_lax_params(params))


def _collective_lowering(target, lax_prim, dimension_param, op, ctx, x, **params):
    # has_side_effect (in emit_ordered_call): XLA must neither merge two identical
    # calls nor drop an unused one; every rank issues the same calls in the
    # same order. The attributes carry no pointers: every process lowers
    # the same HLO.
    why = _policy.lowering_refusal(ctx, params["comm_id"], params["axis_name"])
    if why is not None:
        _policy.fallback(op, *why)
        return _compat.lax_collective_lowering(lax_prim, ctx, x, **_lax_params(params))
    attributes = dict(comm_id=params["comm_id"], site=_ordering.call_site_tag(ctx), dimension=params[dimension_param])
    return _ordering.emit_ordered_call(ctx, target, [x], attributes)


def _all_gather_transpose(ct, x, *, all_gather_dimension, axis_name, tiled, **params):
    # As jax: the cotangent of a gather is scattered back, summed.
    return (psum_scatter(ct, axis_name, scatter_dimension=all_gather_dimension, tiled=tiled),)


def _psum_scatter_transpose(ct, x, *, scatter_dimension, axis_name, tiled, **params):
    # As jax: the cotangent of a scattered sum is gathered.
    return (all_gather(ct, axis_name, axis=scatter_dimension, tiled=tiled),)


def _batcher(op, lax_p, dim_name, gathered):
    """The vmap rule of all_gather (``gathered``) or psum_scatter: the
    batched dimension moves the op's own dimension, and the bigger input is
    decided again."""
    def batcher(axis_data, vals_in, dims_in, **params):
        own_p = all_gather_p if gathered else psum_scatter_p
        (x,), (d,) = vals_in, dims_in
        if axis_data.name in params["axis_name"]:
            # A vmap over the collective's axis itself: jax's rule does it locally.
            return _compat.lax_collective_batcher(lax_p, axis_data, vals_in, dims_in, **_lax_params(params))
        if d is None:
            return own_p.bind(x, **params), None
        dim, tiled = params[dim_name], params["tiled"]
        if d <= dim:
            dim += 1
        elif not tiled:
            # Untiled, all_gather stacks a new axis before d; psum_scatter
            # drops the scattered one before it.
            d += 1 if gathered else -1
        new = dict(params, **{dim_name: dim})
        decision = _decide(op, jax.typeof(x), params["axis_name"], None, gathered=gathered)
        if decision is None:
            return lax_p.bind(x, **_lax_params(new)), d
        return own_p.bind(x, **dict(new, comm_id=decision.comm_id)), d

    return batcher


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
    attributes = dict(comm_id=comm_id, site=_ordering.call_site_tag(ctx), scaled=int(scaled))
    return _ordering.emit_ordered_call(ctx, MOE_COMBINE_TARGET, list(operands), attributes)


### registration

# cacheable=False, as for psum: the ordering and the site tag need the
# lowering rule to run for every call, in place.
all_gather_p = _compat.Primitive("jax_arx_all_gather")
all_gather_p.def_impl(partial(_compat.apply_primitive, all_gather_p))
all_gather_p.def_effectful_abstract_eval(_all_gather_abstract_eval)
_compat.register_lowering(all_gather_p, partial(_collective_lowering, ALL_GATHER_TARGET, _compat.lax_all_gather_p,
                                                "all_gather_dimension", "all_gather"), cacheable=False)
_compat.deflinear2(all_gather_p, _all_gather_transpose)
_compat.register_batcher(all_gather_p, _batcher("all_gather", _compat.lax_all_gather_p, "all_gather_dimension", True))

psum_scatter_p = _compat.Primitive("jax_arx_psum_scatter")
psum_scatter_p.def_impl(partial(_compat.apply_primitive, psum_scatter_p))
psum_scatter_p.def_effectful_abstract_eval(_psum_scatter_abstract_eval)
_compat.register_lowering(psum_scatter_p, partial(_collective_lowering, PSUM_SCATTER_TARGET,
                                                  _compat.lax_reduce_scatter_p, "scatter_dimension", "psum_scatter"),
                          cacheable=False)
_compat.deflinear2(psum_scatter_p, _psum_scatter_transpose)
_compat.register_batcher(psum_scatter_p, _batcher("psum_scatter", _compat.lax_reduce_scatter_p, "scatter_dimension",
                                                   False))

moe_combine_p = _compat.Primitive("jax_arx_moe_combine_psum_scatter")
moe_combine_p.def_impl(partial(_compat.apply_primitive, moe_combine_p))
moe_combine_p.def_effectful_abstract_eval(_moe_abstract_eval)
_compat.register_lowering(moe_combine_p, _moe_lowering, cacheable=False)
