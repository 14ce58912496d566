"""``jax_arx.psum``: an all-reduce sum over one mesh axis, run by jax_arx.

Laid out like jax's ``jax/_src/lax/parallel.py``: the public function, then
the rules, then how calls are ordered, then one registration block per
primitive.

As in jax there are two primitives, one per typing discipline of
``shard_map``:

- ``psum_invariant_p`` (``check_vma=True``, the default): the input must vary
  over the axis (jax inserts ``pvary`` when it does not, so that the sum of a
  replicated value is ``size * x``) and the output does not. It transposes
  to ``pvary``: the cotangent of an invariant value is already summed.
- ``psum_p`` (``check_vma=False``): no typing of variation; the sum
  transposes to the same sum ("psum is psum + pbroadcast").

Both are variadic: one bind sums every leaf of a pytree that jax_arx runs,
and lowers to ONE call of the XLA FFI target ``jax_arx_psum`` with the
leaves as operands (the handler runs them in operand order, so the leaves
of one call never race), followed by dependency operands that order the
call after the previous jax_arx call of the program (``jax_arx/_ordering.py``).
Attributes: the communicator id and the call site's tag; every process
lowers the same HLO, and the handler finds its endpoint from the id and the
device it runs on, and asks the core's plan (ffi/comm/plan.h) which
algorithm runs each leaf's size.

A bind may also carry prefetch operands after the leaves (the primitives'
``prefetch`` parameter counts them): arrays that the kernels after the sum
read, which the CUDA handler asks the GPU's L2 cache to fetch while it waits
for the peers. They are a hint, never read for the result. They become the
call's last operands, after the dependency operands, with a ``prefetch``
attribute that counts them; the CPU handler binds the same attributes and
ignores them, so one lowering serves every platform.

What jax_arx does not run (``jax_arx/_policy.py``) goes to ``jax.lax.psum``, with
one log line per distinct reason, or raises ``JaxArxFallbackError`` when
``JAX_ARX_FALLBACK=error``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from jax_arx import _compat, _notice, _ordering, _policy

FFI_TARGET = "jax_arx_psum"

SUPPORTED_DTYPES = _policy.REDUCING_DTYPES
OP = _policy.Op("psum", "jax.lax.psum", _policy.reducing_dtype_refusal)

# The most prefetch arrays one call takes: the CUDA handler's kMaxPrefetch
# (ffi/cuda/device_side.h), which rejects more.
MAX_PREFETCH = 8


### public function


def psum(x, axis_name, *, axis_index_groups=None, prefetch=None):
    """All-reduce sum of ``x`` over the mesh axis ``axis_name``, run by
    jax_arx: a drop-in replacement for ``jax.lax.psum`` inside ``jax.jit`` +
    ``jax.shard_map``.

    Same contract as ``jax.lax.psum``: ``x`` may be a pytree (each leaf is
    summed on its own); the result has the shape and dtype of ``x`` and is
    the sum over the devices along ``axis_name``, identical on each of them;
    under ``check_vma=True`` a value not varying over the axis is summed as
    ``size * x`` and the result's type is invariant over the axis; ``jax.grad``
    and ``jax.vmap`` behave as they do through ``jax.lax.psum``. The sum is
    taken in float32 in rank order and rounded once, so every device gets
    the same bits. The sums of the backward pass run on jax_arx too: with
    ``check_vma=True`` they are jax's ``pvary`` transposed, which jax_arx
    takes on the axes it set up (``jax_arx/_grad.py``,
    ``JAX_ARX_GRAD_SUMS``); with ``check_vma=False`` this psum transposes
    to itself, and ``shard_map`` sums its replicated inputs' gradients with
    ``jax.lax.psum``.

    jax_arx runs one sum over one axis that ``jax_arx.initialize(mesh)`` set
    up, of a float32, bfloat16 or float16 array whose bytes fit the one-shot
    limit (``JAX_ARX_SLOT_BYTES``), in a ``shard_map`` manual over every mesh
    axis of size > 1. Anything else is computed by ``jax.lax.psum``, logged
    once per reason on the ``"jax_arx"`` logger, or raises
    ``JaxArxFallbackError`` if ``JAX_ARX_FALLBACK=error``. Constants,
    axes of size 1 and names bound by ``jax.vmap`` rather than the mesh are
    left to ``jax.lax.psum`` silently: there is nothing for jax_arx to send.
    The leaves of a pytree that jax_arx runs are summed by one call, one
    leaf after the other.

    ``prefetch`` names arrays that the kernels after this sum read, such as
    the next layer's weights as the ``shard_map`` body sees them: on GPUs,
    while the call waits for its peers (and DRAM is idle), it asks the L2
    cache to fetch them. It is a hint: the result is the same, bit for bit,
    with or without it, and the arrays are not differentiated through (they
    get no cotangent from this call). It is ignored on the CPU backend,
    wherever the sum falls back to ``jax.lax.psum``, for arrays batched by a
    ``jax.vmap`` (another array per batch member), and for constants. The
    arrays become operands of the call, so it starts only once they are
    computed: pass arrays that are already available, such as parameters;
    an array computed after the psum would delay it (and a later in-place
    update of one waits for the psum).

    Args:
      x: array or pytree of arrays.
      axis_name: a mesh axis name, or a tuple of them.
      axis_index_groups: as in ``jax.lax.psum``; jax_arx does not run these
        (they fall back).
      prefetch: None, an array, or a pytree of at most ``MAX_PREFETCH`` (8)
        arrays of any dtype, on the device this body runs on (inside
        ``shard_map`` every value is).

    Returns:
      The sum, with the structure, shapes and dtypes of ``x``.

    Raises:
      ValueError: ``prefetch`` has more than 8 leaves.
      TypeError: a leaf of ``prefetch`` is not an array.
      JaxArxFallbackError: with ``JAX_ARX_FALLBACK=error``, when the call is
        outside what jax_arx runs; the message says what and why.
      NameError: an axis name that neither the enclosing ``shard_map``'s
        mesh nor a ``jax.vmap`` binds; the message names it and the mesh's
        axes (``jax.lax.psum`` raises a bare ``AssertionError`` there).
      ValueError: as ``jax.lax.psum`` raises it (invariant input with
        automatic ``pvary`` disabled, ...).
    """
    axes = _compat.axes_tuple(axis_name)
    hint = _prefetch_operands(prefetch)  # checked even where it is dropped: the same program runs on GPUs
    if not axes:
        return x
    _policy.check_axes_bound(OP, axes)
    leaves, treedef = jax.tree.flatten(x)
    out = list(leaves)
    ours: dict[_Decision, list[int]] = {}  # leaves jax_arx sums, by decision, in leaf order
    for i, leaf in enumerate(leaves):
        # A constant is the same on every device: jax.lax.psum turns it into
        # size * x without communicating.
        decision = _decide(jax.typeof(leaf), axes, axis_index_groups) if isinstance(leaf, _compat.Tracer) else None
        if _policy.falls_back(decision):
            leaf = _notice.announce(leaf, decision, OP)
            out[i] = jax.lax.psum(leaf, axes, axis_index_groups=axis_index_groups)
        else:
            ours.setdefault(decision, []).append(i)
    for decision, idx in ours.items():  # one group in practice: one communicator
        # The first call prefetches; the hint is dropped with the leaves left to jax.lax.
        for i, y in zip(idx, _bind([leaves[i] for i in idx], axes, decision, hint), strict=True):
            out[i] = y
        hint = ()
    return jax.tree.unflatten(treedef, out)


def _prefetch_operands(prefetch) -> tuple:
    """The leaves of ``psum``'s ``prefetch`` argument that can be operands
    of the call: traced arrays of ordinary dtypes. A constant is not a
    buffer the program reads from DRAM, and an extended dtype (a PRNG key)
    has no plain buffer type; both are dropped, as a hint may be."""
    if prefetch is None:
        return ()
    leaves = jax.tree.leaves(prefetch)
    if len(leaves) > MAX_PREFETCH:
        raise ValueError(
            f"jax_arx.psum: prefetch has {len(leaves)} arrays; a call prefetches at most "
            f"{MAX_PREFETCH} (MAX_PREFETCH, the CUDA handler's limit): pass the largest ones"
        )
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"jax_arx.psum: prefetch takes arrays or pytrees of arrays, got a leaf of type {type(leaf).__name__}"
            )
    return tuple(
        leaf
        for leaf in leaves
        if isinstance(leaf, _compat.Tracer) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
    )


def _bind(leaves, axes, decision, prefetch=()):
    """Sums ``leaves`` with one bind, typed as jax.lax.psum's own non-constant
    path (bind_psum_invariant) types each of them, prefetching the arrays
    ``prefetch``."""
    params = dict(axes=axes, comm_id=decision.comm_id)
    prim = psum_p
    if _compat.check_vma_enabled():
        prim = psum_invariant_p
        leaves = [_compat.pvary_to(leaf, axes) for leaf in leaves]
    return prim.bind(*leaves, *prefetch, prefetch=len(prefetch), **params)


### what jax_arx runs, and what it leaves to jax.lax


class _Decision(NamedTuple):
    comm_id: int


def _decide(aval, axes, axis_index_groups) -> _Decision | _policy.Notice | None:
    """How to run a psum of ``aval`` over ``axes``: a decision to run it with
    jax_arx, or None for jax.lax.psum, or a ``_policy.Notice`` for
    jax.lax.psum after a notice (``_policy.decide``, jax_arx/_notice.py)."""
    partial_bytes = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    comm = _policy.decide(OP, aval, axes, axis_index_groups, lane_bytes=lambda world: partial_bytes, announce=True)
    return comm if _policy.falls_back(comm) else _Decision(comm.comm_id)


### rules
#
# Every rule takes the bind's operands: the leaves to sum, then the
# `prefetch` operands (the last `prefetch` of them), which have no results
# and no cotangents and are never read for a result.


def _split(operands, prefetch):
    """(leaves, prefetch operands) of a bind's operands."""
    n = len(operands) - prefetch
    return list(operands[:n]), list(operands[n:])


