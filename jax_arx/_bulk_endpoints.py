"""The bulk collectives' endpoints, made at their first call.

An endpoint's bulk lanes take 4 x ``JAX_ARX_PREFILL_SLOT_BYTES`` of pinned
memory per device (128 MiB at the default; on one host, in ``/dev/shm``), so
``jax_arx.initialize`` makes its endpoints without them, and a program that
only sums pays nothing for ``all_gather``, ``psum_scatter`` and the fused MoE
combine. The first of those that jax_arx takes on a mesh axis (traced inside
``jax.jit``, within ``JAX_ARX_PREFILL_SLOT_BYTES``) makes that axis's bulk
endpoints: one per local device of each group, over the same carrier, with
their own communicator id (``bulk_id``), sequence numbers and proxy threads,
whose regions hold the lanes and next to nothing for psum. The bulk
collectives of the axis run on them from then on, until ``shutdown()``.

The contract: making them is collective, as ``initialize()`` is. Every
process meets the others through jax.distributed's key-value store while it
traces its first bulk collective on the axis, so every process must trace
the same program: the same bulk collectives, on the same axes, in the same
order (which any SPMD program does). A process whose peers do not get there
within ``JAX_ARX_TIMEOUT_S`` raises ``InitializationError`` from the trace,
naming the process it waited for; a peer that traced something else instead
fails in its own wait within the same bound (a collective this process
never issues, or this same rendezvous later): every rank fails loudly, none
hangs. Restart the job after such an error.

``initialize()`` after ``shutdown()`` makes them again at once for the
communicators that had them (every process had, since making them is
collective), so a program traced before ``shutdown()`` runs again, as a
psum-only one does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Iterable

import jax

from jax_arx import _compat, _endpoints, _native, _registry, _store
from jax_arx.errors import InitializationError

# The psum parts of a bulk endpoint's region (no psum runs on it): the
# smallest the core takes.
_PSUM_BYTES = "16"

# The communicator ids (psum's) whose bulk endpoints this process made, kept
# across shutdown() for restore(); and the set-up attempts per initialize()
# (its generation) and id, which name each attempt's keys in the store: after
# a failed one, every process starts again from the same count once all have
# called shutdown() and initialize().
_made: set[int] = set()
_attempts: dict[tuple[int, int], int] = {}


def bulk_id(comm_id: int) -> int:
    """The id of the bulk collectives' communicator of communicator
    ``comm_id``: the same in every process, distinct from every psum id
    with overwhelming probability, a positive int64."""
    digest = hashlib.blake2b(b"jax_arx/bulk\0" + int(comm_id).to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def bulk_options(options: dict) -> dict:
    """The options of a bulk endpoint, from its psum endpoint's (which have
    ``bulk_lanes="0"``; ``bulk_bytes``, the envelope, is the same): the
    lanes, and the least the core takes for psum."""
    return dict(options, bulk_lanes="1", slot_bytes=_PSUM_BYTES, send_bytes=_PSUM_BYTES)


def communicator_for(comm: _registry.Communicator, op: str) -> _registry.Communicator:
    """The communicator the bulk collectives of ``comm``'s axis run on,
    made now if this is the first (see the module's contract; ``op`` names
    the collective in messages).

    Raises:
      InitializationError: a peer did not get to its first bulk collective
        on this axis within JAX_ARX_TIMEOUT_S, or the endpoints could not
        be created or connected; the message says which and why.
    """
    with _registry.lock:
        bulk = _registry.bulk_communicator(comm.axis_name)
        if bulk is not None and bulk.comm_id == bulk_id(comm.comm_id):
            return bulk
        if _registry.communicator(comm.axis_name) is not comm:
            raise InitializationError(
                f"jax_arx.{op}: mesh axis {comm.axis_name!r} was shut down (jax_arx.shutdown()) while this "
                "collective was traced; call jax_arx.initialize(mesh) again, then trace it again"
            )
        return _make(comm, f"jax_arx.{op}")


def restore(comms: Iterable[_registry.Communicator]) -> None:
    """Makes the bulk endpoints of those of ``comms`` that had them before
    a ``shutdown()`` (called by ``initialize()``)."""
    for comm in comms:
        if comm.comm_id in _made:
            with _registry.lock:
                _make(comm, "jax_arx.initialize")


def _make(comm: _registry.Communicator, what: str) -> _registry.Communicator:
    setup: _registry.Setup = comm.setup
    key = bulk_id(comm.comm_id)
    counter = (_registry.generation(), comm.comm_id)
    attempt = _attempts[counter] = _attempts.get(counter, 0) + 1
    plans = [
        dataclasses.replace(p, comm_id=key, name=f"{p.name}/bulk", secret=_bulk_secret(p.secret)) for p in setup.plans
    ]
    hint = (
        f"{what} makes the bulk collectives' endpoints of mesh axis {comm.axis_name!r} on every process, while "
        "each traces its first all_gather, psum_scatter or MoE combine on that axis: every process must trace "
        "the same program (the same bulk collectives on the same axes, in the same order). A process that traced "
        "something else fails within JAX_ARX_TIMEOUT_S too. Restart the job (or call jax_arx.shutdown() and "
        "jax_arx.initialize() on every process); if a process only got there late (a slow compile), raise "
        "JAX_ARX_TIMEOUT_S."
    )
    prefix = f"jax_arx/{_registry.generation()}/bulk/{comm.comm_id}/{attempt}/"
    store = _store.Store(_compat.distributed_client(), prefix, setup.cfg.timeout_s, what=what, hint=hint)
    made = _endpoints.connect_endpoints(_native.core(), store, plans, bulk_options(setup.options), what)
    store.remove_published()  # after success only: see its docstring
    bulk = dataclasses.replace(comm, comm_id=key, endpoints=tuple(le for _, le in made), setup=None)
    # The axis fails as one: a failure of the psum or the bulk endpoint of a
    # device is the other's too, so the ranks' outcomes differ by at most the
    # one collective the notices allow, per axis (ffi/comm/endpoint.h).
    psum_eps = {le.endpoint.device_ordinal: le.endpoint for le in comm.endpoints}
    for le in bulk.endpoints:
        le.endpoint.fail_together(psum_eps[le.endpoint.device_ordinal])
    _registry.add_bulk(comm.axis_name, bulk)
    _made.add(comm.comm_id)
    _endpoints.debug(
        setup.cfg,
        "process %d: the bulk collectives' endpoints of axis %r are set up (%d endpoint(s))",
        jax.process_index(),
        comm.axis_name,
        len(bulk.endpoints),
    )
    return bulk


def _bulk_secret(group_secret: bytes) -> bytes:
    # Its own key for the bulk endpoints' carrier, bound to the group's.
    return hmac.new(group_secret, b"jax_arx bulk endpoints v1", hashlib.sha256).digest()
