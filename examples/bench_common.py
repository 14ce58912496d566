"""What the benchmarks (examples/bench_psum.py, examples/bench_prefill.py) and
the examples (examples/tp_decode.py, examples/seq_parallel_prefill.py,
examples/minilm.py) share: the timing method, the references jax_arx's
results are checked against bit for bit, the inputs the benchmarks check
with, and how sizes are written. (How the benchmarks run their series:
examples/bench_jobs.py.)

The method: K dependent calls inside one jitted program, minus the same
program without the collective, divided by K. ``median_seconds`` times one
program: each sample runs it ``reps`` times back to back (so the ranks'
start skew is spread thin), and the median of the samples is kept. The CPU
examples time each run alone, every process starting it together
(``synced_median_seconds``).
"""

from __future__ import annotations

import functools
import re
import statistics
import time

import numpy as np


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

    jax.block_until_ready(f(*args))  # compile and warm up
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        barrier("jax_arx example timing")
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_BARRIERS = [0]


def timing_default(value, gpu, cpu):
    """A timing option's value: ``value`` where the command line gave one,
    else ``gpu`` on GPUs and ``cpu`` on the CPU backend, whose times are a
    smoke (the host's scheduling, docs/performance.md): fewer runs there keep
    an example's check-and-time run, and CI's runs of it, to seconds."""
    if value is not None:
        return value
    import jax

    return gpu if jax.default_backend() == "gpu" else cpu


def barrier(name, timeout_s=600):
    """Every process waits here for the others, through jax.distributed's
    key-value service, never an XLA collective: on GPUs those are NCCL's,
    which refuses ranks that share a GPU. Every process must call it the
    same number of times; alone, it returns at once."""
    from jax_arx import _compat

    client = _compat.distributed_client()
    if client is None:
        return
    _BARRIERS[0] += 1  # a barrier's name is used once
    client.wait_at_barrier(f"jax_arx_examples/{name}/{_BARRIERS[0]}", int(timeout_s * 1000))


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
    array ``parts``, in rank order starting from rank 0's element (not from
    +0.0: the sum of -0.0 everywhere is -0.0), rounded once to its dtype."""
    acc = parts[0].astype(np.float32)
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].astype(np.float32)
    return acc.astype(parts.dtype)


def combine_rows(y, pos, w, shared):
    """One rank's combined MoE rows (``jax_arx.moe_combine_psum_scatter``'s
    contract), in numpy: ``shared[t] + sum_k w[t, k] * y[pos[t, k]]`` in
    float32, rounded once to bfloat16. Exact where the products are, e.g.
    with bfloat16-valued weights (no fused multiply-add to emulate)."""
    rows = y.astype(np.float32)[np.clip(pos, 0, y.shape[0] - 1)]  # [T, topk, H]
    acc = shared.astype(np.float32)
    for k in range(pos.shape[1]):
        acc = (acc + (w[:, k, None] * rows[:, k]).astype(np.float32)).astype(np.float32)
    return acc.astype(shared.dtype)


def pattern_bits(seed, rank, start, count):
    """``count`` pseudo-random 64-bit words for elements ``start ..`` of
    rank ``rank``'s block of input ``seed``: a function of the element's
    index, so that any rank can make any part of any rank's block (what a
    reference needs) without making the rest."""
    i = np.arange(start, start + count, dtype=np.uint64)
    h = (i + np.uint64((seed * 0x9E3779B1 + rank * 0x85EBCA77 + 1) & 0xFFFFFFFF)) * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(29))


# The period of pattern_bf16: a prime, so that data moved by any power-of-two
# stride (a piece, a chunk, a slot) lands on different values.
_PERIOD = 1048583


@functools.cache
def _pattern_table(seed):
    """``_PERIOD`` bfloat16 bit patterns (pattern_bf16's values)."""
    h = pattern_bits(seed, 0, 0, _PERIOD)
    sign = (h >> np.uint64(15)) & np.uint64(1)
    exponent = np.uint64(120) + ((h >> np.uint64(20)) & np.uint64(15))
    return ((sign << np.uint64(15)) | (exponent << np.uint64(7)) | (h & np.uint64(0x7F))).astype(np.uint16)


def pattern_bf16(seed, rank, start, count):
    """Rank ``rank``'s elements ``start ..`` of input ``seed`` as bfloat16:
    random signs and mantissas, magnitudes in [2^-7, 2^9), so that sums
    round and their order matters; each rank's a table of a prime period
    read from its own offset (as fast as a copy, and any part of any rank's
    block is made without the rest, which a reference needs). Every element
    whose index is a multiple of 61 is -0.0 on every rank, whose sum is
    -0.0 only when it starts from rank 0's element (rank_order_sum)."""
    import ml_dtypes

    table = _pattern_table(seed)
    offset = (start + (rank + 1) * 0x9E3779B1) % _PERIOD
    bits = table[offset : offset + count]
    if len(bits) < count:
        whole = np.tile(table, (count - len(bits)) // _PERIOD + 1)
        bits = np.concatenate([bits, whole[: count - len(bits)]])
    bits = bits.copy()
    bits[(-start) % 61 :: 61] = 0x8000
    return bits.view(ml_dtypes.bfloat16)


def parse_size(text):
    """'64MB', '64M', '64MiB' (all 64 << 20), '16KB', or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 16MB, 256KB, 4096)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 fused MoE combine``, ``2 fused MoE combines``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


RATIO_NOTE = (
    "ratio: jax_arx's time over jax.lax's, so lower is better (below 1: jax_arx is faster). On the CPU "
    "backend jax.lax's collectives are gloo's and the times mostly measure the host's scheduling; the "
    "figures that matter are on GPUs (docs/performance.md)."
)


def describe_run(jax, jax_arx, axis: str) -> str:
    """What ran: the carrier jax_arx chose for ``axis``, ranks, processes,
    backend."""
    return (
        f"jax_arx over the {jax_arx.transport(axis)} carrier, {jax.device_count()} ranks in "
        f"{jax.process_count()} processes on the {jax.default_backend()} backend"
    )


def size_label(b):
    """'4 MB', '64 KB', '1.5 MB', '100 B'."""
    for unit, name in ((1 << 20, "MB"), (1 << 10, "KB")):
        if b >= unit:
            return f"{b // unit} {name}" if b % unit == 0 else f"{b / unit:.3g} {name}"
    return f"{b} B"
