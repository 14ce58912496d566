"""jax_arx.launch: small programs in 2 processes, one of them through the
jax.distributed key-value store rendezvous with the stand-in core
(tests/stand_in_core.py)."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jax_arx
from jax_arx import launch
from stand_in_core import FAKE_CORE_SOURCE

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- launcher ------------------------------------------------------------------------


def test_initialize_distributed_under_a_cluster_manager(monkeypatch):
    # No launcher variables, but SLURM (or Open MPI) started several tasks:
    # jax's own cluster detection is asked, with no arguments; one task
    # alone is a single process.
    for name in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    import jax

    from jax_arx import _distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(_distributed, "_select_cpu_collectives", lambda jax: None)
    monkeypatch.setattr(_distributed.atexit, "register", lambda fn: None)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert launch.initialize_distributed() is False and calls == []
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert launch.initialize_distributed() is True and calls == [((), {})]
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert launch.initialize_distributed() is True and len(calls) == 2


def test_a_process_alone_is_warned_once(monkeypatch, caplog):
    # A script run without the launcher on a mesh of one device: jax_arx says
    # so, once, naming distributed_initialize and the launcher.
    import jax
    import numpy as np

    from jax_arx import _distributed

    monkeypatch.setattr(_distributed, "_warned_alone", [])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("alone_axis",))
    with caplog.at_level("WARNING", logger="jax_arx"):
        jax_arx.initialize(mesh)
        jax_arx.initialize(mesh)
    said = [r.getMessage() for r in caplog.records if "runs alone" in r.getMessage()]
    assert len(said) == 1 and "distributed_initialize()" in said[0] and "jax_arx.launch -n N" in said[0], said
    jax_arx.shutdown()


def test_initialize_refuses_a_process_of_several_that_did_not_join(monkeypatch):
    # JAX_NUM_PROCESSES > 1 (the launcher's) but no jax.distributed: the
    # program forgot distributed_initialize() and would run alone.
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("unjoined_axis",))
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"JAX_NUM_PROCESSES=2 says this process is one of 2 .* "
        r"Call jax_arx.distributed_initialize\(\) first thing",
    ):
        jax_arx.initialize(mesh)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")  # one process: nothing to join
    jax_arx.initialize(mesh)
    jax_arx.shutdown()


def test_split_argv():
    split = launch._split_argv
    assert split(["-n", "2", "s.py", "-n", "3"]) == (["-n", "2"], ["s.py", "-n", "3"])
    assert split(["-n2", "--cpu-devices=2", "s.py"]) == (["-n2", "--cpu-devices=2"], ["s.py"])
    assert split(["-n", "2", "-m", "pkg.mod", "--x"]) == (["-n", "2"], ["-m", "pkg.mod", "--x"])
    assert split(["-n", "2", "--", "-weird.py"]) == (["-n", "2"], ["-weird.py"])


def test_initialize_distributed_needs_all_or_none_of_the_variables(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert launch.initialize_distributed() is False
    assert jax_arx.distributed_initialize is launch.initialize_distributed
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not set while JAX_NUM_PROCESSES"):
        launch.initialize_distributed()


def _launch(args, tmp_path, timeout=240):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_")) or k in ("JAX_PLATFORMS",)}
    # The installed jax_arx (with its C++ module), as the other multi-process
    # tests run it; tmp_path holds the programs and the stand-in core.
    env["PYTHONPATH"] = str(tmp_path)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jax_arx.launch", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def test_launch_two_processes_psum_and_rendezvous(core_built, tmp_path):
    (tmp_path / "fake_core.py").write_text(FAKE_CORE_SOURCE)
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import jax_arx
        assert jax_arx.distributed_initialize()
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        import fake_core
        from jax_arx import _native
        _native._core_module = fake_core

        def say(*words):  # a file per rank: jax's C++ logs share stdout
            with open(f"said{jax.process_index()}.txt", "a") as f:
                f.write(" ".join(map(str, words)) + "\\n")
            print(*words)

        mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        f = jax.jit(jax.shard_map(lambda: jax.lax.psum(jax.lax.axis_index("dp") + 1.0, "dp"),
                                  mesh=mesh, in_specs=(), out_specs=P()))
        say("lax psum", float(f().addressable_data(0)))

        jax_arx.initialize(mesh)
        jax_arx.initialize(mesh)
        me = jax.process_index()
        for e in sorted(fake_core.endpoints, key=lambda e: (e.name, e.rank)):
            say("endpoint", e.name, e.rank, e.world, e.transport, e.device_ordinal, e.connected, e.secret.hex()[:8])

        # jax_arx's primitive across processes, lowered as jax's all-reduce.
        from jax_arx import _compat, _psum
        def lax_lowering(ctx, *xs, **params):
            leaves = xs[:len(xs) - params.get("prefetch", 0)]
            return _compat.lax_psum_lowering(ctx, leaves, axes=params["axes"])
        for prim in (_psum.psum_p, _psum.psum_invariant_p):
            _compat.register_lowering(prim, lax_lowering)
        g = jax.jit(jax.shard_map(lambda: jax_arx.psum(jax.lax.axis_index("dp") + 1.0, "dp"),
                                  mesh=mesh, in_specs=(), out_specs=P()))
        say("arx psum", float(g().addressable_data(0)), "jax_arx_psum_invariant" in str(jax.make_jaxpr(g)()))
        jax_arx.shutdown()
        jax_arx.initialize(mesh)  # a new generation of keys
        say("again", len(fake_core.registered))
        say("args", sys.argv[1:])
        jax_arx.shutdown()
        """)
    )
    proc, _ = _launch(["-n", "2", "--cpu-devices", "2", str(script), "--flag", "x"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    said = {rank: (tmp_path / f"said{rank}.txt").read_text().splitlines() for rank in (0, 1)}
    for rank in (0, 1):
        # What each rank printed, the launcher shows after its rank's prefix
        # (whole lines: jax's own C++ logs may land inside one).
        assert any(line.startswith(f"[rank {rank}] ") for line in out), proc.stdout
        mine = said[rank]
        assert "lax psum 3.0" in mine and "arx psum 3.0 True" in mine, (rank, mine, proc.stderr[-3000:])
        assert "again 4" in mine and "args ['--flag', 'x']" in mine, (rank, mine)
        endpoints = [line.split() for line in mine if line.startswith("endpoint")]
        # dp spans the processes (one rank each in 2 groups); tp stays in one (2 ranks of 1 group).
        assert sorted((e[1], e[2]) for e in endpoints) == (
            [("dp[0]", str(rank)), ("dp[1]", str(rank)), (f"tp[{rank}]", "0"), (f"tp[{rank}]", "1")]
        )
        assert all(e[3:5] == ["2", "shm"] and e[6] == "True" for e in endpoints)
    # Both processes hold the same secret for each group of dp.
    secrets = {}
    for line in said[0] + said[1]:
        if line.startswith("endpoint dp"):
            secrets.setdefault(line.split()[1], set()).add(line.split()[-1])
    assert len(secrets) == 2 and all(len(s) == 1 for s in secrets.values())


def test_launch_failing_rank_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        rank = int(os.environ["JAX_PROCESS_ID"])
        print("started", os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_COORDINATOR_ADDRESS"].split(":")[0])
        if rank == 1:
            print("boom", file=sys.stderr)
            sys.exit(3)
        time.sleep(120)
        """)
    )
    proc, elapsed = _launch(["-n", "2", "--grace-s", "0.5", str(script)], tmp_path)
    assert proc.returncode == 3
    assert elapsed < 30
    assert "[rank 0] started 2 127.0.0.1" in proc.stdout and "[rank 1] started 2 127.0.0.1" in proc.stdout
    assert "[rank 1] boom" in proc.stderr
    assert "[launch] rank 1 failed first (exited with status 3); stopping the other ranks in 0.5 s" in proc.stderr


def test_launch_a_raising_rank_ends_the_job_within_seconds(tmp_path):
    # Rank 1 raises after jax_arx.initialize while rank 0 computes without
    # collectives: rank 1 must not wait at jax_arx's or jax's exit barriers
    # for rank 0, and the launcher names it and stops rank 0. Timed from the
    # raise (written down by rank 1), not from start-up, which load slows.
    (tmp_path / "fake_core.py").write_text(FAKE_CORE_SOURCE)
    raised_at = tmp_path / "raised_at"
    script = tmp_path / "raises.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        import jax_arx
        jax_arx.distributed_initialize()
        import jax
        import fake_core
        from jax_arx import _native
        _native._core_module = fake_core
        mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        jax_arx.initialize(mesh)
        if jax.process_index() == 1:
            with open({str(raised_at)!r}, "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("rank 1 gives up")
        while True:  # rank 0: a long computation with no collective
            time.sleep(0.05)
        """)
    )
    proc, _ = _launch(["-n", "2", "--cpu-devices", "1", str(script)], tmp_path)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ended - float(raised_at.read_text()) < 10, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("[launch] rank 1 failed first (exited with status 1)") :]
    assert "[launch]   RuntimeError: rank 1 gives up" in report, proc.stderr[-3000:]
    assert "[launch] rank 0" not in proc.stderr  # rank 0 was stopped, not reported as the failure


