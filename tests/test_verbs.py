"""The verbs carrier, over soft-RoCE.

test_verbs_host_only builds tests/cpp/test_verbs_device.cc with and without
rdma-core's headers and runs it: the parts that need no RDMA device, GID
discovery on a fake sysfs tree, JAX_ARX_IB_HCA parsing, and the errors of a
machine without devices, without libibverbs, or built without the headers.

test_package_without_verbs builds the Python package with the verbs carrier
left out (JAX_ARX_VERBS=OFF, as on a machine without rdma-core's headers) into
a scratch directory, and checks that it imports, runs psum over shm and tcp,
and says what is missing when verbs is asked for.

test_verbs_soft_roce and test_psum_soft_roce share one boot of a VM with
four soft-RoCE devices on two veth pairs (tests/verbs/rxe_vm.sh, about 10 s
to boot under TCG; tests/verbs/vm_suite.sh runs both parts): the two-rank
carrier test inside it (two roots per rank, then one, then a ring of 2
(each rank's list: the port facing prev, then the port facing next)), then
jax_arx.psum between two processes over the carrier
(tests/workers/verbs_psum.py), a ring of 2 among its phases, and in the
same processes all_gather, psum_scatter and the fused MoE combine
(tests/workers/verbs_bulk.py); test_ring_of_four_soft_roce (ARX_TEST_RING4_VM=1: about 18
minutes) boots it with eight devices on four wires and runs jax_arx.psum in
a ring of four processes. All are skipped, with the reason, where the VM
cannot start: not root, or the VM's packages (qemu, a Debian kernel, ...)
not installed (failed in CI: tests/needs.py). The tests never install them: `.ci/run` does, and so does
`tests/verbs/rxe_vm.sh --prepare` run by hand as root.
RXE_VM_NDEV=2 runs the one-root half only.
"""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import needs

ROOT = pathlib.Path(__file__).resolve().parent.parent
VM = ROOT / "tests" / "verbs" / "rxe_vm.sh"
PAYLOAD = ROOT / "tests" / "verbs" / "vm_transport_test.sh"
PSUM_PAYLOAD = ROOT / "tests" / "verbs" / "vm_psum_test.sh"
PSUM_WORKER = ROOT / "tests" / "workers" / "verbs_psum.py"
CARRIER_SOURCES = (  # what the verbs tests link, besides their own file
    sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ffi" / "transport").glob("verbs*.cc"))
    + ["ffi/base/region.cc", "ffi/base/config.cc"]
)
CANNOT_START = 77  # rxe_vm.sh: the VM cannot start on this machine


def _cxx():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        needs.missing(f"no C++ compiler ({cxx})")
    return cxx


def _have_verbs_headers(cxx):
    r = subprocess.run(
        [cxx, "-x", "c++", "-E", "-", "-o", os.devnull],
        input="#include <infiniband/verbs.h>\n",
        capture_output=True,
        text=True,
    )
    return r.returncode == 0


def _build(cxx, test, out, with_verbs):
    """Starts the standalone build of tests/cpp/``test``.cc (the command line
    tests/verbs/README.md gives)."""
    cmd = [
        cxx,
        "-std=c++20",
        "-O1",
        "-g",
        "-Iffi",
        "-DARX_HAVE_VERBS=1" if with_verbs else "-DARX_HAVE_VERBS=0",
        f"tests/cpp/{test}.cc",
        *CARRIER_SOURCES,
        "-ldl",
        "-lpthread",
        "-o",
        str(out),
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, what):
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"building {what} failed:\n{log}"


def _run(cmd, timeout, env=None):
    # RXE_VM_INSTALL=0: the VM script must not install system packages from
    # a test; where some are missing it exits CANNOT_START naming them.
    env = dict(env or os.environ, RXE_VM_INSTALL="0")
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return r.returncode, r.stdout + r.stderr


