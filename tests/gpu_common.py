"""What the GPU test files (tests/test_gpu_*.py) share: when a GPU test runs,
where its ranks go, how its workers are launched and what they report.

When. A GPU test runs where nvidia-smi lists a GPU (among
CUDA_VISIBLE_DEVICES, when the pytest process has it set), and is skipped,
saying so, where none is. On a machine with a GPU, a jax_arx that cannot run
there fails the test, never skips it: a ``_core`` that does not import, one
built without CUDA, or (for the wait tests) one built without the test hooks;
the message gives the command that builds what is needed (``BUILD``).

Where. A test asks for a world of N ranks, one process each; rank r runs on
GPU r % G of the G GPUs there are, through CUDA_VISIBLE_DEVICES in its own
environment (``place_rank``, the first thing a worker does). With fewer GPUs
than ranks several processes share a GPU, which time-slices between them, so
every test that does not need two physical GPUs runs on one. Each process's
XLA grows its memory pool on demand, up to its share of the GPU. The tests
that do need two (peer access between two devices, one process driving two
GPUs) ask ``require_gpus(2)`` and are skipped on one, with the reason.

How. A worker is a test file run as a script (``--worker NAME``) under
``python -m jax_arx.launch``, from a clean environment: none of the pytest
process's JAX_* / XLA_* settings (tests/test_bulk_endpoints.py sets
JAX_PLATFORMS=cpu at import, for one), only what the test asks for, plus
JAX_PLATFORMS=cuda (never a silent run on the CPU), JAX_ARX_FALLBACK=error
(a fallback would run jax.lax's collectives, NCCL, which refuses ranks that
share a GPU, and would not test jax_arx anyway) and no autotuning (ranks may
compile different programs). A worker runs in phases; each re-initializes
jax_arx with its own settings (environment variables, ``_tuning``) and
prints one ``RESULT {json}`` line: the route each endpoint took
(``Endpoint.route``), what its handlers ran (``Endpoint.stats()``: calls by
kind, by algorithm), and every case it checked, bit for bit against numpy,
with a digest of its results that every rank must share. So the tests assert
what ran, and a setting that is ignored fails them.

``--cpu-smoke`` runs a worker's Python on the CPU backend (the host
handlers); tests/test_gpu_workers_cpu.py runs those in CI.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import bulk_cases as suites
import launched

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = launched.RESULT
AXIS = "sp"  # the mesh axis of every worker (bulk_cases' worker)

# XLA command buffers: forced on (a graph of even one custom call is
# captured, so every jitted call replays a CUDA graph), or off.
CMDBUF_ON = "--xla_gpu_graph_min_graph_size=1"
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="

# The build the GPU tests need, from the source tree (with nanobind and
# scikit-build-core installed: --no-build-isolation uses them).
BUILD = "JAX_ARX_CUDA=ON pip install --no-build-isolation -C cmake.define.JAX_ARX_TESTING=ON ."

# The collectives the stats count (Endpoint.stats()["calls"]), by the FFI
# target a lowering names.
KINDS = {
    "jax_arx_psum": "psum",
    "jax_arx_all_gather": "all_gather",
    "jax_arx_psum_scatter": "psum_scatter",
    "jax_arx_moe_combine_psum_scatter": "moe_combine_psum_scatter",
}

# Endpoint.route's values, and the one line the core logs when GPU inboxes
# were asked for by default but cannot be mapped (ffi/cuda/peer_memory.cc).
GPU_INBOXES, HOST_INBOXES, PROXY = "direct, GPU inboxes", "direct", "proxy"
NO_GPU_INBOXES_LINE = "psum inboxes in pinned host memory, not in GPU memory:"


# --- when to run (the pytest side) ----------------------------------------------


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    """The GPUs the tests may use: those nvidia-smi lists, narrowed to this
    process's CUDA_VISIBLE_DEVICES when it is set (its entries, up to the
    first invalid one, as CUDA reads it)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    listed = [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(listed)
    chosen = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        chosen.append(entry)
    return tuple(chosen[: len(listed)])


@functools.cache
def _core_probe() -> dict:
    """What the installed jax_arx is, asked in a fresh interpreter with a clean
    environment: {"cuda": bool, "hooks": bool}, or {"error": why not}."""
    code = (
        "import ctypes, json; from jax_arx import _core as c; "
        "print(json.dumps({'cuda': c.has_cuda(), 'hooks': hasattr(ctypes.CDLL(c.__file__), 'arx_testing_open')}))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, env=launched.clean_env(), timeout=300
    )
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def require_gpus(n: int = 1, *, hooks: bool = False, why: str = "") -> tuple[str, ...]:
    """The GPUs to run on; skips the test where there are fewer than ``n``
    (``why``: what the second GPU is for), and fails it where there is a GPU
    but no jax_arx that runs on it (with ``hooks``: the test build)."""
    gpus = visible_gpus()
    if not gpus:
        pytest.skip("no NVIDIA GPU here (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)")
    probe = _core_probe()
    if "error" in probe:
        pytest.fail(
            f"this machine has {len(gpus)} GPU(s), but jax_arx's C++ module does not import "
            f"({probe['error']}); build it with CUDA and the test hooks: {BUILD}"
        )
    if not probe["cuda"]:
        pytest.fail(
            f"this machine has {len(gpus)} GPU(s), but jax_arx was built without CUDA (no nvcc at build "
            f"time); rebuild it with CUDA and the test hooks: {BUILD}"
        )
    if hooks and not probe["hooks"]:
        pytest.fail(
            "jax_arx was built without the test hooks these tests drive (tests/gpu/hooks_cuda.cc, CMake "
            f"option JAX_ARX_TESTING); rebuild it with them: {BUILD}"
        )
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs{' (' + why + ')' if why else ''}; this machine shows {len(gpus)}")
    return gpus


# --- launching (the pytest side) --------------------------------------------------


def gpu_env(gpus, ranks: int, env: dict | None = None, devices_per_process: int = 1) -> dict:
    """A worker's environment for ``ranks`` ranks placed on ``gpus`` (see the
    module doc), with ``env`` on top (its XLA_FLAGS added to the defaults)."""
    env = dict(env or {})
    share = math.ceil(ranks / len(gpus))  # processes on the busiest GPU
    flags = " ".join(f for f in ("--xla_gpu_autotune_level=0", env.pop("XLA_FLAGS", "")) if f)
    return launched.clean_env(
        {
            "JAX_PLATFORMS": "cuda",
            "ARX_TEST_GPUS": ",".join(gpus),
            "ARX_TEST_DEVICES_PER_PROCESS": str(devices_per_process),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.8 / share:.3f}",
            "JAX_ARX_FALLBACK": "error",
            "JAX_ARX_TIMEOUT_S": "30",
            "XLA_FLAGS": flags,
            **env,
        }
    )