def _psum_abstract_eval(*avals, axes, comm_id, prefetch, invariant):
    # jax.lax.psum's own rules, leaf by leaf: the same result types, shape
    # checks and NamedAxisEffects as the collectives this replaces.
    # invariant=False: jax's psum (check_vma=False); True: jax's
    # psum_invariant (the output no longer varies over `axes`, and an input
    # that does not vary over them is a type error).
    outs, effects = [], set()
    for aval in _split(avals, prefetch)[0]:
        out, eff = _compat.lax_psum_abstract_eval(aval, axes, invariant=invariant)
        outs.append(out)
        effects |= set(eff)
    return outs, effects


def _psum_lowering(ctx, *operands, axes, comm_id, prefetch):
    # has_side_effect: XLA must neither merge two identical sums nor drop an
    # unused one, since every rank must issue the same collectives in the
    # same order. The attributes carry no pointers, so every process lowers
    # the same HLO.
    xs, pf = _split(operands, prefetch)
    why = _policy.lowering_refusal(ctx, comm_id, axes)
    if why is not None:
        _policy.fallback(OP, *why)
        return _compat.lax_psum_lowering(ctx, xs, axes=axes)  # the prefetch hint goes with jax_arx
    attributes = dict(comm_id=comm_id, site=_ordering.call_site_tag(ctx))
    if pf:  # a call without prefetch operands lowers as before
        attributes["prefetch"] = len(pf)
    return _ordering.emit_ordered_call(ctx, FFI_TARGET, xs, attributes, trailing=pf)


