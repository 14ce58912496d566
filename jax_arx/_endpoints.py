"""This process's endpoints of a set-up: one per local member of each
group, made with the group's secret, their details exchanged through the
rendezvous store, connected all at once, closed quietly. ``_comm`` makes
the psum endpoints with it at initialize(), ``_bulk_endpoints`` the bulk
ones at the first bulk call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Hashable
from typing import Any

import jax

from jax_arx import _compat
from jax_arx.errors import InitializationError

logger = logging.getLogger("jax_arx")


@dataclasses.dataclass(frozen=True)
class LocalEndpoint:
    """One rank of one group that lives on a device of this process."""

    group: int
    rank: int
    world: int
    device: Any  # jax.Device
    device_ordinal: int  # what XLA hands the handler as DeviceOrdinal
    transport: str
    endpoint: Any  # _core.Endpoint


@dataclasses.dataclass
class Plan:
    axis: Hashable
    comm_id: int
    group: int
    members: list  # devices, by rank
    transport: str
    name: str = ""  # the endpoints' name in messages: the axis, and the group where there are several
    nonce: bytes = b""
    secret: bytes = b""


def group_secret(user_secret: str | None, nonce: bytes, comm_id: int, group: int) -> bytes:
    """The 32-byte secret every endpoint of one group is given: HMAC-SHA256
    under JAX_ARX_SECRET (empty when unset) of the group's nonce, communicator
    id and group index.

    The tcp carrier keys each pair's handshake with it and a Diffie-Hellman
    key of that pair (ffi/transport/tcp_auth.h). Without JAX_ARX_SECRET it is
    computable from the store, so it only binds a run and a group, and the
    pair keys stay secret through their Diffie-Hellman half; with it, even
    someone who rewrites the store cannot make a key a rank accepts."""
    key = user_secret.encode() if user_secret else b""
    msg = (
        b"jax_arx group secret v2\0"
        + bytes(nonce)
        + int(comm_id).to_bytes(8, "little")
        + int(group).to_bytes(4, "little")
    )
    return hmac.new(key, msg, hashlib.sha256).digest()


def connect_endpoints(core, store, plans, options, what: str) -> list[tuple[Plan, LocalEndpoint]]:
    """Makes this process's endpoint of each local member of each of
    ``plans``' groups with ``options``, exchanges their details with the
    other members through ``store``, connects them all and meets the other
    processes at the store's barrier. ``what`` begins the error messages
    (the call that sets them up). On failure closes what it made and
    raises InitializationError."""
    me = jax.process_index()
    made: list[tuple[Plan, LocalEndpoint]] = []
    try:
        for p in plans:
            for rank, device in enumerate(p.members):
                if device.process_index != me:
                    continue
                ordinal = _compat.xla_device_ordinal(device)
                try:
                    ep = core.Endpoint(
                        p.comm_id,
                        ordinal,
                        rank,
                        len(p.members),
                        p.transport,
                        platform(device),
                        p.name,
                        p.secret,
                        options,
                    )
                except RuntimeError as e:
                    raise InitializationError(
                        f"{what}: could not create the endpoint of axis {p.axis!r} group {p.group} "
                        f"rank {rank} on {device}: {e}"
                    ) from e
                made.append((p, LocalEndpoint(p.group, rank, len(p.members), device, ordinal, p.transport, ep)))
                store.set(f"{p.comm_id}/{p.group}/details/{rank}", ep.details())

        local_details = {(p.comm_id, p.group, le.rank): le.endpoint.details() for p, le in made}
        jobs = []
        for p, le in made:
            details = []
            for rank, device in enumerate(p.members):
                key = (p.comm_id, p.group, rank)
                details.append(
                    local_details[key]
                    if key in local_details
                    else store.get(
                        f"{p.comm_id}/{p.group}/details/{rank}",
                        f"the connection details of axis {p.axis!r} group {p.group} rank {rank} from process "
                        f"{device.process_index}",
                    )
                )
            jobs.append((p, le, details))
        connect_all(jobs, what)
        store.barrier("connected", "every process to connect its endpoints")
    except BaseException:
        for _, le in made:
            close_quietly(le.endpoint)
        raise
    return made


def connect_all(jobs, what) -> None:
    # connect() waits until every peer has dialled in, and peers may live in
    # this very process (several local devices in one group): connecting
    # one endpoint after the other would wait on an endpoint that has not
    # started yet. So every local endpoint connects at once, each in its own
    # thread (connect() releases the GIL).
    def connect(job):
        p, le, details = job
        try:
            le.endpoint.connect(details)
        except RuntimeError as e:
            raise InitializationError(
                f"{what}: axis {p.axis!r} group {p.group} rank {le.rank} on {le.device} could not "
                f"connect over {p.transport}: {e}"
            ) from e

    if len(jobs) == 1:
        connect(jobs[0])
        return
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, len(jobs)), thread_name_prefix="jax_arx_connect"
    ) as pool:
        futures = [pool.submit(connect, job) for job in jobs]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise InitializationError("\n".join(str(e) for e in errors)) from errors[0]


def platform(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    version = str(getattr(device.client, "platform_version", "")).lower()
    if device.platform in ("gpu", "cuda") and "rocm" not in version:
        return "cuda"
    raise InitializationError(
        f"jax_arx runs on CPU and NVIDIA GPU devices; {device} is a {device.platform} device "
        f"({version or 'unknown platform version'}). Use jax.lax collectives there."
    )


def close_quietly(endpoint) -> None:
    try:
        endpoint.close()
    except Exception as e:  # closing must go on for the other endpoints
        logger.warning("jax_arx: closing an endpoint failed: %s", e)


def debug(cfg, msg, *args) -> None:
    """Logs a set-up step where ``cfg.debug`` (JAX_ARX_DEBUG=1) asks for it."""
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
