"""Running a test file's worker suites under ``python -m jax_arx.launch``.

A multi-process test module launches itself as the worker
(``THIS --worker SUITE``): every rank runs the suite and prints one line
``RESULT {json}``; the test asserts on what each rank reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

RESULT = "RESULT "


def clean_env(extra=None):
    """The environment without the caller's jax / XLA / jax_arx settings
    (``extra`` added), with no idle spin on a machine of few cores."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTHONPATH"))}
    if (os.cpu_count() or 1) < 4:
        # More spinning proxies than cores: a proxy that spins on after its
        # work takes the core its peer needs (docs/configuration.md). The
        # default spin stays covered by the C++ tests and on machines with
        # more cores.
        env["JAX_ARX_IDLE_SPIN_MS"] = "0"
    env.update(extra or {})
    return env


def launcher_cmd(nprocs, cpu_devices, script, *args, grace_s=20):
    """``python -m jax_arx.launch -n nprocs`` running ``script *args``, with
    ``cpu_devices`` CPU devices per process (None: jax's default backend) and
    ``grace_s`` seconds of grace for the others once one rank has failed."""
    devices = ["--cpu-devices", str(cpu_devices)] if cpu_devices is not None else []
    grace = ["--grace-s", str(grace_s)]
    return [sys.executable, "-m", "jax_arx.launch", "-n", str(nprocs), *devices, *grace, script, *args]


def run_suite(worker, suite, nprocs, transport, cwd, *, cpu_devices=1, env=None, timeout=300):
    """Runs ``worker --worker suite`` on ``nprocs`` processes over ``transport``
    (cwd outside the source tree, so the installed jax_arx is imported);
    returns each rank's RESULT, after checking that every rank succeeded.
    ``cpu_devices``: CPU devices per process, or None for jax's default
    backend (GPUs, where the worker picks its own)."""
    full_env = clean_env({"JAX_ARX_TRANSPORT": transport, **(env or {})})
    cmd = launcher_cmd(nprocs, cpu_devices, worker, "--worker", suite)
    start = time.monotonic()
    p = run_launcher(cmd, full_env, cwd, timeout)
    elapsed = time.monotonic() - start
    results = {}
    for line in p.stdout.splitlines():
        if line.startswith("[rank ") and RESULT in line:
            rank = int(line[len("[rank ") : line.index("]")])
            results[rank] = json.loads(line[line.index(RESULT) + len(RESULT) :])
    detail = (
        f"suite {suite!r}, {nprocs} processes, {transport}: status {p.returncode} after {elapsed:.1f} s\n"
        f"--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-6000:]}"
    )
    assert p.returncode == 0, detail
    assert sorted(results) == list(range(nprocs)), detail
    if "JAX_ARX_DEBUG" not in full_env:
        # The proxies' raw counters, printed when a call makes no progress,
        # are for JAX_ARX_DEBUG only (the failure suites stall on purpose).
        assert "STALL" not in p.stderr and "no progress for" not in p.stderr, detail
    return results


def run_launcher(cmd, env, cwd, timeout):
    """subprocess.run(cmd) with its output captured; past ``timeout`` the
    launcher gets SIGTERM, which stops its ranks (each leads its own process
    group, out of reach of a kill of the launcher alone), so none is left
    running on a device. Returns the CompletedProcess; the timeout shows as
    a nonzero status with what was printed until then."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        err += f"\n[run_suite] timed out after {timeout} s; stopped the launcher and its ranks\n"
        return subprocess.CompletedProcess(cmd, p.returncode or 124, out, err)


def assert_all_correct(results, expect):
    """Every rank ran exactly the expected cases, checked something in each,
    and found no mismatch; where ranks report a digest of all their results,
    it is the same on every rank (bit-identical results)."""
    for rank, r in results.items():
        assert sorted(r["cases"]) == sorted(expect), (rank, sorted(r["cases"]))
        for name, case in r["cases"].items():
            assert case["bad"] == [], (rank, name, case["bad"][:5])
            assert case["checked"] > 0, (rank, name)
    digests = {r["digest"] for r in results.values() if "digest" in r}
    assert len(digests) <= 1, {k: r.get("digest") for k, r in results.items()}


def core_is_installed(cwd):
    """None when jax_arx with its C++ module imports in a fresh interpreter
    (outside the source tree), else the reason it does not."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax_arx._core"], capture_output=True, text=True, cwd=cwd, env=clean_env()
    )
    if probe.returncode == 0:
        return None
    return "jax_arx is not installed with its C++ module (pip install .): " + probe.stderr.strip().splitlines()[-1]


