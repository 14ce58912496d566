"""The rendezvous store: jax.distributed's key-value store under one
set-up's prefix (``_comm`` and ``_bulk_endpoints`` set up through it).

It is readable and writable by anyone who reaches the coordinator's port, so
nothing secret goes through it (see ``_endpoints.group_secret``); every process
removes what it published once set-up has succeeded (``remove_published``).
"""

from __future__ import annotations

import logging

import jax

from jax_arx import errors
from jax_arx.errors import InitializationError

logger = logging.getLogger("jax_arx")


INITIALIZE_HINT = (
    "Every process must call jax_arx.initialize() with the same mesh; if some get there much later "
    "than others, raise JAX_ARX_TIMEOUT_S."
)


class Store:
    """jax.distributed's key-value store under one set-up's prefix, or a
    plain dict when this process is alone (no jax.distributed client).
    ``what`` and ``hint`` begin and end the message of a wait that gives
    up: the call that sets up, and what the user should check."""

    def __init__(
        self, client, prefix: str, timeout_s: float, what: str = "jax_arx.initialize", hint: str = INITIALIZE_HINT
    ):
        self._client = client
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._what = what
        self._hint = hint
        self._local: dict[str, bytes] = {}
        self._published: list[str] = []

    def set(self, key: str, value: bytes) -> None:
        self._published.append(key)
        if self._client is None:
            self._local[key] = bytes(value)
        else:
            self._client.key_value_set_bytes(self._prefix + key, bytes(value))

    def remove_published(self) -> None:
        """Deletes every key this process set; called once set-up has
        succeeded (it ends at a barrier: every process has read everything).
        A failed set-up leaves its keys: a peer that still reads them then
        fails on the same cause (connect() checks every peer's fingerprint
        before anything else: a mismatch is named on every rank) instead of
        waiting out the timeout for keys that are gone. No later set-up
        reads them (each has a prefix of its own). Best effort: a
        coordinator that is gone has nothing left to delete."""
        keys, self._published = self._published, []
        for key in keys:
            if self._client is None:
                self._local.pop(key, None)
                continue
            try:
                self._client.key_value_delete(self._prefix + key)
            except Exception as e:  # jax's runtime error type differs between versions
                logger.debug("jax_arx: could not remove %s from the key-value store: %s", key, e)

    def get(self, key: str, waiting_for: str) -> bytes:
        if self._client is None:
            return self._local[key]
        try:
            return bytes(self._client.blocking_key_value_get_bytes(self._prefix + key, self._timeout_ms()))
        except Exception as e:  # jax's runtime error type differs between versions
            raise self._timed_out(waiting_for, e) from e

    def barrier(self, name: str, waiting_for: str) -> None:
        if self._client is None:
            return
        try:
            self._client.wait_at_barrier(self._prefix + name, self._timeout_ms())
        except Exception as e:
            raise self._timed_out(waiting_for, e) from e

    def _timeout_ms(self) -> int:
        return max(1, int(self._timeout_s * 1000))

    def _timed_out(self, waiting_for, e):
        return InitializationError(
            f"{self._what}: process {jax.process_index()} gave up after {self._timeout_s:g} s waiting for "
            f"{waiting_for} ({type(e).__name__}: {errors.first_line(e)}). {self._hint}"
        )
