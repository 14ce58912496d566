"""jax_arx: low-latency collectives for JAX, without NCCL.

Use ``jax_arx.psum`` where ``jax.lax.psum`` would stand, inside ``jax.jit``
and ``jax.shard_map``; this program runs in 2 local processes with
``python -m jax_arx.launch -n 2 program.py``::

    import jax, jax.numpy as jnp
    import jax_arx

    jax_arx.distributed_initialize()    # jax.distributed from the launcher's environment
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    jax_arx.initialize(mesh)            # communicators for the mesh's axes

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=jax.P("tp"), out_specs=jax.P())
    def f(x):
        return jax_arx.psum(x, "tp")

    x = jax.device_put(jnp.arange(2.0 * jax.device_count()).reshape(-1, 2), jax.NamedSharding(mesh, jax.P("tp")))
    print(f(x).addressable_data(0))     # [[2. 4.]] with 2 processes: [0 1] + [2 3]
    jax_arx.shutdown()

Run N local processes with ``python -m jax_arx.launch -n N script.py``.

Public API:
  psum(x, axis_name, *, prefetch=None)
                          all-reduce sum over one mesh axis (jax.lax.psum's contract);
                          on GPUs, prefetch (up to 8 arrays, e.g. the next layer's
                          weights) is fetched into L2 while the call waits
  psum_add_norm(x, residual, weight, axis_name, *, kind="rms", bias=None, eps=1e-6)
                          (normed, hidden): psum(x) + residual and its RMSNorm / LayerNorm,
                          one collective with the norm in its epilogue
  all_gather(x, axis_name, *, axis=0, tiled=False)
                          gather over one mesh axis (jax.lax.all_gather's contract)
  psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False)
                          reduce-scatter over one mesh axis (jax.lax.psum_scatter's)
  moe_combine_psum_scatter(y, pos, w, shared, axis_name, *, y_scale=None)
                          a MoE layer's final combine fused with its reduce-scatter
  initialize(mesh=None)   set up communicators for a mesh (collective)
  shutdown()              close them (collective)
  transport(axis_name)    the carrier initialize() chose for an axis ("shm", "tcp", "verbs")
  check()                 raise CollectiveError (a subclass per kind) if a communicator has failed
  stats()                 per communicator and collective: calls, bytes, algorithms, failures,
                          stalls (the watchdog's last report); the fallbacks to jax.lax
  distributed_initialize()  jax.distributed.initialize from JAX_COORDINATOR_ADDRESS,
                          JAX_NUM_PROCESSES, JAX_PROCESS_ID (what the launcher sets)
  errors                  the exceptions, one family under JaxArxError; errors.translated()
                          turns jax's error from a failed call (JaxRuntimeError, or
                          ValueError from jax's fast path) into them
Configuration: the JAX_ARX_* environment variables, see jax_arx.config.
"""

import importlib

from jax_arx import errors
from jax_arx._distributed import initialize_distributed as distributed_initialize
from jax_arx.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    EndpointFailedError,
    InitializationError,
    InvalidCallError,
    JaxArxError,
    JaxArxFallbackError,
)

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "EndpointFailedError",
    "InitializationError",
    "InvalidCallError",
    "JaxArxError",
    "JaxArxFallbackError",
    "all_gather",
    "check",
    "distributed_initialize",
    "errors",
    "initialize",
    "moe_combine",
    "moe_combine_psum_scatter",
    "psum",
    "psum_add_norm",
    "psum_scatter",
    "shutdown",
    "stats",
    "transport",
]

# The rest of the API imports jax, so it loads on first use: `python -m
# jax_arx.launch`, which imports this package before its module, and a
# probe of the C++ module then start without jax (a CPU-second each).
# jax_arx.initialize() registers the C++ handlers with XLA and jax.grad's
# sums (_comm.py), before anything that uses them is traced.
_LAZY = {
    "check": "_comm",
    "initialize": "_comm",
    "shutdown": "_comm",
    "transport": "_comm",
    "all_gather": "_bulk",
    "psum_scatter": "_bulk",
    "moe_combine": "_moe",
    "moe_combine_psum_scatter": "_moe",
    "psum": "_psum",
    "psum_add_norm": "_norm",
    "stats": "_stats",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_arx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jax_arx.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
