"""GPU tests of jax_arx.psum's CUDA device side (ffi/cuda).

Marked ``gpu`` and skipped without NVIDIA GPUs or without a jax_arx built
with CUDA. Every test runs its GPU work in fresh processes (this file run as
a script, ``--worker NAME``), so the pytest process never starts a GPU
backend and each scenario gets the environment it needs (XLA_FLAGS, NCCL and
JAX_ARX_* variables are read once per process):

- two processes with one GPU each (``python -m jax_arx.launch -n 2``, each
  rank restricted to its GPU with CUDA_VISIBLE_DEVICES), with XLA command
  buffers on and off: every dtype, sizes from 16 bytes to the two-shot limit
  with odd element counts, bit-identical to an fp32 rank-order reference
  computed with numpy and ml_dtypes, both algorithms, and each one-shot
  path of the direct mode (LL, pipelined, whole); inputs aliased to
  outputs; prefetch operands; 10,000 back-to-back calls; proof that XLA
  captured the launches in a CUDA graph (the handler runs once per capture,
  not once per call) and that replays stay correct;
- one process driving two GPUs, the same checks;
- a peer process that exits mid-stream: the survivor's kernel returns within
  the timeout with NaN, ``jax_arx.check()`` names the peer, the GPU still
  runs new work, and the next call whose handler runs raises;
- one GPU and no peer at all: the test writes (or withholds) the peer's
  slots and flags in the pinned region itself, on time, late, stale, with
  a different descriptor, or never, and checks the result, the timeout and
  the failure record (through the test-only C hooks in
  ffi/xla/testing_cuda.cc); the same for the LL one-shot's lines, torn
  halves and stale flags included, with the endpoint in direct mode and its
  own region standing in for the peer's (arx_testing_loopback).

Run them all on a machine with 2 GPUs (about 3 minutes on 2 H200s)::

    pip install --no-build-isolation . && python -m pytest -m gpu tests/test_gpu_psum.py -v

``python tests/test_gpu_psum.py --worker collective --layout 1proc --quick
--cpu-smoke`` (JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2) runs the collective
worker's Python through the CPU handler, to check this file without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
RESULT = "RESULT "


# --- when to run ------------------------------------------------------------

def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# Workers run from this directory, so `import jax_arx` finds the installed
# package (with its compiled _core), not the source tree beside it that
# `python -m pytest` puts first on sys.path when run from the repository root.
WORKDIR = os.path.dirname(THIS)


def _built_with_cuda() -> bool:
    try:
        p = subprocess.run([sys.executable, "-c", "from jax_arx import _core; print(_core.has_cuda())"],
                           capture_output=True, text=True, timeout=120, cwd=WORKDIR)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.stdout.strip() == "True"


def needs_gpus(n):
    return pytest.mark.skipif(_gpu_count() < n or not _built_with_cuda(),
                              reason=f"needs {n} NVIDIA GPU(s) and jax_arx built with CUDA")


# --- running workers --------------------------------------------------------

def _run(args, *, nprocs=None, env=None, timeout=300):
    """Runs this file as a worker (under the launcher when nprocs is given)
    and returns the RESULT records each rank printed, by rank."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("JAX_ARX_TIMEOUT_S", "20")
    cmd = [sys.executable, THIS, "--worker", *args]
    if nprocs is not None:
        cmd = [sys.executable, "-m", "jax_arx.launch", "-n", str(nprocs), THIS, "--worker", *args]
    # Its own process group: on a timeout the launcher gets SIGTERM (it stops
    # its ranks), then the whole group SIGKILL, so nothing is left on the GPUs.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                         start_new_session=True, cwd=WORKDIR)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, err = p.communicate()
        sys.stdout.write(out[-20000:])
        sys.stderr.write(err[-20000:])
        pytest.fail(f"worker {args} did not finish within {timeout} s")
    sys.stdout.write(out[-20000:])
    sys.stderr.write(err[-20000:])
    assert p.returncode == 0, f"worker {args} failed with status {p.returncode}; see its output above"
    results = {}
    for line in out.splitlines():
        rank = 0
        if line.startswith("[rank "):
            rank = int(line[len("[rank "):line.index("]")])
            line = line[line.index("]") + 2:]
        if line.startswith(RESULT):
            results.setdefault(rank, {}).update(json.loads(line[len(RESULT):]))
    return results


# --- the tests --------------------------------------------------------------

# Graphs of even one custom call are captured, so every jitted call below
# exercises the command-buffer path.
CMDBUF_ON = "--xla_gpu_graph_min_graph_size=1"
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="


@needs_gpus(1)
def test_waits_without_a_peer():
    r = _run(["wait"], env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]},
             timeout=150)[0]
    assert r["cases"] and all(c["ok"] for c in r["cases"].values()), json.dumps(r["cases"], indent=1)


@needs_gpus(1)
def test_ll_waits_without_a_peer():
    r = _run(["wait_ll"], env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]},
             timeout=150)[0]
    if r.get("missing_hook"):
        pytest.skip(f"ffi/xla/testing_cuda.cc has no {r['missing_hook']}")
    assert r["cases"] and all(c["ok"] for c in r["cases"].values()), json.dumps(r["cases"], indent=1)


@needs_gpus(2)
@pytest.mark.parametrize("direct,pipeline,ll,inboxes", [
    ("1", "1", "", "gpu"), ("1", "1", "0", "gpu"), ("1", "0", "0", "gpu"), ("1", "", "16KiB", "gpu"),
    ("1", "1", "", "host"), ("1", "", "16KiB", "host"), ("0", "", "", "host")],
    ids=["direct-builtin-ll-pipelined", "direct-pipelined", "direct-whole", "direct-ll-16k", "direct-host-ll-pipelined",
         "direct-host-ll-16k", "proxy"])
