"""The bulk collectives in tests/workers/verbs_psum.py's phases (``bulk=N``):
jax_arx.all_gather, jax_arx.psum_scatter and the fused MoE combine (bf16 and
e4m3 expert outputs) between the two processes, several MB per call, N calls
of each back to back (dispatched in batches before any result is read), every
result checked bit for bit against numpy (tests/bulk_reference.py: the
ranks' pieces; the fp32 rank-order sum rounded once; the combine's fp32 rows
rounded once to bf16, then that sum).

Each call takes one of two input sets, in turn, so consecutive calls carry
different bytes (a stale piece would show) and each reference is computed
once. Every process can make every rank's inputs (seeded), so the references
need no collective of jax's own. Under TCG numpy is slow: the gather and
scatter inputs are rotations of one random array of finite bf16 values.
"""

from __future__ import annotations

import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import bulk_reference as ref  # noqa: E402
import jax_arx  # noqa: E402

AXIS = "x"
GATHER_ELEMENTS = 1 << 19  # bf16 per rank: 1 MiB in, 2 MiB gathered
MOE = dict(T=2048, R=256, H=512, topk=2)  # 2 MiB of combined rows, 1 MiB per rank after the sum
SETS = 2  # input sets, used in turn
BATCH = 10  # calls dispatched before any result is read


def prefill_slot_bytes() -> int:
    """What JAX_ARX_PREFILL_SLOT_BYTES must hold for these calls (the largest
    gathered output or scattered input)."""
    return max(2 * GATHER_ELEMENTS * 2, -(-MOE["T"] // 2) * 2 * MOE["H"] * 2)


def run(mesh, calls: int, say) -> tuple[int, str | None]:
    """Runs ``calls`` calls of each op (all_gather, psum_scatter, the MoE
    combine with bf16 and with e4m3 y, half each); returns (calls checked,
    the first failure or None)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    me, world = jax.process_index(), mesh.shape[AXIS]
    sharded = NamedSharding(mesh, P(AXIS))

    def put(per_rank):
        """The global array whose rank-r piece is per_rank[r][None] (this
        process puts its own)."""
        g = np.stack(per_rank)
        return jax.make_array_from_callback(g.shape, sharded, lambda idx: g[idx])

    def smap(body, n_in):
        def lifted(*xs):
            return body(*[x[0] for x in xs])[None]

        return jax.jit(jax.shard_map(lifted, mesh=mesh, in_specs=(P(AXIS),) * n_in, out_specs=P(AXIS)))

    # The first bulk collective traced sets up the bulk endpoints, on both
    # processes together (within JAX_ARX_TIMEOUT_S): trace one now, while
    # the psum calls just done keep the processes close, before the slow
    # part (the references, under TCG).
    t0 = time.monotonic()
    smap(lambda v: jax_arx.all_gather(v, AXIS, tiled=True), 1).trace(
        jax.ShapeDtypeStruct((world, 16), bf16, sharding=sharded)
    )
    say(f"bulk endpoints set up in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()

    rng = np.random.default_rng
    u = rng(1).integers(0, 1 << 32, world * GATHER_ELEMENTS, dtype=np.uint32)
    base = (((u >> 31) << 15) | ((120 + (u >> 16) % 15) << 7) | (u & 127)).astype(np.uint16).view(bf16)  # |x| < 2^8

    def rotated(s, r, n):
        return np.roll(base[:n], 7919 * (world * s + r) + 1)

    gather_in = [[rotated(s, r, GATHER_ELEMENTS) for r in range(world)] for s in range(SETS)]
    scatter_in = [[rotated(s, r, world * GATHER_ELEMENTS) for r in range(world)] for s in range(SETS)]
    jobs = [
        (
            "all_gather",
            smap(lambda v: jax_arx.all_gather(v, AXIS, tiled=True), 1),
            calls,
            [(put(parts),) for parts in gather_in],
            [np.concatenate(parts) for parts in gather_in],
        ),
        (
            "psum_scatter",
            smap(lambda v: jax_arx.psum_scatter(v, AXIS, tiled=True), 1),
            calls,
            [(put(parts),) for parts in scatter_in],
            [ref.reference_scatter(parts, 0, True, me) for parts in scatter_in],
        ),
    ]
    m = MOE
    tpad = -(-m["T"] // world) * world
    for e4m3 in (False, True):
        args, wants = [], []
        for s in range(SETS):
            ys, scales, poss, ws, shareds = ref._moe_inputs(
                rng([3, s, int(e4m3)]), types.SimpleNamespace(world=world), m["T"], m["R"], m["H"], m["topk"], e4m3
            )
            combined = [
                ref.reference_combine(ys[r], poss[r], ws[r], shareds[r], scales[r] if e4m3 else None, tpad)
                for r in range(world)
            ]
            wants.append(ref.reference_scatter(combined, 0, True, me))
            args.append(tuple(put(x) for x in ([ys] + ([scales] if e4m3 else []) + [poss, ws, shareds])))

        def combine(y, *rest, e4m3=e4m3):
            scale, (pos, w, shared) = (rest[0], rest[1:]) if e4m3 else (None, rest)
            return jax_arx.moe_combine_psum_scatter(y, pos, w, shared, AXIS, y_scale=scale)

        jobs.append(
            (f"moe_combine ({'e4m3' if e4m3 else 'bf16'})", smap(combine, 5 if e4m3 else 4), calls // 2, args, wants)
        )

    say(f"inputs and references made in {time.monotonic() - t0:.1f} s")
    checked = 0
    for name, f, n, args, wants in jobs:
        t0 = time.monotonic()
        for start in range(0, n, BATCH):
            # Back to back: the batch is dispatched before any result is read.
            outs = [(c, f(*args[c % SETS])) for c in range(start, min(n, start + BATCH))]
            for c, out in outs:
                got = np.asarray(out.addressable_shards[0].data)[0]
                want = wants[c % SETS]
                if got.shape != want.shape or not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                    bad = int(np.sum(got != want)) if got.shape == want.shape else f"shape {got.shape}: all"
                    return checked, (
                        f"{name} call {c}: {bad} elements differ from the numpy reference ({got.nbytes} bytes)"
                    )
                checked += 1
        say(f"{name}: {n} calls checked in {time.monotonic() - t0:.1f} s")
    return checked, None
