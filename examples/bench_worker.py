"""The worker side of examples/bench_psum.py and examples/bench_prefill.py:
one job's processes, started by the driver (examples/bench_jobs.py) with
``--worker JOBFILE``.

Each process first places itself (``place_rank``: rank r on GPU r % G, so
that a world larger than the G GPUs shares them), then runs the job's
configurations in order (``BenchWorker.run``); a jax_arx configuration sets
its variables and ``_tuning`` in a phase of its own (``run_phase``:
initialize, run, shutdown). Every cell is checked on every rank and the
verdicts go to process 0 through jax.distributed's key-value store
(``Exchange``: no device collective, which would be NCCL's on GPUs, and
NCCL refuses ranks that share a GPU); process 0 writes the job's JSON after
each cell (``Recorder``), so a job that fails or is stopped later keeps
what it had.
"""

from __future__ import annotations

import collections
import json
import os

from bench_common import median_seconds, size_label
from bench_report import describe_cell

AXIS = "x"
# stats()["algorithms"]' names, by the algorithm numbers of Endpoint.plan (ffi/comm/plan.h).
ALGORITHM_NAMES = {0: "none", 1: "one_shot", 2: "two_shot", 3: "ll", 4: "bulk", 5: "unfused"}  # ffi/comm/plan.h


