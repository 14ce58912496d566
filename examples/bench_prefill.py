"""Per-call latency of the bulk collectives, jax_arx.all_gather,
jax_arx.psum_scatter and the fused MoE combine, against jax.lax's (NCCL) and
against the pinned-copy floor, by size: N processes (--world, default 2),
one rank each, bf16, a per-rank slice of 1, 4, 16 and 64 MB, every result
checked before it is timed.

    # Timed, 2 GPUs: the tables; the JSON and a plot into bench_out/
    python examples/bench_prefill.py --out bench_out
    # Checked only, no timing, at world 2, 3 and 4; exit status 1 on any
    # mismatch. With fewer GPUs than ranks the ranks share them (and the
    # jax.lax series are skipped: NCCL refuses two ranks on one GPU)
    python examples/bench_prefill.py --check --world 2,3,4
    # The CPU backend at small sizes (tests/test_bench_cpu.py runs this)
    python examples/bench_prefill.py --cpu --check

Ranks, jobs, the options shared with examples/bench_psum.py, what is
checked and how the tables read: as there.

The method of examples/bench_psum.py: K dependent calls inside one jitted
program minus the same program without the collective, over K; the median
of samples of back-to-back runs. Each step feeds the collective's output
back as the next step's input through one elementwise pass the baseline has
too, with an optimization barrier after each step:

  all_gather    y [n] -> gathered [world n] -> y = gathered[n/2 : n/2 + n] / 2
  psum_scatter  y [world n] -> s [n] -> y[:n] = s / 2 (in place)
  MoE combine   (y, pos, w, shared [T, H]) -> out [T / world, H] ->
                shared[:T / world] = out / 2

The slice is all_gather's input, psum_scatter's output (its input is world
times that) and the MoE combine's output per rank (H = 512, top-2, one
expert row per output row and one more).

Series (per configuration):

  all_gather                     jax_arx.all_gather, or jax.lax's
  psum_scatter                   jax_arx.psum_scatter, or jax.lax's
  moe_combine_psum_scatter       jax_arx.moe_combine_psum_scatter: the
                                 combine fused into the reduce-scatter
                                 (the moe_fused tuning: the fused kernel,
                                 where the plan would run the pair below)
  moe_combine + psum_scatter     the unfused pair: the combine in plain jax
                                 (jax_arx.moe_combine), then
                                 jax_arx.psum_scatter, or jax.lax's
  pinned_copy                    the floor: (world - 1) x the slice from GPU
                                 to pinned host memory and as much back at
                                 once, every rank together, through the CUDA
                                 driver (examples/pinned_copy.py): what a
                                 collective through host memory cannot beat

Configurations (--configs; default: every one but arx-tcp-ring and
arx-shm-proxy-1copy; all: every one). Each is a job of its own processes
(NCCL reads its environment once per process):

  arx-shm        jax_arx over the shm carrier, as it comes: inboxes in GPU
                 memory where every rank can map every peer's (NVLink here)
  arx-shm-host   the inboxes in pinned host memory (JAX_ARX_CUDA_PEER_MEMORY=0;
                 the GB10 path)
  arx-shm-proxy  through the proxy (JAX_ARX_CUDA_DIRECT=0), as over RoCE
  arx-shm-proxy-1copy  the same, the proxy thread copying alone (_tuning
                 shm_copy_threads=0: no copy helpers; not in the default)
  arx-tcp        the tcp carrier
  arx-shm-ring   the ring topology (JAX_ARX_TOPOLOGY=ring), over shm;
                 arx-tcp-ring over tcp (see bench_psum.py)
  nccl           jax.lax, NCCL as it comes (on --cpu: gloo)
  nccl-p2p-off   NCCL_P2P_DISABLE=1 (through host memory)
  floor          the pinned-copy floor (GPUs only)

The jax_arx series run with JAX_ARX_PREFILL_SLOT_BYTES = world x the
largest slice (at least its default) and JAX_ARX_FALLBACK=error, so a size
jax_arx would leave to jax.lax fails instead of timing jax.lax under
jax_arx's name; each endpoint pins 4 x that (in /dev/shm over shm: 1 GiB per
rank at 64 MB and world 4). Every cell is checked before it is timed: a
program of two calls, run --check-repeats times, every rank's result
against numpy (the gathered blocks; the fp32 sum in rank order starting from
rank 0's element, rounded once; the combined rows rounded once, then summed
so), bit for bit (jax.lax: within bf16 rounding). The JSON records what the
core planned and what the handlers ran (Endpoint.plan, Endpoint.stats()),
and each configuration's route (Endpoint.route).

Prints, per world: the table of the checks (a row per op and
configuration, a column per size: 'bulk' where jax_arx ran it, 'ok' for
jax.lax); unless --check, the per-call latencies and the ratios of the
targets (GPU inboxes at most 1.0 x NCCL; host inboxes at most 1.25 x the
floor); a summary of the checks. With --out DIR, it writes per world
bench_prefill.json (world 2) or bench_prefill_world{N}.json (_check before
the world for --check), and a plot of a timed run (.png, matplotlib). The
JSON's "results" are per configuration, per size, per series, in us. Exit
status 0 when every job ran and every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import bench_jobs as bj
import bench_report as report
import bench_worker as bw
from bench_common import combine_rows, pattern_bf16, pattern_bits, rank_order_sum, size_label

THIS = os.path.abspath(__file__)
MB = 1 << 20
SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [1 * MB, 16 * MB]  # --quick
CPU_SIZES = [16 << 10, 64 << 10]
HIDDEN, TOPK = 512, 2
GATHER, SCATTER, FUSED, UNFUSED, FLOOR = (
    "all_gather",
    "psum_scatter",
    "moe_combine_psum_scatter",
    "moe_combine + psum_scatter",
    "pinned_copy",
)
OPS = (GATHER, SCATTER, FUSED, UNFUSED)
PLANNED_OP = {
    GATHER: "all_gather",
    SCATTER: "psum_scatter",
    FUSED: "moe_combine_psum_scatter",
    UNFUSED: "psum_scatter",
}  # Endpoint.plan's name for what a series runs with jax_arx


def _fused(config):
    """A jax_arx configuration whose fused series times the fused kernel
    itself (the moe_fused tuning): by default the plan steps aside for the
    unfused pair (ffi/comm/plan.cc, plan_moe_combine), which the unfused
    series times."""
    return dict(config, tuning=dict(config["tuning"], moe_fused=1))


CONFIGS = {
    **{name: _fused(config) for name, config in bj.ARX_CONFIGS.items()},
    **bj.NCCL_CONFIGS,
    "floor": bj.floor_config(),
}
DEFAULT = [c for c in CONFIGS if c not in ("arx-tcp-ring", "arx-shm-proxy-1copy")]
RATIOS = [
    *(
        (f"{op}: jax_arx (GPU inboxes) over NCCL as it comes", ("arx-shm", op), ("nccl", op), 1.0)
        for op in (GATHER, SCATTER)
    ),
    *(
        (f"{op}: jax_arx with host inboxes over the pinned-copy floor", ("arx-shm-host", op), ("floor", FLOOR), 1.25)
        for op in (GATHER, SCATTER)
    ),
    *(
        (
            f"{op}: jax_arx with host inboxes over NCCL with P2P disabled",
            ("arx-shm-host", op),
            ("nccl-p2p-off", op),
            None,
        )
        for op in (GATHER, SCATTER)
    ),
    ("MoE combine: fused over the unfused pair, both jax_arx", ("arx-shm", FUSED), ("arx-shm", UNFUSED), None),
    ("MoE combine: fused (jax_arx) over the pair on jax.lax (NCCL)", ("arx-shm", FUSED), ("nccl", UNFUSED), None),
    (
        "MoE combine, host inboxes: fused over the unfused pair",
        ("arx-shm-host", FUSED),
        ("arx-shm-host", UNFUSED),
        None,
    ),
]


def arx_env(sizes, world):
    """The bulk envelope: world x the largest slice, at least the default."""
    from jax_arx.config import Config, size_setting

    return {"JAX_ARX_PREFILL_SLOT_BYTES": size_setting(max(Config().bulk_bytes, world * max(sizes)))}


# --- the inputs and references of one op and size ----------------------------------


class Case:
    """The inputs of ``op`` at a slice of ``nbytes`` (rank r's made by r's
    pattern, bench_common.pattern_bf16), and what rank i must get."""

    def __init__(self, op, nbytes, world):
        self.op, self.world, self.seed = op, world, OPS.index(op) * 1000 + nbytes.bit_length()
        self.n = nbytes // 2  # bf16 elements of a slice
        self.rows = self.n // HIDDEN  # MoE: output rows per rank
        self.tokens = world * self.rows
        self._memo = {}  # what a check asks for more than once

    def blocks(self):
        """(block shape, make(rank)) of each operand."""
        s, n, w = self.seed, self.n, self.world
        if self.op == GATHER:
            return [((n,), lambda r: pattern_bf16(s, r, 0, n))]
        if self.op == SCATTER:
            return [((w * n,), lambda r: pattern_bf16(s, r, 0, w * n))]
        R, T, H = self.rows + 1, self.tokens, HIDDEN
        return [
            ((R, H), lambda r: self.expert_rows(r)),
            ((T, TOPK), lambda r: self.pos(r, 0, T)),
            ((T, TOPK), lambda r: self.weights(r, 0, T)),
            ((T, H), lambda r: pattern_bf16(s + 3, r, 0, T * H).reshape(T, H)),
        ]

    def expert_rows(self, r):
        return pattern_bf16(self.seed, r, 0, (self.rows + 1) * HIDDEN).reshape(self.rows + 1, HIDDEN)

    def pos(self, r, t0, count):
        bits = pattern_bits(self.seed + 1, r, t0 * TOPK, count * TOPK)
        return (bits % np.uint64(self.rows + 1)).astype(np.int32).reshape(count, TOPK)

    def weights(self, r, t0, count):
        # k / 256: bfloat16-valued, so each product with a bfloat16 row is exact in float32.
        bits = pattern_bits(self.seed + 2, r, t0 * TOPK, count * TOPK)
        return (((bits >> np.uint64(40)) & np.uint64(255)).astype(np.float32) / 256).reshape(count, TOPK)

    def partials(self, i):
        """Every rank's part that rank i's result sums, [world, ...]."""
        s, n, w = self.seed, self.n, self.world
        if self.op == SCATTER:
            return np.stack([pattern_bf16(s, r, i * n, n) for r in range(w)])
        t0, rows = i * self.rows, self.rows
        return np.stack(
            [
                combine_rows(
                    self.expert_rows(r),
                    self.pos(r, t0, rows),
                    self.weights(r, t0, rows),
                    pattern_bf16(s + 3, r, t0 * HIDDEN, rows * HIDDEN).reshape(rows, HIDDEN),
                )
                for r in range(w)
            ]
        )

    def want(self, i):
        if ("want", i) not in self._memo:
            self._memo["want", i] = (
                np.concatenate([pattern_bf16(self.seed, r, 0, self.n) for r in range(self.world)])
                if self.op == GATHER
                else rank_order_sum(self.partials(i))
            )
        return self._memo["want", i]

    def tolerance(self, i):
        """jax.lax's result: within bf16 roundings of the partial sums."""
        if self.op == GATHER:
            return 0.0
        if ("tolerance", i) not in self._memo:
            self._memo["tolerance", i] = 2.0**-6 * rank_order_sum(np.abs(self.partials(i).astype(np.float32)))
        return self._memo["tolerance", i]


