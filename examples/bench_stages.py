"""Where one jax_arx.psum's time goes, stage by stage, on whatever route the
environment picks (the proxy: JAX_ARX_CUDA_DIRECT=0; host inboxes:
JAX_ARX_CUDA_PEER_MEMORY=0; tcp: JAX_ARX_TRANSPORT=tcp).

Needs a trace build of jax_arx (the stamps cost nothing in any other):

    pip install --no-build-isolation --no-deps -C cmake.define.JAX_ARX_TRACE=ON .
    JAX_ARX_CUDA_DIRECT=0 python -m jax_arx.launch -n 2 examples/bench_stages.py --sizes-kb 8,64

Every rank runs --calls dependent psums of each size in one jitted program
(as the benchmarks time them), --repeats times (--op add_norm: the fused
jax_arx.psum_add_norm instead, RMSNorm over rows of 4096 bf16, its fused
kernels forced as examples/bench_norm.py's fused series has them; the
norm runs between "seen" and "end"; --op all_gather or psum_scatter: the
bulk collective over a per-rank slice of that size, as
examples/bench_prefill.py chains it, its stamps those of the last of its
pieces; --op moe: jax_arx.moe_combine_psum_scatter, its fused kernel
forced as bench_prefill.py's fused series has it, over a per-rank output
of that size in rows of 512 bf16, two experts a token; the combine runs
between "begin" and "published"), then reads its endpoint's
stamps (ffi/base/trace.h): the kernel's (or host side's) begin, its last
signal, the proxy taking the first trigger and returning from its last put,
the last peer's piece seen, the end. GPU stamps are moved onto the host's
clock (jax_arx._core.pinned_round_trip: a ping-pong whose shortest round
trip bounds the offset; its half is printed as the error), measured right
before and right after each size's calls and averaged: the two clocks drift
apart by microseconds within a second, so one offset taken at the start
put the proxy's taking of a trigger before its publishing. Rank 0 prints, per
size, the median over the calls of each stage's length, with the peer's
stamps for the cross-rank ones (ranks on one host share the clock), and
writes them to --json.
"""

import argparse
import json
import statistics
import sys

import numpy as np

import jax_arx

jax_arx.distributed_initialize()  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench_common import barrier, describe_run  # noqa: E402  (beside this file)

AXIS = "x"
# ffi/base/trace.h: TraceStage, kTraceSeqs, kFamilies.
BEGIN, PUBLISHED, TAKEN, POSTED, ARRIVED, END, FLAG_SEEN, SEQ = range(8)
SEQS, STAGES, FAMILIES = 4096, 8, 2
PSUM_FAMILY, BULK_FAMILY = 0, 1  # ffi/base/words.h: Family
BULK_OPS = ("all_gather", "psum_scatter", "moe")
GPU_STAGES = (BEGIN, PUBLISHED, ARRIVED, END, FLAG_SEEN)

# (name, (whose stamp, stage), (whose stamp, stage)): "me" is the rank that
# waits, "peer" the one whose piece it waits for; "deliver" is the peer's
# last put returned on the proxy route, its last signal on the direct one.
SPANS = [
    ("launch gap: previous end -> begin", ("me", "prev_end"), ("me", BEGIN)),
    ("begin -> published (copy, fence, signal)", ("me", BEGIN), ("me", PUBLISHED)),
    # The proxy takes a seq's first trigger, perhaps before its last piece
    # is published (the LL route publishes its announcement first): "proxy
    # took" is the first, "published" and "returned" the last of the seq.
    ("published -> the proxy's last put returned", ("me", PUBLISHED), ("me", POSTED)),
    ("proxy took the first -> its last put returned", ("me", TAKEN), ("me", POSTED)),
    ("peer delivered -> flags seen, while polling", ("peer", "deliver"), ("me", "flags_polling")),
    ("flags seen -> header checked", ("me", FLAG_SEEN), ("me", ARRIVED)),
    ("peer published -> seen", ("peer", PUBLISHED), ("me", ARRIVED)),
    ("seen -> end (sum, settle)", ("me", ARRIVED), ("me", END)),
    ("begin -> end (the kernel)", ("me", BEGIN), ("me", END)),
    ("begin: me - peer", ("peer", BEGIN), ("me", BEGIN)),
    ("period: begin -> next begin", ("me", BEGIN), ("me", "next_begin")),
]


