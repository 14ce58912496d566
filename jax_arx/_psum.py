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
call after the previous jax_arx call of the program (see "ordering" below).
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

What jax_arx does not run (see ``_decide``) goes to ``jax.lax.psum``, with
one log line per distinct reason, or raises ``JaxArxFallbackError`` when
``JAX_ARX_FALLBACK=error``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
from functools import partial
from typing import NamedTuple

import jax
import numpy as np

from jax_arx import _comm
from jax_arx import _compat
from jax_arx import config as _config
from jax_arx.errors import JaxArxFallbackError

logger = logging.getLogger("jax_arx")

FFI_TARGET = "jax_arx_psum"

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))

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
    the same bits.

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
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    hint = _prefetch_operands(prefetch)  # checked even where it is dropped: the same program runs on GPUs
    if not axes:
        return x
    check_axes_bound("psum", axes)
    leaves, treedef = jax.tree.flatten(x)
    out = list(leaves)
    ours: dict[_Decision, list[int]] = {}  # leaves jax_arx sums, by decision, in leaf order
    for i, leaf in enumerate(leaves):
        # A constant is the same on every device: jax.lax.psum turns it into
        # size * x without communicating.
        decision = (_decide(jax.typeof(leaf), axes, axis_index_groups)
                    if isinstance(leaf, _compat.Tracer) else None)
        if decision is None:
            out[i] = jax.lax.psum(leaf, axes, axis_index_groups=axis_index_groups)
        else:
            ours.setdefault(decision, []).append(i)
    for decision, idx in ours.items():  # one group in practice: one communicator
        # The first call prefetches; the hint is dropped with the leaves left to jax.lax.
        for i, y in zip(idx, _bind([leaves[i] for i in idx], axes, decision, hint)):
            out[i] = y
        hint = ()
    return jax.tree.unflatten(treedef, out)


def check_axes_bound(op: str, axes: tuple) -> None:
    """Raises NameError for the first of ``axes`` that nothing binds where
    ``jax_arx.op`` is traced, naming it, the mesh's axes and the names that
    are bound; jax.lax's collectives fail there on a bare AssertionError."""
    bound = _compat.bound_axis_names()
    for axis in axes:
        if axis not in bound:
            mesh_axes = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()))
            raise NameError(
                f"jax_arx.{op}: axis name {axis!r} is not bound here: the mesh's axes are {mesh_axes}, and the names "
                f"bound where it is called are {tuple(bound)}. Name an axis of the mesh the enclosing jax.shard_map "
                "runs over (or one a jax.vmap(axis_name=...) binds), and call it inside that shard_map.")


def _prefetch_operands(prefetch) -> tuple:
    """The leaves of ``psum``'s ``prefetch`` argument that can be operands
    of the call: traced arrays of ordinary dtypes. A constant is not a
    buffer the program reads from DRAM, and an extended dtype (a PRNG key)
    has no plain buffer type; both are dropped, as a hint may be."""
    if prefetch is None:
        return ()
    leaves = jax.tree.leaves(prefetch)
    if len(leaves) > MAX_PREFETCH:
        raise ValueError(f"jax_arx.psum: prefetch has {len(leaves)} arrays; a call prefetches at most "
                         f"{MAX_PREFETCH} (MAX_PREFETCH, the CUDA handler's limit): pass the largest ones")
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"jax_arx.psum: prefetch takes arrays or pytrees of arrays, got a leaf of type "
                            f"{type(leaf).__name__}")
    return tuple(leaf for leaf in leaves if isinstance(leaf, _compat.Tracer)
                 and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended))


def _bind(leaves, axes, decision, prefetch=()):
    """Sums ``leaves`` with one bind, typed as jax.lax.psum's own non-constant
    path (bind_psum_invariant) types each of them, prefetching the arrays
    ``prefetch``."""
    params = dict(axes=axes, comm_id=decision.comm_id)
    prim = psum_p
    if _compat.check_vma_enabled():
        prim = psum_invariant_p
        leaves = list(leaves)
        for i, leaf in enumerate(leaves):
            missing = tuple(a for a in axes if a not in _compat.varying_axes(jax.typeof(leaf)))
            if missing and _compat.auto_pcast_enabled():
                leaves[i] = _compat.pvary(leaf, missing)
    return prim.bind(*leaves, *prefetch, prefetch=len(prefetch), **params)


### what jax_arx runs, and what it leaves to jax.lax

class _Decision(NamedTuple):
    comm_id: int