def test_launch_a_program_without_distributed_initialize_fails_on_every_rank(tmp_path):
    # Without jax_arx.distributed_initialize() each rank would be a job of
    # its own, psum one rank's value, status 0. A long grace, so that each
    # rank ends by its own error rather than by the launcher's SIGTERM.
    script = tmp_path / "forgot.py"
    script.write_text(
        textwrap.dedent("""
        import jax
        import jax_arx
        mesh = jax.make_mesh((jax.device_count(),), ("tp",))
        jax_arx.initialize(mesh)
        print("initialized alone")
        """)
    )
    proc, elapsed = _launch(["-n", "2", "--cpu-devices", "1", "--grace-s", "60", str(script)], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "initialized alone" not in proc.stdout
    for rank in (0, 1):
        assert (
            f"[rank {rank}] jax_arx.errors.InitializationError: jax_arx.initialize: JAX_NUM_PROCESSES=2 says "
            "this process is one of 2"
        ) in proc.stderr, proc.stderr[-3000:]
    assert "Call jax_arx.distributed_initialize() first thing in the program" in proc.stderr
    assert elapsed < 50, proc.stderr[-3000:]  # the second rank ended by itself, not by the launcher


@pytest.mark.parametrize("how", ["SIGHUP", "SIGTERM", "SIGKILL"])
def test_no_rank_outlives_the_launcher(tmp_path, how):
    # A closed terminal (SIGHUP), a kill, or a kill -9 of the launcher: every
    # rank (each its own process group, reparented if the launcher is gone)
    # must be gone within a few seconds, checked by pid.
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "sleeper.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        time.sleep(600)
        """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jax_arx.launch", "-n", "3", str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(pids)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int(p) for p in os.listdir(pids)]
        assert len(ranks) == 3, launcher.stderr.read() if launcher.poll() is not None else "ranks did not start"
        launcher.send_signal(getattr(signal, how))
        launcher.wait(timeout=60)

        def alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            # A zombie waits for its parent to reap it; it holds nothing.
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"

        deadline = time.monotonic() + 15
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if alive(p)], f"ranks still running {how and ''}after the launcher got {how}"
        if how != "SIGKILL":
            assert f"got signal {int(getattr(signal, how))}; stopping the ranks" in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in os.listdir(pids):
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_rank_sent_sigterm_ends_and_is_named(tmp_path):
    # jax's preemption notifier only logs a SIGTERM; a rank set up by
    # distributed_initialize ends on it (status 143), and the launcher names
    # it and stops the other.
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "term.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        import jax_arx
        jax_arx.distributed_initialize()
        import jax
        open(os.path.join({str(pids)!r}, str(jax.process_index())), "w").write(str(os.getpid()))
        time.sleep(600)
        """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jax_arx.launch", "-n", "2", "--grace-s", "0.5", str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        assert len(os.listdir(pids)) == 2, "ranks did not start"
        time.sleep(0.5)  # the pid is written right after jax.distributed.initialize
        os.kill(int((pids / "1").read_text()), signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143, err[-3000:]
    assert "[rank 1] jax_arx: this process got signal 15 (SIGTERM) and ends now" in err, err[-3000:]
    assert "[launch] rank 1 failed first (exited with status 143)" in err, err[-3000:]


def test_launch_module_form(tmp_path):
    (tmp_path / "arx_launch_probe.py").write_text(
        "import os, sys\nprint('probe', os.environ['JAX_PROCESS_ID'], os.environ['PYTHONUNBUFFERED'], sys.argv[1:])\n"
    )
    proc, _ = _launch(["-n", "3", "-m", "arx_launch_probe", "a", "-b"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        assert f"[rank {rank}] probe {rank} 1 ['a', '-b']" in proc.stdout
