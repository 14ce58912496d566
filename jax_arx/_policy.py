"""What jax_arx runs and what it leaves to ``jax.lax``: the one decide and
fallback policy of every collective.

A call is run by jax_arx when it is a collective over one mesh axis that
``jax_arx.initialize`` set up, inside a ``shard_map`` manual over every mesh
axis of size > 1, on a dtype the op takes, within the size envelope that the
C++ core's plan decides (``Communicator.plan``, ffi/comm/plan.h: the one
place for sizes and algorithms). Anything else goes to ``jax.lax``:

- silently where there is nothing for jax_arx to do or jax.lax owns the
  semantics: names bound by ``jax.vmap`` rather than a mesh, axes of size 1,
  constants (the callers check those);
- otherwise with one log line per distinct reason on the ``"jax_arx"``
  logger, or ``JaxArxFallbackError`` when ``JAX_ARX_FALLBACK=error``.

A fused op whose plan is its unfused form (``ALGORITHM_UNFUSED``: the MoE
combine, run as ``jax_arx.moe_combine`` then ``jax_arx.psum_scatter``;
``psum_add_norm``, run as ``jax_arx.psum`` then the add and the norm in
jax) is no fallback: the plan chose it, and ``decide`` says so
(``UNFUSED``) so that the caller runs it with jax_arx's collective; it is
counted by reason (``planned``, ``stats()["plans"]``), never logged as a
fallback nor refused by ``JAX_ARX_FALLBACK=error``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from jax_arx import _compat, _registry, config as _config
from jax_arx.errors import JaxArxFallbackError

logger = logging.getLogger("jax_arx")

# The reducing ops' element types (psum, psum_scatter, the MoE combine's sums).
REDUCING_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Op:
    """An op as this policy sees it, described once by the module that
    defines it: ``name`` (it is ``jax_arx.{name}``, and the plan's op name),
    ``lax_form`` (what a fallback computes instead, for its messages) and
    ``dtype_refusal(aval)`` (why the op does not take this element type, or
    None). The policy never branches on which op it is."""

    name: str
    lax_form: str
    dtype_refusal: Callable[[object], str | None]


_logged_reasons: set = set()
_fallbacks: dict[str, dict[str, int]] = {}  # op -> reason -> calls traced that fell back (jax_arx.stats())
_plans: dict[str, dict[str, int]] = {}  # op -> reason -> calls traced as their unfused pair (jax_arx.stats())
# Endpoint.plan's algorithm for a fused op run as its unfused pair
# (ffi/comm/plan.h, Algorithm::kUnfused).
ALGORITHM_UNFUSED = 5
# What ``decide`` returns for it: run the op's unfused form.
UNFUSED = "unfused"
_logged_lock = threading.Lock()
# What the calls being decided are, when not the user's own (jax_arx/_grad.py):
# said in their fallback messages.
_note = contextvars.ContextVar("jax_arx_fallback_note", default="")


@contextlib.contextmanager
def noting(note: str):
    """Within it, fallback messages end with ``note`` (in parentheses)."""
    token = _note.set(note)
    try:
        yield
    finally:
        _note.reset(token)


def fallback(op: Op, key: tuple, why: str) -> None:
    """Falls back to ``op.lax_form`` (returns None), logging ``why`` the
    first time this op and ``key`` (a kind of reason and what it concerns)
    come up; or raises JaxArxFallbackError when JAX_ARX_FALLBACK=error."""
    name, lax_name = op.name, op.lax_form
    note = _note.get()
    if note:
        why, key = f"{why} ({note})", (*key, note)
    if _config.load().fallback == "error":
        raise JaxArxFallbackError(
            f"jax_arx.{name}: {why}; JAX_ARX_FALLBACK=error forbids falling back to {lax_name} (unset it to fall back)"
        )
    with _logged_lock:
        first = (name, key) not in _logged_reasons
        _logged_reasons.add((name, key))
        reasons = _fallbacks.setdefault(name, {})
        reasons[why] = reasons.get(why, 0) + 1
    if first:
        logger.warning("jax_arx.%s: %s; using %s", name, why, lax_name)
    return None


def fallback_counts() -> dict[str, dict[str, int]]:
    """How many calls of each op fell back to jax.lax, by reason, since
    jax_arx was imported (a copy): counted when a call is traced or
    lowered, not each time a compiled program runs."""
    with _logged_lock:
        return {op: dict(reasons) for op, reasons in _fallbacks.items()}


def planned(op: Op, reason: str) -> None:
    """Counts a call of ``op`` that the plan runs as its unfused pair, by
    the plan's ``reason`` (not a fallback: nothing is logged or refused)."""
    with _logged_lock:
        reasons = _plans.setdefault(op.name, {})
        reasons[reason] = reasons.get(reason, 0) + 1


def plan_counts() -> dict[str, dict[str, int]]:
    """How many calls of each op the plan ran as their unfused pair, by
    reason, since jax_arx was imported (a copy): counted when a call is
    traced."""
    with _logged_lock:
        return {op: dict(reasons) for op, reasons in _plans.items()}


def check_axes_bound(op: Op, axes: tuple) -> None:
    """Raises NameError for the first of ``axes`` that nothing binds where
    ``op`` is traced, naming it, the mesh's axes and the names that
    are bound; jax.lax's collectives fail there on a bare AssertionError."""
    bound = _compat.bound_axis_names()
    for axis in axes:
        if axis not in bound:
            mesh_axes = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()))
            raise NameError(
                f"jax_arx.{op.name}: axis name {axis!r} is not bound here: the mesh's axes are {mesh_axes}, and the "
                f"names bound where it is called are {tuple(bound)}. Name an axis of the mesh the enclosing "
                "jax.shard_map runs over (or one a jax.vmap(axis_name=...) binds), and call it inside that shard_map."
            )


