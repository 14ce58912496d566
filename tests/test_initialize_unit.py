"""initialize / shutdown / check against a stand-in for ``jax_arx._core``
(tests/stand_in_core.py) that checks what jax_arx hands it; the options and
the size plans are the real core's. Also the carrier choice
(jax_arx._carriers)."""

import logging
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_arx
import launched
from jax_arx import _carriers, _comm, _compat, _native, _registry, config, errors
from stand_in_core import auto_mesh, needs_4_devices

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- initialize / shutdown / check -----------------------------------------------------


@needs_4_devices
def test_initialize_makes_one_endpoint_per_local_device_and_group(mesh22, fake_core):
    eps = fake_core.endpoints
    assert len(eps) == 8 and all(e.connected for e in eps)
    by_axis = {}
    for e in eps:
        by_axis.setdefault(e.comm_id, []).append(e)
    dp, tp = _comm.communicator("dp"), _comm.communicator("tp")
    assert set(by_axis) == {dp.comm_id, tp.comm_id} and dp.comm_id != tp.comm_id
    ids = np.asarray(mesh22.device_ids)  # [[0, 1], [2, 3]]
    # tp groups are rows, dp groups are columns; rank = position along the axis.
    got_tp = sorted((e.name, e.rank, e.device_ordinal) for e in by_axis[tp.comm_id])
    assert got_tp == [
        ("tp[0]", 0, ids[0, 0]),
        ("tp[0]", 1, ids[0, 1]),
        ("tp[1]", 0, ids[1, 0]),
        ("tp[1]", 1, ids[1, 1]),
    ]
    got_dp = sorted((e.name, e.rank, e.device_ordinal) for e in by_axis[dp.comm_id])
    assert got_dp == [
        ("dp[0]", 0, ids[0, 0]),
        ("dp[0]", 1, ids[1, 0]),
        ("dp[1]", 0, ids[0, 1]),
        ("dp[1]", 1, ids[1, 1]),
    ]
    assert all(e.world == 2 and e.transport == "shm" and e.platform == "cpu" for e in eps)
    secrets = {(e.comm_id, e.name): e.secret for e in eps}
    assert len(set(secrets.values())) == 4  # one per group
    assert all(e.secret == secrets[(e.comm_id, e.name)] for e in eps)
    assert all(e.options["slot_bytes"] == "1048576" for e in eps)


@needs_4_devices
def test_device_ordinal_is_what_xla_reports():
    # Measured (2 processes x 2 CPU devices): XLA's CPU DeviceOrdinal is the
    # global device id; see _compat.xla_device_ordinal.
    assert [_compat.xla_device_ordinal(d) for d in jax.local_devices()] == [d.id for d in jax.local_devices()]


@needs_4_devices
def test_communicator_id_is_deterministic_and_mesh_specific():
    a = auto_mesh((2, 2), ("dp", "tp"))
    b = auto_mesh((2, 2), ("dp", "tp"))
    c = auto_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[::-1])
    d = auto_mesh((4,), ("tp",))
    ids = [_comm.communicator_id(m, "tp") for m in (a, b, c, d)]
    assert ids[0] == ids[1] and len(set(ids)) == 3
    assert all(0 <= i < 2**63 for i in ids)


@needs_4_devices
def test_initialize_is_idempotent_and_rejects_a_new_mesh_for_a_known_axis(mesh4, fake_core):
    jax_arx.initialize(mesh4)
    jax_arx.initialize(auto_mesh((4,), ("tp",)))  # an equal mesh
    assert len(fake_core.endpoints) == 4
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"mesh axis 'tp' is already set up for another mesh .*Call jax_arx.shutdown\(\)",
    ):
        jax_arx.initialize(auto_mesh((4,), ("tp",), devices=jax.devices()[::-1]))
    jax_arx.initialize(auto_mesh((4,), ("sp",)))  # a new axis name adds a communicator
    sp = _comm.communicator("sp")
    assert len(fake_core.endpoints) == 8 and sp.mesh_axis_names == ("sp",) and sp.mesh_shape == (4,)
    assert sorted(le.endpoint.rank for le in sp.endpoints) == [0, 1, 2, 3]