def axis_communicator(op: str, axis, mesh, aval, fallback):
    """The communicator jax_arx.initialize set up for mesh axis ``axis``, if
    a jax_arx ``op`` on ``aval`` can run on it inside this shard_map; else
    None, after ``fallback(key, why)`` (log once, or raise). The checks every
    collective makes: the axis is set up, for this very mesh, the shard_map
    is manual over every axis of size > 1, and the input is not typed
    unreduced."""
    comm = _comm.communicator(axis)
    if comm is None:
        return fallback(("uninitialized", axis),
                        f"mesh axis {axis!r} has no jax_arx communicator: call jax_arx.initialize(mesh) on every "
                        f"process before tracing functions that use jax_arx.{op}")
    if (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) != (comm.mesh_axis_names, comm.mesh_shape):
        return fallback(("mesh", axis),
                        f"this shard_map's mesh {_describe(mesh.axis_names, mesh.axis_sizes)} is not the mesh "
                        f"jax_arx.initialize set axis {axis!r} up for, "
                        f"{_describe(comm.mesh_axis_names, comm.mesh_shape)}")
    manual = set(mesh.manual_axes)
    auto = [n for n, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1 and n not in manual]
    if auto:
        return fallback(("partial_manual", axis),
                        f"the shard_map is not manual over mesh axes {auto}; jax_arx runs in shard_maps manual "
                        "over every mesh axis of size > 1")
    if axis in _compat.unreduced_axes(aval):
        return fallback(("unreduced", axis),
                        f"the input is typed unreduced or reduced over {axis!r}, which only jax.lax handles")
    return comm


