"""Per-call latency of jax_arx.psum against jax.lax.psum (NCCL, and XLA's own
one-shot all-reduce kernel), by size, for every algorithm jax_arx picks:
N processes (--world, default 2), one rank each, bf16, 8 KB to 4 MB, every
result checked before it is timed.

    # Timed, 2 GPUs: the tables; the JSON and a plot into bench_out/
    python examples/bench_psum.py --out bench_out
    # Checked only, no timing, at world 2, 3 and 4; exit status 1 on any
    # mismatch. With fewer GPUs than ranks the ranks share them (and the
    # jax.lax series are skipped: NCCL refuses two ranks on one GPU)
    python examples/bench_psum.py --check --world 2,3,4
    # The CPU backend at small sizes (tests/test_bench_cpu.py runs this)
    python examples/bench_psum.py --cpu --check

Ranks: rank r runs on GPU r % G of the G GPUs there are. A timed run whose
ranks share a GPU says so. Under CUDA MPS (its control daemon running) the
ranks' kernels run at the same time, so every route that needs no NVLink
(host inboxes, the proxy, tcp, GPU inboxes on one device) is timed as it
runs, against the floor measured in the same run; without MPS the GPU
time-slices between the processes and the times mean nothing.

Method (bench_common.median_seconds): K dependent calls inside one jitted
program, each scaled by 1/world behind an optimization barrier, minus the
same program without the collective, divided by K; each sample runs the
program --reps times back to back (so the ranks' start skew is spread thin)
and the median of --samples samples is kept.

Configurations (--configs; default: the first five and every jax.lax one;
``all``: every one). Each is a job of its own processes (NCCL and XLA read
their environment once per process; --check runs those that need no
environment of their own in one job), in this order:

  arx-shm           jax_arx over the shm carrier, as it comes: the kernels
                    write the peers' inboxes themselves, in GPU memory where
                    every rank can map every peer's (NVLink here)
  arx-shm-host      the inboxes in pinned host memory
                    (JAX_ARX_CUDA_PEER_MEMORY=0; the GB10 path)
  arx-shm-proxy     the kernels publish and the proxy copies
                    (JAX_ARX_CUDA_DIRECT=0), as over tcp or verbs
  arx-shm-proxy-1copy  the same, the proxy thread copying alone (_tuning
                    shm_copy_threads=0: no copy helpers)
  arx-tcp           the tcp carrier
  arx-shm-ring      the ring topology (JAX_ARX_TOPOLOGY=ring: links to the
                    previous and next rank only, relays at world 4; through
                    the proxy); arx-tcp-ring over tcp. Skipped, saying so,
                    by a jax_arx without that setting
  arx-shm-noll      no LL one-shot (_tuning cuda_ll_max_bytes=0);
                    arx-shm-proxy-noll through the proxy
  arx-shm-ll32k     LL up to 32 KiB (ll64k: 64 KiB); with arx-shm and
                    arx-shm-noll, what the LL limit is chosen from
  arx-shm-piece4k   one-shot pieces of 4 KiB (_tuning cuda_chunk_bytes;
                    8k, 16k, 32k, 64k): what the piece sizes are chosen from
  arx-shm-proxy-piece8k  the same through the proxy (16k, 32k)
  floor             the proxy route's floor: a word from a host thread to
                    a kernel and back through mapped host memory (rank 0,
                    jax_arx._core.pinned_round_trip; GPUs only)
  nccl              jax.lax.psum, NCCL as it comes (on --cpu: gloo)
  nccl-p2p-off      NCCL_P2P_DISABLE=1 (through host memory)
  nccl-socket       NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
  xla-oneshot       jax.lax.psum with XLA_FLAGS=--xla_gpu_unsupported_use_
                    all_reduce_one_shot_kernel=true (up to XLA's size limit;
                    XLA decides at run time, and its log lines about the
                    choice are kept in the JSON, "logged")
  xla-oneshot-1proc the same with one process driving the world's GPUs: the
                    layout XLA's kernel is written for (one host, peer access)

Each jax_arx configuration runs three algorithm series (--algorithms), each
in its own jax_arx.initialize() within the job:

  jax_arx.psum  jax_arx's own choice (ffi/comm/plan.cc): LL, one-shot in
                pieces, or two-shot, at the default one-shot limit; the
                slot and send buffer raised just enough for the largest
                size to run (world x slot >= it, for the two-shot), as its
                message asks
  one-shot      the slot and JAX_ARX_ONESHOT_MAX_BYTES raised to the
                largest size: one-shot at every size (LL where the plan
                takes it), over GPU host inboxes too (their default limit
                is 128 KiB)
  two-shot      JAX_ARX_ONESHOT_MAX_BYTES=16: two-shot at every size (GPUs
                only: the CPU has no two-shot, and says so)

With --pause S (timed runs only), each series also times, at its smallest
size, one jitted call's wall time, dispatch included: warm (": one call"),
and as the first call after every rank slept S seconds alike, a barrier
before the sleep (": one call after S s"): the GPU, the host and the proxy
waking up. Each is the median of PAUSE_SAMPLES, the slowest rank's.

The settings of a series are its own: the JAX_ARX_* variables that define
series are dropped from the environment the jobs inherit, and every jax_arx
series runs with JAX_ARX_FALLBACK=error, so a size jax_arx would leave to
jax.lax fails instead of timing jax.lax under jax_arx's name.

Every cell is checked before it is timed: a program of two calls, run
--check-repeats times, every rank's results against the fp32 sum in rank
order starting from rank 0's element, rounded once, bit for bit (jax.lax:
within bf16 rounding of it). The JSON records, per cell, whether it was
("exact" / "close"), what the core planned (Endpoint.plan) and which
algorithms the handlers ran (Endpoint.stats()), "as_intended" when they are
what the series asked for; per configuration, the route of its endpoints
(Endpoint.route: 'proxy', 'direct', 'direct, GPU inboxes').

Prints, per world: a line per cell as it runs; the table of the checks (a
row per configuration and series, a column per size: the algorithm
planned and run, 'LL', '1-shot/4' for 4 pieces, '2-shot'; 'ok' for
jax.lax; 'skip' where it did not run); unless --check, the latency table
(us per call) and the ratios of jax_arx to the baselines (target: at most
0.5 x NCCL); then a summary of the checks. In the tables '!' marks a
result that was not the reference, '?' an algorithm the series did not ask
for. With --out DIR, it writes per world bench_psum.json (world 2) or
bench_psum_world{N}.json, _check before the world for --check
(bench_psum_check_world3.json), and a plot of a timed run (.png,
matplotlib). The JSON's "results" are per configuration, per size, per
series, in us. Exit status 0 when every job ran and every check passed, 1
otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import bench_jobs as bj
import bench_report as report
import bench_worker as bw
from bench_common import pattern_bf16, rank_order_sum

THIS = os.path.abspath(__file__)
SIZES = [8 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]
CPU_SIZES = [8 << 10, 64 << 10]
SEED = 1
PAUSE_SAMPLES = 5
XLA_ONESHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
XLA_WATCH = r"(?i)collective kernel|one.?shot"
CONFIGS = {
    **bj.ARX_CONFIGS,
    "arx-shm-noll": bj.arx_config(bj.SHM, {"cuda_ll_max_bytes": 0}, gpu_only=True),
    "arx-shm-ll32k": bj.arx_config(bj.SHM, {"cuda_ll_max_bytes": 32 << 10}, gpu_only=True),
    "arx-shm-ll64k": bj.arx_config(bj.SHM, {"cuda_ll_max_bytes": 64 << 10}, gpu_only=True),
    "arx-shm-proxy-noll": bj.arx_config(dict(bj.SHM, JAX_ARX_CUDA_DIRECT="0"), {"cuda_ll_max_bytes": 0}, gpu_only=True),
    **{
        f"arx-shm-piece{k}k": bj.arx_config(bj.SHM, {"cuda_chunk_bytes": k << 10}, gpu_only=True)
        for k in (4, 8, 16, 32, 64)
    },
    **{
        f"arx-shm-proxy-piece{k}k": bj.arx_config(
            dict(bj.SHM, JAX_ARX_CUDA_DIRECT="0"), {"cuda_chunk_bytes": k << 10}, gpu_only=True
        )
        for k in (8, 16, 32)
    },
    "floor": bj.floor_config(),
    **bj.NCCL_CONFIGS,
    "nccl-socket": bj.lax_config(
        {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}, gpu_only=True
    ),
    "xla-oneshot": bj.lax_config({"XLA_FLAGS": XLA_ONESHOT}, gpu_only=True, watch=XLA_WATCH),
    "xla-oneshot-1proc": bj.lax_config({"XLA_FLAGS": XLA_ONESHOT}, gpu_only=True, one_process=True, watch=XLA_WATCH),
}
DEFAULT = (
    "arx-shm",
    "arx-shm-host",
    "arx-shm-proxy",
    "arx-tcp",
    "arx-shm-ring",
    "floor",
    "nccl",
    "nccl-p2p-off",
    "nccl-socket",
    "xla-oneshot",
    "xla-oneshot-1proc",
)
ALGORITHMS = ("jax_arx.psum", "one-shot", "two-shot")
# What each algorithm series may run (stats' names), and the LL ceiling a
# configuration sets: a cell that ran anything else is not "as_intended".
ALLOWED = {"jax_arx.psum": {"ll", "one_shot", "two_shot"}, "one-shot": {"ll", "one_shot"}, "two-shot": {"two_shot"}}
LL_CEILING = {"arx-shm-noll": 0, "arx-shm-proxy-noll": 0, "arx-shm-ll32k": 32 << 10, "arx-shm-ll64k": 64 << 10}
LAX = "jax.lax.psum"
FLOOR = "pinned round trip"
RATIOS = [
    (
        "proxy route over the pinned round trip (target: <= 4 at 8 KB)",
        ("arx-shm-proxy", "jax_arx.psum"),
        ("floor", FLOOR),
        None,
    ),
    ("host inboxes over the pinned round trip", ("arx-shm-host", "jax_arx.psum"), ("floor", FLOOR), None),
    ("jax_arx.psum over NCCL as it comes", ("arx-shm", "jax_arx.psum"), ("nccl", LAX), 0.5),
    ("jax_arx.psum over XLA's one-shot kernel", ("arx-shm", "jax_arx.psum"), ("xla-oneshot", LAX), None),
    (
        "jax_arx.psum over XLA's one-shot kernel, one process",
        ("arx-shm", "jax_arx.psum"),
        ("xla-oneshot-1proc", LAX),
        None,
    ),
    (
        "host inboxes: jax_arx.psum over NCCL with P2P disabled",
        ("arx-shm-host", "jax_arx.psum"),
        ("nccl-p2p-off", LAX),
        None,
    ),
    ("two-shot over one-shot (below 1: two-shot is faster)", ("arx-shm", "two-shot"), ("arx-shm", "one-shot"), None),
    ("host inboxes: two-shot over one-shot", ("arx-shm-host", "two-shot"), ("arx-shm-host", "one-shot"), None),
]


# The library's one-shot limit on GPU host inboxes when JAX_ARX_ONESHOT_MAX_BYTES
# is unset (ffi/comm/plan.cc, kOneShotMaxHostInboxes).
HOST_INBOX_ONESHOT_MAX = 128 << 10


def algorithm_env(algorithm, max_bytes, world, host_inboxes=False):
    """The JAX_ARX_* settings of an algorithm series (see the docstring),
    with room for partials of ``max_bytes``: jax_arx.psum keeps the default
    one-shot limit (``host_inboxes``: the configuration's inboxes are in
    pinned host memory, where that limit is lower), so that it runs what
    the library picks."""
    from jax_arx.config import Config, size_setting

    d = Config()
    if algorithm == "one-shot":
        slot = max(d.slot_bytes, max_bytes)
        send = max(d.send_bytes, slot)
    else:  # the two-shot stages a partial whole, and each rank's part fills at most a slot
        slot = max(d.slot_bytes, -(-max_bytes // world))
        send = max(d.send_bytes, max_bytes)
    env = {"JAX_ARX_SLOT_BYTES": size_setting(slot), "JAX_ARX_SEND_BYTES": size_setting(send)}
    if algorithm == "one-shot":
        env["JAX_ARX_ONESHOT_MAX_BYTES"] = size_setting(slot)
    elif algorithm == "two-shot":
        env["JAX_ARX_ONESHOT_MAX_BYTES"] = "16"
    elif algorithm == "jax_arx.psum" and slot > d.slot_bytes:
        env["JAX_ARX_ONESHOT_MAX_BYTES"] = size_setting(
            min(d.slot_bytes, HOST_INBOX_ONESHOT_MAX) if host_inboxes else d.slot_bytes
        )
    return env


def as_intended(config, algorithm, nbytes, planned, ran):
    """Whether a cell of series ``algorithm`` ran what it asks for: the
    planned algorithm, one the series allows, and LL only up to the
    configuration's ceiling."""
    allowed = set(ALLOWED[algorithm])
    if nbytes > LL_CEILING.get(config, nbytes):
        allowed.discard("ll")
    return planned in allowed and set(ran) == {planned}