def test_two_processes_command_buffers_on(direct, pipeline, ll, inboxes):
    # direct: the kernels write the peer's inbox themselves (shm carrier),
    # the one-shot up to the LL limit (built in: its cap, 128 KiB; ll:
    # JAX_ARX_CUDA_LL_MAX_BYTES, 0 off) in 16-byte lines that carry their flags (LL), above
    # it chunk by chunk with a flag per chunk (pipelined) or in one piece with one
    # flag (whole); proxy: they publish and the proxy copies (as over tcp or
    # verbs). So each direct path runs every dtype and odd counts on both sides
    # of the limits. inboxes: where the peer's data lands, each GPU's own memory
    # mapped into the other's (required here: these GPUs have peer access) or the
    # pinned host region (JAX_ARX_CUDA_PEER_MEMORY=0). The other tests run
    # jax_arx's default choice.
    peer_memory = "1" if inboxes == "gpu" else ("0" if direct == "1" else "")
    results = _run(["collective", "--layout", "2proc"], nprocs=2,
                   env={"XLA_FLAGS": CMDBUF_ON, "JAX_ARX_CUDA_DIRECT": direct, "JAX_ARX_CUDA_PIPELINE": pipeline,
                        "JAX_ARX_CUDA_LL_MAX_BYTES": ll, "JAX_ARX_CUDA_PEER_MEMORY": peer_memory},
                   timeout=240)
    assert sorted(results) == [0, 1]
    for rank, r in results.items():
        assert r["inboxes"] == [inboxes], (rank, r["inboxes"])
        assert r["mismatches"] == [], (rank, r["mismatches"][:5])
        assert r["checked"] > 100
        assert r["loop_error"] == 0.0 and r["twoshot_loop_error"] == 0.0
        # Captured: the handler ran once per capture, far fewer times than calls.
        assert r["graph_calls"] == 8 * 20
        assert r["graph_handler_runs"] < r["graph_calls"] / 4, r
        assert r["graph_replays_ok"]
    assert results[0]["digest"] == results[1]["digest"]


@needs_gpus(2)
def test_two_processes_command_buffers_off():
    results = _run(["collective", "--layout", "2proc", "--quick"], nprocs=2, env={"XLA_FLAGS": CMDBUF_OFF},
                   timeout=200)
    for rank, r in results.items():
        assert r["mismatches"] == [], (rank, r["mismatches"][:5])
        assert r["loop_error"] == 0.0 and r["twoshot_loop_error"] == 0.0
        # Not captured: the handler ran for every call.
        assert r["graph_handler_runs"] == r["graph_calls"]
        assert r["graph_replays_ok"]
    assert results[0]["digest"] == results[1]["digest"]


@needs_gpus(2)
def test_one_process_two_gpus():
    results = _run(["collective", "--layout", "1proc", "--quick"], env={"XLA_FLAGS": CMDBUF_ON}, timeout=200)
    r = results[0]
    assert r["mismatches"] == [], r["mismatches"][:5]
    assert r["loop_error"] == 0.0 and r["twoshot_loop_error"] == 0.0
    assert r["graph_replays_ok"]
    # Both endpoints in one process map each other's GPU inbox (GPUs with peer access).
    assert r["inboxes"] == ["gpu", "gpu"], r["inboxes"]


@needs_gpus(2)
def test_peer_exits_mid_stream():
    timeout_s = 3.0
    results = _run(["peer_exit"], nprocs=2, env={"JAX_ARX_TIMEOUT_S": str(timeout_s), "XLA_FLAGS": CMDBUF_ON},
                   timeout=150)
    r = results[0]
    assert r["healthy_before"]
    # The survivor's kernel gave up within the timeout (plus launch slack),
    # and its output is NaN, never a silently wrong sum.
    assert r["wait_s"] < timeout_s + 2.0, r
    assert r["all_nan"]
    assert "rank 1" in r["check_error"] and "timed out" in r["check_error"], r["check_error"]
    assert r["gpu_still_works"]
    # The program again returns at once: either its captured graph replays
    # (the kernel sees the recorded failure and fills NaN) or XLA captures it
    # anew (new buffer addresses), its handler runs and raises the failure.
    assert r["replay_s"] < 1.0 and (r["replay_all_nan"] or "rank 1" in r["replay_error"]), r
    assert "rank 1" in r["next_call_error"], r["next_call_error"]


# --- the workers ----------------------------------------------------------------
# Everything below runs in the worker processes only.

DTYPES = ("float32", "bfloat16", "float16")
# --cpu-smoke: run the collective worker's Python on the CPU backend (one-shot
# only, through the host handler), to check this file without a GPU.
CPU_SMOKE = False
ALGORITHMS = (1, 2)


def _np_dtype(name):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def reference(parts):
    """The contract: the fp32 sum in rank order, from 0.0f, rounded once to
    the element type (round to nearest even, as numpy and ml_dtypes do)."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc = acc + p.astype(np.float32)
    return acc.astype(parts[0].dtype)


def _bits(a):
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _inputs(dtype, count, world, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(count).astype(np.float32).astype(dtype) for _ in range(world)]


def _direct(x, comm_id, algorithm, prefetch=(), alias=False, site=0):
    """The FFI call jax_arx.psum lowers to, with the algorithm forced."""
    import jax
    call = jax.ffi.ffi_call("jax_arx_psum", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True,
                            input_output_aliases={0: 0} if alias else None)
    attrs = dict(comm_id=np.int64(comm_id), algorithm=np.int64(algorithm), site=np.int64(site))
    if prefetch:
        attrs["prefetch"] = np.int64(len(prefetch))  # the last operands: weights to prefetch into L2
    return call(x, *prefetch, **attrs)


def _chained(calls, xs):
    """calls[i](xs[i]) for every i, each after the one before: every rank
    must issue its collectives in the same order, and independent calls in
    one program carry no order (XLA's CPU runtime runs them concurrently)."""
    import jax
    outs, prev = [], None
    for call, x in zip(calls, xs):
        if prev is not None and CPU_SMOKE:
            # The CPU runtime ignores the barrier's order; a data dependency it keeps.
            x = x + (prev.ravel()[0] * 0).astype(x.dtype)
        elif prev is not None:
            x, _ = jax.lax.optimization_barrier((x, prev))
        prev = call(x)
        outs.append(prev)
    return tuple(outs)


def _emit(**kv):
    print(RESULT + json.dumps(kv), flush=True)


def _setup(layout, heartbeat_timeout_s=None):
    """Mesh axis "x" of two GPUs: one per process (2proc) or both in this
    process (1proc). Returns (jax, jax_arx, mesh, comm)."""
    if layout == "2proc":
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["JAX_PROCESS_ID"]
    import jax
    import jax_arx
    if heartbeat_timeout_s is not None and not CPU_SMOKE:
        # jax.distributed ends every process soon after one stops sending
        # heartbeats; the peer-exit test outlives its peer on purpose.
        jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["JAX_PROCESS_ID"]),
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    jax_arx.distributed_initialize()
    devices = jax.devices()[:2]
    assert len(devices) == 2 and (CPU_SMOKE or all(d.platform == "gpu" for d in devices)), devices
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    jax_arx.initialize(mesh)
    from jax_arx import _comm
    return jax, jax_arx, mesh, _comm.communicator("x")