def cpu_env(env: dict | None = None) -> dict:
    """A ``--cpu-smoke`` worker's environment (the launcher adds the CPU devices)."""
    return launched.clean_env({"JAX_ARX_FALLBACK": "error", "JAX_ARX_TIMEOUT_S": "30", **(env or {})})


@dataclasses.dataclass
class Run:
    """What a launch reported: ``reports[process][phase]``, and its output."""

    reports: dict
    stdout: str
    stderr: str
    seconds: float

    def phase(self, name: str) -> dict:
        """Every rank's report of phase ``name``, by rank (a process with
        several devices reports for each of its ranks: see GpuWorker.report)."""
        by_rank = {}
        for process, phases in sorted(self.reports.items()):
            assert name in phases, f"process {process} reported no phase {name!r}: {sorted(phases)}"
            for rank in phases[name]["ranks"]:
                by_rank[int(rank)] = phases[name]
        return by_rank


def run_workers(
    script: str,
    args: list[str],
    nprocs: int | None,
    env: dict,
    *,
    timeout: float,
    cpu_devices: int | None = None,
    peer_lost: bool = False,
) -> Run:
    """Runs ``script --worker *args`` on ``nprocs`` processes under the launcher
    (None: one process, without it), from the tests' directory so that the
    installed jax_arx is imported; fails the test unless every process
    exits 0. Returns what each printed on its RESULT lines.

    ``peer_lost``: a rank left on purpose, and the survivors may then be
    ended by jax's coordination client (``JAX distributed service detected
    fatal errors``) once every rank has reported: jax.distributed, not
    jax_arx, ends them, and the reports are what the test checks."""
    if nprocs is None:
        cmd = [sys.executable, script, "--worker", *args]
    else:
        cmd = launched.launcher_cmd(nprocs, cpu_devices or None, script, "--worker", *args)
    start = time.monotonic()
    p = launched.run_launcher(cmd, env, HERE, timeout)
    seconds = time.monotonic() - start
    reports: dict = {}
    for line in p.stdout.splitlines():
        process = 0
        if line.startswith("[rank "):
            process, line = int(line[len("[rank ") : line.index("]")]), line[line.index("]") + 2 :]
        if line.startswith(RESULT):
            report = json.loads(line[len(RESULT) :])
            reports.setdefault(process, {})[report["phase"]] = report
    detail = (
        f"{' '.join(args)} on {nprocs or 1} process(es): status {p.returncode} after {seconds:.0f} s\n"
        f"--- stdout\n{p.stdout[-8000:]}\n--- stderr\n{p.stderr[-8000:]}"
    )
    assert sorted(reports) == list(range(nprocs or 1)), detail
    jax_ended_them = peer_lost and "JAX distributed service detected fatal errors" in p.stderr
    assert p.returncode == 0 or jax_ended_them, detail
    return Run(reports, p.stdout, p.stderr, seconds)


