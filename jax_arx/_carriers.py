"""Which carrier a group uses: each process's host identity and whether it
can use RDMA, exchanged at the rendezvous, and the rule every member applies
to the same exchanged data (``choose_transport``), so the members agree
without a further round; and the tcp carrier's default address.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket

import jax

from jax_arx.errors import InitializationError

logger = logging.getLogger("jax_arx")


def choose_transport(cfg, member_hosts: list[str], member_rdma: list[bool] | None = None) -> str:
    """The carrier for one group, given each member process's host identity
    and whether it can use RDMA (``rdma_available``, exchanged at the
    rendezvous). Every member computes this from the same exchanged data, so
    they agree without a further round (the C++ fingerprint check catches a
    ``JAX_ARX_TRANSPORT`` set differently on different processes).

    The rule, in order:

    1. ``JAX_ARX_TRANSPORT``, when set.
    2. ``shm`` when every member is on one host: a copy through shared
       memory beats any NIC, so an RDMA device on a single box (a soft-RoCE
       device on a dev machine, say) never takes over single-host runs.
    3. ``verbs`` when every member can use RDMA: JAX_ARX_IB_HCA (or
       NCCL_IB_HCA) is set, or a hardware RDMA device with an active port
       was found, and this build and host can run the carrier.
    4. ``tcp``.
    """
    if cfg.transport is not None:
        return cfg.transport
    if len(set(member_hosts)) == 1:
        return "shm"
    if member_rdma is not None and len(member_rdma) == len(member_hosts) and all(member_rdma):
        return "verbs"
    return "tcp"


def rdma_available(cfg, core=None, sysfs: str = "/sys/class/infiniband") -> tuple[bool, str]:
    """Whether this process can take part in a group over the verbs carrier,
    and why (for JAX_ARX_DEBUG=1 and warnings).

    RDMA counts as configured when ``cfg.ib_hca`` (JAX_ARX_IB_HCA, else
    NCCL_IB_HCA) is set, and as found when sysfs shows a hardware device
    with an active port (``rdma_devices_found``). Either way the build must
    have the verbs carrier and libibverbs must load; an HCA that is
    configured but unusable is warned about, since the user asked for it.
    """
    if cfg.ib_hca:
        source, configured = f"RDMA devices configured ({cfg.ib_hca})", True
    else:
        found = rdma_devices_found(sysfs)
        if not found:
            return False, (
                "no RDMA device configured (JAX_ARX_IB_HCA) or found with an active port "
                "(soft-RoCE and siw devices count only when configured)"
            )
        source, configured = f"RDMA devices found ({', '.join(found)})", False
    problem = None
    has_verbs = getattr(core, "has_verbs", None)
    if has_verbs is not None and not has_verbs():
        problem = (
            "this jax_arx build has no verbs carrier (it was built without rdma-core's headers; install "
            "libibverbs-dev and reinstall jax_arx)"
        )
    elif not _libibverbs_loads(cfg.ibverbs_lib):
        problem = (
            f"libibverbs cannot be loaded ({cfg.ibverbs_lib or 'libibverbs.so.1'}; install libibverbs1 and "
            "ibverbs-providers, or set JAX_ARX_IBVERBS_LIB)"
        )
    if problem is None:
        return True, source
    if configured:
        logger.warning("jax_arx: %s, but %s; groups that span hosts use tcp", source, problem)
    return False, f"{source}, but {problem}"


def rdma_devices_found(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """The hardware RDMA devices of this host that have a usable port: state
    ACTIVE and either InfiniBand, or Ethernet with a RoCE v2 GID. Software
    devices (soft-RoCE ``rxe``, ``siw``: no ``device`` link to a bus device
    in sysfs) are left out: they are for testing, and are used only when
    named in JAX_ARX_IB_HCA."""
    found = []
    try:
        names = sorted(os.listdir(sysfs))
    except OSError:
        return found
    for name in names:
        dev = os.path.join(sysfs, name)
        if not os.path.exists(os.path.join(dev, "device")):
            continue
        try:
            ports = sorted(os.listdir(os.path.join(dev, "ports")))
        except OSError:
            continue
        if any(_port_usable(os.path.join(dev, "ports", p)) for p in ports):
            found.append(name)
    return found


def _port_usable(port: str) -> bool:
    def read(*parts):
        try:
            with open(os.path.join(port, *parts)) as f:
                return f.read().strip()
        except OSError:  # unused GID entries read as EINVAL
            return ""

    if not read("state").endswith("ACTIVE"):  # "4: ACTIVE"
        return False
    if read("link_layer") == "InfiniBand":
        return True
    try:
        indexes = os.listdir(os.path.join(port, "gid_attrs", "types"))
    except OSError:
        return False
    return any(read("gid_attrs", "types", i) == "RoCE v2" and read("gids", i).strip("0:") for i in indexes)


def _libibverbs_loads(name: str | None) -> bool:
    # The names the carrier tries (ffi/transport/verbs_lib.cc).
    for candidate in [name] if name else ["libibverbs.so.1", "libibverbs.so"]:
        try:
            ctypes.CDLL(candidate)
            return True
        except OSError:
            continue
    return False


def host_identity() -> str:
    """What two processes share when ``shm`` can join them: the same kernel
    boot (boot id), the same ``/dev/shm`` (its device and inode differ per
    container), the same hostname and network namespace. Network namespaces
    stand in for hosts in the multi-host tests, so two processes in
    different namespaces talk as if on different hosts."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    for path in ("/dev/shm", "/proc/self/ns/net"):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("")
    return "|".join(parts)


def exchange_hosts(store, processes, rdma: bool) -> tuple[dict[int, str], dict[int, bool]]:
    """Each process's host identity and whether it can use RDMA, as every
    process sees them: the inputs of ``choose_transport``."""
    me = jax.process_index()
    mine = f"{int(rdma)}{host_identity()}"
    store.set(f"host/{me}", mine.encode())
    got = {
        p: (mine if p == me else store.get(f"host/{p}", f"process {p} to publish its host").decode())
        for p in sorted(processes)
    }
    return {p: v[1:] for p, v in got.items()}, {p: v[:1] == "1" for p, v in got.items()}


def default_tcp_addr(coordinator: str | None) -> str:
    """The IPv4 address of this host on the route to the jax.distributed
    coordinator: an address the peers can reach, since they reach the
    coordinator. A UDP socket's connect() sends nothing; it only makes the
    kernel pick the route and source address, which works inside network
    namespaces too. Without a coordinator (one process): 127.0.0.1."""
    if not coordinator:
        return "127.0.0.1"
    host, _, port = coordinator.rpartition(":")
    if not host:  # "host" without a port
        host, port = coordinator, "1"
    host = host.strip("[]")
    try:
        target = socket.getaddrinfo(host, int(port or 1), socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except (OSError, ValueError, IndexError) as e:
        raise InitializationError(
            f"jax_arx.initialize: could not find this host's IPv4 address towards the coordinator "
            f"{coordinator!r} ({e}); set JAX_ARX_TCP_ADDR to an IPv4 address of this host that the other "
            "hosts can reach."
        ) from e