class MeshWorker:
    """One rank's view inside a worker: jax.distributed and jax_arx set up
    over a 1-D mesh of every device, named ``axis`` (ranks are positions in
    jax.devices(), process 0's devices first), and the record of what each
    case checked, which the RESULT line reports (see assert_all_correct).
    Test files add their own inputs and comparisons. ``tuning``: the
    ``_tuning`` of ``jax_arx.initialize``."""

    def __init__(self, axis: str, tuning: dict | None = None):
        import jax_arx

        jax_arx.distributed_initialize()
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        self.jax, self.jax_arx, self.P = jax, jax_arx, P
        self.mesh = Mesh(np.array(jax.devices()), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
        jax_arx.initialize(self.mesh, _tuning=tuning)
        self.world = self.mesh.size
        self.sharded = NamedSharding(self.mesh, P(axis))
        self.cases: dict[str, dict] = {}
        self.seconds: dict[str, float] = {}  # per case, for the record

    def together(self, f, *args):
        """Runs the jitted ``f(*args)`` on every process at once: compiled
        first, then started after a barrier. For programs with a collective
        of jax's own (a fallback to jax.lax: gloo on the CPU, whose waits
        give up after a fixed time), so that a process compiling slowly on a
        loaded machine does not make its peer's gloo wait time out. The
        barrier is jax.distributed's, with a bound no load reaches."""
        from jax_arx import _compat

        compiled = f.lower(*args).compile()
        self._barriers = getattr(self, "_barriers", 0) + 1
        _compat.distributed_client().wait_at_barrier(f"launched/together/{self._barriers}", 600_000)
        return compiled(*args)

    def smap(self, body, in_specs, out_specs, check_vma=True, **jit_kwargs):
        return self.jax.jit(
            self.jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma),
            **jit_kwargs,
        )

    def record(self, case, bad=None):
        """One more result checked in ``case``; ``bad``: what was wrong with it."""
        entry = self.cases.setdefault(case, {"checked": 0, "bad": []})
        entry["checked"] += 1
        if bad:
            entry["bad"].append(bad)

    def fail(self, case, message):
        self.cases.setdefault(case, {"checked": 0, "bad": []})["bad"].append(message)

    def timed(self, case, *args, record_as=None, **kwargs):
        """Runs ``case(self, *args, **kwargs)`` and records its seconds under
        ``record_as``, or its name without the ``case_`` prefix."""
        start = time.monotonic()
        case(self, *args, **kwargs)
        self.seconds[record_as or case.__name__[len("case_") :]] = round(time.monotonic() - start, 2)

    def calls(self, f, *args, target="jax_arx_"):
        """The custom calls to ``target*`` in ``f``'s lowering for ``args``,
        fallbacks' notices (jax_arx/_notice.py, psums marked notice = 1) left
        out: the calls the program's own collectives lowered to."""
        text = f.lower(*args).as_text()
        return [line for line in text.splitlines() if f"custom_call @{target}" in line and "notice = 1" not in line]


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def family(e: BaseException) -> str:
    """The jax_arx.errors class ``e`` translates to (jax_arx.errors.translated),
    by name, or "" when it carries no jax_arx message."""
    from jax_arx import errors

    err = errors.from_runtime_error(e)
    return type(err).__name__ if err is not None else ""