@needs_4_devices
@needs_4_devices
def test_shutdown_warning_keeps_jax_first_line_whole(mesh4, fake_core, monkeypatch, caplog):
    # A peer that never reaches shutdown(): jax's barrier error, whose first
    # line the warning quotes whole (it used to be cut at 200 characters,
    # mid-word), then this process's endpoints close anyway.
    first = (
        "DEADLINE_EXCEEDED: Barrier timed out. Id: jax_arx/1/shutdown. This usually happens because a task "
        "triggered the barrier too early or too slowly. Please look at the task logs (both timed out and "
        "first task) to debug further."
    )

    class Client:
        def wait_at_barrier(self, name, timeout_ms):
            raise RuntimeError(first + "\n# tasks that did not reach the barrier: /job:jax_worker/task:1")

    monkeypatch.setattr(_compat, "distributed_client", lambda: Client())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        jax_arx.shutdown()
    assert "not every process reached shutdown()" in caplog.text
    assert caplog.text.rstrip().endswith("jax said: " + first), caplog.text
    assert not fake_core.registered


def test_shutdown_then_initialize_again(mesh4, fake_core):
    comm_id = _comm.communicator("tp").comm_id
    generation = _registry.generation()
    jax_arx.shutdown()
    assert all(e.closed for e in fake_core.endpoints) and not fake_core.registered
    assert _comm.communicator("tp") is None
    jax_arx.shutdown()  # idempotent
    jax_arx.initialize(mesh4)
    assert _comm.communicator("tp").comm_id == comm_id and _registry.generation() == generation + 1
    assert len(fake_core.registered) == 4


@needs_4_devices
def test_initialize_uses_the_mesh_in_context(fake_core):
    mesh = auto_mesh((4,), ("tp",))
    with pytest.raises(jax_arx.InitializationError, match=r"pass it, jax_arx.initialize\(mesh\), or set it"):
        jax_arx.initialize()
    with jax.set_mesh(mesh):
        jax_arx.initialize()
    tp = _comm.communicator("tp")
    assert (tp.mesh_axis_names, tp.device_ids) == (("tp",), tuple(d.id for d in mesh.devices.flat))


@needs_4_devices
def test_initialize_topology(fake_core, monkeypatch):
    # The argument reaches every endpoint, and overrides JAX_ARX_TOPOLOGY.
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="ring")
    assert {e.options.get("topology") for e in fake_core.endpoints} == {"ring"}
    assert _comm.communicator("tp").topology == "ring"
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="ring")  # the same: nothing to do
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"'tp' is already set up as a ring; this call asks for a "
        r"mesh .*Call jax_arx.shutdown\(\)",
    ):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    jax_arx.shutdown()
    monkeypatch.setenv("JAX_ARX_TOPOLOGY", "ring")
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="mesh")
    assert all("topology" not in e.options for e in fake_core.endpoints[4:])
    jax_arx.shutdown()
    jax_arx.initialize(auto_mesh((2, 2), ("dp", "tp")))  # every axis a ring of 2
    assert {e.options.get("topology") for e in fake_core.endpoints[8:]} == {"ring"}
    with pytest.raises(jax_arx.ConfigError, match="topology='torus'"):
        jax_arx.initialize(auto_mesh((4,), ("sp",)), topology="torus")
    assert _comm.communicator("sp") is None


def test_a_ring_past_four_is_refused_before_anything_is_set_up():
    ring = config.Config(topology="ring")
    _comm._check_ring_size(ring, "tp", 4)
    _comm._check_ring_size(config.Config(), "tp", 8)  # a mesh of 8 is fine
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"axis 'tp' has 5 devices, but a ring .* takes 2 to 4: .*more than one relay. Cable "
        r"the boxes through a switch and use topology='mesh'",
    ):
        _comm._check_ring_size(ring, "tp", 5)