def _psum_jvp(prim, primals, tangents, *, axes, comm_id, prefetch):
    # The primitive is linear in its leaves, but not jax's linear JVP (the
    # same bind on every operand's tangent, zeros instantiated): the
    # tangent is the sum of the leaves' nonzero tangents, one call with no
    # prefetch operands, or none when they are all zero. The linear JVP
    # would hand the tangent's call zeros the size of the weights to
    # prefetch, and sum zeros whenever only the weights have tangents.
    params = dict(axes=axes, comm_id=comm_id)
    ys = prim.bind(*primals, prefetch=prefetch, **params)
    dxs = _split(tangents, prefetch)[0]
    dys = [_compat.Zero(jax.typeof(y).to_tangent_aval()) for y in ys]
    live = [i for i, t in enumerate(dxs) if type(t) is not _compat.Zero]
    if live:
        for i, dy in zip(live, prim.bind(*[dxs[i] for i in live], prefetch=0, **params), strict=True):
            dys[i] = dy
    return ys, dys


def _no_ct(a):
    # The cotangent of an operand that is not summed: a symbolic zero for a
    # linear input, None for a constant of the linear program. Constants
    # occur as leaves (jax.linear_transpose of a sum of a pytree with a leaf
    # that does not depend on the input) and as prefetch operands, which get
    # no cotangent.
    return _compat.Zero(a.aval.to_ct_aval()) if _compat.is_undefined_primal(a) else None