# --- the worker: one job, every configuration of it --------------------------------


class Worker(bw.BenchWorker):
    configs = CONFIGS

    def __init__(self, job):
        super().__init__(job)
        self._inputs = {}

    def arx(self, config, spec, run):
        for algorithm in self.job["algorithms"]:
            if algorithm == "two-shot" and self.job["cpu"]:
                for nbytes in self.job["sizes"]:
                    self.rec.skip(config, nbytes, algorithm, "the CPU backend has no two-shot")
                continue
            host = not self.job["cpu"] and spec["env"].get("JAX_ARX_CUDA_PEER_MEMORY") == "0"
            env = algorithm_env(algorithm, max(self.job["sizes"]), self.world, host_inboxes=host)
            self.phase(
                config,
                spec,
                env,
                run,
                f"{config} {algorithm}",
                lambda comm, a=algorithm: self.series(config, a, lambda y: self.jax_arx.psum(y, bw.AXIS), comm),
            )

    def other(self, config, spec):
        if spec["kind"] == "floor":
            self.floor(config)
        else:
            self.series(config, LAX, lambda y: self.jax.lax.psum(y, bw.AXIS))

    def floor(self, config):
        """The proxy route's floor, in the same run: a word from a host thread
        to a kernel and back through mapped host memory (the median of 2000
        round trips, jax_arx._core.pinned_round_trip), measured by rank 0
        while the others wait; the same for every size."""
        from jax_arx import _core

        self.ex.barrier()
        if self.rank0:
            rtt = _core.pinned_round_trip(0)
            for nbytes in self.job["sizes"]:
                self.rec.time(config, nbytes, FLOOR, rtt["median_us"])
            self.rec.run(config)["round_trip_us"] = {k: rtt[k] for k in ("min_us", "median_us")}
            print(f"{config} {FLOOR}: median {rtt['median_us']:.2f} us, least {rtt['min_us']:.2f} us", flush=True)
        self.ex.barrier()

    def series(self, config, series, call, comm=None):
        """Every size of one series. ``comm``: jax_arx's communicator
        (None: jax.lax, checked within rounding)."""
        for nbytes in self.job["sizes"]:
            x, want, tolerance = self.inputs(nbytes)
            self.cell(
                config,
                series,
                nbytes,
                call,
                (x,),
                lambda rank, w=want: w,
                comm=comm,
                plan_op="psum",
                tolerance=None if comm is not None else lambda rank, t=tolerance: t,
                chain=self.chain,
                baseline=nbytes,
                intended=lambda planned, ran, n=nbytes: as_intended(config, series, n, planned, ran),
            )
        if self.job.get("pause") and not self.job["check_only"]:
            self.one_call(config, series, call, min(self.job["sizes"]))

    def one_call(self, config, series, call, nbytes):
        """--pause: one jitted call's wall time, dispatch and the wait for
        its result included, warm and then as the first call after every
        rank slept --pause seconds (a barrier first, so they sleep alike);
        the median of PAUSE_SAMPLES each, the slowest rank's."""
        import time

        x = self.inputs(nbytes)[0]
        f = self.smap(call)
        f(x).block_until_ready()
        figures = []
        for pause in (0, self.job["pause"]):
            times = []
            for _ in range(PAUSE_SAMPLES):
                self.ex.barrier()
                time.sleep(pause)
                t0 = time.perf_counter()
                f(x).block_until_ready()
                times.append((time.perf_counter() - t0) * 1e6)
            figures.append(float(np.median(times)))
        views = self.ex.gather(figures)
        if views is None:
            return
        for name, us in zip(pause_series(series, self.job["pause"]), np.max(views, axis=0), strict=True):
            self.rec.time(config, nbytes, name, float(us))
            print(f"{config} {name} {nbytes >> 10} KB: {us:.1f} us", flush=True)
        self.rec.write()

    def inputs(self, nbytes):
        """The sharded input of a size, the reference sum (the same on every
        rank) and the tolerance of jax.lax's result (bf16 roundings of the
        partial sums)."""
        if nbytes not in self._inputs:
            n = nbytes // 2
            x = bw.sharded(self.jax, self.mesh, (n,), lambda r: pattern_bf16(SEED, r, 0, n))
            parts = np.stack([pattern_bf16(SEED, r, 0, n) for r in range(self.world)])
            tolerance = 2.0**-6 * rank_order_sum(np.abs(parts.astype(np.float32)))
            self._inputs[nbytes] = (x, rank_order_sum(parts), tolerance)
        return self._inputs[nbytes]

    def chain(self, call):
        """K dependent calls (bench_common's method), each scaled by
        1/world; call None: the same program without them."""
        jnp, k = self.jax.numpy, self.job["k"]
        scale = jnp.asarray(1.0 / self.world, jnp.bfloat16)

        def body(y):
            for _ in range(k):
                y = self.jax.lax.optimization_barrier((y if call is None else call(y)) * scale)
            return y

        return self.smap(body)