_launches: dict = {}


def launch_once(key, launch) -> Run:
    """``launch()``, run once per pytest session for ``key``: the tests that
    assert on parts of one launch share it (a failed launch fails each)."""
    if key not in _launches:
        try:
            _launches[key] = launch()
        except BaseException as e:  # noqa: BLE001 - pytest's outcomes too: a skip or failure repeats for each test
            _launches[key] = e
    if isinstance(_launches[key], BaseException):
        raise _launches[key]
    return _launches[key]


WORLDS = (2, 3, 4)


def world_launch(script: str, worker: str, world: int, phases: tuple[str, ...] = ()) -> Run:
    """The launch of ``script``'s ``worker`` on ``world`` ranks that every
    test of that world asserts on (once per session); ``phases``: the
    worker's phases to run (``--phases``), where not its default ones (the
    ring phases run in a launch of their own, so ``-k ring`` runs only
    those). XLA command buffers are forced on at world 2 and 4 and off at
    world 3: both modes are covered without more launches."""
    gpus = require_gpus(1)
    flags = CMDBUF_OFF if world == 3 else CMDBUF_ON
    args = [worker, "--phases", ",".join(phases)] if phases else [worker]
    return launch_once(
        (script, worker, world, phases),
        lambda: run_workers(script, args, world, gpu_env(gpus, world, {"XLA_FLAGS": flags}), timeout=480),
    )


RING_PHASES = ("ring", "ring_tcp")  # a launch of their own


def mesh_phases(phases) -> tuple[str, ...]:
    """A suite's phases but the ring's: its default launch's."""
    return tuple(p for p in phases if p not in RING_PHASES)


def phase_tests(script: str, worker: str, phases, check_phase):
    """A suite's two tests, parametrized by world and phase: its phases but
    the ring's in one launch per world, the ring's (``RING_PHASES``) in
    another. ``check_phase(run, phase, world, summary_line)`` asserts one
    phase of a launch. Assign them to ``test_<worker>`` and
    ``test_<worker>_ring`` in the suite's module."""

    @pytest.mark.parametrize("phase", mesh_phases(phases))
    @pytest.mark.parametrize("world", WORLDS)
    def test_mesh(world, phase, summary_line):
        check_phase(world_launch(script, worker, world), phase, world, summary_line)

    @pytest.mark.parametrize("phase", RING_PHASES)
    @pytest.mark.parametrize("world", WORLDS)
    def test_ring(world, phase, summary_line):
        check_phase(world_launch(script, worker, world, RING_PHASES), phase, world, summary_line)

    return test_mesh, test_ring