class Notice(NamedTuple):
    """``decide``'s answer, where asked for (``announce``), for a call that
    jax.lax runs because its operand is outside the plan's envelope here:
    a peer whose operand is within it runs jax_arx, and would wait for this
    rank until the timeout while this rank waits in jax.lax's collective
    for as long as that takes. So the call first tells its peers over
    ``comm_id`` (jax_arx/_notice.py): a peer that decided otherwise raises a
    mismatch, and so does this rank, before jax.lax's collective starts.
    ``comm_id``: the axis's psum communicator, for every op."""

    comm_id: int


def falls_back(decision) -> bool:
    """Whether a caller's decision runs jax.lax: None, or a ``Notice``
    (which ``_notice.announce`` sends first)."""
    return decision is None or isinstance(decision, Notice)


def decide(
    op: Op, aval, axes: tuple, axis_index_groups, *, lane_bytes: Callable[[int], int], announce: bool = False
) -> _registry.Communicator | Notice | str | None:
    """The communicator to run ``op`` on ``aval`` over ``axes`` with, or
    None for jax.lax (after ``fallback`` for a reason the user should know
    about), or ``UNFUSED``, after ``planned``, where the plan runs a fused
    op as its unfused form (which its caller traces with jax_arx's ops).
    ``lane_bytes(world)``: the bytes one rank moves, what the plan's
    envelope is about (a psum's partial, a bulk collective's slice).
    ``announce``: a call outside the envelope gets a ``Notice`` instead of
    None (its caller runs jax.lax after ``_notice.announce``): the one
    fallback that ranks running the same program may take apart, since
    their operands' sizes may differ."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    ours = [a for a in axes if a in manual]
    if not ours:
        # Names bound by vmap (or not bound at all): jax.lax has the
        # semantics, and the error message.
        return None
    if axis_index_groups is not None:
        return fallback(op, ("axis_index_groups",), "axis_index_groups is not supported")
    if len(axes) != 1:
        other = [a for a in axes if a not in manual]
        why = (
            f"a collective over several mesh axes at once {tuple(ours)} is not supported (call jax_arx.{op.name} "
            "once per axis to run each with jax_arx)"
            if len(ours) > 1
            else f"mesh axis {ours[0]!r} together with names bound by jax.vmap {tuple(other)} is not supported"
        )
        return fallback(op, ("axes", axes), why)
    (axis,) = axes
    world = mesh.shape[axis]
    if world == 1:
        return None  # nothing to communicate
    refusal = op.dtype_refusal(aval)
    if refusal:
        return fallback(op, ("dtype", str(aval.dtype)), refusal)
    comm = _axis_communicator(op, axis, mesh, aval)
    if comm is None:
        return None
    algorithm, why_not = comm.plan(op.name, lane_bytes(world))
    if not algorithm:
        fallback(op, ("size", axis), f"{aval.str_short()}: {why_not}")
        return Notice(comm.comm_id) if announce else None
    if algorithm == ALGORITHM_UNFUSED:
        planned(op, why_not)  # why_not holds the plan's reason here
        return UNFUSED
    return comm


def reducing_dtype_refusal(aval) -> str | None:
    """The reducing ops' dtype check (for ``decide``)."""
    if np.dtype(aval.dtype) in REDUCING_DTYPES:
        return None
    return f"dtype {aval.dtype} is not supported (float32, bfloat16 and float16 are)"


