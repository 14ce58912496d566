"""jax_arx's settings, read from the ``JAX_ARX_*`` environment variables.

This is the only place jax_arx reads its environment. Each variable is
parsed strictly: a bad value raises :class:`jax_arx.ConfigError` naming the
variable, the value and what is accepted, because a typo silently turning
into a default is the kind of mistake that shows up only as a slow or hung
job on the cluster.

=========================  =======================================  =========
variable                   meaning                                  default
=========================  =======================================  =========
JAX_ARX_TIMEOUT_S          bound of every wait on peers, seconds    30
                           (rendezvous, connection, each collective)
JAX_ARX_IDLE_SPIN_MS       the proxy spins this long after work     200
JAX_ARX_IDLE_NAP_US        then naps this long per turn (0: spin)   200
JAX_ARX_TRANSPORT          shm | tcp | verbs                        automatic
JAX_ARX_FALLBACK           lax (use jax.lax, log once per reason)   lax
                           | error (raise JaxArxFallbackError)
JAX_ARX_ON_FAILURE         raise | abort (exit the process with     raise
                           the failure message)
JAX_ARX_SLOT_BYTES         per-peer slot; the one-shot size limit   1 MiB
JAX_ARX_SEND_BYTES         per-parity send buffer (two-shot)        4 MiB
JAX_ARX_TCP_ADDR           IPv4 address the tcp carrier listens on  the one
                           and advertises                           routing to
                                                                    the
                                                                    coordinator
JAX_ARX_IB_HCA             RDMA devices for verbs (else             unset
                           NCCL_IB_HCA)
JAX_ARX_IB_GID_INDEX       force this RoCE GID index                found
JAX_ARX_DEBUG              1: log set-up steps                      0
=========================  =======================================  =========

Sizes accept a plain byte count or a binary suffix: ``65536``, ``64K``,
``64KiB``, ``1M``, ``1MiB``, ``1G``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping

from jax_arx.errors import ConfigError

TRANSPORTS = ("shm", "tcp", "verbs")
FALLBACKS = ("lax", "error")
ON_FAILURE = ("raise", "abort")

# The C++ endpoint lays its slots out in 16-byte units (ffi/comm/config.cc
# rejects anything else); checking here names the variable instead.
_SIZE_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class Config:
    """One parsed snapshot of the ``JAX_ARX_*`` environment."""

    timeout_s: float = 30.0
    idle_spin_ms: int = 200
    idle_nap_us: int = 200
    transport: str | None = None  # None: chosen per communicator (see _comm.choose_transport)
    fallback: str = "lax"
    on_failure: str = "raise"
    slot_bytes: int = 1 << 20
    send_bytes: int = 4 << 20
    tcp_addr: str | None = None  # None: the address that routes to the coordinator
    ib_hca: str | None = None
    ib_gid_index: int | None = None  # None: the verbs carrier finds it
    debug: bool = False

    def endpoint_options(self, tcp_addr: str | None) -> dict[str, str]:
        """The options dict ``_core.Endpoint`` takes: every value a string,
        only keys it knows (it rejects unknown keys, so a typo here fails
        loudly instead of being ignored)."""
        options = {
            "slot_bytes": str(self.slot_bytes),
            "send_bytes": str(self.send_bytes),
            "timeout_s": repr(float(self.timeout_s)),
            "idle_spin_ms": str(self.idle_spin_ms),
            "idle_nap_us": str(self.idle_nap_us),
            "abort_on_failure": "1" if self.on_failure == "abort" else "0",
            "verbose": "1" if self.debug else "0",
        }
        if tcp_addr:
            options["tcp_addr"] = tcp_addr
        if self.ib_hca:
            options["ib_hca"] = self.ib_hca
        if self.ib_gid_index is not None:
            options["ib_gid_index"] = str(self.ib_gid_index)
        return options


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Parses the ``JAX_ARX_*`` variables of ``environ`` (default
    ``os.environ``) into a :class:`Config`.

    Raises:
      ConfigError: a variable is set to a value that is not accepted; the
        message names it and lists what is.
    """
    env = os.environ if environ is None else environ
    defaults = Config()
    slot_bytes = _size(env, "JAX_ARX_SLOT_BYTES", defaults.slot_bytes)
    send_bytes = _size(env, "JAX_ARX_SEND_BYTES", defaults.send_bytes)
    return Config(
        timeout_s=_positive_float(env, "JAX_ARX_TIMEOUT_S", defaults.timeout_s),
        idle_spin_ms=_nonnegative_int(env, "JAX_ARX_IDLE_SPIN_MS", defaults.idle_spin_ms),
        idle_nap_us=_nonnegative_int(env, "JAX_ARX_IDLE_NAP_US", defaults.idle_nap_us),
        transport=_choice(env, "JAX_ARX_TRANSPORT", TRANSPORTS, None),
        fallback=_choice(env, "JAX_ARX_FALLBACK", FALLBACKS, defaults.fallback),
        on_failure=_choice(env, "JAX_ARX_ON_FAILURE", ON_FAILURE, defaults.on_failure),
        slot_bytes=slot_bytes,
        send_bytes=send_bytes,
        tcp_addr=_ipv4(env, "JAX_ARX_TCP_ADDR"),
        ib_hca=_string(env, "JAX_ARX_IB_HCA") or _string(env, "NCCL_IB_HCA"),
        ib_gid_index=_nonnegative_int(env, "JAX_ARX_IB_GID_INDEX", None),
        debug=_flag(env, "JAX_ARX_DEBUG", defaults.debug),
    )


def _raw(env: Mapping[str, str], name: str) -> str | None:
    # An empty value means "unset": `VAR= python ...` is how shells unset for one command.
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _string(env, name):
    return _raw(env, name)


def _positive_float(env, name, default):
    value = _raw(env, name)
    if value is None:
        return default
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not (x > 0 and x != float("inf")):
        raise ConfigError(f"{name}={value!r} is not accepted: use a positive number of seconds, e.g. {name}=30")
    return x


def _nonnegative_int(env, name, default):
    value = _raw(env, name)
    if value is None:
        return default
    if not re.fullmatch(r"\d+", value):
        raise ConfigError(f"{name}={value!r} is not accepted: use a non-negative integer, e.g. {name}=0")
    return int(value)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _size(env, name, default):
    value = _raw(env, name)
    if value is None:
        return default
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", value)
    unit = m and _SIZE_UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ConfigError(
            f"{name}={value!r} is not accepted: use a byte count, optionally with a binary suffix "
            f"(K, KiB, M, MiB, G, GiB), e.g. {name}=1MiB")
    n = int(m.group(1)) * unit
    if n <= 0 or n % _SIZE_ALIGNMENT:
        raise ConfigError(
            f"{name}={value!r} is not accepted: {n} bytes is not a positive multiple of "
            f"{_SIZE_ALIGNMENT} bytes; use one, e.g. {name}=1MiB")
    return n


def _choice(env, name, choices, default):
    value = _raw(env, name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ConfigError(f"{name}={value!r} is not accepted: use one of {', '.join(choices)}")
    return value.lower()


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(env, name, default):
    value = _raw(env, name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not accepted: use 1 or 0 (or true/false, yes/no, on/off)")


def _ipv4(env, name):
    value = _raw(env, name)
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        # The tcp carrier speaks IPv4 only (ffi/transport/tcp.cc).
        raise ConfigError(
            f"{name}={value!r} is not accepted: use an IPv4 address of this host that its peers can reach, "
            f"e.g. {name}=198.51.100.1") from None
