"""The bulk collectives: ``jax_arx.all_gather`` and ``jax_arx.psum_scatter``
-- tens of MB per call (sequence-parallel prefill), sent in pieces -- and
what they share with the fused MoE combine (``jax_arx/_moe.py``): the
decision, the axes, the fallback.

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
import numpy as np

from jax_arx import _bulk_endpoints, _compat, _notice, _ordering, _policy

ALL_GATHER_TARGET = "jax_arx_all_gather"
PSUM_SCATTER_TARGET = "jax_arx_psum_scatter"

SCATTER_DTYPES = _policy.REDUCING_DTYPES  # the reducing ops: float32, bfloat16, float16


def _whole_bytes_refusal(aval):
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) or jax.dtypes.itemsize_bits(aval.dtype) < 8:
        return f"dtype {aval.dtype} is not supported (it is not whole bytes)"
    return None


ALL_GATHER = _policy.Op("all_gather", "jax.lax.all_gather", _whole_bytes_refusal)
PSUM_SCATTER = _policy.Op("psum_scatter", "jax.lax.psum_scatter", _policy.reducing_dtype_refusal)


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
    return _per_leaf(
        ALL_GATHER,
        x,
        axis_name,
        axis_index_groups,
        lambda leaf: jax.lax.all_gather(leaf, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled),
        lambda aval: _canonical_axis(axis, aval.ndim if tiled else aval.ndim + 1),
        lambda leaf, dim, axes, decision: all_gather_p.bind(
            leaf,
            all_gather_dimension=dim,
            axis_name=axes,
            axis_index_groups=None,
            axis_size=decision.world,
            tiled=bool(tiled),
            comm_id=decision.comm_id,
        ),
    )


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
    return _per_leaf(
        PSUM_SCATTER,
        x,
        axis_name,
        axis_index_groups,
        lambda leaf: jax.lax.psum_scatter(
            leaf, axis_name, scatter_dimension=scatter_dimension, axis_index_groups=axis_index_groups, tiled=tiled
        ),
        lambda aval: _canonical_axis(scatter_dimension, aval.ndim),
        lambda leaf, dim, axes, decision: psum_scatter_p.bind(
            leaf,
            scatter_dimension=dim,
            axis_name=axes,
            axis_index_groups=None,
            axis_size=decision.world,
            tiled=bool(tiled),
            comm_id=decision.comm_id,
        ),
    )


def _per_leaf(op, x, axis_name, axis_index_groups, lax_op, dim_of, bind):
    """``op`` on each leaf of ``x``: ``bind(leaf, dim, axes, decision)`` where
    jax_arx runs it, ``lax_op(leaf)`` where it does not (outside a trace, a
    dimension jax rejects -- ``dim_of(aval)`` is None, so jax's own error is
    raised -- or a fallback ``_decide`` chose)."""
    axes = _compat.axes_tuple(axis_name)
    if not axes:
        return x
    _policy.check_axes_bound(op, axes)

    def leaf_fn(leaf):
        if not isinstance(leaf, _compat.Tracer):
            return lax_op(leaf)
        aval = jax.typeof(leaf)
        dim = dim_of(aval)
        decision = None if dim is None else decide(op, aval, axes, axis_index_groups, gathered=op is ALL_GATHER)
        if _policy.falls_back(decision):
            return lax_op(_notice.announce(leaf, decision, op))
        return bind(_compat.pvary_to(leaf, axes), dim, axes, decision)

    return jax.tree.map(leaf_fn, x)


def axis_size(axes) -> int:
    """The number of devices over ``axes`` where the op is traced."""
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


### what jax_arx runs, and what it leaves to jax.lax


class Decision(NamedTuple):
    comm_id: int
    world: int


def decide(op: _policy.Op, aval, axes, axis_index_groups, *, gathered, nbytes=None) -> Decision | _policy.Notice | None:
    """How to run ``op`` (all_gather, psum_scatter or the fused MoE combine)
    on ``aval`` over ``axes``: a decision to run it with jax_arx, or None
    for jax.lax, or a ``_policy.Notice`` for jax.lax after a notice
    (``_policy.decide``, jax_arx/_notice.py). ``gathered``: the op's
    buffer is world times ``aval`` (all_gather), else ``aval`` itself;
    ``nbytes`` overrides. The plan's envelope is about one rank's lane: its
    slice of the gathered output, or of the scattered input."""

    def lane_bytes(world):
        total = (
            nbytes
            if nbytes is not None
            else int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize * (world if gathered else 1)
        )
        return total // world

    comm = _policy.decide(op, aval, axes, axis_index_groups, lane_bytes=lane_bytes, announce=True)
    if comm is _policy.UNFUSED:
        return None  # the plan's unfused pair (_moe: jax_arx.psum_scatter)
    if _policy.falls_back(comm):
        # jax.lax, after a notice on the psum communicator where there is
        # one (jax_arx/_notice.py: a fallback makes no bulk endpoints).
        return comm
    # The first bulk collective of the axis makes its endpoints (collective:
    # every process traces it; see _bulk_endpoints.py).
    bulk = _bulk_endpoints.communicator_for(comm, op.name)
    return Decision(bulk.comm_id, bulk.endpoints[0].world)


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
    attributes = dict(
        comm_id=params["comm_id"],
        site=_ordering.call_site_tag(ctx, op.name, params[dimension_param]),
        dimension=params[dimension_param],
    )
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
        decision = decide(op, jax.typeof(x), params["axis_name"], None, gathered=gathered)
        if _policy.falls_back(decision):
            return lax_p.bind(_notice.announce(x, decision, op), **_lax_params(new)), d
        return own_p.bind(x, **dict(new, comm_id=decision.comm_id)), d

    return batcher


### registration

# cacheable=False, as for psum: the ordering and the site tag need the
# lowering rule to run for every call, in place.
all_gather_p = _compat.Primitive("jax_arx_all_gather")
all_gather_p.def_impl(partial(_compat.apply_primitive, all_gather_p))
all_gather_p.def_effectful_abstract_eval(_all_gather_abstract_eval)
_compat.register_lowering(
    all_gather_p,
    partial(_collective_lowering, ALL_GATHER_TARGET, _compat.lax_all_gather_p, "all_gather_dimension", ALL_GATHER),
    cacheable=False,
)
_compat.deflinear2(all_gather_p, _all_gather_transpose)
_compat.register_batcher(all_gather_p, _batcher(ALL_GATHER, _compat.lax_all_gather_p, "all_gather_dimension", True))

psum_scatter_p = _compat.Primitive("jax_arx_psum_scatter")
psum_scatter_p.def_impl(partial(_compat.apply_primitive, psum_scatter_p))
psum_scatter_p.def_effectful_abstract_eval(_psum_scatter_abstract_eval)
_compat.register_lowering(
    psum_scatter_p,
    partial(_collective_lowering, PSUM_SCATTER_TARGET, _compat.lax_reduce_scatter_p, "scatter_dimension", PSUM_SCATTER),
    cacheable=False,
)
_compat.deflinear2(psum_scatter_p, _psum_scatter_transpose)
_compat.register_batcher(
    psum_scatter_p, _batcher(PSUM_SCATTER, _compat.lax_reduce_scatter_p, "scatter_dimension", False)
)
