"""What strangers, stopped peers and killed processes do to a job, on the CPU
backend with the real C++ core, across processes (``python -m jax_arx.launch``;
each test launches this file as its worker, ``--worker SUITE``):

- ``stranger`` (tcp, 2 processes, with and without ``JAX_ARX_SECRET``):
  while rank 0 waits in ``initialize()`` for its peer, a stranger (a thread of
  rank 1, before rank 1 itself connects) reads jax.distributed's key-value
  store (everything jax_arx published there), opens 192 silent connections
  to rank 0 and keeps them open, and tries to open a stream into rank 0 as
  rank 1 with all it read: the old wire's hello carrying each value as the
  secret, and the current handshake keyed by each value. No attempt may be
  acknowledged. Then both set up (through the silent crowd), a psum is
  exact, and nothing jax_arx published is left in the store.
- ``stopped_peer:psum`` and ``stopped_peer:all_gather`` (tcp, 2 processes,
  ``JAX_ARX_TIMEOUT_S=5``): both run a 96 MiB psum (or an 80 MiB
  all_gather) once, then rank 1 stops itself (SIGSTOP; rank 0 resumes it
  when done, or a helper 30 s later). Rank 0's next call must fail within about the timeout (the
  proxy's send to a peer that takes no data gives up, or the call's wait for
  it does), and ``shutdown()`` must return within about the timeout too.
- ``stopped_waiter:shm`` and ``stopped_waiter:tcp`` (2 processes,
  ``JAX_ARX_TIMEOUT_S=3``): rank 1 calls a psum and is stopped (SIGSTOP)
  1 s into its wait for rank 0, and resumed 3 timeouts later; rank 0 calls
  half a second after that. The time rank 1 was stopped is not rank 0's
  lateness (host/steps.h, HostPoll): both must return the exact sum, never
  a timeout naming rank 0 (which a wait counting the clock gives on its
  first look after the resume).
- ``straddle:FIRST:OP`` (2 processes, ``JAX_ARX_TIMEOUT_S=3``): one psum
  (or all_gather) call site whose operand is within jax_arx's size envelope
  on rank 0 (64K float32; 16K) and past it on rank 1 (1M; 256K), where
  rank 1 falls back to jax.lax (gloo). The fallback's notice (jax_arx/_notice.py;
  a bulk op's, on the psum communicator, makes both time out instead)
  must make both ranks raise a mismatch naming the other within the
  timeout plus 5 s, never rank 1 waiting in gloo; with ``FIRST=lax``, after
  a jax.lax.psum (gloo set up) and a fallback both ranks take alike (its
  notices agree: the exact sum).
- ``killed_in_initialize`` and ``failed_initialize`` (shm, 2 processes): a
  process SIGKILLed inside ``initialize()`` (held in its endpoint's
  connect() by a stand-in core module), and processes whose
  ``initialize()`` fails and which then leave with ``os._exit``, must leave
  nothing in /dev/shm once every process is gone.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise (failed in CI: tests/needs.py). tests/test_gpu_failures.py runs the same suites on GPUs.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import launched

THIS = os.path.abspath(__file__)
RESULT = launched.RESULT
TIMEOUT_S = 5  # JAX_ARX_TIMEOUT_S of the stopped-peer suite
# How long rank 1 stays stopped unless rank 0 resumes it sooner (it does,
# once it has timed the call and shutdown): far past every bound below.
STOPPED_S = 30
WAITER_TIMEOUT_S = 3  # JAX_ARX_TIMEOUT_S of the stopped-waiter suite
STRADDLE_TIMEOUT_S = 3  # JAX_ARX_TIMEOUT_S of the straddle suite


# --- the tests (tests/test_gpu_failures.py runs the same on GPUs) ---------------


@pytest.mark.parametrize("user_secret", [False, True], ids=["no-JAX_ARX_SECRET", "JAX_ARX_SECRET"])
def test_a_stranger_with_the_store_gets_no_stream(core_built, tmp_path, user_secret):
    check_stranger(tmp_path, user_secret, gpus=None)


# all_gather's case is the slow suite's: the same bounds, the bulk endpoint.
@pytest.mark.parametrize("op", ["psum", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_a_stopped_peer_fails_the_call_and_shutdown_within_the_timeout(core_built, tmp_path, op):
    check_stopped_peer(tmp_path, op, gpus=None)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_stopped_while_it_waits_does_not_blame_its_peer(core_built, tmp_path, transport):
    results = _run(
        f"stopped_waiter:{transport}",
        transport,
        tmp_path,
        {"JAX_ARX_TIMEOUT_S": str(WAITER_TIMEOUT_S)},
        None,
        timeout=300,
    )
    healthy, stopped = results[0], results[1]
    assert healthy["peer_stopped"] and healthy["peer_resumed"], results
    assert healthy["exact"] and not healthy["error"], results
    assert stopped["was_stopped"], results
    # The stopped rank's call ends after its resume, with the sum rank 0's
    # data completed, not with a timeout that names the healthy rank 0.
    assert stopped["exact"] and not stopped["error"], results


@pytest.mark.parametrize(
    "op,transport,first",
    [
        ("psum", "shm", "none"),
        ("psum", "tcp", "lax"),
        ("all_gather", "tcp", "none"),
        pytest.param("psum", "shm", "lax", marks=pytest.mark.slow),
        pytest.param("psum", "tcp", "none", marks=pytest.mark.slow),
        pytest.param("all_gather", "shm", "lax", marks=pytest.mark.slow),
    ],
)
def test_ranks_that_straddle_the_size_envelope_raise_on_every_rank(core_built, tmp_path, op, transport, first):
    env = {"JAX_ARX_TIMEOUT_S": str(STRADDLE_TIMEOUT_S), "JAX_ARX_PREFILL_SLOT_BYTES": "1M"}
    results = _run(f"straddle:{first}:{op}", transport, tmp_path, env, None, timeout=300)
    for rank in (0, 1):
        r = results[rank]
        if first == "lax":
            assert r["lax_exact"] and r["same_fallback_exact"], results
        # Both raise, in about the time a notice takes (the bound is the
        # issue's: the timeout plus 5 s), naming the other rank's collective.
        assert r["error"], results
        assert r["seconds"] <= STRADDLE_TIMEOUT_S + 5, results
        assert f"rank {1 - rank}" in r["error"], results
        if op == "psum":  # a bulk op's peers wait on different communicators until the timeout
            assert "issued a different collective" in r["error"], results
    # Rank 1 fell back (and said so), rank 0 ran jax_arx.
    assert results[1]["fallbacks"] >= 1 and results[0]["fallbacks"] == (1 if first == "lax" else 0), results


@pytest.mark.parametrize("suite", ["killed_in_initialize", "failed_initialize"])
def test_no_shared_memory_left_after_failed_set_ups(core_built, tmp_path, suite):
    check_no_shared_memory_left(tmp_path, suite, gpus=None)


# --- running the suites and checking what they report --------------------------


def _env(gpus, env: dict) -> dict:
    """The workers' environment: on GPUs (``gpus``, as gpu_common places
    ranks: the worker takes its GPU first), else the CPU backend."""
    if not gpus:
        return launched.clean_env(env)
    import gpu_common

    return gpu_common.gpu_env(gpus, 2, env)


def _run(suite, transport, cwd, env, gpus, timeout):
    return launched.run_suite(
        THIS, suite, 2, transport, cwd, cpu_devices=None if gpus else 1, timeout=timeout, env=_env(gpus, env)
    )


def check_stranger(cwd, user_secret, gpus):
    # The launcher gives its ranks a fresh JAX_ARX_SECRET unless one is set;
    # an empty one means none.
    env = {"JAX_ARX_TIMEOUT_S": "20", "JAX_ARX_PREFILL_SLOT_BYTES": "0"}
    if not user_secret:
        env["JAX_ARX_SECRET"] = ""
    results = _run("stranger", "tcp", cwd, env, gpus, timeout=300)
    stranger = results[1]["stranger"]
    # It found rank 0's address and every value, and tried them all.
    assert stranger["port"] and stranger["values"] >= 4 and stranger["attempts"] >= 8, stranger
    assert stranger["crowd"] == 192, stranger
    assert stranger["acked"] == [], stranger
    for rank in (0, 1):
        r = results[rank]
        assert r["psum_exact"], r
        assert r["leftover_keys"] == [], r


def check_stopped_peer(cwd, op, gpus):
    # The proxy sends psum's 96 MiB or all_gather's 80 MiB, more than the
    # sockets hold, so its send stalls on the stopped peer; shutdown() must
    # not wait for it.
    env = {
        "JAX_ARX_TIMEOUT_S": str(TIMEOUT_S),
        "JAX_ARX_SLOT_BYTES": "96M" if op == "psum" else "1M",
        "JAX_ARX_SEND_BYTES": "96M" if op == "psum" else "4M",
        "JAX_ARX_PREFILL_SLOT_BYTES": "80M" if op == "all_gather" else "0",
    }
    results = _run(f"stopped_peer:{op}", "tcp", cwd, env, gpus, timeout=400)
    r = results[0]
    assert r["warmup_exact"] and r["peer_stopped"], r
    # Each bounded by the timeout, with as much again for a loaded machine;
    # the old carrier took until the peer resumed, 30 s later.
    for what in (op, "shutdown"):
        assert r[what]["seconds"] <= 2 * TIMEOUT_S, (what, r)
    # Never a result; the error (raised by the call on the CPU, by check()
    # on GPUs, where the kernel gives NaN) names the peer.
    assert not r[op]["finite"] and "rank 1" in r[op]["error"] + r["check"], r
    if not gpus:
        assert r[op]["error"], r
    # Why: the proxy's send gave up on the stopped peer, or the call's own
    # wait did; the two race, both at about the timeout.
    assert "took no data" in r[op]["error"] + r["check"] or "timed out after" in r[op]["error"] + r["check"], r
    assert results[1]["resumed"], results[1]


def check_no_shared_memory_left(cwd, suite, gpus):
    devices = ["--cpu-devices", "1"] if not gpus else []
    cmd = [sys.executable, "-m", "jax_arx.launch", "-n", "2", *devices, "--grace-s", "20", THIS, "--worker", suite]
    env = _env(gpus, {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_TIMEOUT_S": "5"})
    p = launched.run_launcher(cmd, env, cwd, 300)
    out = p.stdout + p.stderr
    pids = [int(m) for m in re.findall(r"PID (\d+)", p.stdout)]
    assert len(pids) == 2, out[-4000:]
    if suite == "killed_in_initialize":
        assert "KILLED" in p.stdout, out[-4000:]
    else:
        assert p.stdout.count("INITIALIZE FAILED") == 2, out[-4000:]
    # Every process is gone (the launcher waited for them): poll briefly,
    # the guards act just after their process ends.
    left = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [f for pid in pids for f in glob.glob(f"/dev/shm/jax_arx-{pid}-*")]
        if not left:
            break
        time.sleep(0.1)
    for f in left:  # clean up after a failure, so the machine is not left full
        os.unlink(f)
    assert left == [], (left, out[-3000:])


# --- the wire, as a stranger speaks it (ffi/transport/tcp_wire.h) ---------------

_HELLO, _CHALLENGE, _PROOF = 0x4F4C4C4548585241, 0x4C4C414843585241, 0x464F4F5250585241
_ACK, _REJECT = 0x00004B4341585241, 0x54434A4552585241


def _hello_v1(secret: bytes, rank: int, root: int) -> bytes:
    """Version 1's hello: the communicator's secret itself."""
    return struct.pack("<QIiiiII64s", _HELLO, 1, 2, rank, root, len(secret), 0, secret[:64])


def _hello_v2(view: bytes, rank: int, root: int) -> bytes:
    return struct.pack("<QIiiiI32s32s4x", _HELLO, 2, 2, rank, root, 0, view, os.urandom(32))


def _try(port: int, hello: bytes, key: bytes | None, timeout: float = 2.0) -> str:
    """Sends a hello (and, if challenged, a proof keyed by ``key``); returns
    what came back: "ack", "reject", "closed", "silent" or "other"."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(hello)
        try:
            head = s.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return "closed"
            magic = struct.unpack("<Q", head)[0]
            if magic == _CHALLENGE and key is not None:
                challenge = head + s.recv(64, socket.MSG_WAITALL)
                mac = hmac.new(key, hello + challenge, hashlib.sha256).digest()
                s.sendall(struct.pack("<Q32s", _PROOF, mac))
                head = s.recv(8, socket.MSG_WAITALL)
                magic = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        except TimeoutError:
            return "silent"  # the listener waits (e.g. for its own set-up): no stream either
        except OSError:
            return "closed"
    return {_ACK: "ack", _REJECT: "reject"}.get(magic, "other")


