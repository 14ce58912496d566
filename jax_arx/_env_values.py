"""The readers of one ``JAX_ARX_*`` value each, for :mod:`jax_arx.config`:
strict, so that a typo raises :class:`jax_arx.ConfigError` naming the
variable, the value and what is accepted, instead of turning into a default.
An empty value means unset. Each takes the environment and the variable's
name (and its default) and returns the parsed value."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

from .errors import ConfigError

# The C++ endpoint lays its slots out in 16-byte units (ffi/base/config.cc
# rejects anything else); checking here names the variable instead.
SIZE_ALIGNMENT = 16


def raw(env: Mapping[str, str], name: str) -> str | None:
    # An empty value means "unset": `VAR= python ...` is how shells unset for one command.
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def string(env, name):
    return raw(env, name)


_MIN_SECRET_CHARS = 16


def secret(env, name):
    value = raw(env, name)
    if value is not None and len(value) < _MIN_SECRET_CHARS:
        # The value itself stays out of the message: it is meant to be secret.
        raise ConfigError(
            f"{name} is {len(value)} characters long; use at least {_MIN_SECRET_CHARS} random ones (e.g. "
            "python3 -c 'import secrets; print(secrets.token_hex(32))'), the same on every process: someone "
            "who can reach the ranks could otherwise guess it"
        )
    return value


def positive_float(env, name, default):
    value = raw(env, name)
    if value is None:
        return default
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not (x > 0 and x != float("inf")):
        raise ConfigError(f"{name}={value!r} is not accepted: use a positive number of seconds, e.g. {name}=30")
    return x


def nonnegative_int(env, name, default):
    value = raw(env, name)
    if value is None:
        return default
    if not re.fullmatch(r"\d+", value):
        raise ConfigError(f"{name}={value!r} is not accepted: use a non-negative integer, e.g. {name}=0")
    return int(value)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def int_in(env, name, lo, hi, fallback_name=None):
    """An integer in [lo, hi], or None when unset; ``fallback_name`` (NCCL's
    variable for the same setting) is read when ``name`` is not set."""
    if raw(env, name) is None and fallback_name is not None and raw(env, fallback_name) is not None:
        name = fallback_name
    value = raw(env, name)
    if value is None:
        return None
    if not re.fullmatch(r"\d+", value) or not lo <= int(value) <= hi:
        raise ConfigError(f"{name}={value!r} is not accepted: use an integer from {lo} to {hi}")
    return int(value)


def size(env, name, default, alignment=SIZE_ALIGNMENT, minimum=1):
    value = raw(env, name)
    if value is None:
        return default
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", value)
    unit = m and _SIZE_UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ConfigError(
            f"{name}={value!r} is not accepted: use a byte count, optionally with a binary suffix "
            f"(K, KiB, M, MiB, G, GiB), e.g. {name}=1MiB"
        )
    n = int(m.group(1)) * unit
    if alignment > 1 and (n <= 0 or n % alignment):
        raise ConfigError(
            f"{name}={value!r} is not accepted: {n} bytes is not a positive multiple of "
            f"{alignment} bytes; use one, e.g. {name}=1MiB"
        )
    if n < minimum:
        raise ConfigError(f"{name}={value!r} is not accepted: use at least {minimum} bytes, e.g. {name}=64KiB")
    return n


def size_setting(n: int) -> str:
    """The smallest value of a size variable that holds ``n`` bytes, as a
    user would write it (``2MiB``, ``196608``): for messages that say what
    to set."""
    n = -(-max(n, 1) // SIZE_ALIGNMENT) * SIZE_ALIGNMENT
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def size_or_off(env, name, default):
    """A size as ``size`` reads it, or 0: the feature switched off."""
    value = raw(env, name)
    if value is not None and re.fullmatch(r"0+\s*[a-zA-Z]*", value):
        return 0
    return size(env, name, default)


def choice(env, name, choices, default):
    value = raw(env, name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ConfigError(f"{name}={value!r} is not accepted: use one of {', '.join(choices)}")
    return value.lower()


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(env, name, default):
    value = raw(env, name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not accepted: use 1 or 0 (or true/false, yes/no, on/off)")


def ipv4(env, name):
    value = raw(env, name)
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        # The tcp carrier speaks IPv4 only (ffi/transport/tcp.cc).
        raise ConfigError(
            f"{name}={value!r} is not accepted: use an IPv4 address of this host that its peers can reach, "
            f"e.g. {name}=198.51.100.1"
        ) from None
