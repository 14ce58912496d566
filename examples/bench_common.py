"""What the benchmarks (examples/bench_psum.py, examples/bench_prefill.py) and
the CPU examples (examples/tp_decode.py, examples/seq_parallel_prefill.py)
share: the timing method, the rank-order reference sum, and the running of
one configuration as a two-process job.

The method: K dependent calls inside one jitted program, minus the same
program without the collective, divided by K. ``median_seconds`` times one
program: each sample runs it ``reps`` times back to back (so the ranks'
start skew is spread thin), and the median of the samples is kept. The CPU
examples time each run alone, every process starting it together
(``synced_median_seconds``).
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


def synced_median_seconds(f, *args, repeats):
    """Seconds per run of ``f(*args)``: the median of ``repeats`` runs, each
    started on every process together (a barrier first), after two runs that
    compile and warm up."""
    import jax
    from jax.experimental import multihost_utils

    jax.block_until_ready(f(*args))  # compile and warm up
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        multihost_utils.sync_global_devices("jax_arx example timing")
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_call_us(make_program, collective, x, calls, repeats):
    """Microseconds per call of ``collective``: ``make_program(collective)``
    (``calls`` dependent calls of it in one program) minus
    ``make_program(None)`` (the same program without them), over ``calls``;
    never below 0."""
    with_c = synced_median_seconds(make_program(collective), x, repeats=repeats)
    without = synced_median_seconds(make_program(None), x, repeats=repeats)
    return max(with_c - without, 0.0) / calls * 1e6


def rank_order_sum(parts):
    """The reference sum: float32 over the leading (rank) axis of the numpy
    array ``parts``, in rank order from 0.0, rounded once to its dtype."""
    import numpy as np

    acc = np.zeros(parts.shape[1:], np.float32)
    for r in range(parts.shape[0]):
        acc += parts[r].astype(np.float32)
    return acc.astype(parts.dtype)


def run_config(script, config, env, worker_args, path, timeout, launcher_args=()):
    """Runs ``script --worker config [worker_args] --json path`` on two local
    processes (``python -m jax_arx.launch -n 2 [launcher_args]``) with the
    environment updated by ``env``, its output shown as it comes (a
    configuration takes minutes); returns the JSON the worker wrote, or None
    (with the tail of its stderr) when it failed."""
    import collections
    import threading

    full_env = dict(os.environ)
    full_env.update(env)
    cmd = [sys.executable, "-m", "jax_arx.launch", "-n", "2", *launcher_args, script, "--worker", config,
           *worker_args, "--json", path]
    print(f"{config}: starting", flush=True)
    t = time.time()
    p = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_tail = collections.deque(maxlen=60)
    reader = threading.Thread(target=lambda: err_tail.extend(p.stderr), daemon=True)
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
    reader.join(timeout=5)
    if p.returncode != 0:
        sys.stderr.write("".join(err_tail))
        print(f"{config}: failed with status {p.returncode}", flush=True)
        return None
    print(f"{config}: {time.time() - t:.0f} s", flush=True)
    with open(path) as f:
        return json.load(f)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 fused MoE combine``, ``2 fused MoE combines``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


RATIO_NOTE = ("ratio: jax_arx's time over jax.lax's, so lower is better (below 1: jax_arx is faster). On the CPU "
              "backend jax.lax's collectives are gloo's and the times mostly measure the host's scheduling; the "
              "figures that matter are on GPUs (README, Benchmarks).")


def describe_run(jax, jax_arx, axis: str) -> str:
    """What ran: the carrier jax_arx chose for ``axis``, ranks, processes,
    backend."""
    return (f"jax_arx over the {jax_arx.transport(axis)} carrier, {jax.device_count()} ranks in "
            f"{jax.process_count()} processes on the {jax.default_backend()} backend")


def size_label(b):
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"