def worker_phases(argv: list[str], default) -> list[str]:
    """The phases a worker runs: ``--phases a,b`` on its command line, else
    ``default``."""
    return argv[argv.index("--phases") + 1].split(",") if "--phases" in argv else list(default)


# --- what the tests assert --------------------------------------------------------


def assert_correct(reports: dict, expect=None, same_everywhere=True) -> None:
    """Every rank checked something in each case (exactly the cases in
    ``expect``, when given) and found nothing wrong; with ``same_everywhere``
    (results that are one value on every rank: psum's), every rank has the
    digest of every other, so they are bit-identical everywhere."""
    for rank, r in reports.items():
        assert not r.get("init_error"), (rank, r["init_error"])
        if expect is not None:
            assert sorted(r["cases"]) == sorted(expect), (rank, sorted(r["cases"]))
        assert r["cases"], (rank, "no case ran")
        for name, case in r["cases"].items():
            assert case["bad"] == [], (rank, name, case["bad"][:5])
            assert case["checked"] > 0, (rank, name)
    digests = {r["digest"] for r in reports.values()}
    assert len(digests) == 1 or not same_everywhere, {rank: r["digest"] for rank, r in reports.items()}


def expected_routes(env: dict, platform: str) -> set[str]:
    """The routes a phase with ``env`` may take (Endpoint.route); on the CPU
    the host device side uses the shm carrier's mapping, whatever the CUDA
    settings say."""
    # In a ring the links are the carrier's, even on one host: through the proxy.
    proxy = env.get("JAX_ARX_TRANSPORT") == "tcp" or env.get("JAX_ARX_TOPOLOGY") == "ring"
    if platform == "cpu":
        return {PROXY if proxy else HOST_INBOXES}
    if proxy or env.get("JAX_ARX_CUDA_DIRECT") == "0":
        return {PROXY}
    return {"0": {HOST_INBOXES}, "1": {GPU_INBOXES}}.get(
        env.get("JAX_ARX_CUDA_PEER_MEMORY"), {GPU_INBOXES, HOST_INBOXES}
    )


def assert_route(run: Run, reports: dict, env: dict, summary_line) -> str:
    """Every endpoint took one route, one the phase's settings allow; returns
    it. By default GPU inboxes are used where every rank can map every
    peer's: where they cannot (processes sharing one GPU may not), the core
    says why in one log line, which must be there, and the test run's summary
    says what ran instead."""
    routes = {route for r in reports.values() for route in r["routes"].values()}
    assert len(routes) == 1, routes
    route = routes.pop()
    platform = next(iter(reports.values()))["platform"]
    assert route in expected_routes(env, platform), (route, env, platform)
    if platform == "cuda" and route == HOST_INBOXES and "JAX_ARX_CUDA_PEER_MEMORY" not in env:
        why = [line for line in run.stderr.splitlines() if NO_GPU_INBOXES_LINE in line]
        assert why, f"the route fell back to host inboxes without the log line {NO_GPU_INBOXES_LINE!r}"
        summary_line(f"GPU inboxes are not used here, the direct route took host inboxes: {why[0]}")
    return route


def assert_relays(reports: dict, env: dict) -> None:
    """In a ring of 4 every rank relayed its previous rank's puts to the
    rank two away (Endpoint.stats()["relayed_puts"]); nowhere else did any."""
    for rank, r in reports.items():
        if env.get("JAX_ARX_TOPOLOGY") == "ring" and r["world"] == 4:
            assert all(n > 0 for n in r["relayed"].values()), (rank, r["relayed"])
        else:
            assert not any(r["relayed"].values()), (rank, r["relayed"])