def spans(rows, me, peer, seqs):
    """Median microseconds of each span over `seqs`, for rank `me` waiting
    for rank `peer`."""
    empty = [0] * STAGES

    def stamp(who, stage, s):
        r = rows[me if who == "me" else peer]
        row = r.get(s, empty)
        if stage == "prev_end":
            return r.get(s - 1, empty)[END]
        if stage == "next_begin":
            return r.get(s + 1, empty)[BEGIN]
        if stage == "deliver":
            return row[POSTED] or row[PUBLISHED]
        if stage == "flags_polling":
            # Only where this rank was polling before the peer delivered: the
            # time the route took to show the piece, not this rank's lateness.
            delivered = row_of(rows[peer], s)[POSTED] or row_of(rows[peer], s)[PUBLISHED]
            return row[FLAG_SEEN] if row[PUBLISHED] and row[PUBLISHED] < delivered else 0
        return row[stage]

    def row_of(r, s):
        return r.get(s, empty)

    out = {}
    for name, (wa, sa), (wb, sb) in SPANS:
        vals = [(b - a) / 1e3 for s in seqs for a, b in [(stamp(wa, sa, s), stamp(wb, sb, s))] if a and b]
        out[name] = round(statistics.median(vals), 2) if vals else None
        out[name + " (n)"] = len(vals)
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kb", default="8,64,256")
    p.add_argument("--calls", type=int, default=64, help="dependent psums per program")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the table to this file (rank 0)")
    p.add_argument(
        "--op", default="psum", choices=("psum", "add_norm", *BULK_OPS), help="the call traced (default psum)"
    )
    args = p.parse_args()
    if args.op == "moe" and any(int(v) % (2 * MOE_HIDDEN // 1024) for v in args.sizes_kb.split(",")):
        p.error(f"--op moe: --sizes-kb in whole rows of {MOE_HIDDEN} bf16")
    if args.op == "add_norm" and any(int(v) % (2 * HIDDEN // 1024) for v in args.sizes_kb.split(",")):
        p.error(f"--op add_norm: --sizes-kb in whole rows of {HIDDEN} bf16 (multiples of {2 * HIDDEN // 1024})")
    return args


# --op add_norm: the rows' width, as examples/bench_norm.py's.
HIDDEN = 4096
# --op moe: the rows' width and the experts per token, as bench_prefill.py's.
MOE_HIDDEN, MOE_TOPK = 512, 2


def chain(mesh, calls, op):
    world = mesh.shape[AXIS]
    spec = P(AXIS)

    def body(i, x):
        return (jax_arx.psum(x, AXIS) * (1.0 / world)).astype(x.dtype) + x[0, 0] * 0

    def fused_body(i, carry):
        x, r, w = carry
        normed, hidden = jax_arx.psum_add_norm(x, r, w[0], AXIS)
        return (normed * 0.5).astype(x.dtype), hidden, w

    def gather_body(i, x):  # [1, n] -> [1, world n] -> the middle n, halved
        g = jax_arx.all_gather(x, AXIS, axis=1, tiled=True)
        n = x.shape[1]
        return (g[:, n // 2 : n // 2 + n] * 0.5).astype(x.dtype)

    def scatter_body(i, x):  # [1, world n] -> [1, n] -> tiled back, over world
        s = jax_arx.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True)
        return (jnp.tile(s, (1, world)) * (1.0 / world)).astype(x.dtype)

    def moe_body(i, a):  # this rank's combined rows fed back into its shared rows
        y, pos, w, shared = a
        out = jax_arx.moe_combine_psum_scatter(y, pos, w, shared, AXIS)
        return y, pos, w, jax.lax.dynamic_update_slice_in_dim(shared, (out * 0.5).astype(shared.dtype), 0, axis=0)

    if op == "moe":
        return jax.jit(
            jax.shard_map(
                lambda *a: jax.lax.fori_loop(0, calls, moe_body, a)[3], mesh=mesh, in_specs=(spec,) * 4, out_specs=spec
            )
        )

    bodies = {"psum": body, "all_gather": gather_body, "psum_scatter": scatter_body}
    if op in bodies:
        step = bodies[op]
        return jax.jit(
            jax.shard_map(lambda x: jax.lax.fori_loop(0, calls, step, x), mesh=mesh, in_specs=spec, out_specs=spec)
        )

    def loop(x):
        rows = x.shape[1] // HIDDEN
        x = x.reshape(rows, HIDDEN)
        w = jnp.ones((1, HIDDEN), x.dtype)
        out, _, _ = jax.lax.fori_loop(0, calls, fused_body, (x, x, w))
        return out.reshape(1, -1)

    return jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=spec, out_specs=spec))


def moe_operands(kb, world):
    """This process's blocks of the fused combine's y, pos, w and shared
    (one device a process): ``kb`` KB of output rows a rank, every token's
    experts among the rank's rows, weights that keep the sums bounded."""
    rows = kb * 1024 // 2 // MOE_HIDDEN
    tokens = world * rows
    rng = np.random.default_rng(jax.process_index())
    return (
        rng.standard_normal((rows + 1, MOE_HIDDEN)).astype(jnp.bfloat16),
        rng.integers(0, rows + 1, (tokens, MOE_TOPK)).astype(np.int32),
        np.full((tokens, MOE_TOPK), 0.25, np.float32),
        rng.standard_normal((tokens, MOE_HIDDEN)).astype(jnp.bfloat16),
    )


def my_rows(endpoint, family, offset_ns):
    """{seq: [stamp per stage, host ns, 0 where not reached]} of ``family``."""
    from jax_arx import _core

    t = np.frombuffer(_core.trace(endpoint.comm_id, endpoint.device_ordinal), dtype=np.uint64)
    t = t.reshape(FAMILIES, SEQS, STAGES)[family].astype(np.int64)
    rows = {}
    for row in t:
        if row[SEQ] == 0:
            continue
        stamps = [int(v) for v in row]
        for s in GPU_STAGES if offset_ns is not None else ():
            if stamps[s]:
                stamps[s] += offset_ns
        rows[int(row[SEQ])] = stamps
    return rows


def main():
    args = parse_args()
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    world = mesh.shape[AXIS]
    tuning = {"add_norm": {"norm_fused": 1}, "moe": {"moe_fused": 1}}.get(args.op)
    jax_arx.initialize(mesh, _tuning=tuning)
    from jax_arx import _comm, _core, _registry

    if not hasattr(_core, "trace"):
        sys.exit(
            "bench_stages: this jax_arx is not a trace build; install it with "
            "-C cmake.define.JAX_ARX_TRACE=ON (see this file's docstring)"
        )
    rank0 = jax.process_index() == 0
    (le,) = [e for e in _comm.communicators()[AXIS].endpoints]
    endpoint = le.endpoint
    gpu = devices[0].platform == "gpu"

    def clock_offset():
        """(the GPU clock's offset onto the host's, its error), in ns."""
        rtt = _core.pinned_round_trip(endpoint.device_ordinal)
        return rtt["offset_ns"], rtt["error_ns"]

    error = clock_offset()[1] if gpu else 0
    if rank0:
        print(
            f"bench_stages: {args.op}, {describe_run(jax, jax_arx, AXIS)}; route {endpoint.route}; "
            f"GPU clock onto the host's within {error / 1e3:.2f} us",
            flush=True,
        )
    from jax_arx import _compat

    client = _compat.distributed_client()
    table = {}
    for kb in [int(v) for v in args.sizes_kb.split(",")]:
        # psum_scatter's input is world slices of the size.
        elems = kb * 1024 // 2 * (world if args.op == "psum_scatter" else 1)
        # This process's rows only: a device_put of a global array would check it
        # across processes with an XLA collective (NCCL on GPUs, which refuses
        # ranks that share a GPU).
        sharded = jax.sharding.NamedSharding(mesh, P(AXIS))
        if args.op == "moe":
            x = [jax.make_array_from_process_local_data(sharded, a) for a in moe_operands(kb, world)]
        else:
            local = np.ones((len(jax.local_devices()), elems), jnp.bfloat16)
            x = [jax.make_array_from_process_local_data(sharded, local)]
        f = chain(mesh, args.calls, args.op)
        f(*x).block_until_ready()
        # The bulk collectives run on endpoints of their own, made at their
        # first call (jax_arx/_bulk_endpoints.py).
        traced = endpoint
        if args.op in BULK_OPS:
            (bulk,) = _registry.bulk_communicator(AXIS).endpoints
            traced = bulk.endpoint
        barrier(f"bench_stages {kb}")
        before = clock_offset()[0] if gpu else None
        for _ in range(args.repeats):
            y = f(*x)
        y.block_until_ready()
        after = clock_offset()[0] if gpu else None
        offset = (before + after) // 2 if gpu else None
        if gpu and rank0:
            print(f"bench_stages: {kb} KB: the clocks' offset moved {(after - before) / 1e3:+.2f} us", flush=True)
        barrier(f"bench_stages {kb} done")
        rows = my_rows(traced, BULK_FAMILY if args.op in BULK_OPS else PSUM_FAMILY, offset)
        key = f"bench_stages/{kb}"
        client.key_value_set_bytes(f"{key}/{jax.process_index()}", json.dumps(rows).encode())
        if rank0:
            every = [
                {
                    int(k): v
                    for k, v in json.loads(bytes(client.blocking_key_value_get_bytes(f"{key}/{r}", 60_000))).items()
                }
                for r in range(world)
            ]
            common = sorted(set.intersection(*[set(r) for r in every]))
            seqs = common[-min(len(common), args.calls * args.repeats) :][1:-1]
            table[kb] = {
                f"rank {me} <- rank {(me + 1) % world}": spans(every, me, (me + 1) % world, seqs) for me in range(world)
            }
            table[kb]["raw"] = {r: {s: every[r][s] for s in seqs[:40]} for r in range(world)}
            print(f"\n{kb} KB ({len(seqs)} calls)")
            names = [name for name, _, _ in SPANS]
            heads = [k for k in table[kb] if k != "raw"]
            print(f"  {'':42s}" + "".join(f"{h[:22]:>24s}" for h in heads))
            for name in names:
                cells = [table[kb][h][name] for h in heads]
                print(f"  {name:42s}" + "".join(f"{'-' if c is None else f'{c:8.2f} us':>24s}" for c in cells))
        barrier(f"bench_stages {kb} read")
    if rank0 and args.json:
        with open(args.json, "w") as fh:
            doc = {"op": args.op, "route": endpoint.route, "clock_error_us": error / 1e3, "median_us": table}
            json.dump(doc, fh, indent=1)
    jax_arx.shutdown()


if __name__ == "__main__":
    main()
