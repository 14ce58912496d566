"""Per-call latency of jax_arx.psum_add_norm against the unfused decode step
it replaces (jax_arx.psum, then the residual add and the norm in jax):
N processes (--world, default 2), one rank each, rows of hidden size 4096
bf16, 1 to 64 rows (8 KB to 512 KB per call), every result checked before
it is timed.

    # Timed on GPUs (on one GPU, start CUDA MPS first): tables, JSON and plot
    python examples/bench_norm.py --out bench_out
    # Checked only, no timing, at world 2, 3 and 4
    python examples/bench_norm.py --check --world 2,3,4
    # The CPU backend at 1 and 4 rows (a win is not required there)
    python examples/bench_norm.py --cpu --out bench_out

Ranks, jobs, the options shared with examples/bench_psum.py (--world,
--configs, --sizes, --check, --k, --samples, --reps, --out, --cpu,
--timeout, --max-seconds), what the tables show and the JSON holds: as
there. Sizes are the bytes of one call's partial, whole rows of 4096 bf16
(8KB = 1 row).

Configurations (--configs; default: arx-shm, arx-shm-host, arx-shm-proxy,
arx-tcp, floor; all: every one), bench_psum.py's: arx-shm (GPU inboxes
where every rank maps every peer's), arx-shm-host (inboxes in pinned host
memory, JAX_ARX_CUDA_PEER_MEMORY=0), arx-shm-proxy (through the proxy,
JAX_ARX_CUDA_DIRECT=0, the verbs route's steps), arx-tcp, arx-shm-ring,
arx-tcp-ring, and floor (the proxy route's floor: a word from a host thread
to a kernel and back through mapped host memory, rank 0, GPUs only). Each
jax_arx configuration runs with the slot and send buffer raised just enough
for the largest size (bench_psum.py's "jax_arx.psum" series: the library
picks LL, the one-shot or the two-shot) and JAX_ARX_FALLBACK=error.

Series, per jax_arx configuration:

  psum_add_norm       (normed, hidden) = jax_arx.psum_add_norm(x, residual,
                      weight, kind=--kind): one collective, the norm in its
                      epilogue
  psum + add + norm   jax_arx.psum(x), + residual, then the norm in jax
                      (float32, XLA's own fusion)
  psum + add          jax_arx.psum(x) + residual alone, no norm: what a
                      fused call costs if its norm were free, so the
                      least its ratio to the unfused step can be

Method (bench_common.median_seconds): K dependent steps in one jitted
program, each step's partial the previous step's normed / 2 and its
residual the previous hidden, minus the same program without the
collective (normed = x, hidden = residual), over K; the median of
--samples samples of --reps runs back to back.

Checks, every cell on every rank before it is timed: hidden bit for bit
against numpy (the fp32 sum in rank order rounded once, plus the residual
rounded once); normed against the formula in float64, within half an ulp
of bf16 plus 4 float32 ulps of the row's largest value for the fused call
(its contract), 2^-7 of it for the unfused one (XLA may norm the float32
sum before it is rounded to bf16).

Prints, per world, the table of the checks, the latencies (us per call),
and the ratios: fused over unfused per configuration (target: at most 0.7
on GPUs), psum + add over unfused (the least that ratio can be), and the
proxy route over the floor. With --out DIR, writes
bench_norm.json (world 2) or bench_norm_world{N}.json (_check before the
world for --check) and a plot of a timed run. Exit status 0 when every job
ran and every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import bench_jobs as bj
import bench_psum
import bench_report as report
import bench_worker as bw
from bench_common import rank_order_sum

THIS = os.path.abspath(__file__)
HIDDEN = 4096
ROW_BYTES = HIDDEN * 2  # bf16
SIZES = [ROW_BYTES * r for r in (1, 4, 16, 64)]
CPU_SIZES = [ROW_BYTES * r for r in (1, 4)]
EPS = 1e-6
FUSED, UNFUSED, BOUND, FLOOR = "psum_add_norm", "psum + add + norm", "psum + add", bench_psum.FLOOR
SERIES = (FUSED, UNFUSED, BOUND)
# The fused series times the fused kernels themselves (the norm_fused
# tuning): by default the plan steps aside for psum then the add and the
# norm in jax (ffi/comm/plan.cc, plan_add_norm), which the unfused series
# times.
CONFIGS = {
    **{name: dict(c, tuning=dict(c["tuning"], norm_fused=1)) for name, c in bj.ARX_CONFIGS.items()},
    "floor": bj.floor_config(),
}
DEFAULT = ("arx-shm", "arx-shm-host", "arx-shm-proxy", "arx-tcp", "floor")
RATIOS = [
    *(
        (f"{c}: psum_add_norm over psum + add + norm", (c, FUSED), (c, UNFUSED), 0.7)
        for c in ("arx-shm", "arx-shm-host", "arx-shm-proxy")
    ),
    ("arx-tcp: psum_add_norm over psum + add + norm", ("arx-tcp", FUSED), ("arx-tcp", UNFUSED), None),
    *(
        (f"{c}: psum + add over psum + add + norm", (c, BOUND), (c, UNFUSED), None)
        for c in ("arx-shm", "arx-shm-host", "arx-shm-proxy")
    ),
    ("proxy route: psum_add_norm over the pinned round trip", ("arx-shm-proxy", FUSED), ("floor", FLOOR), None),
]
# The tolerance of normed, in float32 ulps of the row's largest |value|
# (see the docstring): the fused call's contract, and the unfused formula's.
ROW_ULPS = {FUSED: 4, UNFUSED: 2**16}


def normed_f64(hidden, weight, kind):
    """The norm of ``hidden`` (as stored) in float64, per row."""
    h = hidden.astype(np.float64)
    d = h - h.mean(-1, keepdims=True) if kind == "layer" else h
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + float(np.float32(EPS))) * weight.astype(np.float64)


class Case:
    """The inputs of one size (rows of HIDDEN) and what every rank must get:
    rank r's partial, the residual and the weight (the same on every rank),
    and the reference (normed in float64, hidden as stored)."""

    def __init__(self, nbytes, world, kind):
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
        self.rows = nbytes // ROW_BYTES
        rng = np.random.default_rng(self.rows)
        self.parts = [rng.standard_normal((self.rows, HIDDEN)).astype(bf16) for _ in range(world)]
        self.residual = rng.standard_normal((self.rows, HIDDEN)).astype(bf16)
        self.weight = (1 + 0.1 * rng.standard_normal((1, HIDDEN))).astype(bf16)
        summed = rank_order_sum(np.stack(self.parts)).astype(np.float32)
        self.hidden = (summed + self.residual.astype(np.float32)).astype(bf16)
        self.normed = normed_f64(self.hidden, self.weight[0], kind)

    def want(self, series):
        """The call's result as the cell sees it: normed rows (hidden again
        for the series without a norm), then hidden rows."""
        first = self.hidden.astype(np.float64) if series == BOUND else self.normed
        return np.concatenate([first, self.hidden.astype(np.float64)])

    def tolerance(self, series):
        """Per element of want(series): normed's tolerance (the docstring's),
        0 for hidden."""
        if series == BOUND:
            return np.zeros((2 * self.rows, HIDDEN))
        ulp = np.spacing(np.abs(self.normed).astype(self.hidden.dtype)).astype(np.float64)
        row = ROW_ULPS[series] * 2.0**-23 * np.abs(self.normed).max(-1, keepdims=True)
        return np.concatenate([0.5 * ulp + row, np.zeros(self.hidden.shape)])


class Worker(bw.BenchWorker):
    configs = CONFIGS

    def arx(self, config, spec, run):
        host = not self.job["cpu"] and spec["env"].get("JAX_ARX_CUDA_PEER_MEMORY") == "0"
        env = bench_psum.algorithm_env("jax_arx.psum", max(self.job["sizes"]), self.world, host_inboxes=host)
        self.phase(config, spec, env, run, config, lambda comm: self.series(config, comm))

    def other(self, config, spec):
        bench_psum.Worker.floor(self, config)  # the same floor as bench_psum.py's

    def steps(self):
        """{series: step(x, residual, weight) -> (normed, hidden)}."""
        jax, jnp, kind = self.jax, self.jax.numpy, self.job["kind"]

        def fused(x, r, w):
            return self.jax_arx.psum_add_norm(x, r, w, bw.AXIS, kind=kind, eps=EPS)

        def unfused(x, r, w):
            h = self.jax_arx.psum(x, bw.AXIS) + r
            f = h.astype(jnp.float32)
            if kind == "layer":
                f = f - jnp.mean(f, -1, keepdims=True)
            y = f * jax.lax.rsqrt(jnp.mean(f * f, -1, keepdims=True) + EPS) * w.astype(jnp.float32)
            return y.astype(h.dtype), h

        def bound(x, r, w):
            h = self.jax_arx.psum(x, bw.AXIS) + r
            return h, h

        return {FUSED: fused, UNFUSED: unfused, BOUND: bound}

    def series(self, config, comm):
        jnp = self.jax.numpy
        for nbytes in self.job["sizes"]:
            case = Case(nbytes, self.world, self.job["kind"])
            args = (
                bw.sharded(self.jax, self.mesh, (case.rows, HIDDEN), lambda r, c=case: c.parts[r]),
                bw.sharded(self.jax, self.mesh, (case.rows, HIDDEN), lambda r, c=case: c.residual),
                bw.sharded(self.jax, self.mesh, (1, HIDDEN), lambda r, c=case: c.weight),
            )
            for name, step in self.steps().items():

                def call(x, r, w, step=step):
                    return jnp.concatenate(step(x, r, w[0]))

                tol = case.tolerance(name)
                self.cell(
                    config,
                    name,
                    nbytes,
                    call,
                    args,
                    lambda rank, c=case, n=name: c.want(n),
                    comm=comm,
                    plan_op="psum",
                    tolerance=lambda rank, t=tol: t,
                    chain=lambda c, step=step: self.chain(None if c is None else step),
                    baseline=f"chain {nbytes}",
                    intended=lambda planned, ran: bool(ran) and set(ran) <= {"ll", "one_shot", "two_shot"},
                )

    def chain(self, step):
        """K dependent steps (the docstring's); step None: the same program
        without the collective."""
        lax, jnp, k = self.jax.lax, self.jax.numpy, self.job["k"]
        half = jnp.asarray(0.5, jnp.bfloat16)

        def body(x, r, w):
            for _ in range(k):
                n, r = (x, r) if step is None else step(x, r, w[0])
                x, r = lax.optimization_barrier((n * half, r))
            return x

        return self.smap(body, 3)


def table_rows(doc, names):
    rows = []
    for config in names:
        if CONFIGS[config]["kind"] == "floor":
            rows.append((config, FLOOR, f"{config}: {FLOOR}"))
        else:
            rows += [(config, s, f"{config} {s}") for s in SERIES]
    return [r for r in rows if r[0] in doc["results"] or r[0] in doc["checks"]]


def plot(doc, rows, path, title):
    style = {FUSED: "-", FLOOR: ":", BOUND: "-."}
    lines = [(c, s, label, style.get(s, "--")) for c, s, label in rows]
    report.plot_latencies(
        doc,
        [("psum + residual + norm", lines)],
        doc["meta"]["sizes"],
        path,
        title,
        "partial per rank (bf16 rows of 4096)",
    )


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bj.add_arguments(
        ap,
        f"configurations (default {','.join(DEFAULT)}; all: every one)",
        "partials per rank, whole rows of 8KB, e.g. 8KB,512KB (default 1, 4, 16 and 64 rows; --cpu: 1 and 4)",
    )
    ap.add_argument("--kind", default="rms", choices=("rms", "layer"), help="the norm (default rms)")
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.k, args.samples, args.reps = args.k or 32, args.samples or 9, args.reps or 5
    bj.finish_arguments(ap, args, CONFIGS, DEFAULT, CPU_SIZES if args.cpu else SIZES)
    if any(s % ROW_BYTES for s in args.sizes):
        ap.error(f"--sizes: whole rows of {HIDDEN} bf16, multiples of {ROW_BYTES} bytes (8KB)")
    return args


def bench(args, world):
    return dict(
        name="norm",
        script=THIS,
        configs=CONFIGS,
        job=dict(kind=args.kind),
        meta=dict(kind=args.kind, hidden=HIDDEN, eps=EPS, series=list(SERIES)),
        rows=lambda doc: table_rows(doc, args.names),
        ratios=RATIOS,
        plot=plot,
        label_width=36,
    )


if __name__ == "__main__":
    sys.exit(bj.main(parse_args, Worker, bench, sys.argv[1:]))