# --- the worker: one job, every configuration of it ------------------------------------


class Worker(bw.BenchWorker):
    configs = CONFIGS

    def arx(self, config, spec, run):
        self.phase(
            config,
            spec,
            arx_env(self.job["sizes"], self.world),
            run,
            config,
            lambda comm: self.series(config, self.jax_arx, comm),
        )

    def other(self, config, spec):
        if spec["kind"] == "floor":
            self.floor(config)
        else:
            self.series(config, self.jax.lax)

    def collective(self, op, lib):
        """op(*operands) -> this rank's result, with ``lib``'s collectives
        (jax_arx or jax.lax)."""
        from jax_arx import moe_combine

        if op == GATHER:
            return lambda y: lib.all_gather(y, bw.AXIS, tiled=True)
        if op == SCATTER:
            return lambda y: lib.psum_scatter(y, bw.AXIS, tiled=True)
        if op == FUSED:
            return lambda y, pos, w, shared: lib.moe_combine_psum_scatter(y, pos, w, shared, bw.AXIS)
        return lambda y, pos, w, shared: lib.psum_scatter(moe_combine(y, pos, w, shared), bw.AXIS, tiled=True)

    def series(self, config, lib, comm=None):
        """Every op and size with ``lib``'s collectives. ``comm``: jax_arx's
        communicator (None: jax.lax, whose sums are checked within
        rounding; it has no fused combine)."""
        ops = [op for op in self.job["ops"] if comm is not None or op != FUSED]
        for nbytes in self.job["sizes"]:
            for op in ops:
                case = Case(op, nbytes, self.world)
                if op in (FUSED, UNFUSED) and (case.n % HIDDEN or not case.rows):
                    self.rec.skip(config, nbytes, op, f"the MoE case needs a slice of a multiple of {2 * HIDDEN} bytes")
                    continue
                args = tuple(bw.sharded(self.jax, self.mesh, shape, make) for shape, make in case.blocks())
                exact = comm is not None or op == GATHER
                self.cell(
                    config,
                    op,
                    nbytes,
                    self.collective(op, lib),
                    args,
                    case.want,
                    comm=comm,
                    plan_op=PLANNED_OP[op],
                    tolerance=None if exact else case.tolerance,
                    chain=lambda c, op=op, case=case: self.chain(op, case, c),
                    baseline=f"{op} {nbytes}",
                    intended=lambda planned, ran: planned == "bulk" and set(ran) == {"bulk"},
                )
                del args

    def chain(self, op, case, call):
        """K dependent steps (the docstring's); call None: the same program
        without the collective."""
        lax, jnp, k = self.jax.lax, self.jax.numpy, self.job["k"]
        half = jnp.asarray(0.5, jnp.bfloat16)
        n, rows = case.n, case.rows

        def step(*a):
            if op == GATHER:
                y = a[0]
                return (y * half,) if call is None else (lax.dynamic_slice_in_dim(call(y), n // 2, n) * half,)
            varying = a[0] if op == SCATTER else a[3]
            part = varying[: rows if op != SCATTER else n] if call is None else call(*a)
            updated = lax.dynamic_update_slice_in_dim(varying, part * half, 0, axis=0)
            return (updated,) if op == SCATTER else (*a[:3], updated)

        def body(*a):
            for _ in range(k):
                a = lax.optimization_barrier(step(*a))
            return a[-1]

        return self.smap(body, len(case.blocks()))

    def floor(self, config):
        from pinned_copy import PinnedCopy

        samples, reps = self.job["samples"], self.job["reps"]
        for nbytes in self.job["sizes"]:
            each_way = (self.world - 1) * nbytes
            with PinnedCopy(each_way) as copy:
                copy.run()  # warm up
                copy.wait()
                per_run = []
                for _ in range(samples):
                    self.ex.barrier()  # every rank at once
                    t = time.perf_counter()
                    for _ in range(reps):
                        copy.run()
                    copy.wait()
                    per_run.append((time.perf_counter() - t) / reps)
            us = float(np.median(per_run)) * 1e6
            slowest = self.ex.gather(us)  # the floor of a collective is its slowest rank's
            if slowest is not None:
                self.rec.time(config, nbytes, FLOOR, max(slowest))
                print(
                    f"{config} {FLOOR} {size_label(nbytes)}: {size_label(each_way)} each way, "
                    f"{max(slowest):.1f} us (ranks: {', '.join(f'{v:.1f}' for v in slowest)})",
                    flush=True,
                )


# --- the driver ---------------------------------------------------------------------------


def table_rows(doc, names, ops):
    rows = [(config, op, f"{op} | {config}") for op in ops for config in names if CONFIGS[config]["kind"] != "floor"]
    rows += [(config, FLOOR, f"{FLOOR} | {config}") for config in names if CONFIGS[config]["kind"] == "floor"]
    return [
        r
        for r in rows
        if any(r[1] in cells for part in ("results", "checks") for cells in doc[part].get(r[0], {}).values())
    ]


def plot(doc, rows, path, title):
    def style(config, series):
        return ":" if series == FLOOR else "-" if CONFIGS[config]["kind"] == "arx" else "--"

    floors = [(c, s, c, style(c, s)) for c, s, _ in rows if s == FLOOR]
    panels = [
        (op, [(c, s, c, style(c, s)) for c, s, _ in rows if s == op] + floors)
        for op in OPS
        if any(s == op for _, s, _ in rows)
    ]
    report.plot_latencies(doc, panels, doc["meta"]["sizes"], path, title, "slice per rank (bf16)")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bj.add_arguments(
        ap,
        f"configurations (default {','.join(DEFAULT)}; all: every one of {','.join(CONFIGS)})",
        "slices per rank, e.g. 1MB,4MB,16MB,64MB (the default; --quick: 1 and 16 MB; --cpu: 16 and 64 KB)",
    )
    ap.add_argument("--ops", default=",".join(OPS), help="series of each configuration (of the docstring's)")
    ap.add_argument("--quick", action="store_true", help="1 and 16 MB (unless --sizes), K 8, 5 samples of 3")
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.k = args.k or (8 if args.quick or args.cpu else 16)
    args.samples = args.samples or (1 if args.check_only else 5 if args.quick or args.cpu else 7)
    args.reps = args.reps or (1 if args.check_only else 3)
    bj.finish_arguments(ap, args, CONFIGS, DEFAULT, CPU_SIZES if args.cpu else QUICK_SIZES if args.quick else SIZES)
    args.ops = bj.parse_series(ap, args.ops, OPS, "--ops")
    return args


def bench(args, world):
    return dict(
        name="prefill",
        script=THIS,
        configs=CONFIGS,
        job=dict(ops=args.ops),
        meta=dict(ops=args.ops, hidden=HIDDEN, topk=TOPK, arx_env=arx_env(args.sizes, world)),
        rows=lambda doc: table_rows(doc, args.names, args.ops),
        ratios=RATIOS,
        plot=plot,
        label_width=44,
    )


if __name__ == "__main__":
    sys.exit(bj.main(parse_args, Worker, bench, sys.argv[1:]))
