"""The driver side of examples/bench_psum.py and examples/bench_prefill.py:
configurations, the jobs that run them, and the document a run writes per
world. (The processes of a job: examples/bench_worker.py; what a run
prints: examples/bench_report.py.)

A configuration is what one job (a set of processes started by
``python -m jax_arx.launch``) runs:

- ``arx``: jax_arx, its series set by ``JAX_ARX_*`` variables and the private
  ``_tuning`` argument of ``jax_arx.initialize``. Both are read when
  jax_arx.initialize() runs, so the worker sets them itself, phase by phase
  (initialize, run, shutdown): one process can run several.
- ``lax``: ``jax.lax``'s collectives; NCCL and XLA read their variables
  once per process, so these go into the job's environment.
- ``floor``: the pinned-copy floor (examples/pinned_copy.py).

The driver drops the variables that define jax_arx series from the
environment it passes on (a series is its own settings, never the
caller's), and the retired ones (``jax_arx.config.RETIRED``). A timed run
gives each configuration a job of its own; ``--check`` runs every
configuration that needs no environment of its own in one job per world,
which saves the start-up of the others. A configuration whose setting the
installed jax_arx does not read (``needs``) is skipped, saying so.

Ranks: rank r runs on GPU r % G of the G GPUs there are (nvidia-smi's,
narrowed to CUDA_VISIBLE_DEVICES), so a world larger than G shares GPUs
(time-sliced: the results are checked, the times mean nothing; under CUDA
MPS the kernels run at once and the times of routes that need no NVLink
hold). NCCL refuses two ranks on one GPU, so ``lax`` configurations are
skipped there.
A configuration with ``one_process`` runs one process driving the world's
GPUs (``--world`` of them).

Per world a run prints its tables and, with --out, writes ``{bench}.json``
at world 2 (the README's tables) or ``{bench}_world{N}.json``, ``_check``
before the world for --check: {"meta": how it ran (command, sizes, K,
configurations' settings, shared_gpus, timing_caveat),
"results": {config: {size: {series: us}}}, "checks": {config: {size:
{series: {...}}}} (exact / close, planned, ran, as_intended), "skipped"
(the same keys, why), "baselines", "runs": {config: {route, transport,
errors, job_failed, logged, skipped}}, "ratios"}.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench_common import parse_size
from bench_report import check_summary, check_table, latency_table, ratio_tables

# The variables that define a jax_arx series (set per phase by the worker).
SERIES_VARIABLES = (
    "JAX_ARX_TRANSPORT",
    "JAX_ARX_TOPOLOGY",
    "JAX_ARX_SLOT_BYTES",
    "JAX_ARX_SEND_BYTES",
    "JAX_ARX_ONESHOT_MAX_BYTES",
    "JAX_ARX_PREFILL_SLOT_BYTES",
    "JAX_ARX_CUDA_DIRECT",
    "JAX_ARX_CUDA_PEER_MEMORY",
    "JAX_ARX_FALLBACK",
)
NCCL_SHARED_GPU = "NCCL refuses two ranks on one GPU: it needs a GPU per rank"


# --- configurations ---------------------------------------------------------------


def _config(
    kind, *, env=None, tuning=None, process_env=None, gpu_only=False, one_process=False, watch=None, needs=None
):
    return dict(
        kind=kind,
        env=dict(env or {}),
        tuning=dict(tuning or {}),
        process_env=dict(process_env or {}),
        gpu_only=gpu_only,
        one_process=one_process,
        watch=watch,
        needs=dict(needs or {}),
    )


def arx_config(env, tuning=None, *, gpu_only=False, needs=None):
    """jax_arx with ``env`` (JAX_ARX_*) and ``_tuning``; ``gpu_only``: its
    settings mean nothing on the CPU backend (skipped there); ``needs``:
    {field: value} that ``jax_arx.config.load()`` must show with ``env``
    set, or the configuration is skipped (a jax_arx that does not read a
    variable would otherwise run its default under the configuration's
    name)."""
    return _config("arx", env=env, tuning=tuning, gpu_only=gpu_only, needs=needs)


def lax_config(process_env=None, *, gpu_only=False, one_process=False, watch=None):
    """jax.lax with ``process_env`` (NCCL_*, XLA_FLAGS: XLA_FLAGS is added
    to the caller's); ``watch``: a regular expression of stderr lines to
    record (what XLA logged about its choice)."""
    return _config("lax", process_env=process_env, gpu_only=gpu_only, one_process=one_process, watch=watch)


def floor_config():
    """The pinned-copy floor (GPUs only)."""
    return _config("floor", gpu_only=True)


SHM, TCP = {"JAX_ARX_TRANSPORT": "shm"}, {"JAX_ARX_TRANSPORT": "tcp"}
_RING = {"JAX_ARX_TOPOLOGY": "ring"}
# What both benchmarks run (their docstrings say what each is).
ARX_CONFIGS = {
    "arx-shm": arx_config(SHM),
    "arx-shm-host": arx_config(dict(SHM, JAX_ARX_CUDA_PEER_MEMORY="0"), gpu_only=True),
    "arx-shm-proxy": arx_config(dict(SHM, JAX_ARX_CUDA_DIRECT="0"), gpu_only=True),
    # The shm carrier's copy on the proxy thread alone (no copy helpers).
    "arx-shm-proxy-1copy": arx_config(dict(SHM, JAX_ARX_CUDA_DIRECT="0"), {"shm_copy_threads": 0}, gpu_only=True),
    "arx-tcp": arx_config(TCP),
    "arx-shm-ring": arx_config(dict(SHM, **_RING), needs={"topology": "ring"}),
    "arx-tcp-ring": arx_config(dict(TCP, **_RING), needs={"topology": "ring"}),
}
NCCL_CONFIGS = {
    "nccl": lax_config(),
    "nccl-p2p-off": lax_config({"NCCL_P2P_DISABLE": "1"}, gpu_only=True),
}


def parse_series(ap, text, known, option):
    """The series a comma-separated ``text`` names, each one of ``known``;
    ap.error naming ``option`` otherwise."""
    chosen = [a for a in text.split(",") if a]
    if not chosen or any(a not in known for a in chosen):
        ap.error(f"{option} takes {', '.join(known)} (comma-separated); got {text!r}")
    return chosen


def select(text, configs, default):
    """The configurations ``--configs`` names (``all``: every one), in the
    order given; raises ValueError naming the unknown ones."""
    names = list(configs) if text == "all" else [c for c in (text or ",".join(default)).split(",") if c]
    unknown = [c for c in names if c not in configs]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {', '.join(configs)} (or all)")
    return names


def parse_worlds(text):
    worlds = [int(w) for w in str(text).split(",") if w.strip().isdigit()]
    if not worlds or len(worlds) != len([w for w in str(text).split(",") if w]) or any(w < 2 for w in worlds):
        raise ValueError(f"--world takes ranks counts of at least 2, e.g. 2 or 2,3,4; got {text!r}")
    return worlds


# --- where the ranks go --------------------------------------------------------------


def visible_gpus():
    """The GPUs a run may use: those nvidia-smi lists, narrowed to
    CUDA_VISIBLE_DEVICES where it is set (its entries up to the first
    invalid one, as CUDA reads it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    listed = [str(i) for i, _ in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    chosen = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        chosen.append(entry)
    return chosen[: len(listed)]


# --- jobs (the driver) -------------------------------------------------------------------


def plan_jobs(names, configs, world, gpus, cpu, check_only):
    """The jobs that run configurations ``names`` at ``world`` ranks, and
    the configurations skipped here with the reason: ([job], {name: why}).
    A job: {"configs": [...], "process_env": {...}, "nprocs": n}."""
    jobs, skipped, grouped = [], {}, {}
    shared = not cpu and world > len(gpus)
    for name in names:
        spec = configs[name]
        why = unmet_needs(spec["env"], spec["needs"])
        if why:
            skipped[name] = why
        elif cpu and spec["gpu_only"]:
            skipped[name] = "a GPU series (its settings mean nothing on the CPU backend)"
        elif spec["one_process"] and (cpu or world > len(gpus)):
            skipped[name] = f"one process driving {world} GPUs: needs {world} GPUs"
        elif spec["kind"] == "floor" and check_only:
            skipped[name] = "a timing, with nothing to check"
        elif spec["kind"] == "lax" and shared:
            skipped[name] = f"{NCCL_SHARED_GPU} ({world} ranks, {len(gpus)} GPU(s))"
        else:
            nprocs = 1 if spec["one_process"] else world
            key = (json.dumps(spec["process_env"], sort_keys=True), nprocs)
            if check_only and key in grouped:
                grouped[key]["configs"].append(name)
                continue
            job = dict(configs=[name], process_env=spec["process_env"], nprocs=nprocs)
            grouped[key] = job
            jobs.append(job)
    return jobs, skipped


def unmet_needs(env, needs):
    """Why the installed jax_arx cannot run a configuration that ``needs``
    {field: value} of ``jax_arx.config.load()`` with its ``env`` set, or
    None."""
    if not needs:
        return None
    from jax_arx import config

    cfg = config.load(dict(os.environ, **env))
    unmet = [f"{k} is {getattr(cfg, k, None)!r}, not {v!r}" for k, v in needs.items() if getattr(cfg, k, None) != v]
    if not unmet:
        return None
    settings = " ".join(f"{k}={v}" for k, v in env.items())
    return f"with {settings}, jax_arx's configuration says {'; '.join(unmet)}: this jax_arx has no such setting"


_dropped_told = set()


def job_environment(process_env, cpu, watch):
    """The environment of a job's processes: the caller's without the
    variables that define jax_arx series and the retired ones (each
    dropped one said once), with the configuration's."""
    from jax_arx.config import RETIRED

    env = dict(os.environ)
    for name in (*SERIES_VARIABLES, *RETIRED):
        if name in env:
            value = env.pop(name)
            if name not in _dropped_told:
                _dropped_told.add(name)
                print(f"note: {name}={value} is not passed on: each series sets its own settings", flush=True)
    for name, value in process_env.items():
        env[name] = f"{env.get(name, '')} {value}".strip() if name == "XLA_FLAGS" else value
    if not cpu:
        env["JAX_PLATFORMS"] = "cuda"  # never a silent run on the CPU
    if watch:
        # What XLA says about its choices (its VLOG lines are INFO lines).
        env.setdefault("TF_CPP_VMODULE", "collective_kernel_thunk=3,all_reduce_thunk=3")
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    return env


def run_job(script, job, configs, out_dir, tag, timeout):
    """Runs ``script --worker JOBFILE`` in ``job["nprocs"]`` local
    processes, its output shown as it comes; returns (the JSON its process
    0 wrote or None, the stderr lines that matched the configurations'
    ``watch``, why it failed or None)."""
    spec_path = os.path.join(out_dir, f"{tag}.job.json")
    job["out"] = os.path.join(out_dir, f"{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(job, f)
    watch = next((configs[c]["watch"] for c in job["configs"] if configs[c]["watch"]), None)
    env = job_environment(job["process_env"], job["cpu"], watch)
    cmd = [
        sys.executable,
        "-m",
        "jax_arx.launch",
        "-n",
        str(job["nprocs"]),
        *(["--cpu-devices", "1"] if job["cpu"] else []),
        script,
        "--worker",
        spec_path,
    ]
    label = ", ".join(job["configs"])
    print(f"[{tag}] {label}: starting {job['nprocs']} process(es)", flush=True)
    t = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_tail = collections.deque(maxlen=60)
    watched = []

    def read_stderr():
        for line in p.stderr:
            err_tail.append(line)
            if watch and re.search(watch, line) and len(watched) < 50:
                watched.append(line.rstrip())

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    timer = threading.Timer(timeout, p.terminate)  # the launcher then stops its ranks
    timer.start()
    try:
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
        p.wait()
    finally:
        timer.cancel()
        stop(p)  # the driver stopped early (SIGTERM, Ctrl-C): no rank is left behind
    reader.join(timeout=5)
    doc = None
    if os.path.exists(job["out"]):
        with open(job["out"]) as f:
            doc = json.load(f)
    if p.returncode != 0:
        sys.stderr.write("".join(err_tail))
        why = f"the job exited with status {p.returncode}" + (
            f" (after the {timeout:g} s limit)" if time.time() - t >= timeout else ""
        )
        print(f"[{tag}] {label}: failed: {why}", flush=True)
        return doc, watched, why
    print(f"[{tag}] {label}: {time.time() - t:.0f} s", flush=True)
    return doc, watched, None


def stop(p, grace_s=30):
    """Stops the launcher ``p`` if it still runs: SIGTERM (it stops its
    ranks), then SIGKILL after ``grace_s``."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def mps_running():
    """Whether a CUDA MPS control daemon serves this machine (its pipe
    directory, CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps, holds the
    control socket): then processes that share a GPU run their kernels at
    the same time instead of taking turns."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipe, "control"))


def describe_where(world, gpus, cpu, device):
    """'3 ranks on 1 x NVIDIA H200 (3 per GPU, time-sliced)', '2 ranks on
    1 x NVIDIA H200 (2 per GPU, under CUDA MPS)', '2 ranks on the CPU'."""
    if cpu:
        return f"{world} ranks on the CPU"
    used = min(world, len(gpus))
    how = "under CUDA MPS" if mps_running() else "time-sliced"
    sharing = f" ({-(-world // used)} per GPU, {how})" if world > used else ""
    return f"{world} ranks on {used} x {device or 'GPU'}{sharing}"


def timing_caveat(world, gpus, cpu):
    """Why the times of a run mean little, or None: ranks that share a GPU
    take turns on it, so a time measures the scheduling of the processes;
    on the CPU backend the host's scheduling dominates."""
    if cpu:
        return (
            "the CPU backend: the times mostly measure the host's scheduling of the ranks' threads; the "
            "figures that matter are from GPUs"
        )
    if world > len(gpus) and mps_running():
        return (
            f"{world} ranks share {len(gpus)} GPU(s) under CUDA MPS: their kernels run at once, so the routes "
            f"through host memory, the proxy and tcp are timed as they run, but GPU inboxes are one device's "
            f"memory (no NVLink), and jax.lax is skipped (NCCL refuses ranks that share a GPU): compare with "
            f"the floors of this run"
        )
    if world > len(gpus):
        return (
            f"{world} ranks share {len(gpus)} GPU(s), which time-slice between their processes: the timings are "
            f"NOT meaningful (the checks are); time with a GPU per rank, or under CUDA MPS"
        )
    return None


def add_arguments(ap, configs_help, sizes_help):
    """The options both benchmarks take."""
    import argparse

    ap.add_argument("--world", default="2", help="ranks, one process each; a list runs each in turn: 2,3,4")
    ap.add_argument("--configs", help=configs_help)
    ap.add_argument("--sizes", help=sizes_help)
    ap.add_argument(
        "--check",
        "--check-only",
        dest="check_only",
        action="store_true",
        help="check every cell against the reference and time nothing; exit status 1 on any mismatch "
        "(the configurations that need no environment of their own share one job)",
    )
    ap.add_argument(
        "--out",
        help="write the JSON document of each world (and a plot of a timed run) into this "
        "directory; without it, only the tables are printed",
    )
    ap.add_argument("--check-repeats", type=int, default=2, help="runs of each check program")
    ap.add_argument("--cpu", action="store_true", help="the CPU backend (GPU-only configurations are skipped)")
    ap.add_argument("--k", type=int, help="dependent calls per timed program")
    ap.add_argument("--samples", type=int, help="samples per timing (the median is kept)")
    ap.add_argument("--reps", type=int, help="programs per sample, back to back")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job (a set of processes)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        help="seconds for the whole run: the job running then is stopped, later ones are not started, "
        "the tables show what ran, and the exit status is 1",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def finish_arguments(ap, args, configs, default, sizes):
    """Parses and checks what add_arguments added (``sizes``: the default
    sizes); ap.error on bad input; finds the GPUs."""
    try:
        args.worlds = parse_worlds(args.world)
        args.names = select(args.configs, configs, default)
        args.sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else sizes
    except ValueError as e:
        ap.error(str(e))
    if any(s < 16 or s % 16 for s in args.sizes):
        ap.error("--sizes: multiples of 16 bytes")
    if min(args.k, args.samples, args.reps, args.check_repeats) < 1:
        ap.error("--k, --samples, --reps and --check-repeats must be at least 1")
    if args.timeout <= 0 or (args.max_seconds is not None and args.max_seconds <= 0):
        ap.error("--timeout and --max-seconds take a positive number of seconds")
    args.gpus = [] if args.cpu else visible_gpus()
    if not args.cpu and not args.gpus:
        ap.error(
            "no NVIDIA GPU here (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them); --cpu runs on "
            "the CPU backend"
        )


def run_world(args, world, bench, scratch):
    """Every job of one world, the tables, the JSON and the plot (into
    --out, when given; the jobs' files go to ``scratch``); returns whether
    every job ran and every check passed. ``bench``: name, script,
    configs, job (the fields a job adds), meta, rows(doc), ratios,
    plot(doc, rows, path, title), label_width."""
    configs = bench["configs"]
    caveat = timing_caveat(world, args.gpus, args.cpu)
    if caveat and not args.check_only:
        print(f"NOTE: {caveat}", flush=True)
    jobs, skipped = plan_jobs(args.names, configs, world, args.gpus, args.cpu, args.check_only)
    outputs = []
    for i, job in enumerate(jobs):
        job.update(
            world=world,
            gpus=args.gpus,
            cpu=args.cpu,
            sizes=args.sizes,
            k=args.k,
            samples=args.samples,
            reps=args.reps,
            check_only=args.check_only,
            check_repeats=args.check_repeats,
            **bench["job"],
        )
        tag = f"bench_{bench['name']}_world{world}_job{i}"
        left = args.timeout
        if args.deadline is not None:
            # Under a second of the run left: a job would only be stopped.
            if args.deadline - time.monotonic() < 1:
                why = f"not started: the run's --max-seconds {args.max_seconds:g} had passed"
                print(f"[{tag}] {', '.join(job['configs'])}: {why}", flush=True)
                outputs.append((job, (None, [], why)))
                continue
            left = min(left, args.deadline - time.monotonic())
        outputs.append((job, run_job(bench["script"], job, configs, scratch, tag, left)))
    doc = dict(
        meta=dict(
            bench=bench["name"],
            world=world,
            gpus=len(args.gpus),
            cpu=args.cpu,
            check_only=args.check_only,
            sizes=args.sizes,
            dtype="bfloat16",
            k=args.k,
            samples=args.samples,
            reps=args.reps,
            check_repeats=args.check_repeats,
            command=" ".join(["python", *sys.argv]),
            shared_gpus=not args.cpu and world > len(args.gpus),
            timing_caveat=caveat,
            configs={n: {key: configs[n][key] for key in ("kind", "env", "tuning", "process_env")} for n in args.names},
            method="K dependent calls in one jitted program minus the same program without the collective, / K; "
            "median of samples of back-to-back runs",
            **bench["meta"],
        ),
        **merge(outputs, skipped),
    )
    rows = bench["rows"](doc)
    where = describe_where(world, args.gpus, args.cpu, doc["device"])
    text = (
        f"\nchecks, {where} (the algorithm jax_arx planned and ran; '!': not the reference, '?': not the "
        f'algorithm asked for, skip: see the JSON\'s "skipped")\n'
        + check_table(doc, args.sizes, rows, bench["label_width"])
    )
    if not args.check_only:
        text += (
            f"\n\nper-call latency, us (bf16, {where})"
            + (f"\nNOTE: {caveat}" if caveat else "")
            + "\n"
            + latency_table(doc, args.sizes, rows, bench["label_width"])
        )
        ratios_text, doc["ratios"] = ratio_tables(doc, args.sizes, bench["ratios"])
        text += "\n" + ratios_text
    summary, ok = check_summary(doc)
    text += f"\n\nchecks, {where}: {summary}"
    if args.out:
        path = json_path(args.out, f"bench_{bench['name']}", world, args.check_only)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        if doc["results"]:
            bench["plot"](doc, rows, path[:-5] + ".png", f"{where}: K dependent calls in one jit, minus baseline")
        text += f"\nwrote {path}"
    print(text, flush=True)
    return ok


def main(parse_args, worker, bench_of, argv):
    """A benchmark's entry point: the worker (``--worker JOBFILE``), or the
    driver over every world; exit status 0 when every job ran and every
    check passed, 1 otherwise."""
    args = parse_args(argv)
    if args.worker:
        worker(args.worker).run()
        return 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    args.deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
    # SIGTERM (a timeout's, a batch system's) unwinds as an exception does, so
    # that the running job's launcher is stopped (run_job) and its ranks with it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix=f"bench_{os.getpid()}_") as scratch:
        results = [run_world(args, world, bench_of(args, world), scratch) for world in args.worlds]
    return 0 if all(results) else 1


def json_path(out_dir, bench, world, check_only):
    """bench_psum.json at world 2 (the README's tables), bench_psum_world4.json
    at 4; with _check for --check runs, whose times mean nothing."""
    return os.path.join(
        out_dir, f"{bench}{'_check' if check_only else ''}{'' if world == 2 else f'_world{world}'}.json"
    )


def merge(outputs, skipped):
    """One world's document from its jobs' (doc, watched, failure) and the
    configurations skipped before any job: results / checks / skipped /
    baselines / runs, each by configuration."""
    merged = dict(results={}, checks={}, skipped={}, baselines={}, runs={}, device=None, platform=None)
    for job, (doc, watched, failure) in outputs:
        for name in job["configs"]:
            run = dict((doc or {}).get("runs", {}).get(name, {}))
            if failure:
                run["job_failed"] = failure
            if watched:
                run["logged"] = watched
            merged["runs"][name] = run
            for key in ("results", "checks", "skipped"):
                if doc and name in doc.get(key, {}):
                    merged[key][name] = doc[key][name]
            if doc:
                merged["baselines"][name] = doc.get("baselines", {})
        if doc:
            merged["device"] = merged["device"] or doc.get("device")
            merged["platform"] = merged["platform"] or doc.get("platform")
    for name, why in skipped.items():
        merged["runs"][name] = {"skipped": why}
    return merged