def _decide(aval, axes, axis_index_groups) -> _Decision | None:
    """How to run a psum of ``aval`` over ``axes``: a decision to run it with
    jax_arx, or None for jax.lax.psum. Falling back for a reason the user
    should know about goes through ``_fallback`` (log once, or raise)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if len(axes) == 1 and axes[0] not in manual:
        # A name bound by vmap (or not bound at all): jax.lax.psum has the
        # semantics, and the error message.
        return None
    if axis_index_groups is not None:
        return _fallback(("axis_index_groups",), "axis_index_groups is not supported")
    if len(axes) != 1:
        return _fallback(("axes", axes),
                         f"a sum over several axes at once {axes} is not supported (call jax_arx.psum once per "
                         "axis to run each with jax_arx)")
    axis, = axes
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.shape[axis] == 1:
        return None  # nothing to communicate
    if aval.dtype not in SUPPORTED_DTYPES:
        return _fallback(("dtype", str(aval.dtype)),
                         f"dtype {aval.dtype} is not supported (float32, bfloat16 and float16 are)")
    comm = axis_communicator("psum", axis, mesh, aval, _fallback)
    if comm is None:
        return None
    nbytes = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    algorithm, why_not = comm.plan("psum", nbytes)
    if not algorithm:
        return _fallback(("size", axis), f"{aval.str_short()}: {why_not}")
    return _Decision(comm.comm_id)


def _describe(names, sizes):
    return "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes)) + ")"


_logged_reasons: set = set()
_logged_lock = threading.Lock()


def _fallback(key: tuple, why: str) -> None:
    """Falls back to jax.lax.psum (returns None), logging ``why`` the first
    time this ``key`` (a kind of reason and what it concerns) comes up; or
    raises JaxArxFallbackError when JAX_ARX_FALLBACK=error."""
    if _config.load().fallback == "error":
        raise JaxArxFallbackError(f"jax_arx.psum: {why}; JAX_ARX_FALLBACK=error forbids falling back to "
                                  "jax.lax.psum (unset it to fall back)")
    with _logged_lock:
        first = key not in _logged_reasons
        _logged_reasons.add(key)
    if first:
        logger.warning("jax_arx.psum: %s; using jax.lax.psum", why)
    return None


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
    comm = _comm.communicator_by_id(comm_id)
    why = None
    if comm is None:
        why = (("lowering_uninitialized", axes), f"mesh axis {axes[0]!r} was shut down (jax_arx.shutdown()) "
               "between tracing and lowering; call jax_arx.initialize(mesh) again")
    else:
        device_ids = _compat.lowering_mesh_device_ids(ctx)
        if device_ids is not None and device_ids != comm.device_ids:
            why = (("lowering_devices", axes), f"this shard_map's mesh has devices {device_ids} where "
                   f"jax_arx.initialize set axis {axes[0]!r} up for devices {comm.device_ids}")
    if why is not None:
        _fallback(*why)
        return _compat.lax_psum_lowering(ctx, xs, axes=axes)  # the prefetch hint goes with jax_arx
    attributes = dict(comm_id=comm_id, site=call_site_tag(ctx))
    if pf:  # a call without prefetch operands lowers as before
        attributes["prefetch"] = len(pf)
    return emit_ordered_call(ctx, FFI_TARGET, xs, attributes, trailing=pf)


def lax_lowering(ctx, *operands, axes, comm_id, prefetch=0):
    """Lowers either primitive the way jax.lax.psum lowers (an XLA
    all-reduce per leaf), ignoring jax_arx's attributes and the prefetch
    operands: a stand-in for the FFI call in tests that run without the C++
    module."""
    return _compat.lax_psum_lowering(ctx, _split(operands, prefetch)[0], axes=axes)


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
        for i, dy in zip(live, prim.bind(*[dxs[i] for i in live], prefetch=0, **params)):
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
    live = [i for i, (ct, a) in enumerate(zip(cts, xs))
            if type(ct) is not _compat.Zero and _compat.is_undefined_primal(a)]
    if live:
        summed = psum_p.bind(*[cts[i] for i in live], axes=axes, comm_id=comm_id, prefetch=0)
        for i, y in zip(live, summed):
            out[i] = y
    return out + [_no_ct(a) for a in pf]


def _psum_invariant_transpose_rule(cts, *args, axes, comm_id, prefetch):
    # As jax: the cotangent of an invariant result is itself invariant, i.e.
    # already the same on every device; it only has to be typed as varying.
    xs, pf = _split(args, prefetch)
    return [_compat.pvary(ct, axes) if type(ct) is not _compat.Zero and _compat.is_undefined_primal(a)
            else _no_ct(a) for ct, a in zip(cts, xs)] + [_no_ct(a) for a in pf]


def _psum_batcher(prim, axis_data, vals_in, dims_in, *, axes, comm_id, prefetch):
    invariant = prim is psum_invariant_p
    vals_in, pf_vals = _split(vals_in, prefetch)
    dims_in, pf_dims = _split(dims_in, prefetch)
    if axis_data.name in axes:
        # A vmap over the very axis being summed: jax's rule sums the batch
        # dimension locally; there is nothing of ours to keep (the prefetch
        # hint included).
        pairs = [_compat.lax_psum_batcher(axis_data, [v], [d], axes=axes, invariant=invariant)
                 for v, d in zip(vals_in, dims_in)]
        return [o for o, _ in pairs], [d for _, d in pairs]
    # A prefetch operand batched by this vmap is another array per batch
    # member, not the one the next kernels read: its hint is dropped. The
    # others stay with the first call.
    pf = [v for v, d in zip(pf_vals, pf_dims) if d is None]
    # The sum is elementwise across devices, so each batch dimension stays
    # where it is; but a batched partial grew by the batch size, so decide
    # again for those leaves (and keep the others' decision).
    out = list(vals_in)
    ours: dict[_Decision, list[int]] = {}
    for i, (v, d) in enumerate(zip(vals_in, dims_in)):
        decision = _Decision(comm_id) if d is None else _decide(jax.typeof(v), axes, None)
        if decision is None:
            out[i] = _compat.lax_psum_bind(v, axes=axes, invariant=invariant)
        else:
            ours.setdefault(decision, []).append(i)
    for decision, idx in ours.items():
        summed = prim.bind(*[vals_in[i] for i in idx], *pf, axes=axes, comm_id=decision.comm_id,
                           prefetch=len(pf))
        for i, y in zip(idx, summed):
            out[i] = y
        pf = []
    return out, list(dims_in)


### ordering: every rank issues its jax_arx calls in the same order
#
# Each call takes the next sequence number of its endpoint, so every rank
# must issue the calls of a program in one order. XLA's CPU runtime does not
# run a program in program order: it runs each thunk (a kernel, a custom
# call, a whole loop, a whole conditional) as soon as the thunks that wrote
# the buffers it reads are done, several at once, in an order that can
# differ between processes. A custom call declares only the buffers it reads
# and writes, nothing that orders two independent ones. So jax_arx turns the
# order into data: a call reads (and ignores) results of the jax_arx calls
# before it, as trailing dependency operands, and XLA runs a reader after
# the writer. (The handler also holds the endpoint's lock for a whole call,
# so the leaves of one call, its operands in order, never race.)
#
# The dependencies are read off the IR under construction, where the call
# is emitted. Program order in a block is lowering order, which is jaxpr
# order: the same in every process.
#
# - A call depends on the first result of the last jax_arx call before it
#   in its block, and on each op after that one that contains jax_arx calls
#   (a loop, a conditional, a call of a nested jit or scan body, a
#   shard_map). By induction, the calls of a block form one chain.
# - An op that contains calls is depended on through a result computed
#   after the last call inside it: one whose yielded value is computed from
#   that call (`_ordering_value`). Where XLA inlines the op (functions,
#   shard_map bodies) that data path orders the inner call first; a loop or
#   conditional runs as one thunk, complete only when its body is.
#
# What this does not order: the first call inside a nested computation
# after the calls before the computation. jax lowers a loop, cond, scan or
# nested jit as a function of its operands (a loop or cond is built in a
# function of its own, then pasted into place), and a shard_map body as a
# region closed to values from outside, so nothing inside can read a value
# from around it; only the data it reads orders it. In a program where such
# a call and an earlier one are independent, XLA may start them in
# different orders on different ranks. The `site` tag makes that an error
# on every rank ("issued a different collective"), never a wrong sum; make
# one depend on the other's result to fix the order.
#
# The site tag identifies the call site: a hash of the module's name, the
# call's number among the module's jax_arx calls in lowering order, and
# where in the user's code it comes from (`_compat.call_site`), all the same
# in every process. It travels, with size and dtype, in the descriptor each
# rank sends; ranks that pair different calls get an error, even calls of
# two programs that happen to share a name.

_LOOPS_AND_BRANCHES = ("stablehlo.while", "stablehlo.case", "stablehlo.if")
_TARGET_PREFIX = "jax_arx_"  # the FFI targets of every jax_arx collective


class _Analysis:
    """What one module's lowering learned about its ops (they do not change
    once built: every op before the insertion point is complete)."""

    def __init__(self):
        self.sites = itertools.count(1)
        self.blocks: dict = {}  # block -> _Block
        self.contains: dict = {}  # op -> whether it contains a jax_arx call
        self.values: dict = {}  # op -> its ordering value, or None
        self.functions: dict = {}  # function name -> whether its body contains a jax_arx call


class _Block:
    """A block's ops up to `seen` (jax appends ops, never inserts): its last
    jax_arx call, and the ops after it that contain calls."""

    def __init__(self):
        self.seen = 0
        self.last_call = None
        self.nested: list = []


def _analysis(ctx) -> _Analysis:
    return _compat.module_state(ctx, "psum_ordering", _Analysis)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site_tag(ctx) -> int:
    """The `site` attribute of the call being lowered (see above)."""
    n = next(_analysis(ctx).sites)
    key = f"{_compat.module_name(ctx)}|{n}|{_compat.call_site(ctx, _PACKAGE_DIR)}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 16  # 48 bits: the handler tags leaves as site * 64 + i


def emit_ordered_call(ctx, target: str, xs, attributes: dict[str, int], *, trailing=()):
    """Emits a side-effecting call of the FFI target ``target`` on operands
    ``xs`` at the end of the current block, reading, as dependency operands
    after them, results of the jax_arx calls before it (see the comment
    above), and then the operands ``trailing`` (psum's prefetch operands,
    which the handler finds at the end). Returns its results, typed by
    ``ctx.avals_out``. Every jax_arx collective lowers through here: they
    all take sequence numbers on the same endpoints, so they all join one
    chain."""
    a = _analysis(ctx)
    ip = _compat.ir.InsertionPoint.current
    ops = ip.block.operations
    if ip.ref_operation is None:
        # jax appends to a block: only the ops added since the last call
        # here are new. ops[i] walks the block in C++, cheaper than
        # iterating it in Python.
        b = a.blocks.setdefault(ip.block, _Block())
        new = (ops[i].operation for i in range(b.seen, len(ops)))
    else:  # inserting before an op: look at everything before it
        b, stop = _Block(), ip.ref_operation.operation
        new = itertools.takewhile(lambda op: op != stop, (op.operation for op in ops))
    for op in new:
        if _is_call(op):  # pasted in with a copy of a cached lowering
            b.last_call, b.nested = op, []
        elif _contains_call(op, ctx, a):
            b.nested.append(op)
    deps = []
    for op in ([b.last_call] if b.last_call is not None else []) + b.nested:
        v = _ordering_value(op, ctx, a)
        if v is not None and v not in deps and v not in xs:
            deps.append(v)
    results = _compat.ffi_custom_call(ctx, target, [*xs, *deps, *trailing], has_side_effect=True,
                                      attributes=attributes)
    if ip.ref_operation is None:
        b.last_call, b.nested, b.seen = results[0].owner.operation, [], len(ops)
    return results


def _is_call(op) -> bool:
    """Whether ``op`` is a jax_arx collective (any of its FFI targets)."""
    if op.name != "stablehlo.custom_call":
        return False
    return _compat.ir.StringAttr(op.attributes["call_target_name"]).value.startswith(_TARGET_PREFIX)


def _callee(op, ctx):
    """The body block of the function a func.call calls, or None."""
    name = _compat.ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    try:
        func = ctx.module_context.symbol_table[name]
    except KeyError:
        return None
    regions = func.operation.regions
    return regions[0].blocks[0] if len(regions) and len(regions[0].blocks) else None


def _contains_call(op, ctx, a: _Analysis) -> bool:
    """Whether ``op`` holds a jax_arx call in its regions or in a function
    it calls (at any depth)."""
    if not len(op.regions) and op.name != "func.call":
        return False
    if op in a.contains:
        return a.contains[op]
    ir = _compat.ir
    found = False

    def visit(o):
        nonlocal found
        if _is_call(o) or (o.name == "func.call" and _function_contains_call(o, ctx, a)):
            found = True
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    a.contains[op] = found
    return found


def _function_contains_call(call, ctx, a: _Analysis) -> bool:
    name = _compat.ir.FlatSymbolRefAttr(call.attributes["callee"]).value
    if name not in a.functions:
        a.functions[name] = False  # a recursive call finds nothing new
        body = _callee(call, ctx)
        a.functions[name] = body is not None and _contains_call(body.owner.operation, ctx, a)
    return a.functions[name]


def _ordering_value(op, ctx, a: _Analysis):
    """A result of ``op`` (a jax_arx call, or an op containing some) that is
    available only after every jax_arx call in it ran, or None."""
    if _is_call(op):
        return op.results[0]
    if op in a.values:
        return a.values[op]
    a.values[op] = None  # while computing (a function cannot reach itself)
    blocks = [_callee(op, ctx)] if op.name == "func.call" else [r.blocks[len(r.blocks) - 1] for r in op.regions
                                                                if len(r.blocks)]
    results = list(op.results)
    tensor = {i for i, r in enumerate(results) if isinstance(r.type, _compat.ir.RankedTensorType)}
    good = None  # indices of results computed after the last call of every block that has one
    for block in blocks:
        if block is None:
            good = set()
            break
        ops = [o.operation for o in block.operations]
        yielded = list(ops[-1].operands) if ops else []
        if len(yielded) != len(results):
            continue  # not the block that makes the results (a loop's condition)
        last = next((o for o in reversed(ops) if _is_call(o) or _contains_call(o, ctx, a)), None)
        if last is None:
            continue
        target = last if _is_call(last) else _ordering_value(last, ctx, a)
        found = set() if target is None else {i for i, v in enumerate(yielded) if _reaches(v, target, block)}
        good = found if good is None else good & found
    good = sorted((good or set()) & tensor)
    value = results[good[0]] if good else None
    if value is None and op.name in _LOOPS_AND_BRANCHES and tensor:
        # XLA runs a loop or a conditional as one thunk: any result the body
        # writes is available only after the whole of it.
        if op.name == "stablehlo.while":
            body = op.regions[1].blocks[0]
            written = [i for i, v in enumerate(list(body.operations)[-1].operation.operands)
                       if i in tensor and v != body.arguments[i]]
            value = results[written[0]] if written else None
        else:
            value = results[min(tensor)]
    a.values[op] = value
    return value


def _reaches(value, target, block) -> bool:
    """Whether ``value`` is computed, within ``block``, from ``target`` (a
    value, or any result of an op)."""
    ir = _compat.ir
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(target, ir.Value) and v == target:
            return True
        owner = v.owner
        if isinstance(owner, ir.Block):
            continue  # an argument: from outside
        op = owner.operation
        if op in seen:
            continue
        seen.add(op)
        if op == target:
            return True
        if op.block != block:
            continue  # from an enclosing block: computed before `block` ran
        stack.extend(op.operands)
        if len(op.regions):
            # What ops nested in its regions use from this block.
            def visit(o):
                stack.extend(x for x in o.operands if not isinstance(x.owner, ir.Block)
                             and x.owner.operation.block == block)
                return ir.WalkResult.ADVANCE
            op.walk(visit)
    return False


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