def test_verbs_host_only(tmp_path):
    if any(pathlib.Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this host has RDMA devices; the device-free checks expect none")
    cxx = _cxx()
    builds = {"no-headers": _build(cxx, "test_verbs_device", tmp_path / "test_noverbs", False)}
    if _have_verbs_headers(cxx):
        builds["verbs"] = _build(cxx, "test_verbs_device", tmp_path / "test_verbs", True)
    for name, proc in builds.items():
        _finish(proc, name)
    for name in builds:
        binary = tmp_path / ("test_verbs" if name == "verbs" else "test_noverbs")
        rc, out = _run([binary], timeout=120)
        print(out)
        assert rc == 0 and "ALL PASSED" in out, out
        for check in ("sysfs-gid", "hca-list", "gid-text", "load-failure", "no-devices", "ring-device-list"):
            assert f"PASS {check}" in out, out
        if name == "no-headers":
            assert "compiled without rdma-core's headers" in out


_NO_VERBS_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_arx
    assert jax_arx.__file__.startswith(sys.argv[1]), jax_arx.__file__
    from jax_arx import _native
    core = _native.core()
    assert not getattr(core, "has_verbs", lambda: False)()
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    f = jax.jit(jax.shard_map(lambda v: jax_arx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    x = np.random.default_rng(0).standard_normal((2, 4097)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    for transport in ("shm", "tcp"):
        os.environ["JAX_ARX_TRANSPORT"] = transport
        jax_arx.initialize(mesh)
        used = {ep.transport for ep in jax_arx._comm.communicator("x").endpoints}
        assert used == {transport}, used
        for _ in range(20):
            got = np.asarray(f(xs)).reshape(-1)
            assert got.tobytes() == (x[0] + x[1]).tobytes()
        jax_arx.shutdown()
        print("PASS", transport)
    os.environ["JAX_ARX_TRANSPORT"] = "verbs"
    try:
        jax_arx.initialize(mesh)
    except jax_arx.InitializationError as e:
        assert "no verbs carrier" in str(e), e
        print("PASS verbs refused:", str(e).splitlines()[0])
    else:
        raise AssertionError("a build without the verbs carrier set up a verbs endpoint")
""")


@pytest.mark.slow
def test_package_without_verbs(tmp_path):
    """The package built without the verbs carrier (JAX_ARX_VERBS=OFF, what a
    machine without infiniband/verbs.h gets) imports and runs over shm and
    tcp. Builds into tmp_path (about a minute on two cores); the installed
    package and its build directory are left alone."""
    site, build = tmp_path / "site", tmp_path / "build"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-compile",
        "--target",
        site,
        "-C",
        f"build-dir={build}",
        "-C",
        "cmake.define.JAX_ARX_VERBS=OFF",
        "-C",
        "cmake.define.JAX_ARX_CUDA=OFF",
    ]
    if all(importlib.util.find_spec(m) for m in ("nanobind", "scikit_build_core")):
        cmd.append("--no-build-isolation")  # this environment can build; no download needed
    rc, out = _run([*cmd, ROOT], timeout=900, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if rc != 0 and re.search(
        r"No matching distribution|Could not find a version|NewConnectionError|"
        r"Temporary failure in name resolution",
        out,
    ):
        needs.missing(f"cannot fetch the build requirements (nanobind, scikit-build-core): {out.strip()[-300:]}")
    assert rc == 0, f"building jax_arx with JAX_ARX_VERBS=OFF failed:\n{out[-6000:]}"
    ninja = build / "build.ninja"
    if ninja.exists():
        assert "ARX_HAVE_VERBS=1" not in ninja.read_text(), "JAX_ARX_VERBS=OFF still built the verbs carrier"
    env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", JAX_ARX_FALLBACK="error")
    for k in ("JAX_ARX_TRANSPORT", "JAX_ARX_IB_HCA", "NCCL_IB_HCA"):
        env.pop(k, None)
    script = tmp_path / "no_verbs.py"
    script.write_text(_NO_VERBS_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(site)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    out = r.stdout + r.stderr
    print(out)
    assert r.returncode == 0, out[-6000:]
    assert "PASS shm" in out and "PASS tcp" in out and "PASS verbs refused" in out, out


def _prepare_vm():
    """Builds the VM's initramfs; skips, naming what is missing, where the VM
    cannot start here (installing is .ci/run's job, never a test's)."""
    if os.geteuid() != 0:
        needs.missing("the soft-RoCE VM needs root (it reads /boot/vmlinuz-* and sets up network namespaces)")
    rc, out = _run([VM, "--prepare"], timeout=900)
    if rc == CANNOT_START:
        needs.missing(out.strip().splitlines()[-1])
    assert rc == 0, out


VM_SUITE = ROOT / "tests" / "verbs" / "vm_suite.sh"


@pytest.fixture(scope="module")
def vm_suite(tmp_path_factory):
    """One VM boot for the verbs tests that need its four devices
    (tests/verbs/vm_suite.sh): the carrier test, then jax_arx over the
    carrier; each test checks its part. Uses this interpreter (the VM sees
    the host's filesystem read-only), so jax_arx must be installed in it,
    as CI does. Returns {part: (exit status, output)} and the wall time."""
    _prepare_vm()
    cxx = _cxx()
    if not _have_verbs_headers(cxx):
        needs.missing("no rdma-core headers (infiniband/verbs.h) even after rxe_vm.sh --prepare")
    probe = subprocess.run(
        [sys.executable, "-c", "import jax, jax_arx._core"], capture_output=True, text=True, cwd="/", timeout=120
    )
    if probe.returncode != 0:
        needs.missing(
            f"jax_arx with its C++ module is not installed in {sys.executable} (pip install . first): "
            f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''}"
        )
    binary = tmp_path_factory.mktemp("verbs") / "test_verbs_transport"
    _finish(_build(cxx, "test_verbs_transport", binary, True), "test_verbs_transport")
    # Hang guards, not speed checks: under TCG on a loaded 2-core host the
    # VM runs many times slower than on an idle one.
    env = dict(os.environ, RXE_VM_NDEV=os.environ.get("RXE_VM_NDEV", "4"), RXE_VM_TIMEOUT="3000")
    t0 = time.monotonic()
    rc, out = _run([VM, VM_SUITE, VM_SUITE.parent, binary, sys.executable, PSUM_WORKER], timeout=3100, env=env)
    wall = time.monotonic() - t0
    print(out)
    if rc == CANNOT_START:
        needs.missing(out.strip().splitlines()[-1])
    parts = {}
    for m in re.finditer(r"^=== part (\w+)\n(.*?)^=== part \1: exit (\d+)$", out, re.S | re.M):
        parts[m.group(1)] = (int(m.group(3)), m.group(2))
    assert set(parts) == {"transport", "psum"}, f"the VM ended before its parts did (status {rc}):\n{out[-6000:]}"
    return parts, wall


@pytest.mark.verbs
def test_verbs_soft_roce(vm_suite):
    """The carrier test in the VM (tests/verbs/vm_transport_test.sh): two
    roots per rank, then one, then a ring of 2."""
    rc, out = vm_suite[0]["transport"]
    ndev = os.environ.get("RXE_VM_NDEV", "4")
    assert rc == 0, out[-6000:]
    runs = 3 if ndev == "4" else 1  # two roots, one root, a ring of 2
    assert "FAIL" not in out, out
    assert out.count("test_verbs_transport: ALL PASSED") == runs, out
    for rank in (0, 1):
        for check in ("construct", "gid-discovery", "bad-details", "connect", "pattern", "burst", "large", "bounds"):
            assert out.count(f"[rank {rank}] PASS {check} ") == runs, (rank, check)
    for check in ("bad-hca", "bad-gid-index", "peer-close", "silent-peer", "peer-exit"):
        assert out.count(f"[rank 0] PASS {check} ") == runs, check
    if ndev == "4":
        assert "[rank 0] PASS construct rxe0,rxe2: 2 roots" in out
        # The ring: rank 0's ports (prev rxe2, next rxe0), two roots each; a
        # peer that never connects fails connect() naming it and the port.
        assert "[rank 0] PASS construct rxe2,rxe2,rxe0,rxe0: 2 roots" in out
        assert re.search(
            r"PASS silent-peer connect failed in [0-9.]+ s: .*no answer from rank 1 .*the port facing "
            r"(prev|next) \(rank 1\)",
            out,
        ), out
    assert "[rank 0] PASS construct rxe0: 1 root" in out
    # A lost peer surfaces as an error naming it, within the QP's retry budget.
    detect = [float(s) for s in re.findall(r"PASS peer-(?:close|exit) detected in ([0-9.]+) s", out)]
    assert len(detect) == 2 * runs and max(detect) < 10, detect
    assert all("rank 1" in line for line in out.splitlines() if "PASS peer-" in line and "detected" in line)
    # The bytes really crossed the veth wire.
    sent = [int(n) for n in re.findall(r"veth0 sent (\d+) packets", out)]
    assert len(sent) == runs and min(sent) > 1000, sent


@pytest.mark.verbs
def test_psum_soft_roce(vm_suite, summary_line):
    """jax_arx.psum between two processes in the VM over soft-RoCE, every result
    checked bit for bit against numpy's fp32 rank-order sum (bf16, f16, f32,
    sizes 1 to 131071, 4 back to back per dtype and size on two roots (72
    calls), 2 in the other phases): two roots per rank, one root (with small
    WRs), a ring of 2, the automatic choice (verbs when both ranks name
    devices, tcp when one does not), then a rank exiting mid-stream, which the
    other's psum reports, naming it, within seconds. On two roots (one with
    RXE_VM_NDEV=2), 30 bulk calls too, bit for bit against numpy: all_gather
    and psum_scatter (10 each, 2 MiB gathered or scattered) and the fused MoE
    combine (5 with bf16 expert outputs, 5 with e4m3), never a fallback
    (JAX_ARX_FALLBACK=error), every call counted by the bulk endpoints over
    verbs."""
    (rc, out), wall = vm_suite[0]["psum"], vm_suite[1]
    ndev = os.environ.get("RXE_VM_NDEV", "4")
    assert rc == 0, out[-8000:]
    assert "FAIL" not in out, out[-8000:]
    phases = (["two-roots", "ring"] if ndev == "4" else []) + ["one-root", "auto-verbs", "auto-tcp"]
    for phase in phases:
        for rank in (0, 1):
            assert f"verbs_psum: [rank {rank}] PASS {phase}: " in out, (phase, rank)
    for phase in ("two-roots", "ring", "one-root", "auto-verbs"):
        if phase in phases:
            assert re.search(rf"PASS {phase}: \d+ psum calls over verbs", out), phase
    if ndev == "4":  # a ring of 2, two roots per port: rank 0's prev port rxe2, next port rxe0
        assert "psum calls over verbs (JAX_ARX_IB_HCA=rxe2,rxe2,rxe0,rxe0)" in out, out[-4000:]
    assert re.search(r"PASS auto-tcp: \d+ psum calls over tcp", out)
    assert out.count("psum calls over verbs (JAX_ARX_IB_HCA=rxe0,rxe2)") == (1 if ndev == "4" else 0)
    # The bulk collectives, on both ranks: every call jax_arx's, over verbs, on
    # both NIC roots where there are two.
    bulk_phase, roots = ("two-roots", 2) if ndev == "4" else ("one-root", 1)
    for rank in (0, 1):
        bulk = re.search(
            rf"verbs_psum: \[rank {rank}\] PASS {bulk_phase}: .*; (\d+) bulk calls over verbs with "
            rf"(\d) root",
            out,
        )
        assert bulk and int(bulk.group(1)) == 30 and int(bulk.group(2)) == roots, (rank, bulk and bulk.group(0))
    # The lost peer: rank 0's psum fails, naming rank 1, long before the timeout.
    lost = re.search(
        r"verbs_psum: \[rank 0\] PASS lose-peer: psum failed ([0-9.]+) s after its first call without "
        r"rank 1 .*the error names the peer: .*rank 1",
        out,
    )
    assert lost and float(lost.group(1)) < 20, out[-4000:]
    # The bytes really crossed the veth wire.
    sent = re.search(r"psum over verbs: veth0 sent (\d+) packets", out)
    assert sent and int(sent.group(1)) > 1000, sent
    for line in out.splitlines():
        if line.startswith("verbs_psum: [rank 0] PASS"):
            summary_line(line if len(line) < 400 else line[:400] + " ...")
    summary_line(f"soft-RoCE psum test: {wall:.1f} s wall, veth0 sent {sent.group(1)} packets")


# A ring of four in the VM: eight soft-RoCE devices on four wires, wire k
# from rank k's next port (rxe 2k) to rank k + 1's prev port (rxe 2k + 1).
RING_OF_FOUR = "/".join(f"rxe{(2 * r - 1) % 8},rxe{2 * r}" for r in range(4))


@pytest.mark.verbs
def test_ring_of_four_soft_roce(summary_line):
    """jax_arx.psum in a ring of four processes over soft-RoCE in the VM
    (RXE_VM_NDEV=8), each rank's device list its prev port, then its next
    port: every result bit for bit against numpy, every rank relaying what
    its previous rank sends two ranks on. Uses this interpreter, as
    test_psum_soft_roce does. Four jax processes under TCG take long (18
    minutes on a loaded 2-core host, 9 of them starting jax): it runs when
    ARX_TEST_RING4_VM=1 asks for it."""
    if os.environ.get("ARX_TEST_RING4_VM") != "1":
        pytest.skip(
            "a ring of four jax processes in the soft-RoCE VM takes about 18 minutes on 2 cores; set "
            "ARX_TEST_RING4_VM=1 to run it"
        )
    _prepare_vm()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax, jax_arx._core"], capture_output=True, text=True, cwd="/", timeout=120
    )
    if probe.returncode != 0:
        pytest.skip(f"jax_arx with its C++ module is not installed in {sys.executable} (pip install . first)")
    # Four jax processes under TCG: more memory, and hang guards no load reaches.
    env = dict(os.environ, RXE_VM_NDEV="8", RXE_VM_MEM="4096", RXE_VM_TIMEOUT="2400")
    phase = f"name=ring-of-4 transport=verbs topology=ring hca={RING_OF_FOUR} expect=verbs calls=4"
    t0 = time.monotonic()
    rc, out = _run(
        [VM, PSUM_PAYLOAD, sys.executable, PSUM_WORKER, "--ranks", "4", "--phase", phase], timeout=2500, env=env
    )
    wall = time.monotonic() - t0
    print(out)
    if rc == CANNOT_START:
        pytest.skip(out.strip().splitlines()[-1])
    assert rc == 0, out[-8000:]
    assert "FAIL" not in out, out[-8000:]
    for rank in range(4):
        m = re.search(
            rf"verbs_psum: \[rank {rank}\] PASS ring-of-4: \d+ psum calls over verbs .* (\d+) puts relayed", out
        )
        assert m and int(m.group(1)) > 0, (rank, out[-4000:])
    sent = re.search(r"psum over verbs: veth0 sent (\d+) packets", out)
    assert sent and int(sent.group(1)) > 1000, sent
    summary_line(f"soft-RoCE ring of four: {wall:.1f} s wall, veth0 sent {sent.group(1)} packets")


# --- configuration and the automatic choice (no RDMA needed) ----------------


def test_ib_settings_travel_as_endpoint_options():
    """The JAX_ARX_IB_* knobs are read in jax_arx/config.py only, and reach
    the C++ Config through the options dict, which checks them again."""
    from jax_arx import config

    cfg = config.load(
        {
            "JAX_ARX_IB_TIMEOUT": "16",
            "NCCL_IB_RETRY_CNT": "6",
            "JAX_ARX_IB_TC": "106",
            "NCCL_IB_SL": "3",
            "JAX_ARX_IBVERBS_LIB": "libx.so.1",
        }
    )
    # ib_chunk_bytes is tuning (a test's, through jax_arx.initialize(_tuning=...)), no user setting.
    options = cfg.endpoint_options(None, {"ib_chunk_bytes": 65536})
    assert {
        k: options[k] for k in ("ib_timeout", "ib_retry_cnt", "ib_tc", "ib_sl", "ib_chunk_bytes", "ibverbs_lib")
    } == {
        "ib_timeout": "16",
        "ib_retry_cnt": "6",
        "ib_tc": "106",
        "ib_sl": "3",
        "ib_chunk_bytes": "65536",
        "ibverbs_lib": "libx.so.1",
    }
    assert config.load({"JAX_ARX_IB_RETRY_CNT": "5", "NCCL_IB_RETRY_CNT": "6"}).ib_retry_cnt == 5
    # Unset: the carrier's defaults (14, 7, 0, 0, whole), and no keys at all.
    assert not {k for k in config.Config().endpoint_options(None) if k.startswith("ib")}
    for name, value in (
        ("JAX_ARX_IB_TIMEOUT", "0"),
        ("JAX_ARX_IB_TIMEOUT", "32"),
        ("NCCL_IB_RETRY_CNT", "8"),
        ("JAX_ARX_IB_TC", "256"),
        ("JAX_ARX_IB_SL", "x"),
    ):
        with pytest.raises(Exception, match=f"{name}='{value}' is not accepted"):
            config.load({name: value})

    # The installed C++ module takes them (and checks them), in an interpreter
    # outside the source tree, whose jax_arx has no _core.
    script = textwrap.dedent(f"""
        import os, sys
        try:
            from jax_arx import _core
        except ImportError as e:
            print("NO CORE", e); sys.exit(0)
        options = {options!r}
        _core.Endpoint(1, 0, 0, 2, "shm", "cpu", "ib-options", os.urandom(32), options).close()
        try:
            _core.Endpoint(2, 0, 0, 2, "shm", "cpu", "ib-options", os.urandom(32), dict(options, ib_timeout="0"))
        except RuntimeError as e:
            assert "ib_timeout=0 is outside" in str(e), e
            print("REFUSED", e)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if r.stdout.startswith("NO CORE"):
        needs.missing(f"jax_arx's C++ module is not installed ({r.stdout.strip()}); pip install . first")
    assert "REFUSED" in r.stdout, r.stdout


def _fake_ib_device(
    root,
    name,
    *,
    hardware,
    state="4: ACTIVE",
    link_layer="Ethernet",
    gid_type="RoCE v2",
    gid="0000:0000:0000:0000:0000:ffff:c633:6401",
):
    port = root / name / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text(link_layer + "\n")
    (port / "gids" / "0").write_text("fe80:0000:0000:0000:0000:0000:0000:0001\n")
    (port / "gid_attrs" / "types" / "0").write_text("IB/RoCE v1\n")
    (port / "gids" / "1").write_text(gid + "\n")
    (port / "gid_attrs" / "types" / "1").write_text(gid_type + "\n")
    if hardware:
        (root / name / "device").mkdir()  # sysfs: a link to the PCI function
    else:
        (root / name / "parent").write_text("veth0\n")  # soft-RoCE: the netdev's name


def test_rdma_devices_found_on_a_fake_sysfs(tmp_path):
    from jax_arx import _carriers

    _fake_ib_device(tmp_path, "mlx5_0", hardware=True)
    _fake_ib_device(tmp_path, "mlx5_1", hardware=True, state="1: DOWN")
    _fake_ib_device(tmp_path, "mlx5_2", hardware=True, gid_type="IB/RoCE v1")
    _fake_ib_device(tmp_path, "mlx5_3", hardware=True, gid="0000:0000:0000:0000:0000:0000:0000:0000")
    _fake_ib_device(tmp_path, "mlx5_4", hardware=True, link_layer="InfiniBand", gid_type="")
    _fake_ib_device(tmp_path, "rxe0", hardware=False)
    assert _carriers.rdma_devices_found(str(tmp_path)) == ["mlx5_0", "mlx5_4"]
    assert _carriers.rdma_devices_found(str(tmp_path / "none")) == []
    no_rdma, why = _carriers.rdma_available(_config_for(), sysfs=str(tmp_path / "none"))
    assert not no_rdma and "no RDMA device" in why


def _config_for(**kw):
    from jax_arx import config

    return config.Config(**kw)


def test_choose_transport_with_rdma():
    from jax_arx import _carriers

    auto = _config_for()
    assert _carriers.choose_transport(auto, ["a", "b"], [True, True]) == "verbs"
    assert _carriers.choose_transport(auto, ["a", "b"], [True, False]) == "tcp"  # every member must be able to
    assert _carriers.choose_transport(auto, ["a", "a"], [True, True]) == "shm"  # one host: shm wins
    assert _carriers.choose_transport(auto, ["a", "b"]) == "tcp"
    assert _carriers.choose_transport(_config_for(transport="tcp"), ["a", "b"], [True, True]) == "tcp"
    assert _carriers.choose_transport(_config_for(transport="verbs"), ["a", "a"], [False, False]) == "verbs"


def test_rdma_available_needs_the_carrier_and_libibverbs(tmp_path, caplog):
    from jax_arx import _carriers

    class NoVerbs:
        @staticmethod
        def has_verbs():
            return False

    class WithVerbs:
        @staticmethod
        def has_verbs():
            return True

    hca = _config_for(ib_hca="mlx5_0")
    ok, why = _carriers.rdma_available(hca, NoVerbs, sysfs=str(tmp_path))
    assert not ok and "no verbs carrier" in why
    assert "groups that span hosts use tcp" in caplog.text  # configured but unusable: said out loud
    ok, why = _carriers.rdma_available(
        _config_for(ib_hca="mlx5_0", ibverbs_lib="/nonexistent/libibverbs.so.1"), WithVerbs, sysfs=str(tmp_path)
    )
    assert not ok and "libibverbs cannot be loaded" in why
    _fake_ib_device(tmp_path, "mlx5_0", hardware=True)
    found, why = _carriers.rdma_available(
        _config_for(ibverbs_lib="/nonexistent/libibverbs.so.1"), WithVerbs, sysfs=str(tmp_path)
    )
    assert not found and "found (mlx5_0)" in why
    if _carriers._libibverbs_loads(None):
        assert _carriers.rdma_available(hca, WithVerbs, sysfs=str(tmp_path)) == (
            True,
            "RDMA devices configured (mlx5_0)",
        )
        assert _carriers.rdma_available(_config_for(), WithVerbs, sysfs=str(tmp_path))[0]
