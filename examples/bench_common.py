"""What the benchmarks share (examples/bench_psum.py, examples/bench_prefill.py):
the timing method and the running of one configuration as a two-process job.

The method: K dependent calls inside one jitted program, minus the same
program without the collective, divided by K. ``median_seconds`` times one
program: each sample runs it ``reps`` times back to back (so the ranks'
start skew is spread thin), and the median of the samples is kept.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def median_seconds(f, x, samples, reps):
    """Seconds per run of ``f(x)``: the median over ``samples`` samples of
    ``reps`` runs back to back, after two runs that compile, capture and
    warm up."""
    f(x).block_until_ready()  # compile, capture, warm up
    f(x).block_until_ready()
    per_run = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(reps):
            y = f(x)
        y.block_until_ready()
        per_run.append((time.perf_counter() - t) / reps)
    return statistics.median(per_run)


def run_config(script, config, env, worker_args, path, timeout, launcher_args=()):
    """Runs ``script --worker config [worker_args] --json path`` on two local
    processes (``python -m jax_arx.launch -n 2 [launcher_args]``) with the
    environment updated by ``env``; returns the JSON the worker wrote, or
    None (with the tail of its output) when it failed."""
    full_env = dict(os.environ)
    full_env.update(env)
    cmd = [sys.executable, "-m", "jax_arx.launch", "-n", "2", *launcher_args, script, "--worker", config,
           *worker_args, "--json", path]
    t = time.time()
    p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(p.stdout[-4000:])
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-6000:])
        print(f"{config}: failed with status {p.returncode}", flush=True)
        return None
    print(f"{config}: {time.time() - t:.0f} s", flush=True)
    with open(path) as f:
        return json.load(f)


def size_label(b):
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"