@needs_4_devices
def test_transport_override_and_tcp_address(fake_core, monkeypatch):
    monkeypatch.setenv("JAX_ARX_TRANSPORT", "tcp")
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert {(e.transport, e.options["tcp_addr"]) for e in fake_core.endpoints} == {("tcp", "127.0.0.1")}
    jax_arx.shutdown()
    monkeypatch.setenv("JAX_ARX_TCP_ADDR", "198.51.100.9")
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert {e.options["tcp_addr"] for e in fake_core.endpoints[4:]} == {"198.51.100.9"}


def test_choose_transport():
    cfg = config.Config()
    assert _carriers.choose_transport(cfg, ["a", "a", "a"]) == "shm"
    assert _carriers.choose_transport(cfg, ["a", "b"]) == "tcp"
    assert _carriers.choose_transport(config.Config(transport="tcp"), ["a", "a"]) == "tcp"
    assert _carriers.choose_transport(config.Config(transport="shm"), ["a", "b"]) == "shm"
    assert _carriers.host_identity() == _carriers.host_identity()


def test_default_tcp_addr():
    assert _carriers.default_tcp_addr(None) == "127.0.0.1"
    assert _carriers.default_tcp_addr("127.0.0.1:1234") == "127.0.0.1"
    assert _carriers.default_tcp_addr("localhost:1234") == "127.0.0.1"
    with pytest.raises(jax_arx.InitializationError, match="set JAX_ARX_TCP_ADDR"):
        _carriers.default_tcp_addr("no-such-host.invalid:1234")


@needs_4_devices
def test_initialize_without_the_core_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(_native, "_core_module", None)
    monkeypatch.setattr(_native, "_core_import_error", ImportError("No module named 'jax_arx._core'"))
    with pytest.raises(jax_arx.InitializationError, match=r"jax_arx._core could not be imported .*pip install \."):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert _comm.communicator("tp") is None
    assert jax_arx.check() is None  # nothing set up, nothing failed


def _checkout(tmp_path, with_core=False):
    """A copy of the checkout's top folder as a user has it before building:
    pyproject.toml, ffi/ and the package's Python files, no _core."""
    root = tmp_path / "checkout"
    (root / "ffi").mkdir(parents=True)
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    shutil.copytree(REPO / "jax_arx", root / "jax_arx", ignore=shutil.ignore_patterns("_core*", "__pycache__"))
    if with_core:
        (root / "jax_arx" / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    return root


def test_a_script_in_the_checkout_is_told_why_core_is_missing(tmp_path):
    # The README's Usage, saved where a user stands after its first command:
    # the script's folder shadows the installed jax_arx with the unbuilt one.
    root = _checkout(tmp_path)
    script = root / "psum_demo.py"
    script.write_text("import jax_arx\nfrom jax_arx import _native\n_native.core()\n")
    p = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=launched.clean_env(),
        timeout=300,
    )
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("jax_arx.errors.InitializationError:"), p.stderr
    assert f"Python imported jax_arx from its source tree ({root / 'jax_arx'})" in last, last
    assert f"because {root} comes first on sys.path" in last and "Save scripts outside that folder" in last, last


def test_core_missing_hint_names_the_installed_copy_or_says_to_install(tmp_path):
    root = _checkout(tmp_path)
    site = tmp_path / "site"
    (site / "jax_arx").mkdir(parents=True)
    (site / "jax_arx" / "__init__.py").write_text("")
    hint = _native.core_missing_hint([str(root / "jax_arx")], [str(root), str(site)])
    assert f"not the installed one ({site / 'jax_arx'})" in hint and "pip install" not in hint, hint
    hint = _native.core_missing_hint([str(root / "jax_arx")], [str(root)])
    assert "Save scripts outside that folder" in hint and "install jax_arx: Build and install" in hint, hint
    # Not a checkout (an installed package), a checkout built in place, or
    # one whose package also looks in a built copy (as this suite's
    # conftest arranges): the module is missing or broken, not shadowed.
    assert _native.core_missing_hint([str(site / "jax_arx")], [str(site)]).startswith("Build and install it")
    built = _checkout(tmp_path / "built", with_core=True)
    assert _native.core_missing_hint([str(built / "jax_arx")], [str(built)]).startswith("Build and install it")
    both = [str(root / "jax_arx"), str(built / "jax_arx")]
    assert _native.core_missing_hint(both, [str(root)]).startswith("Build and install it")


