"""Worker for tests/test_netns.py: one process per network namespace.

jax.distributed comes from the environment (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID). Runs jax_arx.psum over the mesh of both
processes and checks every result bit for bit against the fp32 rank-order
reference computed with numpy. Prints one JSON line.
"""

import json
import sys

import numpy as np

import jax_arx

jax_arx.distributed_initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main():
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    jax_arx.initialize(mesh)
    transport = sorted({ep.transport for ep in jax_arx._comm.communicator("x").endpoints})
    f = jax.jit(jax.shard_map(lambda v: jax_arx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    world = mesh.shape["x"]
    checked = 0
    me = jax.process_index()
    # Every process can make every rank's input (seeded by rank), so the
    # reference needs no collective of jax's own: gloo would bind to loopback,
    # which each namespace has to itself.
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for n in (1, 7, 4096, 40001):
            inputs = [np.random.default_rng([r, n]).standard_normal((1, n)).astype(np.float32).astype(dtype)
                      for r in range(world)]
            acc = np.zeros((n,), np.float32)
            for r in range(world):
                acc += inputs[r][0].astype(np.float32)
            ref = acc.astype(inputs[0].dtype)
            x = multihost_utils.host_local_array_to_global_array(inputs[me], mesh, P("x"))
            y = f(x)
            for shard in y.addressable_shards:
                got = np.asarray(shard.data)
                if got.tobytes() != ref.tobytes():
                    print(json.dumps(dict(ok=False, dtype=str(np.dtype(dtype)), n=n,
                                          bad=int(np.sum(got != ref)))))
                    return 1
            checked += 1
    jax_arx.check()
    print(json.dumps(dict(ok=True, checked=checked, process=jax.process_index(), transport=transport)))
    jax_arx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