def place_rank(job):
    """The worker's first step, before jax starts: this process's GPUs
    (rank r: GPU r % G; one process: the world's first GPUs), and memory
    that grows on demand, up to a share of the GPU, where ranks share one
    (XLA would otherwise take 75% of it per process)."""
    if job["cpu"]:
        return
    gpus, world = job["gpus"], job["world"]
    if job["nprocs"] == 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:world])
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(os.environ["JAX_PROCESS_ID"]) % len(gpus)]
    if world > len(gpus):
        share = -(-world // len(gpus))  # processes on the busiest GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.8 / share:.3f}")


class Exchange:
    """What the processes of a job tell process 0, through jax.distributed's
    key-value store: no device collective (on GPUs that would be NCCL,
    which refuses ranks that share a GPU)."""

    def __init__(self, jax, timeout_s=900.0):
        from jax_arx import _compat

        self.client = _compat.distributed_client()
        self.rank, self.n = jax.process_index(), jax.process_count()
        self.timeout_ms = int(timeout_s * 1000)
        self.seq = 0

    def gather(self, value):
        """Every process's ``value`` (JSON-able), in process order, on
        process 0; None on the others."""
        self.seq += 1
        if self.client is None or self.n == 1:
            return [value]
        key = f"bench/{self.seq}"
        if self.rank != 0:
            self.client.key_value_set_bytes(f"{key}/{self.rank}", json.dumps(value).encode())
            return None
        return [value] + [
            json.loads(bytes(self.client.blocking_key_value_get_bytes(f"{key}/{r}", self.timeout_ms)))
            for r in range(1, self.n)
        ]

    def barrier(self):
        self.seq += 1
        if self.client is not None and self.n > 1:
            self.client.wait_at_barrier(f"bench/barrier/{self.seq}", self.timeout_ms)


class Recorder:
    """A job's results on process 0, written to the job's JSON after every
    cell (so that a job that fails or is stopped later keeps what it
    measured)."""

    def __init__(self, job, jax):
        self.job, self.rank0 = job, jax.process_index() == 0
        self.doc = dict(
            device=jax.devices()[0].device_kind,
            platform=jax.devices()[0].platform,
            processes=jax.process_count(),
            results={},
            checks={},
            skipped={},
            baselines={},
            runs={},
        )

    def run(self, config):
        return self.doc["runs"].setdefault(config, {"errors": []})

    def time(self, config, nbytes, series, us):
        self.doc["results"].setdefault(config, {}).setdefault(str(nbytes), {})[series] = us

    def check(self, config, nbytes, series, check):
        self.doc["checks"].setdefault(config, {}).setdefault(str(nbytes), {})[series] = check

    def skip(self, config, nbytes, series, why):
        self.doc["skipped"].setdefault(config, {}).setdefault(str(nbytes), {})[series] = why
        if self.rank0:
            print(f"{config} {series} {size_label(nbytes)}: skipped: {why}", flush=True)

    def write(self):
        if self.rank0:  # whole or not at all: the driver may stop the job at any moment
            with open(self.job["out"] + ".part", "w") as f:
                json.dump(self.doc, f)
            os.replace(self.job["out"] + ".part", self.job["out"])


class BenchWorker:
    """What the workers of bench_psum.py and bench_prefill.py share: the
    set-up (placement, jax.distributed, a mesh of the world's devices over
    AXIS), the loop over the job's configurations, the check of a program's
    results on every rank, the timing against a baseline, and the record of
    a cell. A subclass sets ``configs`` and defines ``arx(config, spec,
    run)`` and ``other(config, spec)`` (jax.lax, the floor)."""

    configs: dict = {}

    def __init__(self, job_path):
        with open(job_path) as f:
            job = json.load(f)
        place_rank(job)
        import jax
        import numpy as np
        from jax.sharding import Mesh

        import jax_arx

        jax_arx.distributed_initialize()
        self.jax, self.jax_arx, self.job, self.world = jax, jax_arx, job, job["world"]
        self.mesh = Mesh(np.array(jax.devices()[: self.world]), (AXIS,))
        self.ex, self.rec = Exchange(jax), Recorder(job, jax)
        self.rank0 = jax.process_index() == 0
        self._baselines = {}

    def run(self):
        for config in self.job["configs"]:
            spec, run = self.configs[config], self.rec.run(config)
            try:
                if spec["kind"] == "arx":
                    self.arx(config, spec, run)
                else:
                    self.other(config, spec)
            except Exception as e:  # noqa: BLE001  (recorded; the run then fails)
                run["errors"].append(f"{config}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                print(f"{config}: FAILED: {type(e).__name__}: {e}", flush=True)
            self.rec.write()
        self.rec.doc["baselines"] = {str(k): us for k, us in self._baselines.items()}
        self.rec.write()

    def phase(self, config, spec, env, run, label, body):
        """``body(comm)`` in a jax_arx phase (run_phase) with the
        configuration's settings, ``env`` and JAX_ARX_FALLBACK=error; the
        configuration's route noted once."""

        def with_route(comm):
            if "route" not in run:
                run.update(describe_route(comm))
                if self.rank0:
                    print(f"{config}: jax_arx over {run['transport']}, route '{run['route']}'", flush=True)
            body(comm)

        env = dict(env, **spec["env"], JAX_ARX_FALLBACK="error")
        run_phase(self.jax_arx, self.mesh, env, spec["tuning"], run["errors"], label, with_route)

    def cell(
        self,
        config,
        series,
        nbytes,
        call,
        args,
        want,
        *,
        comm=None,
        plan_op=None,
        tolerance=None,
        chain=None,
        baseline=None,
        intended=None,
    ):
        """One cell: ``call(*args)`` (sharded over AXIS) checked against
        ``want(rank)`` (bit for bit, or within ``tolerance(rank)``), then,
        unless --check, timed in ``chain(call)`` against ``chain(None)``
        (timed once per ``baseline`` key). For a jax_arx series (``comm``):
        skipped where the core plans no algorithm for ``plan_op`` at
        ``nbytes`` (it would fall back), and ``intended(planned, ran)`` says
        whether what the handlers ran of ``plan_op`` is what the series asks
        for."""
        check = {}
        if comm is not None:
            name, pieces, why = planned(comm, plan_op, nbytes)
            if name == "none":
                self.rec.skip(config, nbytes, series, why)
                return
            check["planned"] = {"algorithm": name, "pieces": pieces}
            before = algorithms_ran(comm, plan_op)
        twice = self.smap(lambda *a: (call(*a), call(*a)), len(args), 2)
        ok = self.checked(twice, args, want, tolerance)
        us = None if self.job["check_only"] else self.per_call_us(chain, call, args, baseline)
        ran = ran_since(comm, plan_op, before) if comm is not None else None
        self.record(
            config,
            nbytes,
            series,
            check,
            ok,
            exact=tolerance is None,
            us=us,
            ran=ran,
            intended=ran is not None and intended(check["planned"]["algorithm"], ran),
        )

    def smap(self, body, n_in=1, n_out=1):
        from jax.sharding import PartitionSpec as P

        spec = P(AXIS)
        return self.jax.jit(
            self.jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(spec,) * n_in,
                out_specs=spec if n_out == 1 else (spec,) * n_out,
                check_vma=False,
            )
        )

    def checked(self, f, args, want, tolerance=None):
        """``f(*args)`` (a tuple of results, each sharded over AXIS) run
        --check-repeats times: whether every shard this process holds
        equals ``want(rank)`` bit for bit (tolerance None) or within
        ``tolerance(rank)``."""
        import numpy as np

        ok = True
        for _ in range(self.job["check_repeats"]):
            for out in f(*args):
                for rank, data in shards_by_rank(out):
                    w = want(rank)
                    if tolerance is None:
                        ok &= data.dtype == w.dtype and data.tobytes() == w.tobytes()
                    else:
                        ok &= bool(np.all(np.abs(data.astype(np.float32) - w.astype(np.float32)) <= tolerance(rank)))
        return bool(ok)

    def per_call_us(self, chain, call, args, key):
        """us per call of ``call`` in ``chain(call)`` (K dependent calls),
        minus ``chain(None)`` (timed once per ``key``), over K."""
        samples, reps = self.job["samples"], self.job["reps"]

        def time(program):
            return median_seconds(lambda a: program(*a), args, samples, reps) * 1e6

        if key not in self._baselines:
            self._baselines[key] = time(chain(None))
        return max(0.0, (time(chain(call)) - self._baselines[key]) / self.job["k"])

    def record(self, config, nbytes, series, check, ok, *, exact, us=None, ran=None, intended=None):
        """One cell, from every process's ``ok`` (and, for a jax_arx series,
        ``ran``: what its endpoints ran, and ``intended``: whether that is
        what the series asked for) to process 0's record and line. ``check``
        holds what is known already ("planned"); ``ok`` goes in as "exact"
        (bit for bit) or "close" (within rounding)."""
        views = self.ex.gather({"ok": ok, "ran": ran})
        if views is None:
            return
        check["exact" if exact else "close"] = all(v["ok"] for v in views)
        if ran is not None:
            same = all(v["ran"] == ran for v in views)
            check.update(ran=ran, as_intended=bool(intended) and same)
            if not same:
                check["ran_by_rank"] = [v["ran"] for v in views]
        self.rec.check(config, nbytes, series, check)
        if us is not None:
            self.rec.time(config, nbytes, series, us)
        self.rec.write()
        print(f"{config} {series} {size_label(nbytes)}: {describe_cell(check, us)}", flush=True)


def run_phase(jax_arx, mesh, env, tuning, errors, label, body):
    """One jax_arx set-up: ``env`` set, ``jax_arx.initialize(mesh,
    _tuning=tuning)``, ``body(communicator)``, then shutdown and ``env``
    restored. An exception is recorded in ``errors`` and the job goes on
    with its next phase (a failed collective fails on every rank, so the
    processes stay in step)."""
    from jax_arx import _comm

    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        jax_arx.initialize(mesh, _tuning=tuning or None)
        body(_comm.communicator(AXIS))
    except Exception as e:  # noqa: BLE001  (recorded, and the run says it failed)
        first = (str(e).strip().splitlines() or [""])[0]
        errors.append(f"{label}: {type(e).__name__}: {first}")
        print(f"{label}: FAILED: {type(e).__name__}: {first}", flush=True)
    finally:
        try:
            jax_arx.shutdown()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{label}: shutdown: {type(e).__name__}: {e}")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def describe_route(comm):
    """{"transport": ..., "route": ...} of this process's endpoints."""
    eps = comm.endpoints
    return dict(
        transport=", ".join(sorted({le.transport for le in eps})),
        route=", ".join(sorted({le.endpoint.route for le in eps})),
    )


def axis_endpoints(comm):
    """This process's endpoints of ``comm``'s axis: psum's and, once the
    first bulk collective made them, the bulk collectives' own
    (jax_arx/_bulk_endpoints.py)."""
    from jax_arx import _bulk_endpoints, _comm

    bulk = _comm.communicator_by_id(_bulk_endpoints.bulk_id(comm.comm_id))
    return comm.endpoints + (bulk.endpoints if bulk is not None else ())


def algorithms_ran(comm, op):
    """How many calls of ``op`` each algorithm ran on this process's
    endpoints of the axis (Endpoint.stats(): a handler run counts; a replay
    of a captured CUDA graph runs none)."""
    total = collections.Counter()
    for le in axis_endpoints(comm):
        total.update(le.endpoint.stats()["ops"][op]["algorithms"])
    return total


def planned(comm, op, nbytes):
    """What the core plans for ``op`` at ``nbytes`` (Endpoint.plan): (name,
    pieces, why_not)."""
    algorithm, pieces, why = comm.endpoints[0].endpoint.plan(op, int(nbytes))
    return ALGORITHM_NAMES.get(algorithm, str(algorithm)), pieces, why


def ran_since(comm, op, before):
    after = algorithms_ran(comm, op)
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def sharded(jax, mesh, block_shape, make_block):
    """The global array whose rank-r block (along the first axis, sharded
    over the mesh axis) is ``make_block(r)``, made only for the blocks this
    process holds."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows = block_shape[0]
    world = mesh.shape[AXIS]
    shape = (world * rows, *block_shape[1:])
    return jax.make_array_from_callback(
        shape, NamedSharding(mesh, P(AXIS)), lambda idx: make_block((idx[0].start or 0) // rows)
    )


def shards_by_rank(out):
    """(rank, numpy data) of each shard of ``out`` this process holds,
    sharded along its first axis over the mesh axis."""
    import numpy as np

    n = out.shape[0] // len(out.sharding.mesh.devices.flat)
    return [((s.index[0].start or 0) // n, np.asarray(s.data)) for s in out.addressable_shards]