def _global(jax, mesh, parts):
    """The array whose shard on rank r is parts[r]."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    flat = np.concatenate(parts)
    return jax.make_array_from_callback(flat.shape, NamedSharding(mesh, P("x")), lambda idx: flat[idx])


def _local_results(out, n):
    """{rank: numpy result} for the shards of `out` on this process."""
    return {s.index[0].start // n if s.index[0].start else 0: np.asarray(s.data) for s in out.addressable_shards}


def _sharded(jax, mesh, body, donate=False):
    from jax.sharding import PartitionSpec as P
    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return jax.jit(f, donate_argnums=(0,) if donate else ())


def _handler_calls():
    if CPU_SMOKE:
        return 0
    import ctypes
    from jax_arx import _core
    lib = ctypes.CDLL(_core.__file__)
    lib.arx_testing_handler_calls.restype = ctypes.c_uint64
    return int(lib.arx_testing_handler_calls())


def worker_collective(layout, quick):
    jax, jax_arx, mesh, comm = _setup(layout)
    import jax.numpy as jnp
    world = 2
    slot = comm.slot_bytes
    twoshot_max = min(comm.send_bytes, world * slot)
    mismatches, checked = [], 0
    digest = 0

    # 1. Every dtype, sizes from 16 bytes to the two-shot limit, odd counts,
    # both algorithms: one program per dtype holding every case, in the
    # same order on every rank. 16384 and 131072 are the LL one-shot's limit
    # in two of the cases above and its cap, the built-in limit (direct
    # mode), and 32768 a former one: each with a size just past it.
    byte_sizes = [16, 8192, 65536, slot, twoshot_max] if quick else \
        [16, 48, 1000, 8192, 16384, 16400, 32768, 32784, 65536, 131072, 131088, 262144, 524288, slot, twoshot_max]
    for name in DTYPES:
        dt = _np_dtype(name)
        counts = sorted({c for b in byte_sizes for c in (b // dt.itemsize, b // dt.itemsize - 1)} | {1, 3})
        cases = []
        for c in counts:
            for alg in ALGORITHMS:
                limit = slot if alg == 1 else twoshot_max
                if 0 < c * dt.itemsize <= limit:
                    cases.append((c, alg))
        # Seeds every rank computes alike (str hashes differ between processes).
        parts = [_inputs(dt, c, world, seed=zlib.crc32(f"{name}/{c}".encode())) for c, _ in cases]

        def body(*xs):
            return _chained([lambda x, alg=alg, k=k: _direct(x, comm.comm_id, alg, site=k)
                             for k, (_, alg) in enumerate(cases)], xs)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("x"),) * len(cases),
                                  out_specs=(jax.sharding.PartitionSpec("x"),) * len(cases), check_vma=False))
        outs = f(*[_global(jax, mesh, p) for p in parts])
        for (c, alg), p, out in zip(cases, parts, outs):
            want = reference(p)
            for rank, got in _local_results(out, c).items():
                checked += 1
                if not np.array_equal(_bits(got), _bits(want)):
                    bad = np.flatnonzero(_bits(got) != _bits(want))
                    mismatches.append(dict(dtype=name, count=c, algorithm=alg, rank=rank, bad=int(bad.size),
                                           first=int(bad[0]), got=float(got[bad[0]]), want=float(want[bad[0]])))
                digest = (digest * 1000003 + int(_bits(got).astype(np.uint64).sum())) % (1 << 61)

    # 2. jax_arx.psum itself (its algorithm choice: one-shot, and past the
    # 1 MiB slot the two-shot), aliasing, prefetch operands.
    for name in DTYPES if not CPU_SMOKE else ():
        dt = _np_dtype(name)
        for c in (5, 4097, (3 << 19) // dt.itemsize + 1):
            p = _inputs(dt, c, world, seed=7 + c)
            out = _sharded(jax, mesh, lambda x: jax_arx.psum(x, "x"))(_global(jax, mesh, p))
            for rank, got in _local_results(out, c).items():
                checked += 1
                if not np.array_equal(_bits(got), _bits(reference(p))):
                    mismatches.append(dict(dtype=name, count=c, what="jax_arx.psum", rank=rank))
            # jax_arx.psum(prefetch=...): the weights reach the CUDA handler as
            # operands (counted by its `prefetch` attribute) and change no bit.
            def with_prefetch(x):
                weights = {"w": jnp.ones((1 << 20,), jnp.bfloat16) * x[0].astype(jnp.bfloat16),
                           "b": jnp.ones((777,), jnp.float32)}
                return jax_arx.psum(x, "x", prefetch=weights)
            f = _sharded(jax, mesh, with_prefetch)
            xg = _global(jax, mesh, p)
            if "prefetch = 2" not in f.lower(xg).as_text():
                mismatches.append(dict(dtype=name, count=c, what="jax_arx.psum(prefetch=) lowered without operands"))
            for rank, got in _local_results(f(xg), c).items():
                checked += 1
                if not np.array_equal(_bits(got), _bits(reference(p))):
                    mismatches.append(dict(dtype=name, count=c, what="jax_arx.psum(prefetch=)", rank=rank))
    # 4001 bf16: the LL one-shot in direct mode (below its built-in limit).
    for alg, c in ((a, c) for a in ALGORITHMS for c in (4001, 100003)):
        dt = _np_dtype("bfloat16")
        p = _inputs(dt, c, world, seed=11 + alg + c)
        for alias, prefetch in ((True, False), (False, not CPU_SMOKE)):  # the CPU handler takes no prefetch
            def body(x, alias=alias, prefetch=prefetch, alg=alg):
                # Weights the next kernels would read: prefetched into L2 while the kernel waits.
                w = (jnp.ones((1 << 20,), jnp.bfloat16) * x[0], jnp.ones((12345,), jnp.float32)) if prefetch else ()
                return _direct(x * 1, comm.comm_id, alg, prefetch=w, alias=alias)
            out = _sharded(jax, mesh, body, donate=alias)(_global(jax, mesh, p))
            for rank, got in _local_results(out, c).items():
                checked += 1
                if not np.array_equal(_bits(got), _bits(reference(p))):
                    mismatches.append(dict(count=c, algorithm=alg, alias=alias, prefetch=prefetch, rank=rank))

    # 3. Back-to-back calls: 10,000 one-shot sums in one program (fori_loop),
    # each checked against what it must be, so a stale slot or a skipped seq
    # shows; then 1,000 two-shot sums (2,000 seqs).
    def loop(n_iter, count, alg):
        def body(x):
            r = jax.lax.axis_index("x").astype(jnp.float32)
            i = jnp.arange(count, dtype=jnp.float32)

            def step(k, err):
                kf = k.astype(jnp.float32)
                y = _direct(kf + r + i, comm.comm_id, alg)
                want = world * kf + world * (world - 1) / 2 + world * i
                return err + jnp.sum(jnp.abs(y - want))
            return jax.lax.fori_loop(0, n_iter, step, jnp.zeros((), jnp.float32) + x[0] * 0)[None]
        f = _sharded(jax, mesh, body)
        out = f(_global(jax, mesh, [np.zeros(1, np.float32)] * world))
        return float(max(np.asarray(s.data).max() for s in out.addressable_shards))

    t = time.perf_counter()
    loop_error = loop(10000, 2048, 1)
    loop_s = time.perf_counter() - t
    twoshot_loop_error = loop(1000, 300001, 2) if 2 in ALGORITHMS else 0.0

    # 4. Command buffers: a program of 8 sums run 20 times. Captured in a CUDA
    # graph, the handler runs once per capture (XLA re-captures when buffer
    # addresses change), not once per call; every replay must be right.
    n = 4099
    parts = _inputs(_np_dtype("bfloat16"), n, world, seed=99)
    want = reference(parts)

    def body8(x):
        calls = [lambda x, k=k: _direct(x, comm.comm_id, ALGORITHMS[k % len(ALGORITHMS)]) for k in range(8)]
        return _chained(calls, [x] * 8)[-1]
    f8 = _sharded(jax, mesh, body8)
    xg = _global(jax, mesh, parts)
    f8(xg).block_until_ready()  # compile and first run
    before = _handler_calls()
    replays_ok = True
    for _ in range(20):
        out = f8(xg)
        for rank, got in _local_results(out, n).items():
            replays_ok &= bool(np.array_equal(_bits(got), _bits(want)))
    handler_runs = _handler_calls() - before
    per_process = len(_local_results(out, n))

    _emit(mismatches=mismatches, checked=checked, digest=digest, loop_error=loop_error, loop_s=loop_s,
          twoshot_loop_error=twoshot_loop_error, graph_calls=8 * 20,
          graph_handler_runs=handler_runs // per_process, graph_replays_ok=replays_ok,
          xla_flags=os.environ.get("XLA_FLAGS", ""), inboxes=[le.endpoint.psum_inboxes for le in comm.endpoints])
    jax_arx.check()


def worker_peer_exit():
    jax, jax_arx, mesh, comm = _setup("2proc", heartbeat_timeout_s=600)
    import jax.numpy as jnp
    rank = jax.process_index()
    n = 4096
    parts = _inputs(_np_dtype("bfloat16"), n, 2, seed=5)
    f = _sharded(jax, mesh, lambda x: _direct(x, comm.comm_id, 1))
    xg = _global(jax, mesh, parts)
    # Compiled while both ranks live: compiling a program over the mesh after
    # the peer is gone would wait for it in jax.distributed.
    g = _sharded(jax, mesh, lambda x: _direct(x * 2, comm.comm_id, 1)).lower(xg).compile()
    healthy = True
    for _ in range(50):
        out = f(xg)
    for r, got in _local_results(out, n).items():
        healthy &= bool(np.array_equal(_bits(got), _bits(reference(parts))))
    if rank == 1:
        # Exit mid-stream without a word to anyone (no atexit, no shutdown).
        sys.stdout.flush()
        os._exit(0)
    t0 = time.perf_counter()

    def step(what):  # progress on stderr, so a hang shows where
        print(f"peer_exit: {time.perf_counter() - t0:.2f} s: {what}", file=sys.stderr, flush=True)

    time.sleep(1.0)

    def call(f):
        """(seconds, all NaN, error text): on GPUs a failed collective comes
        back as NaN (the kernel gave up); on the CPU backend it raises."""
        t = time.perf_counter()
        try:
            got = _local_results(f(xg), n)[0]
            return time.perf_counter() - t, bool(np.isnan(got.astype(np.float32)).all()), ""
        except Exception as e:  # jax's runtime error type differs between versions
            return time.perf_counter() - t, CPU_SMOKE, str(e)

    step("calling with the peer gone")
    wait_s, all_nan, _ = call(f)
    step(f"returned after {wait_s:.2f} s")
    try:
        jax_arx.check()
        check_error = ""
    except jax_arx.CollectiveError as e:
        check_error = str(e)
    step("checked")
    x = jnp.arange(100, dtype=jnp.float32)
    gpu_ok = float(x @ x) == 328350.0
    step("new work ran")
    # The captured graph again: no handler runs, the kernel sees the failure.
    replay_s, replay_nan, replay_error = call(f)
    step("replayed")
    # A program not run before: its first run captures it, so its handler
    # runs, and raises the endpoint's failure.
    _, _, next_error = call(g)
    step("raised" if next_error else "did not raise")
    _emit(healthy_before=healthy, wait_s=wait_s, all_nan=all_nan, check_error=check_error, gpu_still_works=gpu_ok,
          replay_s=replay_s, replay_all_nan=replay_nan, replay_error=replay_error[:2000],
          next_call_error=next_error[:2000])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the peer is gone: skip the shutdown barriers


# The LL one-shot (ffi/comm/layout.h, "The LL one-shot"): its slots, the
# tag that sets its descriptor apart, and the flag its lines carry.
LL_SLOT_BYTES = 256 << 10  # kLLSlotBytes: kLLMaxPayload (128 KiB) in 16-byte lines of 8 payload bytes
LL_TAG = 0x9E3779B97F4A7C15  # ll_tag(tag) = tag ^ LL_TAG


def _call_timed(peer, f, x):
    """Calls f(x) on peer's endpoint: the result, the seconds the call took,
    and what the endpoint recorded (control words, failure message)."""
    t = time.perf_counter()
    got = np.asarray(f(x))
    return got, time.perf_counter() - t, peer.control(), peer.failure()


def _aborted_while_waiting(peer, f, x):
    """Compiles f for x, calls it on peer's endpoint (whose peer never
    answers), and 0.3 s into the wait fails the endpoint from the host, as a
    carrier that lost the peer does (Control::abort). Returns whether the
    call came back within 2 s, all NaN, with the failure recorded as an
    abort that names the peer, and what was seen."""
    f.lower(x).compile()
    t = time.perf_counter()
    y = f(x)
    time.sleep(0.3)
    peer.fail("jax_arx: test: lost rank 1: connection reset")
    got = np.asarray(y)
    abort_s = time.perf_counter() - t
    ctl = peer.control()
    ok = (np.isnan(got).all() and abort_s < 2.0 and ctl["abort"] == 1 and ctl["failed_kind"] == 3
          and "lost rank 1" in peer.failure())
    return ok, dict(abort_s=abort_s, control=ctl)


def ll_flag(seq, desc):
    return (desc & 0xFFFFFF) << 8 | ((seq >> 1) & 0x7F) << 1 | 1


class FakePeer:
    """One endpoint with no peer process: the test is the peer. It writes
    the peer's slots and flags into the pinned region exactly where a
    carrier would (ffi/comm/layout.h), and the peer's LL lines where the
    peer's kernel would."""

    MODES = {"full": 1, "scatter": 2, "gather": 3}
    DTYPE = {"float32": 1, "bfloat16": 2, "float16": 3}

    def __init__(self, lib, comm_id, rank, world=2, timeout_s=2.0):
        import ctypes
        self.lib, self.comm_id, self.rank, self.world = lib, comm_id, rank, world
        err = ctypes.create_string_buffer(1024)
        rc = lib.arx_testing_open(ctypes.c_int64(comm_id), 0, rank, world, ctypes.c_double(timeout_s),
                                  ctypes.c_uint64(0), ctypes.c_uint64(0), err, 1024)
        assert rc == 0, err.value.decode()
        lay = (ctypes.c_uint64 * 8)()
        assert lib.arx_testing_layout(ctypes.c_int64(comm_id), 0, lay) == 0
        self.base, self.flags, self.recv, self.send, self.slot, self.send_bytes, self.total, self.roots = list(lay)

    def describe(self, mode, dtype, count, tag=0):
        """What a flag for this collective carries: tag = site * 64 + leaf (0 for _direct's calls)."""
        import ctypes
        self.lib.arx_testing_describe.restype = ctypes.c_uint64
        return int(self.lib.arx_testing_describe(self.MODES[mode], self.DTYPE[dtype], ctypes.c_uint64(count),
                                                 ctypes.c_uint64(tag)))

    def write_slot(self, seq, src, data: np.ndarray, offset=0):
        import ctypes
        buf = np.ascontiguousarray(data).tobytes()
        at = self.recv + ((seq & 1) * self.world + src) * self.slot + offset
        assert self.lib.arx_testing_write(ctypes.c_int64(self.comm_id), 0, ctypes.c_uint64(at), buf,
                                          ctypes.c_uint64(len(buf))) == 0

    def flag(self, src, progress, desc):
        import ctypes
        for root in range(self.roots):
            assert self.lib.arx_testing_store_flag(ctypes.c_int64(self.comm_id), 0, src * 2 + root,
                                                   ctypes.c_uint64(progress << 24 | desc)) == 0

    def control(self):
        import ctypes
        w = (ctypes.c_uint64 * 32)()
        assert self.lib.arx_testing_control(ctypes.c_int64(self.comm_id), 0, w) == 0
        w = list(w)
        return dict(published=w[0], bytes=w[1:3], mode=w[3:5], desc=w[5:7], dtype=w[7:9], done=w[9],
                    failed_seq=w[16], failed_kind=w[17], failed_missing=w[18], failed_flag=w[19],
                    failed_src=w[20], failed_desc=w[21], abort=w[24])

    def send_buffer(self, seq, nbytes):
        import ctypes
        return bytes((ctypes.c_uint8 * nbytes).from_address(self.base + self.send + (seq & 1) * self.send_bytes))

    def failure(self):
        import ctypes
        buf = ctypes.create_string_buffer(4096)
        self.lib.arx_testing_failure(ctypes.c_int64(self.comm_id), 0, buf, 4096)
        return buf.value.decode()

    def fail(self, message):
        self.lib.arx_testing_fail(__import__("ctypes").c_int64(self.comm_id), 0, message.encode())

    def loopback(self, ll_max_bytes=128 << 10):
        """Direct mode, with this endpoint's own region standing in for the
        peer's (arx_testing_loopback): one-shots up to ll_max_bytes go LL,
        and what the kernel sends lands at this rank's own places, which its
        waits never read."""
        import ctypes
        assert self.lib.arx_testing_loopback(ctypes.c_int64(self.comm_id), 0, ctypes.c_int64(ll_max_bytes)) == 0
        # ll_recv is the last area, whole pages: [total - 2 * world * slot, total).
        self.ll_recv = self.total - 2 * self.world * LL_SLOT_BYTES

    def describe_ll(self, dtype, count, tag=0):
        return self.describe("full", dtype, count, tag ^ LL_TAG)

    def _ll_at(self, seq, src):
        return self.base + self.ll_recv + ((seq & 1) * self.world + src) * LL_SLOT_BYTES

    def write_lines(self, seq, src, data: np.ndarray, flag, halves=(True, True)):
        """data as src's LL lines for seq, {data0, flag, data1, flag}, the last
        one padded, in ll_recv[seq & 1][src]; flags only in the halves asked
        for. The data goes in first with both flags 0, then the flags: this
        copy is not 8-byte atomic as the kernel's stores are, and the kernel
        must never see a flag before its data."""
        import ctypes
        raw = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8)
        words = np.concatenate([raw, np.zeros(-len(raw) % 8, np.uint8)]).view(np.uint32).reshape(-1, 2)
        lines = np.zeros((len(words), 4), np.uint32)
        lines[:, 0], lines[:, 2] = words[:, 0], words[:, 1]
        ctypes.memmove(self._ll_at(seq, src), lines.ctypes.data, lines.nbytes)
        lines[:, 1] = flag if halves[0] else 0
        lines[:, 3] = flag if halves[1] else 0
        ctypes.memmove(self._ll_at(seq, src), lines.ctypes.data, lines.nbytes)
        return lines

    def read_lines(self, seq, src, n):
        import ctypes
        raw = (ctypes.c_uint8 * (16 * n)).from_address(self._ll_at(seq, src))
        return np.frombuffer(bytes(raw), np.uint32).reshape(n, 4)

    def flag_words(self, src):
        """The flag words at flag_index(src, root), every root."""
        import ctypes
        raw = (ctypes.c_uint64 * self.roots).from_address(self.base + self.flags + 8 * 2 * src)
        return [int(w) for w in raw]

    def close(self):
        import ctypes
        self.lib.arx_testing_close(ctypes.c_int64(self.comm_id), 0)