def _axis_communicator(op: Op, axis, mesh, aval) -> _registry.Communicator | None:
    """The communicator jax_arx.initialize set up for mesh axis ``axis``, if
    ``op`` on ``aval`` can run on it inside this shard_map; else None, after
    ``fallback``. The axis is set up, for this very mesh, the shard_map is
    manual over every axis of size > 1, and the input is not typed
    unreduced."""
    comm = _registry.communicator(axis)
    if comm is None:
        return fallback(
            op,
            ("uninitialized", axis),
            f"mesh axis {axis!r} has no jax_arx communicator: call jax_arx.initialize(mesh) on every "
            f"process before tracing functions that use jax_arx.{op.name}",
        )
    if (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) != (comm.mesh_axis_names, comm.mesh_shape):
        return fallback(
            op,
            ("mesh", axis),
            f"this shard_map's mesh {_describe(mesh.axis_names, mesh.axis_sizes)} is not the mesh "
            f"jax_arx.initialize set axis {axis!r} up for, "
            f"{_describe(comm.mesh_axis_names, comm.mesh_shape)}",
        )
    manual = set(mesh.manual_axes)
    auto = [n for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if s > 1 and n not in manual]
    if auto:
        return fallback(
            op,
            ("partial_manual", axis),
            f"the shard_map is not manual over mesh axes {auto}; jax_arx runs in shard_maps manual "
            "over every mesh axis of size > 1",
        )
    if axis in _compat.unreduced_axes(aval):
        return fallback(
            op,
            ("unreduced", axis),
            f"the input is typed unreduced or reduced over {axis!r}, which only jax.lax handles",
        )
    return comm


def lowering_refusal(ctx, comm_id: int, axes: tuple) -> tuple[tuple, str] | None:
    """Why a call decided at trace time cannot run with jax_arx after all,
    found at lowering time: (key, why) for ``fallback``, or None."""
    comm = _registry.communicator_by_id(comm_id)
    if comm is None:
        return (
            ("lowering_uninitialized", axes),
            f"mesh axis {axes[0]!r} was shut down (jax_arx.shutdown()) "
            "between tracing and lowering; call jax_arx.initialize(mesh) again",
        )
    device_ids = _compat.lowering_mesh_device_ids(ctx)
    if device_ids is not None and device_ids != comm.device_ids:
        return (
            ("lowering_devices", axes),
            f"this shard_map's mesh has devices {device_ids} where "
            f"jax_arx.initialize set axis {axes[0]!r} up for devices {comm.device_ids}",
        )
    return None


def _describe(names, sizes):
    return "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes, strict=True)) + ")"
