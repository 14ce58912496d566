"""The verbs carrier, over soft-RoCE.

test_verbs_host_only builds tests/cpp/test_verbs_transport.cc with and without
rdma-core's headers and runs the part that needs no RDMA device: GID discovery
on a fake sysfs tree, JAX_ARX_IB_HCA parsing, and the errors of a machine
without devices, without libibverbs, or built without the headers.

test_verbs_soft_roce boots a VM with four soft-RoCE devices on two veth pairs
(tests/verbs/rxe_vm.sh; about 10 s to boot under TCG) and runs the two-rank
test inside it: two roots per rank, then one. It is skipped, with the reason,
where the VM cannot start (not root, no qemu or kernel and no way to install
them). RXE_VM_NDEV=2 runs the one-root half only.
"""

import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
VM = ROOT / "tests" / "verbs" / "rxe_vm.sh"
PAYLOAD = ROOT / "tests" / "verbs" / "vm_transport_test.sh"
SOURCES = (
    ["tests/cpp/test_verbs_transport.cc"]
    + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ffi" / "transport").glob("verbs*.cc"))
    + ["ffi/comm/region.cc", "ffi/comm/config.cc"]
)
CANNOT_START = 77  # rxe_vm.sh: the VM cannot start on this machine


def _cxx():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    return cxx


def _have_verbs_headers(cxx):
    r = subprocess.run([cxx, "-x", "c++", "-E", "-", "-o", os.devnull], input="#include <infiniband/verbs.h>\n",
                       capture_output=True, text=True)
    return r.returncode == 0


def _build(cxx, out, with_verbs):
    """Starts the standalone build of the test (the brief's command line)."""
    cmd = [cxx, "-std=c++20", "-O1", "-g", "-Iffi", *(["-DARX_HAVE_VERBS=1"] if with_verbs else []), *SOURCES,
           "-ldl", "-lpthread", "-o", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, what):
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"building {what} failed:\n{log}"


def _run(cmd, timeout, **kw):
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)
    return r.returncode, r.stdout + r.stderr


def test_verbs_host_only(tmp_path):
    if any(pathlib.Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this host has RDMA devices; the device-free checks expect none")
    cxx = _cxx()
    builds = {"no-headers": _build(cxx, tmp_path / "test_noverbs", False)}
    if _have_verbs_headers(cxx):
        builds["verbs"] = _build(cxx, tmp_path / "test_verbs", True)
    for name, proc in builds.items():
        _finish(proc, name)
    for name in builds:
        binary = tmp_path / ("test_verbs" if name == "verbs" else "test_noverbs")
        rc, out = _run([binary, "--host-only"], timeout=120)
        print(out)
        assert rc == 0 and "ALL PASSED" in out, out
        for check in ("sysfs-gid", "hca-list", "gid-text", "load-failure", "no-devices"):
            assert f"PASS {check}" in out, out
        if name == "no-headers":
            assert "compiled without rdma-core's headers" in out


@pytest.mark.verbs
@pytest.mark.slow
def test_verbs_soft_roce(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the soft-RoCE VM needs root (it installs qemu and a kernel, and reads /boot/vmlinuz-*)")
    rc, out = _run([VM, "--prepare"], timeout=900)
    if rc == CANNOT_START:
        pytest.skip(out.strip().splitlines()[-1])
    assert rc == 0, out
    cxx = _cxx()
    if not _have_verbs_headers(cxx):
        pytest.skip("no rdma-core headers (infiniband/verbs.h) even after rxe_vm.sh --prepare")
    binary = tmp_path / "test_verbs_transport"
    _finish(_build(cxx, binary, True), "test_verbs_transport")

    ndev = os.environ.get("RXE_VM_NDEV", "4")
    env = dict(os.environ, RXE_VM_NDEV=ndev, RXE_VM_TIMEOUT="600")
    t0 = time.monotonic()
    rc, out = _run([VM, PAYLOAD, binary], timeout=700, env=env)
    wall = time.monotonic() - t0
    print(out)
    print(f"soft-RoCE VM test: {wall:.1f} s wall")
    if rc == CANNOT_START:
        pytest.skip(out.strip().splitlines()[-1])
    assert rc == 0, out[-6000:]
    runs = 2 if ndev == "4" else 1
    assert "FAIL" not in out, out
    assert out.count("test_verbs_transport: ALL PASSED") == runs, out
    for rank in (0, 1):
        for check in ("construct", "gid-discovery", "bad-details", "connect", "pattern", "burst", "large", "bounds"):
            assert out.count(f"[rank {rank}] PASS {check} ") == runs, (rank, check)
    for check in ("bad-hca", "bad-gid-index", "peer-close", "peer-exit"):
        assert out.count(f"[rank 0] PASS {check} ") == runs, check
    if ndev == "4":
        assert "[rank 0] PASS construct rxe0,rxe2: 2 roots" in out
    assert "[rank 0] PASS construct rxe0: 1 root" in out
    # A lost peer surfaces as an error naming it, within the QP's retry budget.
    detect = [float(s) for s in re.findall(r"PASS peer-(?:close|exit) detected in ([0-9.]+) s", out)]
    assert len(detect) == 2 * runs and max(detect) < 10, detect
    assert all("rank 1" in line for line in out.splitlines() if "PASS peer-" in line and "detected" in line)
    # The bytes really crossed the veth wire.
    sent = [int(n) for n in re.findall(r"veth0 sent (\d+) packets", out)]
    assert len(sent) == runs and min(sent) > 1000, sent
