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
import dataclasses
import hashlib
import importlib.machinery
import logging
import os
import pathlib
import sys
import threading
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from jax_arx import _carriers, _compat, _endpoints, _store
from jax_arx import _distributed
from jax_arx import config as _config
from jax_arx import errors
from jax_arx.errors import CollectiveError, ConfigError, InitializationError

logger = logging.getLogger("jax_arx")


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


_lock = threading.RLock()
_communicators: dict[Hashable, Communicator] = {}
# The bulk collectives' communicators, by axis, made at their first call
# (jax_arx/_bulk_endpoints.py); closed by shutdown() with the others.
_bulk_communicators: dict[Hashable, Communicator] = {}
_generation = 0

# The C++ module, imported on first use so that jax_arx imports (and falls
# back to jax.lax) where it is not built. Tests put a stand-in here.
_core_module: Any = None
_core_import_error: ImportError | None = None
_ffi_targets_registered = False


def _core(required: bool = True):
    global _core_module, _core_import_error
    if _core_module is None and _core_import_error is None:
        try:
            from jax_arx import _core as module
        except ImportError as e:
            _core_import_error = e
        else:
            _core_module = module
    if _core_module is None and required:
        raise InitializationError(
            f"jax_arx's C++ module jax_arx._core could not be imported ({_core_import_error}). "
            + core_missing_hint(list(sys.modules[__package__].__path__), sys.path)
            + " Until then jax_arx.psum falls back to jax.lax.psum."
        ) from _core_import_error
    return _core_module


def core_missing_hint(package_path: list[str], search_path: list[str]) -> str:
    """What to do about a missing ``_core``, given the folders jax_arx's
    modules are looked up in (its ``__path__``) and ``sys.path``. The common
    cause is not a missing build: a script saved in the checkout's top
    folder (or ``python -m``/``-c`` run there) puts that folder first on
    ``sys.path``, so Python imports the source folder ``jax_arx/``, which
    holds no built module, ahead of the installed package."""
    build = ("Build and install it from the jax_arx source tree with `pip install .` (needs CMake >= 3.24, a "
             "C++20 compiler, and nvcc for GPUs).")
    package = pathlib.Path(package_path[0])
    root = package.parent
    checkout = (root / "pyproject.toml").is_file() and (root / "ffi").is_dir()
    if not checkout or any(any(pathlib.Path(p).glob("_core*")) for p in package_path):
        return build  # not shadowed: the module is not built, or does not load
    elsewhere = [p for p in search_path if pathlib.Path(p or os.getcwd()).resolve() != root.resolve()]
    spec = importlib.machinery.PathFinder.find_spec("jax_arx", elsewhere)
    installed = (f", not the installed one ({pathlib.Path(spec.origin).parent})"
                 if spec is not None and spec.origin else "")
    return (f"Python imported jax_arx from its source tree ({package}){installed}, because {root} comes first "
            "on sys.path: it is the folder of the script, or the current folder under `python -m` or "
            "`python -c`. Save scripts outside that folder (a subfolder such as examples/ is fine), and run "
            "`python -m` and `python -c` from another folder" + ("." if installed else "; and install "
                                                                 "jax_arx: " + build))


def register_ffi_targets() -> bool:
    """Registers the C++ handlers with XLA (``jax.ffi.register_ffi_target``)
    for every platform the module was built for. Called when jax_arx is
    imported; returns False, registering nothing, when ``_core`` is not
    built. Registration does not start a jax backend, so importing jax_arx
    before ``jax.distributed.initialize`` is fine."""
    global _ffi_targets_registered
    core = _core(required=False)
    if core is None:
        return False
    if not _ffi_targets_registered:
        for platform, targets in core.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _ffi_targets_registered = True
    return True


# --- the registry, as the primitives see it ---------------------------------

def communicator(axis_name: Hashable) -> Communicator | None:
    """The communicator set up for ``axis_name``, or None."""
    return _communicators.get(axis_name)


def communicators() -> dict[Hashable, Communicator]:
    """Every communicator set up in this process, by mesh axis (a copy)."""
    with _lock:
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