@needs_4_devices
def test_endpoint_creation_failure_closes_what_was_made(fake_core):
    fake_core.fail_create_rank = 2
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"could not create the endpoint of axis 'tp' group 0 rank 2 .*no memory for the slots",
    ):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert len(fake_core.endpoints) == 2 and all(e.closed for e in fake_core.endpoints)
    assert _comm.communicator("tp") is None


@needs_4_devices
def test_check_reports_failures(mesh4, fake_core):
    assert jax_arx.check() is None
    ep = fake_core.endpoints[1]
    fake_core.failed[(ep.comm_id, ep.device_ordinal)] = "communicator 'tp' rank 1 of 4: rank 3 sent nothing for 30 s"
    with pytest.raises(jax_arx.CollectiveError, match=r"a communicator has failed:\n  communicator 'tp' rank 1"):
        jax_arx.check()
    assert issubclass(jax_arx.CollectiveError, RuntimeError)
    fake_core.failed[(ep.comm_id, ep.device_ordinal)] = (
        "jax_arx: communicator 'tp' rank 1 of 4: collective #3 timed out after 30 s waiting for rank 3."
    )
    with pytest.raises(jax_arx.CollectiveTimeoutError, match="timed out after 30 s waiting for rank 3"):
        jax_arx.check()
    other = fake_core.endpoints[0]
    fake_core.failed[(other.comm_id, other.device_ordinal)] = (
        "jax_arx: communicator 'tp' rank 0 of 4: at collective #3 rank 2 issued a different collective (op...)"
    )
    with pytest.raises(jax_arx.CollectiveError) as mixed:  # two kinds: the common base
        jax_arx.check()
    assert type(mixed.value) is jax_arx.CollectiveError and "2 communicators have failed" in str(mixed.value)


# The messages as jax raises them: the status, then the handler's message.
_TIMEOUT = (
    "INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: collective #7 timed out after 3 s waiting for rank 1. "
    "Last seq heard from each peer: r1=6."
)
_MISMATCH = (
    "INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: at collective #1 rank 1 issued a different "
    "collective (op, dtype, element count or call site differ: descriptor 2c9453, this rank 70e6d4)."
)
_PEER_CLOSED = "INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: tcp: rank 1 closed its connection (root 0)"
_TOO_BIG = (
    "INVALID_ARGUMENT: jax_arx.psum: 2097152 bytes exceed the one-shot limit of 1048576 bytes on "
    "communicator 'tp' rank 0 of 2 (JAX_ARX_SLOT_BYTES, ...)"
)
_NOT_SET_UP = (
    "INTERNAL: jax_arx: no communicator 42 on local device 0 in this process; call jax_arx.initialize(mesh) (after ...)"
)


@pytest.mark.parametrize(
    "raised,message,expected",
    [
        (RuntimeError, _TIMEOUT, errors.CollectiveTimeoutError),
        (ValueError, _TIMEOUT, errors.CollectiveTimeoutError),  # jax's fast path raises ValueError
        (RuntimeError, _MISMATCH, errors.CollectiveMismatchError),
        (RuntimeError, _PEER_CLOSED, errors.EndpointFailedError),
        (ValueError, _TOO_BIG, errors.InvalidCallError),
        (RuntimeError, _NOT_SET_UP, errors.InitializationError),
    ],
)
def test_translated_raises_the_family_class(raised, message, expected):
    jax_runtime_error = type("JaxRuntimeError", (raised,), {})  # jax's own class is created in C++
    original = jax_runtime_error(message)
    with pytest.raises(expected) as got:
        with errors.translated():
            raise original
    assert type(got.value) is expected and isinstance(got.value, errors.JaxArxError)
    assert str(got.value) == message[message.index("jax_arx") :]  # the status prefix dropped, all else kept
    assert got.value.__cause__ is original
    if expected is errors.CollectiveTimeoutError:
        assert isinstance(got.value, TimeoutError) and isinstance(got.value, errors.CollectiveError)

    @errors.translated()
    def step():
        raise jax_runtime_error(message)

    with pytest.raises(expected):
        step()