def stats_sum(ran: dict, group: str) -> dict:
    """Endpoint.stats() deltas of every rank of a report, ``group`` ("calls"
    or "algorithms"), as {rank: {name: n}}."""
    return {rank: {k: v for k, v in s[group].items() if v} for rank, s in ran.items()}


def assert_ran(ran: dict, expected: dict, group: str) -> None:
    """Each rank's handlers ran ``expected`` ({name: n}) for one run of a
    program, or a whole multiple of it (XLA may run a captured program's
    handlers again when it records the graph anew)."""
    want = {k: v for k, v in expected.items() if v}
    for rank, got in stats_sum(ran, group).items():
        assert want and set(got) == set(want), (rank, got, want)
        name = next(iter(want))
        k = got[name] // want[name]
        assert k >= 1 and got == {name: k * n for name, n in want.items()}, (rank, got, want)


def assert_graph_calls(graph: dict, xla_flags: str, platform: str) -> None:
    """A program of ``ops`` collectives run again and again: with XLA command
    buffers forced on its CUDA graph replays without running the handlers
    (far fewer runs than calls: XLA records the graph again only when buffer
    addresses change); with them off, or on the CPU, they run once a call."""
    calls = {rank: sum(c.values()) for rank, c in graph["calls"].items()}
    if platform == "cuda" and CMDBUF_ON in xla_flags.split():
        assert all(n < graph["ops"] / 4 for n in calls.values()), graph
    else:
        assert all(n == graph["ops"] for n in calls.values()), graph


# --- the worker's side ------------------------------------------------------------