def mismatch_report(call, jax_arx) -> dict:
    """The failure suites' "ranks that issue different ops": runs ``call()``
    (it returns the result as a numpy array) and reports ``error``, what it
    and then jax_arx.check() raised, and ``finite_result``, whether it
    returned finite values instead."""
    import numpy as np

    error, finite, kind = "", False, ""
    try:
        finite = bool(np.isfinite(call()).all())
    except Exception as e:  # the handler's error, raised by jax
        error, kind = error_text(e), family(e)
    try:
        jax_arx.check()
    except jax_arx.CollectiveError as e:
        error += "\n" + error_text(e)
        kind = kind or type(e).__name__
    return {"error": error, "finite_result": finite, "kind": kind}


def assert_failure_suite(results, timeout_s: float = 3.0) -> dict:
    """What every failure suite's RESULT must show (ranks 0 and 1; run with
    JAX_ARX_TIMEOUT_S=``timeout_s``): on each rank, the ops that did not
    match gave an error naming a different collective, never a finite
    result; on rank 0, the call no peer joined (compiled before it was
    timed) gave up after the timeout and within twice it, and
    jax_arx.check() then raised a CollectiveTimeoutError naming rank 1; each
    error is of its kind's jax_arx.errors class (from the call, through
    jax_arx.errors.translated). Returns rank 0's "missing_peer" report, for
    the suite's own checks."""
    for rank in (0, 1):
        mismatch = results[rank]["mismatch"]
        # Either the call raised, or it returned NaN and check() raised: never a result.
        assert not mismatch["finite_result"], mismatch
        assert "different collective" in mismatch["error"], mismatch
        assert mismatch["kind"] == "CollectiveMismatchError", mismatch
    missing = results[0]["missing_peer"]
    assert "rank 1" in missing["check"] and missing["check_type"] == "CollectiveTimeoutError", missing
    assert missing["kind"] in ("", "CollectiveTimeoutError"), missing  # "": the call did not raise (GPUs)
    assert timeout_s <= missing["seconds"] <= 2 * timeout_s, missing
    return missing


def alone_call_report(call, jax_arx, key: str, *, on_error=None) -> dict:
    """The failure suites' "a peer that never calls": rank 0 runs ``call()``
    alone (it should fail within the timeout) and reports the error, the
    seconds it took, what jax_arx.check() raised after it, and what
    ``call`` returned (a dict), or ``on_error`` if it raised. The other
    ranks wait (on the key-value store, key ``key``) until rank 0 is done,
    so that they do not shut down under it; they report ``{"skipped": True}``."""
    import jax

    from jax_arx import _compat

    client = _compat.distributed_client()
    if jax.process_index() != 0:
        client.blocking_key_value_get(key, 120_000)
        return {"skipped": True}
    report = {"error": "", "kind": ""}
    start = time.monotonic()
    try:
        report.update(call() or {})
    except Exception as e:
        report["error"], report["kind"] = error_text(e), family(e)
        report.update(on_error or {})
    report["seconds"] = time.monotonic() - start
    try:
        jax_arx.check()
        report["check"], report["check_type"] = "", None
    except Exception as e:
        report["check"], report["check_type"] = str(e), type(e).__name__
    client.key_value_set(key, "1")
    return report


def _running(pid):
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by
    its launcher, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def leave_after_a_lost_peer(tag: str, survivors, code: int = 0):
    """Ends a surviving rank of a suite whose peer is gone, without the exit
    barriers of jax.distributed and jax_arx (they would wait for the dead).
    Rank 0's process holds jax's coordination service: when it leaves, jax's
    client fails every other rank still running (status 1 or 134), so each
    survivor gives its pid, and rank 0 leaves once every one of them has
    exited (the ranks share this host)."""
    import jax

    from jax_arx import _compat

    sys.stdout.flush()
    sys.stderr.flush()
    client, me = _compat.distributed_client(), jax.process_index()
    client.key_value_set(f"{tag}/left{me}", str(os.getpid()))
    if me == 0:
        pids = [int(client.blocking_key_value_get(f"{tag}/left{r}", 120_000)) for r in survivors if r != 0]
        deadline = time.monotonic() + 60
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
    os._exit(code)
