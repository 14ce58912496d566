"""jax.distributed from the environment the launcher sets (jax_arx.launch).

Kept apart from the launcher so that ``import jax_arx`` does not import
``jax_arx.launch``, which ``python -m jax_arx.launch`` runs as ``__main__``.
"""

from __future__ import annotations

import os

_ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM = "JAX_NUM_PROCESSES"
_ENV_ID = "JAX_PROCESS_ID"


def initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize`` from the environment the
    launcher sets; call it first thing, before anything starts a jax
    backend.

    Reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``. On CPU it also selects the gloo cross-process
    collectives (when this jax has that option and nothing else was chosen),
    so ``jax.lax`` collectives work across processes there too.

    Returns:
      True when jax.distributed is initialized (now or already), False when
      none of the variables is set (a single process: nothing to do).

    Raises:
      ValueError: only some of the variables are set, or one is malformed.
    """
    values = {name: os.environ.get(name) for name in (_ENV_ADDRESS, _ENV_NUM, _ENV_ID)}
    present = {name: v for name, v in values.items() if v}
    if not present:
        return False
    missing = [name for name in values if name not in present]
    if missing:
        raise ValueError(
            f"jax_arx.distributed_initialize: {', '.join(missing)} not set while "
            f"{', '.join(present)} is; set all three (python -m jax_arx.launch does) or none.")
    try:
        num_processes = int(values[_ENV_NUM])
        process_id = int(values[_ENV_ID])
    except ValueError:
        raise ValueError(
            f"jax_arx.distributed_initialize: {_ENV_NUM}={values[_ENV_NUM]!r} and {_ENV_ID}={values[_ENV_ID]!r} "
            "must be integers") from None
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"jax_arx.distributed_initialize: {_ENV_ID}={process_id} must be in [0, {_ENV_NUM}={num_processes})")

    import jax

    if jax.distributed.is_initialized():
        return True
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:
        pass  # a jax without the option: its CPU backend picks its own
    jax.distributed.initialize(coordinator_address=values[_ENV_ADDRESS], num_processes=num_processes,
                               process_id=process_id)
    return True