def place_rank() -> None:
    """This process's GPU(s), before jax starts: with ARX_TEST_GPUS = the G
    GPUs of the test, process p with k devices (ARX_TEST_DEVICES_PER_PROCESS)
    gets GPUs (p * k + i) % G, i < k, as its CUDA_VISIBLE_DEVICES."""
    gpus = [g for g in os.environ.get("ARX_TEST_GPUS", "").split(",") if g]
    if not gpus:
        return
    p, k = int(os.environ.get("JAX_PROCESS_ID", "0")), int(os.environ.get("ARX_TEST_DEVICES_PER_PROCESS", "1"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[(p * k + i) % len(gpus)] for i in range(k))


def emit(**report) -> None:
    print(RESULT + json.dumps(report), flush=True)


def signed_inputs(dtype, count: int, world: int, seed: int) -> list[np.ndarray]:
    """Each rank's partial: normal values over twelve binades (so that the
    fp32 sum's order shows in its bits), led by signed zeros in every
    combination of the ranks' signs (all negative: -0.0, since the sum starts
    from rank 0's element, not from +0.0)."""
    rng = np.random.default_rng(seed)
    parts = [
        (rng.standard_normal(count) * 2.0 ** rng.integers(-6, 7, count)).astype(np.float32).astype(dtype)
        for _ in range(world)
    ]
    zeros = min(count, 1 << world)
    for r, p in enumerate(parts):
        p[:zeros] = np.where((np.arange(zeros) >> r) & 1, -0.0, 0.0).astype(dtype)
    return parts


# The GPU suites test the fused kernels themselves (the MoE combine, the
# norm), where the plan would step aside for their unfused forms
# (ffi/comm/plan.cc); a phase's tuning may say otherwise.
FUSED_KERNELS = {**suites.MOE_FUSED, "norm_fused": 1}


class GpuWorker(suites._Worker):
    """One process of a GPU worker: bulk_cases' worker (a 1-D mesh
    ``sp`` of every device, numpy-checked cases) run in phases, with a digest
    of every result it checked. jax.lax's collectives are never run (they
    would be NCCL's, which refuses ranks sharing a GPU)."""

    def __init__(self, cpu_smoke: bool = False):
        super().__init__()
        self.smoke = cpu_smoke
        self.platform = "cpu" if self.jax.devices()[0].platform == "cpu" else "cuda"
        # What suites._Worker initialized jax_arx with: a phase that asks for
        # other tuning (FUSED_KERNELS, the first) initializes it again.
        self.phase_name, self.crc, self._env, self._tuning = "main", 0, {}, dict(suites.MOE_FUSED)
        self.lowered: dict[str, int] = {}

    def phase(self, name: str, env: dict | None = None, tuning: dict | None = None, fresh: bool = False) -> str:
        """Starts phase ``name``: fresh records, and jax_arx initialized again
        with ``env`` on top of the worker's environment and ``tuning`` (on
        top of FUSED_KERNELS: the fused cases run the fused kernels) where
        they differ from the last phase's (or where ``fresh``: new endpoints).
        Every process must run the same phases in order. Returns
        initialize's error, or ''."""
        self.phase_name, self.crc, self.cases, self.lowered = name, 0, {}, {}
        tuning = dict(FUSED_KERNELS, **(tuning or {}))
        if not fresh and (env or {}) == self._env and tuning == self._tuning:
            return ""
        self.jax_arx.shutdown()
        for key in self._env:
            os.environ.pop(key, None)
        os.environ.update(env or {})
        self._env, self._tuning = dict(env or {}), tuning
        try:
            self.jax_arx.initialize(self.mesh, _tuning=tuning)
        except self.jax_arx.InitializationError as e:
            return str(e)
        return ""

    def endpoints(self, bulk: bool = False):
        """This process's endpoints of the axis: initialize()'s, or
        (``bulk``) the bulk collectives', which the first of those made
        (none before it)."""
        from jax_arx import _comm, _registry

        if bulk:
            comm = _registry._bulk_communicators.get(AXIS)
            return comm.endpoints if comm is not None else ()
        return _comm.communicator(AXIS).endpoints

    def stats(self) -> dict:
        """Each local rank's Endpoint.stats() "calls" and "algorithms",
        summed over its endpoints (psum's and the bulk collectives')."""
        out = {}
        for le in self.endpoints() + self.endpoints(bulk=True):
            mine = out.setdefault(le.rank, {"calls": {}, "algorithms": {}})
            st = le.endpoint.stats()
            for group, counts in mine.items():
                for k, v in st[group].items():
                    counts[k] = counts.get(k, 0) + v
        return out

    def counted(self, fn, *args, **kwargs) -> dict:
        """Runs fn; returns each local rank's Endpoint.stats() calls and
        algorithms run meanwhile."""
        before = self.stats()
        fn(*args, **kwargs)
        after = self.stats()
        return {
            rank: {
                group: {k: after[rank][group][k] - before[rank][group][k] for k in after[rank][group]}
                for group in ("calls", "algorithms")
            }
            for rank in after
        }

    def calls(self, f, *args, target="jax_arx_"):
        found = super().calls(f, *args, target=target)
        for line in found:
            name = line.split("custom_call @")[1].split("(")[0].strip()
            self.lowered[KINDS.get(name, name)] = self.lowered.get(KINDS.get(name, name), 0) + 1
        return found

    def check(self, case, got, want, what):
        super().check(case, got, want, what)
        self.crc = zlib.crc32(np.ascontiguousarray(got).tobytes(), self.crc)

    def report(self, **extra) -> None:
        """The phase's RESULT line (see the module doc), for every local rank."""
        routes, relayed = {}, {}
        if not extra.get("init_error"):
            # Puts made for another rank (a ring of 4), bulk endpoints' included.
            for le in self.endpoints() + self.endpoints(bulk=True):
                relayed[le.rank] = relayed.get(le.rank, 0) + le.endpoint.stats()["relayed_puts"]
            routes = {str(le.rank): le.endpoint.route for le in self.endpoints()}
            routes.update({f"{le.rank}/bulk": le.endpoint.route for le in self.endpoints(bulk=True)})
        emit(
            phase=self.phase_name,
            platform=self.platform,
            world=self.world,
            ranks=[self.rank_of(d) for d in self.jax.local_devices()],
            routes=routes,
            cases=self.cases,
            digest=self.crc,
            relayed=relayed,
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            **extra,
        )