def worker_wait():
    import ctypes
    import jax
    import jax.numpy as jnp
    import jax_arx  # registers the handlers
    from jax_arx import _core
    lib = ctypes.CDLL(_core.__file__)
    timeout_s = 2.0
    cases = {}

    def run(comm_id, x, alg=1, alias=False):
        f = jax.jit(lambda x: _direct(x, comm_id, alg, alias=alias), donate_argnums=(0,) if alias else ())
        return f

    def case(name, ok, **info):
        cases[name] = dict(ok=bool(ok), **{k: (v if isinstance(v, (int, float, str, bool, list)) else str(v))
                                           for k, v in info.items()})

    bf = _np_dtype("bfloat16")

    # On time, late, then stale (never): one endpoint, seqs 1, 2, 3.
    peer = FakePeer(lib, 9001, rank=0, timeout_s=timeout_s)
    n = 1001
    mine, theirs = _inputs(bf, n, 2, seed=1)
    desc = peer.describe("full", "bfloat16", n)
    f = run(9001, None)
    xd = jnp.asarray(mine)
    f.lower(xd).compile()
    peer.write_slot(1, 1, theirs)
    peer.flag(1, 1, desc)
    got = np.asarray(f(xd))
    ctl = peer.control()
    case("on_time", np.array_equal(_bits(got), _bits(reference([mine, theirs]))) and ctl["published"] == 1
         and ctl["done"] == 1 and ctl["bytes"][1] == 2 * n and ctl["mode"][1] == 1 and ctl["desc"][1] == desc,
         control=ctl)

    mine2, theirs2 = _inputs(bf, n, 2, seed=2)
    t = time.perf_counter()
    y = f(jnp.asarray(mine2))
    time.sleep(0.3)
    ctl = peer.control()
    waiting = ctl["published"] == 2 and ctl["done"] == 1
    peer.write_slot(2, 1, theirs2)
    peer.flag(1, 2, desc)
    got = np.asarray(y)
    late_s = time.perf_counter() - t
    case("late", waiting and late_s >= 0.3 and np.array_equal(_bits(got), _bits(reference([mine2, theirs2]))),
         late_s=late_s, control=ctl)

    got, stale_s, ctl, msg = _call_timed(peer, f, xd)  # the flags stay at 2: stale for seq 3
    case("stale_never", np.isnan(got.astype(np.float32)).all() and timeout_s * 0.9 <= stale_s <= timeout_s + 3
         and ctl["failed_seq"] == 3 and ctl["failed_kind"] == 1 and ctl["failed_missing"] == 0b1100
         and ctl["done"] == 3 and "rank 1" in msg and "timed out" in msg, stale_s=stale_s, control=ctl, message=msg)
    try:
        np.asarray(run(9001, None)(xd + 1))
        raised = ""
    except Exception as e:
        raised = str(e)
    x = jnp.arange(100, dtype=jnp.float32)
    case("failed_next_call_raises_gpu_usable", "rank 1" in raised and float(x.sum()) == 4950.0, error=raised[:500])
    peer.close()

    # Rank 1 of 2: the peer is rank 0, so the sum starts with its partial.
    peer = FakePeer(lib, 9002, rank=1, timeout_s=timeout_s)
    dt = np.dtype(np.float16)
    n = 4097
    mine, theirs = _inputs(dt, n, 2, seed=3)
    peer.write_slot(1, 0, theirs)
    peer.flag(0, 1, peer.describe("full", "float16", n))
    got = np.asarray(run(9002, None, alias=True)(jnp.asarray(mine)))  # in == out
    case("rank1_f16_aliased", np.array_equal(_bits(got), _bits(reference([theirs, mine]))))
    peer.close()

    # A peer that issued a different collective: reported at once, not at the timeout.
    peer = FakePeer(lib, 9003, rank=0, timeout_s=timeout_s)
    n = 512
    mine = _inputs(np.dtype(np.float32), n, 1, seed=4)[0]
    peer.flag(1, 1, peer.describe("full", "float32", n + 1))
    f = run(9003, None)
    xd = jnp.asarray(mine)
    f.lower(xd).compile()
    got, mismatch_s, ctl, msg = _call_timed(peer, f, xd)
    case("mismatch", np.isnan(got).all() and mismatch_s < 1.0 and ctl["failed_kind"] == 2 and ctl["failed_src"] == 1
         and "different collective" in msg, mismatch_s=mismatch_s, control=ctl, message=msg)
    peer.close()

    # The host fails the endpoint (a carrier lost the peer): Control::abort
    # stops the wait at once.
    peer = FakePeer(lib, 9004, rank=0, timeout_s=30.0)
    ok, seen = _aborted_while_waiting(peer, run(9004, None), jnp.asarray(mine))
    case("abort", ok, **seen)
    peer.close()

    # Two-shot on one GPU: the test plays rank 1 for both halves. Its flags
    # at seq 2 (the all-gather) count for seq 1 (the reduce-scatter) too.
    peer = FakePeer(lib, 9005, rank=0, timeout_s=timeout_s)
    n = 1001  # 2002 bytes: chunk 0 is [0, 1008), chunk 1 [1008, 2002)
    mine, theirs = _inputs(bf, n, 2, seed=6)
    step = ((2 * n + 1) // 2 + 15) & ~15
    c0 = step // 2
    peer.write_slot(1, 1, theirs[:c0])  # rank 1's partial of chunk 0, for the reduce-scatter
    gathered = _inputs(bf, n - c0, 1, seed=8)[0]  # rank 1's summed chunk 1, for the all-gather
    peer.write_slot(2, 1, gathered)
    peer.flag(1, 2, peer.describe("gather", "bfloat16", n))
    got = np.asarray(run(9005, None, alg=2)(jnp.asarray(mine)))
    want = np.concatenate([reference([mine[:c0], theirs[:c0]]), gathered])
    ctl = peer.control()
    sent = np.frombuffer(peer.send_buffer(2, 2 * c0), dtype=bf)
    case("two_shot", np.array_equal(_bits(got), _bits(want)) and np.array_equal(_bits(sent), _bits(want[:c0]))
         and ctl["published"] == 2 and ctl["mode"] == [3, 2] and ctl["bytes"] == [2 * c0, 2 * n]
         and ctl["done"] == 2, control=ctl)
    peer.close()

    _emit(cases=cases)


def worker_wait_ll():
    """The LL one-shot's wait with no peer: the endpoint in direct mode with
    its own region standing in for the peer's (FakePeer.loopback); the test
    writes the peer's lines (on time, late, torn, stale, of another
    collective, never) and its announcement of the seq (the seq-level flag
    word, which the kernel also waits for), and reads what the kernel sent,
    announced and zeroed."""
    import ctypes
    import jax
    import jax.numpy as jnp
    import jax_arx  # registers the handlers
    from jax_arx import _core
    lib = ctypes.CDLL(_core.__file__)
    if not hasattr(lib, "arx_testing_loopback"):
        _emit(missing_hook="arx_testing_loopback")
        return
    timeout_s = 2.0
    cases = {}

    def run(comm_id, alias=False):
        return jax.jit(lambda x: _direct(x, comm_id, 1, alias=alias), donate_argnums=(0,) if alias else ())

    def case(name, ok, **info):
        cases[name] = dict(ok=bool(ok), **{k: (v if isinstance(v, (int, float, str, bool, list)) else str(v))
                                           for k, v in info.items()})

    def nlines(data):
        return -(-data.nbytes // 8)

    bf = _np_dtype("bfloat16")

    def endpoint(comm_id, seed, n=1001):
        """Rank 0 of 2 on a loopback endpoint, bf16 inputs (this rank's, the
        peer's) of n elements, the LL descriptor, the call compiled for them."""
        peer = FakePeer(lib, comm_id, rank=0, timeout_s=timeout_s)
        peer.loopback()
        mine, theirs = _inputs(bf, n, 2, seed=seed)
        f = run(comm_id)
        xd = jnp.asarray(mine)
        f.lower(xd).compile()
        return peer, mine, theirs, peer.describe_ll("bfloat16", n), f, xd

    # On time (seq 1), then late with the halves of each line arriving apart
    # (seq 2), then a stale line (seq 3): one endpoint. 1001 bf16: the last
    # line holds 2 bytes and 6 of padding.
    n = 1001
    peer, mine, theirs, desc, f, xd = endpoint(9101, seed=21, n=n)
    peer.write_lines(1, 1, theirs, ll_flag(1, desc))
    peer.flag(1, 1, desc)
    got = np.asarray(f(xd))
    ctl = peer.control()
    # Loopback: this rank's lines for rank 1 are in its own ll_recv[1][0],
    # and its announcement at flag_index(0, root). The seq is published for
    # the watchdog alone (direct mode: the proxy sends nothing), without
    # bytes or descriptor.
    sent = peer.read_lines(1, 0, nlines(mine))
    want_sent = np.zeros_like(sent)
    raw = np.concatenate([np.frombuffer(mine.tobytes(), np.uint8), np.zeros(-mine.nbytes % 8, np.uint8)])
    want_sent[:, 0], want_sent[:, 2] = raw.view(np.uint32)[0::2], raw.view(np.uint32)[1::2]
    want_sent[:, 1] = want_sent[:, 3] = ll_flag(1, desc)
    zeroed = not peer.read_lines(1, 1, nlines(theirs)).any()
    case("ll_on_time", np.array_equal(_bits(got), _bits(reference([mine, theirs]))) and ctl["published"] == 1
         and ctl["done"] == 1 and np.array_equal(sent, want_sent) and peer.flag_words(0) == [1 << 24 | desc] * peer.roots and zeroed,
         zeroed=zeroed, sent_ok=bool(np.array_equal(sent, want_sent)), flags=peer.flag_words(0), control=ctl)

    mine2, theirs2 = _inputs(bf, n, 2, seed=22)
    peer.flag(1, 2, desc)
    t = time.perf_counter()
    y = f(jnp.asarray(mine2))
    peer.write_lines(2, 1, theirs2, ll_flag(2, desc), halves=(True, False))
    time.sleep(0.3)
    ctl = peer.control()
    waiting = ctl["published"] == 2 and ctl["done"] == 1  # half a line is not a line
    peer.write_lines(2, 1, theirs2, ll_flag(2, desc))
    got = np.asarray(y)
    late_s = time.perf_counter() - t
    case("ll_late_torn", waiting and late_s >= 0.3 and np.array_equal(_bits(got), _bits(reference([mine2, theirs2])))
         and not peer.read_lines(2, 1, nlines(theirs2)).any(), late_s=late_s, control=ctl)

    # Seq 3 uses seq 1's slot: lines carrying seq 1's flag are stale and
    # never taken (the kernel zeroed seq 1's; the test writes them again).
    peer.write_lines(3, 1, theirs, ll_flag(1, desc))
    peer.flag(1, 3, desc)
    got, stale_s, ctl, msg = _call_timed(peer, f, xd)
    case("ll_stale_never", np.isnan(got.astype(np.float32)).all() and timeout_s * 0.9 <= stale_s <= timeout_s + 3
         and ctl["failed_seq"] == 3 and ctl["failed_kind"] == 1 and ctl["failed_missing"] == 0b1100
         and ctl["done"] == 3 and "rank 1" in msg and "timed out" in msg, stale_s=stale_s, control=ctl, message=msg)
    peer.close()

    # Rank 1 of 2 (the sum starts with the peer's partial): f16 aliased with
    # a 2-byte tail in 2 blocks of lines, f32 with a 4-byte tail, and bf16 at
    # the cap, 128 KiB in 16 blocks, seqs 1, 2, 3.
    peer = FakePeer(lib, 9102, rank=1, timeout_s=timeout_s)
    peer.loopback()
    ok, info = True, {}
    for seq, (dt, c, alias) in enumerate(((np.dtype(np.float16), 4097, True), (np.dtype(np.float32), 1001, False),
                                          (bf, 65536, False)), start=1):
        mine, theirs = _inputs(dt, c, 2, seed=30 + seq)
        peer.write_lines(seq, 0, theirs, ll_flag(seq, peer.describe_ll(dt.name, c)))
        peer.flag(0, seq, peer.describe_ll(dt.name, c))
        got = np.asarray(run(9102, alias=alias)(jnp.asarray(mine)))
        info[f"{dt.name}/{c}"] = same = bool(np.array_equal(_bits(got), _bits(reference([theirs, mine]))))
        ok &= same and not peer.read_lines(seq, 0, nlines(theirs)).any()
    case("ll_rank1_tails_blocks", ok and peer.control()["done"] == 3, **info)
    peer.close()

    # A peer that issued another collective at this seq: its lines carry
    # another flag (never taken) and its flag word another descriptor, an
    # LL one (another size) or not (the one-piece kernel, no lines):
    # reported at once, not at the timeout.
    for comm_id, other in ((9103, "ll"), (9104, "whole")):
        peer = FakePeer(lib, comm_id, rank=0, timeout_s=timeout_s)
        peer.loopback()
        n = 512
        mine, theirs = _inputs(np.dtype(np.float32), n, 2, seed=40)
        if other == "ll":
            d = peer.describe_ll("float32", n + 2)
            peer.write_lines(1, 1, np.concatenate([theirs, theirs[:2]]), ll_flag(1, d))
        else:
            d = peer.describe("full", "float32", n)
        peer.flag(1, 1, d)
        f = run(comm_id)
        xd = jnp.asarray(mine)
        f.lower(xd).compile()
        got, mismatch_s, ctl, msg = _call_timed(peer, f, xd)
        case(f"ll_mismatch_{other}", np.isnan(got).all() and mismatch_s < 1.0 and ctl["failed_kind"] == 2
             and ctl["failed_src"] == 1 and ctl["failed_flag"] == 1 << 24 | d and "different collective" in msg,
             mismatch_s=mismatch_s, control=ctl, message=msg)
        peer.close()

    # Every line on time but no announcement: the kernel waits for that too
    # (it orders the peer's zeroing before this rank's next lines), and
    # gives up at the timeout.
    peer, mine, theirs, desc, f, xd = endpoint(9106, seed=23)
    peer.write_lines(1, 1, theirs, ll_flag(1, desc))
    got, silent_s, ctl, msg = _call_timed(peer, f, xd)
    case("ll_no_announcement", np.isnan(got.astype(np.float32)).all()
         and timeout_s * 0.9 <= silent_s <= timeout_s + 3 and ctl["failed_seq"] == 1 and ctl["failed_kind"] == 1
         and ctl["failed_missing"] == 0b1100 and not peer.read_lines(1, 1, nlines(theirs)).any()
         and "rank 1" in msg and "timed out" in msg, silent_s=silent_s, control=ctl, message=msg)
    peer.close()

    # The host fails the endpoint: Control::abort stops the LL wait at once.
    peer = FakePeer(lib, 9105, rank=0, timeout_s=30.0)
    peer.loopback()
    ok, seen = _aborted_while_waiting(peer, run(9105), jnp.asarray(mine))
    case("ll_abort", ok, **seen)
    peer.close()

    _emit(cases=cases)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=("collective", "peer_exit", "wait", "wait_ll"))
    ap.add_argument("--layout", default="2proc", choices=("2proc", "1proc"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        global CPU_SMOKE, ALGORITHMS
        CPU_SMOKE, ALGORITHMS = True, (1,)
    if a.worker == "collective":
        worker_collective(a.layout, a.quick)
    elif a.worker == "peer_exit":
        worker_peer_exit()
    elif a.worker == "wait_ll":
        worker_wait_ll()
    else:
        worker_wait()


if __name__ == "__main__":
    main(sys.argv[1:])