def communicator_id(mesh, axis_name: Hashable) -> int:
    """The id of ``axis_name``'s communicator on ``mesh``: the same in every
    process (it depends only on what every process knows about the mesh),
    different for a different mesh, and a positive int64."""
    key = repr(("jax_arx/1", axis_name, tuple(mesh.axis_names), tuple(mesh.devices.shape),
                tuple(int(i) for i in mesh.device_ids.flat)))
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
      InitializationError: no mesh; an axis name already set up for a
        different mesh or topology (call ``jax_arx.shutdown()`` first); a
        ring axis of more than 4 devices; the C++ module
        is missing; a peer did not show up within ``JAX_ARX_TIMEOUT_S``; or
        an endpoint could not be created or connected (the message says
        which axis, group and rank, and why).
      ConfigError: a ``JAX_ARX_*`` variable, or ``topology``, has a bad
        value.
    """
    global _generation
    mesh = _resolve_mesh(mesh)
    _distributed.warn_if_alone(mesh)
    cfg = _config.with_topology(_config.load(), topology)
    with _lock:
        wanted: dict[Hashable, int] = {}
        for axis, size in mesh.shape.items():
            if size <= 1:
                continue  # nothing to communicate; jax_arx.psum leaves such axes to jax.lax
            comm_id = communicator_id(mesh, axis)
            known = _communicators.get(axis)
            if known is not None and known.comm_id == comm_id and known.topology != cfg.topology:
                raise InitializationError(
                    f"jax_arx.initialize: mesh axis {axis!r} is already set up as a {known.topology}; this call "
                    f"asks for a {cfg.topology} (topology argument or JAX_ARX_TOPOLOGY). Call jax_arx.shutdown() on "
                    "every process first.")
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
                    "on every process first, or name this mesh's axes differently.")
        if not wanted:
            return
        core = _core(required=True)
        _generation += 1
        store = _store.Store(_compat.distributed_client(), f"jax_arx/{_generation}/", cfg.timeout_s)
        _check_same_mesh_everywhere(store, mesh, wanted)
        made = _set_up(core, cfg, store, mesh, wanted, _tuning)
        _communicators.update(made)
        store.remove_published()  # after success only: see its docstring
        from jax_arx import _bulk_endpoints  # it builds on this module
        _bulk_endpoints.restore(made.values())


def _check_ring_size(cfg, axis, size) -> None:
    # Every process sees the same mesh, so every process refuses alike,
    # before anything is published or connected.
    if cfg.topology == "ring" and size > _config.MAX_RING_WORLD:
        raise InitializationError(
            f"jax_arx.initialize: mesh axis {axis!r} has {size} devices, but a ring (topology='ring' or "
            f"JAX_ARX_TOPOLOGY=ring) takes 2 to {_config.MAX_RING_WORLD}: past that, data for a rank further "
            "away would go through more than one relay. Cable the boxes through a switch and use "
            "topology='mesh', or make the axis smaller.")


def _resolve_mesh(mesh):
    if mesh is None:
        mesh = jax.sharding.get_mesh()
        if mesh is None or mesh.empty:
            raise InitializationError(
                "jax_arx.initialize() needs the mesh your shard_map calls run over: pass it, "
                "jax_arx.initialize(mesh), or set it first with jax.set_mesh(mesh).")
    if isinstance(mesh, jax.sharding.AbstractMesh) or not hasattr(mesh, "devices"):
        raise InitializationError(
            f"jax_arx.initialize needs a concrete jax.sharding.Mesh (with devices), got {type(mesh).__name__}; "
            "build one with jax.make_mesh(...).")
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
                "and device order).")


def _describe_setup(mesh, wanted):
    axes = ", ".join(f"{axis!r}" for axis in wanted)
    return (f"{_describe_mesh(mesh.axis_names, mesh.devices.shape)}, devices "
            f"{tuple(int(i) for i in mesh.device_ids.flat)}, setting up axes {axes}")


def _describe_mesh(names, shape):
    return "mesh(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape)) + ")"


def _abbrev(ids, limit=16):
    ids = tuple(ids)
    return str(ids) if len(ids) <= limit else str(ids[:limit])[:-1] + ", ...)"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one communicator's endpoints in this process were made from: the
    plans of this process's groups (secrets included) and the endpoint
    options, from which jax_arx/_bulk_endpoints.py makes the bulk ones."""

    plans: tuple
    options: dict
    cfg: Any  # the config.Config they were made with