def test_translated_takes_the_cpu_backends_plain_value_error():
    # What a failed call raises through jax's fast path (a function that
    # has run before): builtins.ValueError itself, no subclass of jax's.
    with pytest.raises(errors.EndpointFailedError) as got:
        with errors.translated():
            raise ValueError(_PEER_CLOSED)
    assert type(got.value.__cause__) is ValueError


def test_translated_leaves_other_errors_alone():
    for e in (
        RuntimeError("INTERNAL: some other library failed"),
        KeyError("jax_arx: not a runtime error"),
        jax_arx.ConfigError("JAX_ARX_TIMEOUT_S='x' is not a number"),
    ):
        with pytest.raises(type(e)) as got:
            with errors.translated():
                raise e
        assert got.value is e
    with errors.translated():
        pass


def test_cpu_beside_a_gpu_is_said_once(tmp_path, monkeypatch, caplog):
    # jax without CUDA on a machine whose driver shows a GPU: jax_arx runs on
    # the CPU, and says so once; not where no GPU shows, nor where the CPU
    # was asked for (JAX_PLATFORMS=cpu).
    from jax_arx import _distributed

    mesh = jax.make_mesh((1,), ("x",))
    monkeypatch.setattr(_distributed, "_warned_cpu", [])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    assert not _distributed.warn_if_cpu_beside_a_gpu(mesh, marks=(str(tmp_path / "nvidia0"), str(gpus)))
    (gpus / "0000:01:00.0").mkdir()
    with caplog.at_level("WARNING", logger="jax_arx"):
        assert _distributed.warn_if_cpu_beside_a_gpu(mesh, marks=(str(gpus),))
        assert not _distributed.warn_if_cpu_beside_a_gpu(mesh, marks=(str(gpus),))
    said = [r.getMessage() for r in caplog.records if "NVIDIA GPU" in r.getMessage()]
    assert len(said) == 1 and "jax[cuda13]" in said[0] and "JAX_PLATFORMS=cpu" in said[0], said
    monkeypatch.setattr(_distributed, "_warned_cpu", [])
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not _distributed.warn_if_cpu_beside_a_gpu(mesh, marks=(str(gpus),))


@needs_4_devices
def test_initialize_refuses_a_core_without_a_target_python_lowers_to(fake_core, monkeypatch):
    # A core of another version: it registers every name but the fused norm's.
    names = {name: object() for name in _comm.FFI_TARGETS if name != "jax_arx_psum_add_norm"}
    monkeypatch.setattr(fake_core, "registrations", lambda: {"cpu": names})
    with pytest.raises(jax_arx.InitializationError, match="registers no jax_arx_psum_add_norm for cpu.*Reinstall"):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert _comm.communicator("tp") is None  # refused before anything was made


def test_the_real_core_registers_every_target_python_lowers_to(tmp_path):
    # The installed module, in a fresh interpreter (this one may hold a stand-in).
    names = repr(_comm.FFI_TARGETS)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import jax_arx._core as c\nfor t in c.registrations().values(): "
            f"assert set({names}) <= set(t), sorted(t)\nprint('ok', sorted(c.registrations()))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "No module named 'jax_arx._core'" in p.stderr:
        pytest.skip("jax_arx's C++ module is not installed (pip install .)")
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stderr[-2000:]
