"""The processes of a job meet before jax.distributed starts, so that a
set-up mistake is named within seconds.

Given a wrong coordinator address, a rank that never starts or a coordinator
port another program holds, ``jax.distributed.initialize`` waits its whole
initialization timeout (five minutes by default), then aborts the process
with a C++ stack trace naming neither the address nor the rank; a taken port
can crash rank 0 outright. So first the processes meet on the coordinator's
port themselves, in three lines of text:

  rank 0 -> a peer, when it accepts:  ``jax_arx join 1 <nonce>``
  the peer -> rank 0:                 ``rank <r> of <n> <mac>``
  rank 0 -> every peer, at the end:   ``ok`` | ``fail <why>``

``<mac>`` is the HMAC-SHA256 of the nonce, r and n under ``JAX_ARX_SECRET``
("-" without one): with a secret, a stranger on the port cannot pose as a
rank; without one it can, and the join then fails loudly (two processes say
they are one rank), never silently. Rank 0 answers once every rank has
arrived, or when ``JAX_ARX_JOIN_TIMEOUT_S`` has passed, naming the ranks that
did not; a peer that cannot reach rank 0 within that time names the address.
Rank 0 then closes its listener and jax.distributed binds the same port
(jax's client retries its connection until the service is up).

Bounds: rank 0 waits at most the join timeout from its start; a peer at most
the join timeout to connect, then the join timeout again for rank 0's
answer (rank 0's deadline is earlier: it started before the peer
connected). Lines are at most ``_MAX_LINE`` bytes, and a connection that
sends anything else is closed and not counted, so strangers can neither
stall the join nor grow its memory.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import time

from jax_arx.errors import InitializationError

_GREETING = "jax_arx join 1"
_MAX_LINE = 256  # a greeting or a hello
_MAX_ANSWER = 4096  # rank 0's answer, which may name many ranks
_RETRY_S = 0.2  # between a peer's connection attempts while rank 0 is not up yet


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into (host, port).

    Raises:
      InitializationError: no port, or a port outside 1..65535.
    """
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InitializationError(
            f"jax_arx.distributed_initialize: JAX_COORDINATOR_ADDRESS={address!r} is not host:port (a host name or "
            "address of rank 0's machine, then a free TCP port, e.g. 10.0.0.1:12355)"
        )
    return host, int(port)


def join(address: str, num_processes: int, process_id: int, timeout_s: float, secret: str | None) -> None:
    """Meets the other ``num_processes - 1`` processes of the job on
    ``address`` (rank 0 listens there, the others connect). Returns when
    every rank has arrived.

    Raises:
      InitializationError: the address does not resolve; rank 0 cannot
        listen on its port; a peer cannot reach rank 0 within ``timeout_s``
        or reaches something else there; ranks did not arrive within
        ``timeout_s`` (named); two processes say they are one rank, or a
        rank's process count differs from rank 0's. Every process that
        started fails, each naming the address or the ranks.
    """
    host, port = split_address(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InitializationError(
            f"jax_arx.distributed_initialize: the coordinator's host {host!r} (JAX_COORDINATOR_ADDRESS={address}) "
            f"does not resolve on this machine: {e.strerror}. Use rank 0's IP address, or a name this machine "
            "resolves (/etc/hosts)"
        ) from None
    mac_key = secret.encode() if secret else None
    if process_id == 0:
        _host(address, port, found, num_processes, timeout_s, mac_key)
    else:
        _arrive(address, found, num_processes, process_id, timeout_s, mac_key)


def _mac(key: bytes | None, nonce: str, rank: int, n: int) -> str:
    if key is None:
        return "-"
    return hmac.new(key, f"{nonce} {rank} {n}".encode(), hashlib.sha256).hexdigest()


def _is_local(found) -> bool:
    for family, _, _, _, sockaddr in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def _listen(address: str, port: int) -> socket.socket:
    # Where jax's coordination service binds (every interface, [::]:port).
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        return socket.create_server(("", port), backlog=64)
    except OSError as e:
        raise InitializationError(
            f"jax_arx.distributed_initialize: rank 0 cannot listen on port {port} (JAX_COORDINATOR_ADDRESS="
            f"{address}): {e.strerror}. Another program holds it (`ss -ltnp 'sport = :{port}'` names it): stop it, "
            "or give every rank another port"
        ) from None


class _Peer:
    def __init__(self, conn: socket.socket, where: str, nonce: str):
        self.conn, self.where, self.nonce, self.buf, self.rank = conn, where, nonce, b"", None


def _host(address, port, found, n, timeout_s, key) -> None:
    if not _is_local(found):
        logging.getLogger("jax_arx").warning(
            "jax_arx.distributed_initialize: JAX_COORDINATOR_ADDRESS=%s is not an address of this machine, but rank "
            "0 hosts the coordinator there: unless a NAT forwards it here, the other ranks will not find it (use "
            "an address `hostname -I` lists)",
            address,
        )
    listener = _listen(address, port)
    sel = selectors.DefaultSelector()
    peers: dict[socket.socket, _Peer] = {}
    arrived: dict[int, _Peer] = {}
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        sel.register(listener, selectors.EVENT_READ)
        while len(arrived) < n - 1 and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, n) if r not in arrived]
                failure = (
                    f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {n} did not "
                    f"arrive at the coordinator {address} within {timeout_s:g} s (JAX_ARX_JOIN_TIMEOUT_S)"
                )
                break
            for sk, _ in sel.select(min(left, 1.0)):
                if sk.fileobj is listener:
                    try:
                        conn, where = listener.accept()
                    except OSError:
                        continue
                    peer = _Peer(conn, where[0], secrets.token_hex(16))
                    try:
                        conn.setblocking(False)
                        conn.sendall(f"{_GREETING} {peer.nonce}\n".encode())
                    except OSError:
                        conn.close()
                        continue
                    peers[conn] = peer
                    sel.register(conn, selectors.EVENT_READ)
                else:
                    failure = _read_hello(peers[sk.fileobj], n, key, arrived, sel, peers)
        if failure is None:
            for peer in arrived.values():
                _say(peer.conn, "ok")
            return
        for peer in peers.values():
            _say(peer.conn, f"fail {failure}")
        raise InitializationError(
            f"jax_arx.distributed_initialize: {failure}. Start every rank with the same "
            "JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, each with its own JAX_PROCESS_ID, "
            "within the join timeout of each other"
        )
    finally:
        for conn in peers:
            conn.close()
        sel.close()
        listener.close()


