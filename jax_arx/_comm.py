"""Communicators: ``initialize()``, ``shutdown()`` and ``check()``.

One communicator per mesh axis of size > 1. Its id is a hash of the axis
name and the mesh (names, shape, device ids), so every process computes the
same id without talking, and a program traced before a shutdown() runs again
after initialize() with the same mesh. The devices along the axis, with the
other axes fixed, form a group; this process makes one endpoint
(``_core.Endpoint``) per local device of each group, rank = position along
the axis. A handler finds its endpoint from the ``comm_id`` attribute and
XLA's device ordinal (see ``_compat.xla_device_ordinal``).

The rendezvous goes through jax.distributed's key-value store, under keys
namespaced by a per-process generation counter (bumped by every initialize()
that sets something up), so shutdown() then initialize() again never reads a
stale key. Every process must call initialize() and shutdown() the same
number of times, with the same meshes: they are collective.

The store is readable and writable by anyone who reaches the coordinator's
port, so nothing secret goes through it: each group's first process
publishes a random nonce, and every member derives the group's shared
secret from it and JAX_ARX_SECRET (``_endpoints.group_secret``); the tcp carrier adds
a key pair per endpoint, whose public half travels in its details. Every
process removes what it published once set-up is over.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from jax_arx import (
    _bulk,
    _bulk_endpoints,
    _carriers,
    _compat,
    _distributed,
    _endpoints,
    _grad,
    _moe,
    _native,
    _norm,
    _psum,
    _registry,
    _store,
    config as _config,
    errors,
)
from jax_arx.errors import CollectiveError, ConfigError, InitializationError

logger = logging.getLogger("jax_arx")


# The registry's read side, for the rules, the handlers and the tests.
communicator = _registry.communicator
communicators = _registry.communicators
communicator_by_id = _registry.communicator_by_id
transport = _registry.transport
Communicator = _registry.Communicator


def communicator_id(mesh, axis_name: Hashable) -> int:
    """The id of ``axis_name``'s communicator on ``mesh``: the same in every
    process (it depends only on what every process knows about the mesh),
    different for a different mesh, and a positive int64."""
    key = repr(
        (
            "jax_arx/1",
            axis_name,
            tuple(mesh.axis_names),
            tuple(mesh.devices.shape),
            tuple(int(i) for i in mesh.device_ids.flat),
        )
    )
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def groups(mesh, axis_name: Hashable) -> list[list[Any]]:
    """The devices of each group of ``axis_name``: one list per combination
    of the other axes' indices (row-major), ordered by rank, i.e. by the
    position along the axis."""
    k = mesh.axis_names.index(axis_name)
    rows = np.moveaxis(mesh.devices, k, -1).reshape(-1, mesh.devices.shape[k])
    return [list(row) for row in rows]


# --- initialize -------------------------------------------------------------


def initialize(mesh=None, *, topology=None, _tuning=None) -> None:
    """Sets up jax_arx's communicators for ``mesh``; call it on every process.

    Call after ``jax.distributed.initialize`` (or in a single process with
    several local devices, without it) and before tracing functions that
    use ``jax_arx.psum``: a function traced earlier keeps using
    ``jax.lax.psum`` for as long as jax caches it.

    For each mesh axis of size > 1, the devices along the axis with the
    other axes fixed form a group, and every process makes one endpoint per
    local device of each group, exchanges connection details with the other
    members through jax.distributed's key-value store, connects, and meets
    the other processes at a barrier. Transport per group: ``shm`` when all
    its members are on one host, else ``verbs`` when every member has RDMA
    (configured or found, see ``choose_transport``), else ``tcp``;
    ``JAX_ARX_TRANSPORT`` overrides.

    Args:
      mesh: the ``jax.sharding.Mesh`` the ``shard_map`` calls run over.
        Default: the mesh set with ``jax.set_mesh``.
      topology: how the hosts are cabled, the same on every process:
        ``"mesh"`` (every rank reaches every other, through a switch) or
        ``"ring"`` (2 to 4 boxes cabled in a ring with no switch: each
        group's rank r reaches only ranks r - 1 and r + 1, in mesh order;
        at world 4 what goes to the rank two away is relayed by the rank
        in between). Default: ``JAX_ARX_TOPOLOGY``, else ``"mesh"``. See
        docs/topology.md.

    Idempotent: calling again with the same mesh (and topology) does
    nothing, and a mesh whose axis names are all new adds communicators
    for them.

    ``_tuning`` is not for users: tests and benchmarks pass settings that a
    benchmark decided (``jax_arx.config.TUNING_KEYS``) to reach a path the
    defaults take only at other sizes. Every process must pass the same.

    Raises:
      InitializationError: ``JAX_NUM_PROCESSES`` says this process is
        one of several, but jax.distributed is not initialized (call
        ``jax_arx.distributed_initialize()`` first); no mesh; an axis name
        already set up for a different mesh or topology (call
        ``jax_arx.shutdown()`` first); a ring axis of more than 4 devices;
        the C++ module is missing; a peer did not show up within
        ``JAX_ARX_TIMEOUT_S``; or an endpoint could not be created or
        connected (the message says which axis, group and rank, and why).
      ConfigError: a ``JAX_ARX_*`` variable, or ``topology``, has a bad
        value, or a ``JAX_ARX_*`` variable jax_arx does not know is set
        (a misspelled name: the message names the closest known one).
    """
    _distributed.refuse_if_not_joined()
    # Before anything that uses them is traced (the package loads lazily):
    # the C++ handlers known to XLA, and jax.grad's sums routed to jax_arx.
    _check_ffi_targets(_native.core(required=False))
    _native.register_ffi_targets()
    _grad.install()
    mesh = _resolve_mesh(mesh)
    _distributed.warn_if_alone(mesh)
    _distributed.warn_if_cpu_beside_a_gpu(mesh)
    cfg = _config.with_topology(_config.load(), topology)
    with _registry.lock:
        wanted: dict[Hashable, int] = {}
        for axis, size in mesh.shape.items():
            if size <= 1:
                continue  # nothing to communicate; jax_arx.psum leaves such axes to jax.lax
            comm_id = communicator_id(mesh, axis)
            known = _registry.communicator(axis)
            if known is not None and known.comm_id == comm_id and known.topology != cfg.topology:
                raise InitializationError(
                    f"jax_arx.initialize: mesh axis {axis!r} is already set up as a {known.topology}; this call "
                    f"asks for a {cfg.topology} (topology argument or JAX_ARX_TOPOLOGY). Call jax_arx.shutdown() on "
                    "every process first."
                )
            if known is None:
                _check_ring_size(cfg, axis, size)
                wanted[axis] = comm_id
            elif known.comm_id != comm_id:
                raise InitializationError(
                    f"jax_arx.initialize: mesh axis {axis!r} is already set up for another mesh "
                    f"({_describe_mesh(known.mesh_axis_names, known.mesh_shape)}, devices "
                    f"{_abbrev(known.device_ids)}); this mesh is "
                    f"{_describe_mesh(mesh.axis_names, mesh.devices.shape)}, devices "
                    f"{_abbrev(tuple(int(i) for i in mesh.device_ids.flat))}. Call jax_arx.shutdown() "
                    "on every process first, or name this mesh's axes differently."
                )
        if not wanted:
            return
        core = _native.core(required=True)
        generation = _registry.next_generation()
        store = _store.Store(_compat.distributed_client(), f"jax_arx/{generation}/", cfg.timeout_s)
        _check_same_mesh_everywhere(store, mesh, wanted)
        made = _set_up(core, cfg, store, mesh, wanted, _tuning)
        _registry.add(made)
        store.remove_published()  # after success only: see its docstring
        _bulk_endpoints.restore(made.values())


# The FFI targets the primitives lower to. Each must be one the C++ module
# registers, on every platform it was built for: a name changed on one side
# only would otherwise surface as XLA's "no FFI handler" at a first compile,
# far from its cause.
FFI_TARGETS = (
    _psum.FFI_TARGET,
    _norm.FFI_TARGET,
    _bulk.ALL_GATHER_TARGET,
    _bulk.PSUM_SCATTER_TARGET,
    _moe.MOE_COMBINE_TARGET,
)


def _check_ffi_targets(core) -> None:
    if core is None:
        return  # not built: initialize() says so once it needs the module
    for platform, targets in core.registrations().items():
        missing = sorted(set(FFI_TARGETS) - set(targets))
        if missing:
            raise InitializationError(
                f"jax_arx.initialize: the C++ module ({getattr(core, '__file__', core)}) registers no "
                f"{', '.join(missing)} for {platform}, which jax_arx's Python code lowers to: the two come from "
                "different versions of jax_arx. Reinstall it (pip install --force-reinstall jax_arx, or pip "
                "install . from the checkout)"
            )


def _check_ring_size(cfg, axis, size) -> None:
    # Every process sees the same mesh, so every process refuses alike,
    # before anything is published or connected.
    if cfg.topology == "ring" and size > _config.MAX_RING_WORLD:
        raise InitializationError(
            f"jax_arx.initialize: mesh axis {axis!r} has {size} devices, but a ring (topology='ring' or "
            f"JAX_ARX_TOPOLOGY=ring) takes 2 to {_config.MAX_RING_WORLD}: past that, data for a rank further "
            "away would go through more than one relay. Cable the boxes through a switch and use "
            "topology='mesh', or make the axis smaller."
        )


def _resolve_mesh(mesh):
    if mesh is None:
        mesh = jax.sharding.get_mesh()
        if mesh is None or mesh.empty:
            raise InitializationError(
                "jax_arx.initialize() needs the mesh your shard_map calls run over: pass it, "
                "jax_arx.initialize(mesh), or set it first with jax.set_mesh(mesh)."
            )
    if isinstance(mesh, jax.sharding.AbstractMesh) or not hasattr(mesh, "devices"):
        raise InitializationError(
            f"jax_arx.initialize needs a concrete jax.sharding.Mesh (with devices), got {type(mesh).__name__}; "
            "build one with jax.make_mesh(...)."
        )
    return mesh


def _check_same_mesh_everywhere(store, mesh, wanted):
    # Different meshes give different communicator ids, hence keys nobody
    # writes: without this check that is a timeout instead of a message.
    mine = _describe_setup(mesh, wanted).encode()
    me = jax.process_index()
    store.set(f"mesh/{me}", mine)
    if me != 0:
        first = store.get("mesh/0", "process 0 to start jax_arx.initialize")
        if first != mine:
            raise InitializationError(
                f"jax_arx.initialize: process {me} and process 0 were given different meshes:\n"
                f"  process 0: {first.decode()}\n  process {me}: {mine.decode()}\n"
                "Every process must call jax_arx.initialize() with the same mesh (same axis names, shape "
                "and device order)."
            )


def _describe_setup(mesh, wanted):
    axes = ", ".join(f"{axis!r}" for axis in wanted)
    return (
        f"{_describe_mesh(mesh.axis_names, mesh.devices.shape)}, devices "
        f"{tuple(int(i) for i in mesh.device_ids.flat)}, setting up axes {axes}"
    )


def _describe_mesh(names, shape):
    return "mesh(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape, strict=True)) + ")"


def _abbrev(ids, limit=16):
    ids = tuple(ids)
    return str(ids) if len(ids) <= limit else str(ids[:limit])[:-1] + ", ...)"


def _set_up(core, cfg, store, mesh, wanted, tuning=None) -> dict[Hashable, _registry.Communicator]:
    me = jax.process_index()
    rdma = False
    if cfg.transport is None:
        rdma, why = _carriers.rdma_available(cfg, core)
        _endpoints.debug(cfg, "process %d: RDMA %s: %s", me, "usable" if rdma else "not used", why)
    hosts, rdma_of = _carriers.exchange_hosts(store, {d.process_index for d in mesh.devices.flat}, rdma)
    plans: list[_endpoints.Plan] = []
    for axis, comm_id in wanted.items():
        axis_groups = groups(mesh, axis)
        for g, members in enumerate(axis_groups):
            if any(d.process_index == me for d in members):
                transport = _carriers.choose_transport(
                    cfg, [hosts[d.process_index] for d in members], [rdma_of[d.process_index] for d in members]
                )
                name = str(axis) if len(axis_groups) == 1 else f"{axis}[{g}]"
                plans.append(_endpoints.Plan(axis, comm_id, g, members, transport, name))
    _endpoints.debug(
        cfg,
        "process %d: %d group(s) with local devices: %s",
        me,
        len(plans),
        ", ".join(f"{p.axis!r}[{p.group}] via {p.transport}" for p in plans),
    )

    # Every process publishes all it owns before waiting for anything, so no
    # process waits on one that is itself waiting. The nonce is public.
    for p in plans:
        if p.members[0].process_index == me:
            p.nonce = os.urandom(16)
            store.set(f"{p.comm_id}/{p.group}/nonce", p.nonce)
    for p in plans:
        if not p.nonce:
            p.nonce = store.get(
                f"{p.comm_id}/{p.group}/nonce",
                f"the set-up nonce of axis {p.axis!r} group {p.group} from process {p.members[0].process_index}",
            )
        p.secret = _endpoints.group_secret(cfg.secret, p.nonce, p.comm_id, p.group)

    tcp_addr = None
    if any(p.transport == "tcp" for p in plans):
        tcp_addr = cfg.tcp_addr or _carriers.default_tcp_addr(_compat.coordinator_address())
        _endpoints.debug(cfg, "process %d: tcp address %s", me, tcp_addr)
    # No bulk lanes: the bulk collectives get endpoints of their own at
    # their first call (jax_arx/_bulk_endpoints.py, bulk_options).
    options = dict(cfg.endpoint_options(tcp_addr, tuning), bulk_lanes="0")
    made = _endpoints.connect_endpoints(core, store, plans, options, "jax_arx.initialize")
    comms = {}
    for axis, comm_id in wanted.items():
        comms[axis] = _registry.Communicator(
            axis_name=axis,
            comm_id=comm_id,
            mesh_axis_names=tuple(mesh.axis_names),
            mesh_shape=tuple(mesh.devices.shape),
            device_ids=tuple(int(i) for i in mesh.device_ids.flat),
            endpoints=tuple(le for p, le in made if p.axis == axis),
            topology=cfg.topology,
            setup=_registry.Setup(tuple(p for p in plans if p.axis == axis), options, cfg),
        )
    _endpoints.debug(cfg, "process %d: jax_arx ready on axes %s", me, ", ".join(repr(a) for a in wanted))
    return comms


# --- shutdown and check -----------------------------------------------------


def shutdown() -> None:
    """Closes every jax_arx communicator of this process; call it on every
    process, after the last results you need are ready.

    It first waits (up to ``JAX_ARX_TIMEOUT_S``) for the other processes to
    reach shutdown() too: a proxy closed early could leave a peer waiting
    for the last partial it had still to send. A program traced before
    shutdown() fails when run afterwards, until initialize() is called again
    with the same mesh; on GPUs, a program XLA had captured as a CUDA graph
    (command buffers) keeps returning NaN even then, so call
    ``jax.clear_caches()`` after that initialize() to have it compiled
    again. Also runs at interpreter exit; there, when the
    process is ending on an uncaught exception, it closes at once without
    waiting for the others. Idempotent.
    """
    with _registry.lock:
        comms = _registry.take_all()
        if not comms:
            return
        client = _compat.distributed_client()
        if client is not None and jax.process_count() > 1 and not _distributed.uncaught_exception():
            try:
                timeout_s = _config.load().timeout_s
            except ConfigError:
                timeout_s = _config.Config().timeout_s
            try:
                client.wait_at_barrier(f"jax_arx/{_registry.generation()}/shutdown", max(1, int(timeout_s * 1000)))
            except Exception as e:
                logger.warning(
                    "jax_arx.shutdown: not every process reached shutdown() within %g s; closing this "
                    "process's endpoints anyway (a peer still in a collective with this process will "
                    "fail it within JAX_ARX_TIMEOUT_S). jax said: %s",
                    timeout_s,
                    errors.first_line(e),
                )
        for comm in comms:
            for le in comm.endpoints:
                _endpoints.close_quietly(le.endpoint)


# jax registered its own exit hook (which shuts jax.distributed down) when
# it was imported, before this one; hooks run last-registered first, so
# this shutdown, and its barrier, run while the client still works.
atexit.register(shutdown)
_distributed.on_uncaught_exception(shutdown)


def check() -> None:
    """Raises :class:`jax_arx.CollectiveError` if a communicator of this
    process has failed (a peer lost, a wait timed out, ranks that disagreed),
    with each failure's message; returns None while all are healthy. When
    every failure is of one kind, the error is that kind's subclass
    (``CollectiveTimeoutError``, ``CollectiveMismatchError``,
    ``EndpointFailedError``; see ``jax_arx.errors``).

    Cheap and non-blocking: it reads the failure records the endpoints keep,
    and runs nothing on the devices. Use it between steps, or after a
    collective's output came back as NaN.
    """
    core = _native.core(required=False)
    if core is None:
        return None
    failures = [str(f) for f in core.failures()]
    if failures:
        kinds = {errors.classify(f) for f in failures}
        kind = kinds.pop() if len(kinds) == 1 else CollectiveError
        if not issubclass(kind, CollectiveError):
            kind = CollectiveError
        raise kind(
            "jax_arx: "
            + ("a communicator has" if len(failures) == 1 else f"{len(failures)} communicators have")
            + " failed:\n  "
            + "\n  ".join(failures)
            + "\nA failed communicator stays failed; restart the job (or call jax_arx.shutdown() and "
            "jax_arx.initialize() again on every process, if all are alive)."
        )
    return None
