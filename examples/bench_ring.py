"""Per-call latency of jax_arx.psum cabled as a ring against a mesh, in the
same run: world 3 (every rank a neighbour) and world 4 (the rank two away
through a relay), one process per rank, over the tcp carrier on the CPU:

    JAX_ARX_TRANSPORT=tcp python -m jax_arx.launch -n 4 examples/bench_ring.py

The processes set jax_arx up as a mesh, time every size, shut it down, set it
up as a ring (jax_arx.initialize(mesh, topology=...)), time every size, and
do that --rounds times, so that both topologies see the machine's load
alike; rank 0 prints the median over the rounds. Each time: K dependent
psums in one jitted program, minus the same program without them, over K;
the median of --repeats runs, each started on every process together
(examples/bench_common.py). Every result is checked first, bit for bit
against the fp32 rank-order sum, in both topologies. Exit status 0 means
every check passed.

On a CPU the proxies and handler threads of every rank share the host's
cores, so these figures measure the relay's extra hop and the host's
scheduling, not a NIC: they compare the two topologies, nothing more.
"""

import argparse
import statistics
import sys

import numpy as np

import jax_arx

jax_arx.distributed_initialize()  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench_common import describe_run, per_call_us, rank_order_sum  # noqa: E402  (beside this file)
from tp_decode import AXIS, chain_program  # noqa: E402

TOPOLOGIES = ("mesh", "ring")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kb", default="8,64,256", help="bf16 partials per rank, KB")
    p.add_argument("--calls", type=int, default=50, help="dependent calls per program (K)")
    p.add_argument("--repeats", type=int, default=7, help="runs per median")
    p.add_argument("--rounds", type=int, default=2, help="mesh, then ring, this many times")
    return p.parse_args()


def main():
    args = parse_args()
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    world, rank0 = mesh.shape[AXIS], jax.process_index() == 0
    sharded = NamedSharding(mesh, P(AXIS))
    sizes = [int(s) for s in args.sizes_kb.split(",")]
    inputs = {}
    for kb in sizes:
        n = kb * 1024 // 2
        parts = np.random.default_rng(kb).standard_normal((world, n)).astype(jnp.bfloat16)
        inputs[kb] = (parts, jax.make_array_from_callback(parts.shape, sharded, lambda idx, p=parts: p[idx]))
    once = jax.jit(
        jax.shard_map(lambda v: jax_arx.psum(v, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)
    )
    chain = lambda psum: chain_program(mesh, psum, args.calls)  # noqa: E731
    times = {t: {kb: [] for kb in sizes} for t in TOPOLOGIES}
    what = ""
    for r in range(args.rounds):
        for topology in TOPOLOGIES:
            jax_arx.initialize(mesh, topology=topology)
            what = describe_run(jax, jax_arx, AXIS)
            for kb in sizes:
                parts, x = inputs[kb]
                want = rank_order_sum(parts)
                for shard in once(x).addressable_shards:
                    if np.asarray(shard.data)[0].tobytes() != want.tobytes():
                        raise SystemExit(f"{topology}: psum of {kb} KB differs from the fp32 rank-order sum")
                times[topology][kb].append(per_call_us(chain, jax_arx.psum, x, args.calls, args.repeats))
                if rank0:
                    print(
                        f"round {r + 1} of {args.rounds}, {topology}, {kb} KB: "
                        f"{times[topology][kb][-1]:.1f} us per call",
                        flush=True,
                    )
            jax_arx.check()
            jax_arx.shutdown()
    if rank0:
        print(
            f"\nper-call psum latency, bf16, {what}; {world} ranks as a mesh and as a ring "
            f"({'the rank two away through a relay' if world == 4 else 'every rank a neighbour'}); median of "
            f"{args.rounds} rounds of the median of {args.repeats} runs of {args.calls} dependent calls minus "
            f"the same program without them; every result checked bit for bit in both:"
        )
        print(f"{'KB':>6} {'mesh us':>10} {'ring us':>10} {'ring/mesh':>10}")
        for kb in sizes:
            m, g = (statistics.median(times[t][kb]) for t in TOPOLOGIES)
            print(f"{kb:>6} {m:>10.1f} {g:>10.1f} {g / m if m else float('nan'):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
