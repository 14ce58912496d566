"""The exceptions jax_arx raises: one family, :class:`JaxArxError`.

.. code-block:: text

    JaxArxError (RuntimeError)
      ConfigError (also ValueError)        a JAX_ARX_* variable has a bad value
      InitializationError                  jax_arx.initialize() could not set up
      JaxArxFallbackError                  outside jax_arx's envelope, JAX_ARX_FALLBACK=error
      InvalidCallError (also ValueError)   a handler refused a call's operands
      CollectiveError                      a communicator has failed:
        CollectiveTimeoutError (also TimeoutError)   a wait on a peer gave up
        CollectiveMismatchError            ranks issued different collectives
        EndpointFailedError                a carrier or device error, a lost peer,
                                           or a call after the endpoint failed

Where each comes from: jax_arx raises set-up errors itself. A collective
that fails while it runs fails inside XLA, and jax raises an error whose
message starts with the status, ``INTERNAL: jax_arx: ...``, of one of two
types (seen on the CPU backend, jax 0.10, for a lost peer, a timeout and a
mismatch alike): its runtime error (``jax.errors.JaxRuntimeError``, a
``RuntimeError``) where a compiled function's first run fails, and a plain
``ValueError`` where a later run does (jax's fast path for a function that
has run before raises that). Two places turn those into this family:

- ``jax_arx.check()`` raises the right :class:`CollectiveError` subclass for
  a failed communicator, whatever the backend (on GPUs a call replayed from
  a CUDA graph runs no host code and raises nothing itself);
- :func:`translated` (a context manager and a decorator) re-raises jax's
  errors (``ValueError`` or ``RuntimeError``) that carry a jax_arx message
  as the class above, chained to jax's error (``__cause__``).

So one ``except`` covers every backend and call::

    import jax, jax.numpy as jnp
    import jax_arx

    jax_arx.distributed_initialize()
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    jax_arx.initialize(mesh)
    step = jax.jit(jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=mesh,
                                 in_specs=jax.P("tp"), out_specs=jax.P()))
    x = jax.device_put(jnp.ones((jax.device_count(), 8)), jax.NamedSharding(mesh, jax.P("tp")))
    try:
        with jax_arx.errors.translated():
            y = step(x).block_until_ready()
        jax_arx.check()
    except jax_arx.errors.CollectiveTimeoutError as e:
        print("a peer is gone or stuck:", e)
        raise
    except jax_arx.errors.CollectiveError as e:
        print("the communicator failed:", e)
        raise
    jax_arx.shutdown()
"""

from __future__ import annotations

import contextlib
import re


class JaxArxError(RuntimeError):
    """Base class of every error of jax_arx (see the module's docstring)."""


class ConfigError(JaxArxError, ValueError):
    """A ``JAX_ARX_*`` environment variable has a value jax_arx does not accept.

    The message names the variable, its value and what is accepted.
    """


class InitializationError(JaxArxError):
    """``jax_arx.initialize()`` could not set up the communicators, or a
    program runs a jax_arx collective on a device that has none (it was
    traced after ``jax_arx.initialize()`` and run after ``shutdown()``).

    The message says which step failed (rendezvous, endpoint creation,
    connection), for which mesh axis and rank, and what to do about it.
    """


class JaxArxFallbackError(JaxArxError):
    """A collective is outside what jax_arx runs, and ``JAX_ARX_FALLBACK=error``
    forbids falling back to ``jax.lax``. The message says what was outside
    (dtype, size, axes, ...) and which limit applies.
    """


class InvalidCallError(JaxArxError, ValueError):
    """A jax_arx handler refused a call: operands it does not take, or more
    bytes than the limit it was set up with. The message names the op, the
    numbers and the limit."""


class CollectiveError(JaxArxError):
    """A communicator has failed: a peer was lost, a wait timed out, or the
    ranks disagreed on what to run. Raised by ``jax_arx.check()`` (as one of
    the subclasses below when every failure is of one kind) and by
    :func:`translated`.

    Once failed, a communicator stays failed: every later collective on it
    returns at once with NaN output and the same error. Recover by restarting
    the processes (or ``jax_arx.shutdown()`` then ``jax_arx.initialize()`` on
    every process, if all of them are still alive).
    """


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A wait on a peer gave up after ``JAX_ARX_TIMEOUT_S``. The message
    names the peers that did not send and what each last sent: such a peer
    exited, crashed, is stuck, or issues other collectives."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives at the same point (op, dtype,
    element count or call site differ). The message names the rank that
    differed; fix the program so that every rank issues the same
    collectives in the same order."""


class EndpointFailedError(CollectiveError):
    """The endpoint failed for another reason: its carrier reported an
    error (a peer closed its connection, an RDMA write failed), the device
    failed a launch, or the call came after an earlier failure."""


# Where a jax_arx message starts inside jax's error text ("INTERNAL: jax_arx:
# ...", "INVALID_ARGUMENT: jax_arx.psum: ..."): the core's messages start with
# "jax_arx: ", the handlers' checks with "jax_arx.<op>: ".
_MESSAGE = re.compile(r"\bjax_arx(?:\.\w+)?: ")


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, whole: jax's runtime errors put
    the status and what failed there, and a trace of their own below."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def classify(message: str) -> type[JaxArxError]:
    """The class of this family for a message of jax_arx's C++ core or
    handlers (the text ``jax_arx.check()`` and failed calls carry)."""
    if "timed out after" in message:
        return CollectiveTimeoutError
    if "issued a different collective" in message:
        return CollectiveMismatchError
    if "no communicator" in message:
        return InitializationError
    if re.match(r"jax_arx\.\w+: ", message) and "launching on device" not in message:
        return InvalidCallError
    return EndpointFailedError


def from_runtime_error(e: BaseException) -> JaxArxError | None:
    """The error of this family that ``e`` carries: ``e`` itself when it is
    one; for jax's error carrying a jax_arx message (its
    ``JaxRuntimeError``, or the ``ValueError`` its fast path raises), that message as the class
    :func:`classify` gives, with ``__cause__`` set to ``e``; else None."""
    if isinstance(e, JaxArxError):
        return e
    if not isinstance(e, (RuntimeError, ValueError)):
        return None
    text = str(e)
    m = _MESSAGE.search(text)
    if m is None:
        return None
    message = text[m.start() :]
    err = classify(message)(message)
    err.__cause__ = e
    return err


@contextlib.contextmanager
def translated():
    """Re-raises, inside its block, jax's errors (its ``JaxRuntimeError``,
    or the ``ValueError`` its fast path raises) that carry a jax_arx message
    as the matching class of this family (see
    :func:`from_runtime_error`); other exceptions pass unchanged. A context
    manager (``with jax_arx.errors.translated(): ...``) and a decorator
    (``@jax_arx.errors.translated()``). On the CPU backend the failed call
    raises (when it runs, or where its result is read); wrap both."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        err = from_runtime_error(e)
        if err is None or err is e:
            raise
        raise err from e
