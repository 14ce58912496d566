"""Worker for tests/test_netns.py: one process per network namespace.

jax.distributed comes from the environment (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID). Sets jax_arx up over the mesh of every
process (``--topology mesh|ring``: jax_arx.initialize's argument; default:
JAX_ARX_TOPOLOGY), then runs jax_arx.psum, all_gather and psum_scatter and
checks every result bit for bit against numpy: the fp32 rank-order sum
rounded once, the ranks' blocks. Prints one JSON line: what was checked, or
the error initialize raised.
"""

import json
import sys
import time

import numpy as np

import jax_arx

jax_arx.distributed_initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main():
    topology = sys.argv[sys.argv.index("--topology") + 1] if "--topology" in sys.argv else None
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    start = time.monotonic()
    try:
        jax_arx.initialize(mesh, topology=topology)
    except jax_arx.InitializationError as e:
        print(
            json.dumps(dict(ok=False, init_error=str(e), seconds=time.monotonic() - start, process=jax.process_index()))
        )
        return 0
    transport = sorted({ep.transport for ep in jax_arx._comm.communicator("x").endpoints})
    smap = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    ops = {
        "psum": smap(lambda v: jax_arx.psum(v, "x")),
        "all_gather": smap(lambda v: jax_arx.all_gather(v[0], "x", tiled=True)[None]),
        "psum_scatter": smap(lambda v: jax_arx.psum_scatter(v[0], "x", tiled=True)[None]),
    }
    world, me = mesh.shape["x"], jax.process_index()
    checked = {op: 0 for op in ops}
    # Every process can make every rank's input (seeded by rank), so the
    # reference needs no collective of jax's own: gloo would bind to loopback,
    # which each namespace has to itself.
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for n in (1, 7, 4096, 40001):
            n *= world  # psum_scatter splits it
            inputs = [
                np.random.default_rng([r, n]).standard_normal((1, n)).astype(np.float32).astype(dtype)
                for r in range(world)
            ]
            acc = np.zeros((n,), np.float32)
            for r in range(world):
                acc += inputs[r][0].astype(np.float32)
            want = {
                "psum": acc.astype(inputs[0].dtype),
                "all_gather": np.concatenate([x[0] for x in inputs]),
                "psum_scatter": np.split(acc.astype(inputs[0].dtype), world)[me],
            }
            x = multihost_utils.host_local_array_to_global_array(inputs[me], mesh, P("x"))
            for op, f in ops.items():
                for shard in f(x).addressable_shards:
                    got = np.asarray(shard.data)[0]
                    if got.tobytes() != want[op].tobytes():
                        print(
                            json.dumps(
                                dict(ok=False, op=op, dtype=str(np.dtype(dtype)), n=n, bad=int(np.sum(got != want[op])))
                            )
                        )
                        return 1
                checked[op] += 1
    jax_arx.check()
    relayed = sum(ep.endpoint.stats()["relayed_puts"] for ep in jax_arx._comm.communicator("x").endpoints)
    print(
        json.dumps(
            dict(
                ok=True,
                checked=checked,
                process=me,
                transport=transport,
                relayed=relayed,
                topology=jax_arx._comm.communicator("x").topology,
            )
        )
    )
    jax_arx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