def _psum_transpose_rule(cts, *args, axes, comm_id, prefetch):
    # As jax: psum is psum + pbroadcast, so the cotangent is summed again.
    # Same shapes and dtypes as the primals, hence the same decision. Leaves
    # with a symbolic zero cotangent, or that are constants, have nothing to
    # sum. The sum of the cotangents prefetches nothing: what the backward
    # pass reads next is not what the forward pass read.
    xs, pf = _split(args, prefetch)
    out = [_no_ct(a) for a in xs]
    live = [
        i
        for i, (ct, a) in enumerate(zip(cts, xs, strict=True))
        if type(ct) is not _compat.Zero and _compat.is_undefined_primal(a)
    ]
    if live:
        summed = psum_p.bind(*[cts[i] for i in live], axes=axes, comm_id=comm_id, prefetch=0)
        for i, y in zip(live, summed, strict=True):
            out[i] = y
    return out + [_no_ct(a) for a in pf]


def _psum_invariant_transpose_rule(cts, *args, axes, comm_id, prefetch):
    # As jax: the cotangent of an invariant result is itself invariant, i.e.
    # already the same on every device; it only has to be typed as varying.
    xs, pf = _split(args, prefetch)
    return [
        _compat.pvary(ct, axes) if type(ct) is not _compat.Zero and _compat.is_undefined_primal(a) else _no_ct(a)
        for ct, a in zip(cts, xs, strict=True)
    ] + [_no_ct(a) for a in pf]


def _psum_batcher(prim, axis_data, vals_in, dims_in, *, axes, comm_id, prefetch):
    invariant = prim is psum_invariant_p
    vals_in, pf_vals = _split(vals_in, prefetch)
    dims_in, pf_dims = _split(dims_in, prefetch)
    if axis_data.name in axes:
        # A vmap over the very axis being summed: jax's rule sums the batch
        # dimension locally; there is nothing of ours to keep (the prefetch
        # hint included).
        pairs = [
            _compat.lax_psum_batcher(axis_data, [v], [d], axes=axes, invariant=invariant)
            for v, d in zip(vals_in, dims_in, strict=True)
        ]
        return [o for o, _ in pairs], [d for _, d in pairs]
    # A prefetch operand batched by this vmap is another array per batch
    # member, not the one the next kernels read: its hint is dropped. The
    # others stay with the first call.
    pf = [v for v, d in zip(pf_vals, pf_dims, strict=True) if d is None]
    # The sum is elementwise across devices, so each batch dimension stays
    # where it is; but a batched partial grew by the batch size, so decide
    # again for those leaves (and keep the others' decision).
    out = list(vals_in)
    ours: dict[_Decision, list[int]] = {}
    for i, (v, d) in enumerate(zip(vals_in, dims_in, strict=True)):
        decision = _Decision(comm_id) if d is None else _decide(jax.typeof(v), axes, None)
        if _policy.falls_back(decision):
            out[i] = _compat.lax_psum_bind(_notice.announce(v, decision, OP), axes=axes, invariant=invariant)
        else:
            ours.setdefault(decision, []).append(i)
    for decision, idx in ours.items():
        summed = prim.bind(*[vals_in[i] for i in idx], *pf, axes=axes, comm_id=decision.comm_id, prefetch=len(pf))
        for i, y in zip(idx, summed, strict=True):
            out[i] = y
        pf = []
    return out, list(dims_in)


### registration


# Params of both primitives: axes, comm_id, and prefetch (how many of the
# operands, the last ones, are prefetch operands).
#
# cacheable=False: by default jax lowers a primitive once per distinct
# (params, types) into a private function and pastes copies of it wherever
# the same equation recurs. The ordering and the site tag above need the
# lowering rule to run for every call, in place, where it sees the block the
# call ends up in.
#
# Autodiff: the transposes (`deflinear2`, which skips a zero cotangent) and
# the JVP `_psum_jvp`, registered after it in place of its linear JVP.
def _define_psum(name: str, invariant: bool, transpose_rule):
    prim = _compat.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(partial(_compat.apply_primitive, prim))
    prim.def_effectful_abstract_eval(partial(_psum_abstract_eval, invariant=invariant))
    _compat.register_lowering(prim, _psum_lowering, cacheable=False)
    _compat.deflinear2(prim, transpose_rule)
    _compat.register_jvp(prim, partial(_psum_jvp, prim))
    _compat.register_batcher(prim, partial(_psum_batcher, prim))
    return prim


psum_p = _define_psum("jax_arx_psum", False, _psum_transpose_rule)
psum_invariant_p = _define_psum("jax_arx_psum_invariant", True, _psum_invariant_transpose_rule)