def _set_up(core, cfg, store, mesh, wanted, tuning=None) -> dict[Hashable, Communicator]:
    me = jax.process_index()
    rdma = False
    if cfg.transport is None:
        rdma, why = _carriers.rdma_available(cfg, core)
        _debug(cfg, "process %d: RDMA %s: %s", me, "usable" if rdma else "not used", why)
    hosts, rdma_of = _carriers.exchange_hosts(store, {d.process_index for d in mesh.devices.flat}, rdma)
    plans: list[_endpoints.Plan] = []
    for axis, comm_id in wanted.items():
        axis_groups = groups(mesh, axis)
        for g, members in enumerate(axis_groups):
            if any(d.process_index == me for d in members):
                transport = _carriers.choose_transport(cfg, [hosts[d.process_index] for d in members],
                                             [rdma_of[d.process_index] for d in members])
                name = str(axis) if len(axis_groups) == 1 else f"{axis}[{g}]"
                plans.append(_endpoints.Plan(axis, comm_id, g, members, transport, name))
    _debug(cfg, "process %d: %d group(s) with local devices: %s", me, len(plans),
           ", ".join(f"{p.axis!r}[{p.group}] via {p.transport}" for p in plans))

    # Every process publishes all it owns before waiting for anything, so no
    # process waits on one that is itself waiting. The nonce is public.
    for p in plans:
        if p.members[0].process_index == me:
            p.nonce = os.urandom(16)
            store.set(f"{p.comm_id}/{p.group}/nonce", p.nonce)
    for p in plans:
        if not p.nonce:
            p.nonce = store.get(f"{p.comm_id}/{p.group}/nonce",
                                f"the set-up nonce of axis {p.axis!r} group {p.group} from process "
                                f"{p.members[0].process_index}")
        p.secret = _endpoints.group_secret(cfg.secret, p.nonce, p.comm_id, p.group)

    tcp_addr = None
    if any(p.transport == "tcp" for p in plans):
        tcp_addr = cfg.tcp_addr or _carriers.default_tcp_addr(_compat.coordinator_address())
        _debug(cfg, "process %d: tcp address %s", me, tcp_addr)
    # No bulk lanes: the bulk collectives get endpoints of their own at
    # their first call (jax_arx/_bulk_endpoints.py, bulk_options).
    options = dict(cfg.endpoint_options(tcp_addr, tuning), bulk_lanes="0")
    made = _endpoints.connect_endpoints(core, store, plans, options, "jax_arx.initialize")
    comms = {}
    for axis, comm_id in wanted.items():
        comms[axis] = Communicator(
            axis_name=axis, comm_id=comm_id, mesh_axis_names=tuple(mesh.axis_names),
            mesh_shape=tuple(mesh.devices.shape), device_ids=tuple(int(i) for i in mesh.device_ids.flat),
            endpoints=tuple(le for p, le in made if p.axis == axis), topology=cfg.topology,
            setup=Setup(tuple(p for p in plans if p.axis == axis), options, cfg))
    _debug(cfg, "process %d: jax_arx ready on axes %s", me, ", ".join(repr(a) for a in wanted))
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
    with _lock:
        if not _communicators:
            return
        comms = list(_communicators.values()) + list(_bulk_communicators.values())
        _communicators.clear()
        _bulk_communicators.clear()
        client = _compat.distributed_client()
        if client is not None and jax.process_count() > 1 and not _distributed.uncaught_exception():
            try:
                timeout_s = _config.load().timeout_s
            except ConfigError:
                timeout_s = _config.Config().timeout_s
            try:
                client.wait_at_barrier(f"jax_arx/{_generation}/shutdown", max(1, int(timeout_s * 1000)))
            except Exception as e:
                logger.warning("jax_arx.shutdown: not every process reached shutdown() within %g s; closing this "
                               "process's endpoints anyway (a peer still in a collective with this process will "
                               "fail it within JAX_ARX_TIMEOUT_S). jax said: %s", timeout_s, errors.first_line(e))
        for comm in comms:
            for le in comm.endpoints:
                _endpoints.close_quietly(le.endpoint)


# jax registered its own exit hook (which shuts jax.distributed down) when
# it was imported, before this one; hooks run last-registered first, so
# this shutdown, and its barrier, run while the client still works.
atexit.register(shutdown)


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
    core = _core(required=False)
    if core is None:
        return None
    failures = [str(f) for f in core.failures()]
    if failures:
        kinds = {errors.classify(f) for f in failures}
        kind = kinds.pop() if len(kinds) == 1 else CollectiveError
        if not issubclass(kind, CollectiveError):
            kind = CollectiveError
        raise kind(
            "jax_arx: " + ("a communicator has" if len(failures) == 1 else f"{len(failures)} communicators have")
            + " failed:\n  " + "\n  ".join(failures)
            + "\nA failed communicator stays failed; restart the job (or call jax_arx.shutdown() and "
            "jax_arx.initialize() again on every process, if all are alive).")
    return None


def _debug(cfg, msg, *args) -> None:
    if not cfg.debug:
        return
    if not logger.handlers and not logging.getLogger().handlers:
        # JAX_ARX_DEBUG=1 should print without the program configuring logging.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("jax_arx: %(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.info(msg, *args)