# --- the driver ------------------------------------------------------------------------


def pause_series(series, pause):
    """The --pause figures' series names: warm, and after the pause."""
    return f"{series}: one call", f"{series}: one call after {pause:g} s"


def table_rows(doc, names, algorithms, pause=0):
    rows = []
    for config in names:
        if CONFIGS[config]["kind"] == "arx":
            rows += [(config, a, f"{config} {a}") for a in algorithms]
            if pause:
                rows += [(config, s, f"{config} {s}") for a in algorithms for s in pause_series(a, pause)]
        elif CONFIGS[config]["kind"] == "floor":
            rows.append((config, FLOOR, f"{config}: {FLOOR}"))
        else:
            rows.append((config, LAX, config))
            if pause and CONFIGS[config]["kind"] != "floor":
                rows += [(config, s, f"{config} {s}") for s in pause_series(LAX, pause)]
    return [r for r in rows if r[0] in doc["results"] or r[0] in doc["checks"]]


def plot(doc, rows, path, title):
    lines = [(c, s, label, "-" if CONFIGS[c]["kind"] == "arx" else "--") for c, s, label in rows]
    report.plot_latencies(doc, [("psum", lines)], doc["meta"]["sizes"], path, title, "partial per rank (bf16)")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bj.add_arguments(
        ap,
        f"configurations (default {','.join(DEFAULT)}; all: every one)",
        "partials per rank, e.g. 8KB,4MB (default 8 KB to 4 MB; --cpu: 8 and 64 KB)",
    )
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="series of each jax_arx configuration")
    ap.add_argument(
        "--pause",
        type=float,
        default=0,
        help="also time one call, warm and after every rank slept this many seconds (0: not)",
    )
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.k, args.samples, args.reps = args.k or 32, args.samples or 9, args.reps or 5
    bj.finish_arguments(ap, args, CONFIGS, DEFAULT, CPU_SIZES if args.cpu else SIZES)
    args.algorithms = bj.parse_series(ap, args.algorithms, ALGORITHMS, "--algorithms")
    if args.pause < 0:
        ap.error("--pause must be at least 0")
    return args


def bench(args, world):
    return dict(
        name="psum",
        script=THIS,
        configs=CONFIGS,
        job=dict(algorithms=args.algorithms, pause=args.pause),
        meta=dict(algorithms={a: algorithm_env(a, max(args.sizes), world) for a in args.algorithms}),
        rows=lambda doc: table_rows(doc, args.names, args.algorithms, args.pause),
        ratios=RATIOS,
        plot=plot,
        label_width=30,
    )


if __name__ == "__main__":
    sys.exit(bj.main(parse_args, Worker, bench, sys.argv[1:]))