def _read_hello(peer: _Peer, n, key, arrived, sel, peers) -> str | None:
    """Reads what ``peer`` sent; a complete valid hello counts its rank.
    Returns the job's failure, if this hello shows one."""

    def drop():
        sel.unregister(peer.conn)
        peers.pop(peer.conn).conn.close()

    try:
        data = peer.conn.recv(_MAX_LINE)
    except OSError:
        data = b""
    if not data or peer.rank is not None:
        if peer.rank is not None:
            arrived.pop(peer.rank)  # it left, or broke the protocol: it must arrive again
        drop()
        return None
    peer.buf += data
    if b"\n" not in peer.buf:
        if len(peer.buf) >= _MAX_LINE:
            drop()
        return None
    words = peer.buf.split(b"\n", 1)[0].decode(errors="replace").split()
    if (
        len(words) != 5
        or words[0] != "rank"
        or words[2] != "of"
        or not words[1].isdigit()
        or not words[3].isdigit()
        or not hmac.compare_digest(words[4], _mac(key, peer.nonce, int(words[1]), int(words[3])))
    ):
        drop()  # a stranger, or a process without the job's secret
        return None
    rank, their_n = int(words[1]), int(words[3])
    if their_n != n:
        return (
            f"the process at {peer.where} says it is rank {rank} of {their_n} (JAX_NUM_PROCESSES={their_n}), "
            f"rank 0 has JAX_NUM_PROCESSES={n}"
        )
    if not 0 < rank < n:
        return f"the process at {peer.where} says it is rank {rank}, which is not one of ranks 1..{n - 1}"
    if rank in arrived:
        return (
            f"two processes say they are rank {rank} (from {arrived[rank].where} and {peer.where}): give each "
            "its own JAX_PROCESS_ID"
        )
    peer.rank = rank
    arrived[rank] = peer
    return None


def _say(conn: socket.socket, line: str) -> None:
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(line.encode()[: _MAX_ANSWER - 1] + b"\n")
    except OSError:
        pass  # it left; it fails on its own, naming rank 0's address


def _arrive(address, found, n, rank, timeout_s, key) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no address to try"
    conn = None
    while conn is None:
        for family, kind, proto, _, sockaddr in found:
            s = socket.socket(family, kind, proto)
            try:
                s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                s.connect(sockaddr)
                conn = s
                break
            except OSError as e:
                s.close()
                last = e.strerror or str(e)
        if conn is None:
            if time.monotonic() >= deadline:
                raise InitializationError(
                    f"jax_arx.distributed_initialize: rank {rank} could not reach the coordinator at {address} "
                    f"within {timeout_s:g} s (JAX_ARX_JOIN_TIMEOUT_S; last: {last}). Check that rank 0 "
                    "(JAX_PROCESS_ID=0) runs, that the address is its machine's and reachable from this one, and "
                    "that no firewall closes the port"
                )
            time.sleep(_RETRY_S)
    with conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        greeting = _read_line(conn, _MAX_LINE)
        words = (greeting or "").split()
        if len(words) != 4 or " ".join(words[:3]) != _GREETING:
            raise InitializationError(
                f"jax_arx.distributed_initialize: rank {rank} reached {address}, but what listens there is not "
                "jax_arx's rank 0 (another program holds the port, or rank 0 runs another version of jax_arx): "
                "pick a free port for JAX_COORDINATOR_ADDRESS on every rank"
            )
        conn.settimeout(timeout_s + 5.0)
        try:
            conn.sendall(f"rank {rank} of {n} {_mac(key, words[3], rank, n)}\n".encode())
            answer = _read_line(conn, _MAX_ANSWER)
        except OSError:
            answer = None
    if answer == "ok":
        return
    if answer and answer.startswith("fail "):
        raise InitializationError(
            f"jax_arx.distributed_initialize: rank {rank}: rank 0 at {address} says: {answer[5:]}"
        )
    raise InitializationError(
        f"jax_arx.distributed_initialize: rank {rank}: rank 0 at {address} ended the join without an answer "
        "(it failed: its own error says why; with JAX_ARX_SECRET set, check that every rank has the same one)"
    )


def _read_line(conn: socket.socket, limit: int) -> str | None:
    buf = b""
    while b"\n" not in buf:
        if len(buf) >= limit:
            return None
        try:
            data = conn.recv(limit)
        except OSError:  # TimeoutError included
            return None
        if not data:
            return None
        buf += data
    return buf.split(b"\n", 1)[0].decode(errors="replace")
