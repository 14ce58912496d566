"""The communicators of this process: the one owner of their state.

``jax_arx.initialize`` (``_comm``) adds the psum communicators, one per
mesh axis; the bulk collectives' communicators are added at their first
call (``_bulk_endpoints``); ``shutdown`` takes them all. The primitives'
rules and handlers look them up here, by axis or by id. Every change
happens under ``lock``; the generation counts the ``initialize()`` calls
that set something up, and names their keys in jax.distributed's store.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable
from typing import Any

from jax_arx import _endpoints


@dataclasses.dataclass(frozen=True)
class Communicator:
    """What jax_arx set up for one mesh axis, in this process."""

    axis_name: Hashable
    comm_id: int
    mesh_axis_names: tuple
    mesh_shape: tuple[int, ...]
    device_ids: tuple[int, ...]  # the mesh's devices, flat, row-major
    endpoints: tuple[_endpoints.LocalEndpoint, ...]
    topology: str = "mesh"  # "ring": each group's ranks reach only their neighbours
    # What its endpoints were made from (this process's groups, the options):
    # the bulk collectives' endpoints are made from it at their first call
    # (jax_arx/_bulk_endpoints.py).
    setup: Any = dataclasses.field(default=None, repr=False, compare=False)

    def plan(self, op: str, nbytes: int) -> tuple[int, str]:
        """What runs a collective ``op`` with ``nbytes`` per rank on this
        communicator, as the C++ core decides it (ffi/comm/plan.h, the one
        place): (algorithm, why_not); algorithm 0 means jax_arx does not
        take it, and why_not says why and what to set. Every endpoint of a
        communicator decides alike."""
        if not self.endpoints:
            return 0, "this process has no device on the axis"
        algorithm, _pieces, why_not = self.endpoints[0].endpoint.plan(op, int(nbytes))
        return algorithm, why_not


lock = threading.RLock()
_communicators: dict[Hashable, Communicator] = {}
# The bulk collectives' communicators, by axis, made at their first call
# (jax_arx/_bulk_endpoints.py); taken by shutdown() with the others.
_bulk_communicators: dict[Hashable, Communicator] = {}
_generation = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one communicator's endpoints in this process were made from: the
    plans of this process's groups (secrets included) and the endpoint
    options, from which jax_arx/_bulk_endpoints.py makes the bulk ones."""

    plans: tuple
    options: dict
    cfg: Any  # the config.Config they were made with


def communicator(axis_name: Hashable) -> Communicator | None:
    """The communicator set up for ``axis_name``, or None."""
    return _communicators.get(axis_name)


def communicators() -> dict[Hashable, Communicator]:
    """Every communicator set up in this process, by mesh axis (a copy)."""
    with lock:
        return dict(_communicators)


def transport(axis_name: Hashable) -> str | None:
    """The carrier jax_arx.initialize chose for mesh axis ``axis_name`` in
    this process: ``"shm"``, ``"tcp"`` or ``"verbs"`` (several, joined by
    ", ", where this process's groups of the axis differ), or None when the
    axis is not set up."""
    comm = _communicators.get(axis_name)
    if comm is None or not comm.endpoints:
        return None
    return ", ".join(sorted({le.transport for le in comm.endpoints}))


def communicator_by_id(comm_id: int) -> Communicator | None:
    """The communicator (a bulk collectives' one too) of id ``comm_id``."""
    for comm in list(_communicators.values()) + list(_bulk_communicators.values()):
        if comm.comm_id == comm_id:
            return comm
    return None


def bulk_communicator(axis_name: Hashable) -> Communicator | None:
    """The bulk collectives' communicator of ``axis_name``, or None before
    their first call on it."""
    return _bulk_communicators.get(axis_name)


def generation() -> int:
    """The count of ``initialize()`` calls that set something up in this
    process (the same in every process: they are collective)."""
    return _generation


def add(made: dict[Hashable, Communicator]) -> None:
    """Adds the psum communicators one ``initialize()`` set up. Call under
    ``lock``."""
    _communicators.update(made)


def next_generation() -> int:
    """Starts the set-up of one ``initialize()``: its generation. Call
    under ``lock``."""
    global _generation
    _generation += 1
    return _generation


def add_bulk(axis_name: Hashable, comm: Communicator) -> None:
    """Adds the bulk collectives' communicator of ``axis_name``. Call under
    ``lock``."""
    _bulk_communicators[axis_name] = comm


def take_all() -> list[Communicator]:
    """Removes and returns every communicator, psum's then bulk's, for
    ``shutdown()``; an empty list when none is set up. Call under ``lock``."""
    if not _communicators:
        return []
    comms = list(_communicators.values()) + list(_bulk_communicators.values())
    _communicators.clear()
    _bulk_communicators.clear()
    return comms
