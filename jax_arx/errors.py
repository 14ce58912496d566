"""The exceptions jax_arx raises.

Errors from a collective that ran (a peer lost, a timeout, a mismatch) come
back from jax as its own runtime error (``XlaRuntimeError`` /
``JaxRuntimeError``) carrying jax_arx's message; ``jax_arx.check()`` raises
the same failures as :class:`CollectiveError` without running anything.
"""


class JaxArxError(RuntimeError):
    """Base class of every error jax_arx raises itself."""


class ConfigError(JaxArxError, ValueError):
    """A ``JAX_ARX_*`` environment variable has a value jax_arx does not accept.

    The message names the variable, its value and what is accepted.
    """


class InitializationError(JaxArxError):
    """``jax_arx.initialize()`` could not set up the communicators.

    The message says which step failed (rendezvous, endpoint creation,
    connection), for which mesh axis and rank, and what to do about it.
    """


class CollectiveError(JaxArxError):
    """A communicator has failed: a peer was lost, a wait timed out, or the
    ranks disagreed on what to run. Raised by ``jax_arx.check()``.

    Once failed, a communicator stays failed: every later collective on it
    returns at once with NaN output and the same error. Recover by restarting
    the processes (or ``jax_arx.shutdown()`` then ``jax_arx.initialize()`` on
    every process, if all of them are still alive).
    """


class JaxArxFallbackError(JaxArxError):
    """A collective is outside what jax_arx runs, and ``JAX_ARX_FALLBACK=error``
    forbids falling back to ``jax.lax``. The message says what was outside
    (dtype, size, axes, ...) and which limit applies.
    """