def _try_all(port: int, attempts) -> list[str]:
    """_try for every (hello, key) of ``attempts`` at once."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        return list(pool.map(lambda a: _try(port, *a), attempts))


# --- the worker -------------------------------------------------------------------


def _setup(axis="x"):
    import jax_arx

    jax_arx.distributed_initialize()
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    return jax, jax_arx, mesh, NamedSharding(mesh, P(axis)), P


def _psum_fn(jax, jax_arx, mesh, P, axis):
    return jax.jit(jax.shard_map(lambda v: jax_arx.psum(v, axis), mesh=mesh, in_specs=P(axis), out_specs=P()))


def _reference(rows):
    acc = np.zeros(rows.shape[1:], np.float32)
    for row in rows:
        acc += row.astype(np.float32)
    return acc


def _before_connect(hook):
    """Makes every endpoint this process creates call ``hook()`` before it
    connects, through the stand-in core module jax_arx._native takes for tests
    (``_core_module``): the real module, with Endpoint wrapped."""
    from jax_arx import _native

    real = _native.core()

    class Endpoint:
        def __init__(self, *args):
            self._ep = real.Endpoint(*args)

        def __getattr__(self, name):
            return getattr(self._ep, name)

        def connect(self, details):
            hook()
            return self._ep.connect(details)

    stand_in = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    stand_in.Endpoint = Endpoint
    _native._core_module = stand_in


def _store_values(client, prefix="jax_arx/"):
    try:
        return list(client.key_value_dir_get_bytes(prefix))
    except Exception:
        return []


def _stranger(client, done, report, crowd):
    """Reads everything jax_arx published in the store, as anyone who reaches
    the coordinator can, once rank 0 has published its tcp details (it then
    waits in its endpoint's connect()); opens 192 connections to rank 0 that
    never say a word (into ``crowd``: the old carrier then refused every
    further one, the real rank 1's included), and tries to open a stream into
    rank 0 as rank 1 with all it read."""
    seen, port = [], None
    deadline = time.monotonic() + 60
    while port is None and time.monotonic() < deadline:
        seen = _store_values(client)
        for key, value in seen:
            m = re.search(rb"arx-tcp/\d+ (\S+) (\d+)", value)
            if key.endswith("/details/0") and m:
                port = int(m.group(2))
        time.sleep(0.05)
    if port is not None:
        crowd.extend(socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(192))
    values = [bytes(v) for _, v in seen]
    candidates = [v for v in values if 8 <= len(v) <= 64] + [hashlib.sha256(v).digest() for v in values]
    attempts = [
        (hello, key)
        for root in (0, 1)
        for c in candidates
        for hello, key in (
            (_hello_v1(c, 1, root), None),
            (_hello_v2(bytes(32), 1, root), c),
            (_hello_v2(c[:32].ljust(32, b"\0"), 1, root), c),
        )
    ]
    answers = _try_all(port, attempts) if port is not None else []
    report["stranger"] = {
        "port": port,
        "values": len(values),
        "attempts": len(attempts),
        "crowd": len(crowd),
        "answers": sorted(set(answers)),
        "acked": [i for i, a in enumerate(answers) if a == "ack"],
    }
    done.set()


def _suite_stranger():
    jax, jax_arx, mesh, sharded, P = _setup()
    from jax_arx import _compat

    client = _compat.distributed_client()
    me = jax.process_index()
    report = {}
    if me == 1:
        # The stranger runs beside rank 1's own set-up, which connects only
        # once the stranger is done (through the stand-in core module
        # jax_arx._native takes for tests), so it tries before the real rank 1.
        done, crowd = threading.Event(), []
        threading.Thread(target=_stranger, args=(client, done, report, crowd), daemon=True).start()
        _before_connect(lambda: done.wait(60))
    jax_arx.initialize(mesh)
    if me == 1:
        for c in crowd:  # the silent crowd stayed through rank 1's own set-up
            c.close()
    world = mesh.size
    rows = np.random.default_rng(7).standard_normal((world, 4096)).astype(np.float32)
    x = jax.make_array_from_callback(rows.shape, sharded, lambda idx: rows[idx])
    got = np.asarray(_psum_fn(jax, jax_arx, mesh, P, "x")(x).addressable_data(0))
    report["psum_exact"] = bool(np.array_equal(got.reshape(-1), _reference(rows)))
    client.wait_at_barrier("test_failures/set_up", 60_000)  # every process is past initialize()
    report["leftover_keys"] = [k for k, _ in _store_values(client)]
    jax_arx.shutdown()
    return report


def _timed(call):
    """Runs call() (it returns a numpy array); seconds, error text, finite."""
    start = time.monotonic()
    error, finite = "", False
    try:
        finite = bool(np.isfinite(call()).all())
    except Exception as e:
        error = launched.error_text(e)
    return {"seconds": round(time.monotonic() - start, 2), "error": error, "finite": finite}


def _suite_stopped_peer(op):
    jax, jax_arx, mesh, sharded, P = _setup()
    from jax_arx import _compat

    client = _compat.distributed_client()
    me = jax.process_index()
    world = mesh.size
    jax_arx.initialize(mesh)
    if op == "psum":
        n = (96 << 20) // 4
        f = _psum_fn(jax, jax_arx, mesh, P, "x")
        rows = np.ones((world, n), np.float32)
        x = jax.make_array_from_callback(rows.shape, sharded, lambda idx: rows[idx])
    else:
        n = (40 << 20) // 4  # per rank: 80 MiB gathered at world 2
        # Each device's block of the output is the whole gathered array.
        f = jax.jit(
            jax.shard_map(
                lambda v: jax_arx.all_gather(v, "x", tiled=True), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )
        )
        x = jax.make_array_from_callback((world * n,), sharded, lambda idx: np.ones(n, np.float32))
    # Once together: compiled, connected, exact.
    warm = np.asarray(f(x).addressable_data(0))
    report = {"warmup_exact": bool((warm == (world if op == "psum" else 1)).all())}
    client.wait_at_barrier("test_failures/warm", 120_000)
    if me == 1:
        # Stop this whole process; a helper outside it resumes it later.
        subprocess.Popen(["sh", "-c", f"sleep {STOPPED_S}; kill -CONT {os.getpid()}"], start_new_session=True)
        client.key_value_set("test_failures/stopping", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        report["resumed"] = True
        client.key_value_set("test_failures/resumed", "1")
        jax_arx.shutdown()
        return report
    stopped_pid = int(client.blocking_key_value_get("test_failures/stopping", 120_000))
    report["peer_stopped"] = _until_stopped(stopped_pid, within_s=60)
    report[op] = _timed(lambda: np.asarray(f(x).addressable_data(0)))
    try:
        jax_arx.check()
        report["check"] = ""
    except Exception as e:
        report["check"] = str(e)
    start = time.monotonic()
    jax_arx.shutdown()
    report["shutdown"] = {"seconds": round(time.monotonic() - start, 2)}
    os.kill(stopped_pid, signal.SIGCONT)  # done with it stopped: no need to wait out STOPPED_S
    # Exit together (process 0 hosts jax.distributed's coordinator).
    client.blocking_key_value_get("test_failures/resumed", (STOPPED_S + 120) * 1000)
    return report


def _suite_stopped_waiter():
    jax, jax_arx, mesh, sharded, P = _setup()
    from jax_arx import _compat

    client = _compat.distributed_client()
    me, world = jax.process_index(), mesh.size
    jax_arx.initialize(mesh)
    f = _psum_fn(jax, jax_arx, mesh, P, "x")
    rows = np.arange(world * 1024, dtype=np.float32).reshape(world, 1024)
    x = jax.make_array_from_callback(rows.shape, sharded, lambda idx: rows[idx])
    want = rows.sum(0)
    np.asarray(f(x).addressable_data(0))  # compiled and connected, together
    client.wait_at_barrier("test_failures/waiter_warm", 120_000)
    report = {}
    if me == 1:
        # Stopped 1 s into its wait, resumed 3 timeouts later, from outside.
        pid = os.getpid()
        subprocess.Popen(
            ["sh", "-c", f"sleep 1; kill -STOP {pid}; sleep {3 * WAITER_TIMEOUT_S}; kill -CONT {pid}"],
            start_new_session=True,
        )
        client.key_value_set("test_failures/waiter_pid", str(pid))
    else:
        # Rank 0 calls half a second after rank 1 runs again: rank 1 has
        # waited far past the timeout by the clock, but not by the time it ran.
        pid = int(client.blocking_key_value_get("test_failures/waiter_pid", 120_000))
        report["peer_stopped"] = _until_stopped(pid, within_s=60)
        report["peer_resumed"] = _until_stopped(pid, within_s=60, state_is_stopped=False)
        time.sleep(0.5)
    start = time.monotonic()
    try:
        got = np.asarray(f(x).addressable_data(0)).reshape(-1)
        report["exact"], report["error"] = bool((got == want).all()), ""
    except Exception as e:
        report["exact"], report["error"] = False, launched.error_text(e)
    report["seconds"] = round(time.monotonic() - start, 2)
    report["was_stopped"] = me == 1 and report["seconds"] >= 2 * WAITER_TIMEOUT_S
    client.key_value_set(f"test_failures/waiter_done{me}", "1")
    client.blocking_key_value_get(f"test_failures/waiter_done{1 - me}", 120_000)
    jax_arx.shutdown()
    return report


def _suite_straddle(first, op):
    jax, jax_arx, mesh, sharded, P = _setup()
    me = jax.process_index()
    jax_arx.initialize(mesh)
    report = {}

    def rows(n, per_rank):
        return jax.make_array_from_callback((2 * n,), sharded, lambda idx: per_rank(idx[0].start // n, n))

    def run(x, with_lax=False):
        if op == "psum" or with_lax:
            fn, out = (jax.lax.psum if with_lax else jax_arx.psum), P()
        else:
            fn, out = lambda v, axis: jax_arx.all_gather(v, axis, tiled=True), P("x")
        f = jax.jit(jax.shard_map(lambda v: fn(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=out))
        return np.asarray(f(x).addressable_data(0))

    def ramp(r, n):
        return (np.arange(n) % 251 + 1000 * r).astype(np.float32)

    def want(n):
        return ramp(0, n) + ramp(1, n) if op == "psum" else np.concatenate([ramp(0, n), ramp(1, n)])

    # Per rank, past and within the envelope: JAX_ARX_SLOT_BYTES's default
    # (psum); JAX_ARX_PREFILL_SLOT_BYTES=1M for the two ranks' 4 bytes each.
    big, small = (1 << 20, 1 << 16) if op == "psum" else (1 << 18, 1 << 14)
    if first == "lax":
        got = run(rows(8, ramp), with_lax=True)
        report["lax_exact"] = bool((got == ramp(0, 8) + ramp(1, 8)).all())
        got = run(rows(big, ramp))  # both ranks fall back, alike
        report["same_fallback_exact"] = bool(np.array_equal(got, want(big)))
    n = small if me == 0 else big
    x = jax.make_array_from_callback((2 * n,), sharded, lambda idx: ramp(me, n))
    start = time.monotonic()
    try:
        run(x)
        report["error"] = ""
    except Exception as e:
        report["error"] = launched.error_text(e)
    report["seconds"] = round(time.monotonic() - start, 2)
    report["fallbacks"] = sum(jax_arx.stats()["fallbacks"].get(op, {}).values())
    jax_arx.shutdown()
    return report


def _until_stopped(pid: int, within_s: float, state_is_stopped: bool = True) -> bool:
    """Polls until process ``pid`` is stopped (state T in /proc/PID/stat),
    or runs again where ``state_is_stopped`` is False; whether it was within
    ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if (f.read().rsplit(")", 1)[1].split()[0] == "T") == state_is_stopped:
                return True
        time.sleep(0.01)
    return False


def _suite_killed_in_initialize():
    """Run with JAX_ARX_TIMEOUT_S=5. Rank 1 stops inside initialize(), in its
    endpoint's connect() (its shared memory made and published), through the
    stand-in module jax_arx._native takes for tests; rank 0 kills it there."""
    jax, jax_arx, mesh, _, _ = _setup()
    from jax_arx import _compat

    client = _compat.distributed_client()
    me = jax.process_index()
    print(f"PID {os.getpid()}", flush=True)
    client.key_value_set(f"test_failures/pid{me}", str(os.getpid()))
    if me == 1:

        def stuck():
            client.key_value_set("test_failures/in_connect", "1")
            time.sleep(600)

        _before_connect(stuck)
        jax_arx.initialize(mesh)
        return {}

    def kill_when_stuck():
        client.blocking_key_value_get("test_failures/in_connect", 60_000)
        pid1 = int(client.blocking_key_value_get("test_failures/pid1", 60_000))
        os.kill(pid1, signal.SIGKILL)
        print("KILLED", flush=True)

    threading.Thread(target=kill_when_stuck, daemon=True).start()
    try:
        jax_arx.initialize(mesh)
    except Exception as e:
        print("rank 0: initialize failed as it should:", launched.error_text(e)[:200], flush=True)
    os._exit(0)  # rank 1 is dead: leave without jax.distributed's exit barrier


def _suite_failed_initialize():
    # Process-specific buffer sizes: the ranks' fingerprints differ, so
    # initialize() fails on both after their shared memory exists.
    import jax_arx

    jax_arx.distributed_initialize()
    os.environ["JAX_ARX_SLOT_BYTES"] = "64K" if os.environ["JAX_PROCESS_ID"] == "0" else "128K"
    jax, jax_arx, mesh, _, _ = _setup()
    print(f"PID {os.getpid()}", flush=True)
    try:
        jax_arx.initialize(mesh)
    except Exception as e:
        print("INITIALIZE FAILED", launched.error_text(e)[:300], flush=True)
        # Both fail; process 0 hosts the coordinator, so they leave together.
        from jax_arx import _compat

        client, me = _compat.distributed_client(), jax.process_index()
        client.key_value_set(f"test_failures/failed{me}", "1")
        client.blocking_key_value_get(f"test_failures/failed{1 - me}", 60_000)
        os._exit(3)  # no destructors, no exit hooks: what a crashing program does
    return {}


def _worker_main(argv):
    suite = argv[argv.index("--worker") + 1]
    if os.environ.get("ARX_TEST_GPUS"):
        import gpu_common

        gpu_common.place_rank()  # before jax starts its backend
    if suite.startswith("stopped_peer:"):
        report = _suite_stopped_peer(suite.split(":")[1])
    elif suite.startswith("stopped_waiter:"):
        report = _suite_stopped_waiter()
    elif suite.startswith("straddle:"):
        report = _suite_straddle(*suite.split(":")[1:])
    else:
        report = {
            "stranger": _suite_stranger,
            "killed_in_initialize": _suite_killed_in_initialize,
            "failed_initialize": _suite_failed_initialize,
        }[suite]()
    print(RESULT + json.dumps(report), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main(sys.argv)
