"""The C++ core's own tests: built with CMake and run here.

- tests/cpp/test_core.cc: endpoints, proxies, carriers and the host device side
  with ranks as threads, over shm and tcp, against an independent reference.
- tests/cpp/test_bulk.cc: the bulk collectives (all-gather, reduce-scatter,
  the fused MoE combine) over the channels, the same way; test_layout.cc: the layout.
- tests/cpp/test_tcp_transport.cc, test_tcp_auth.cc, test_tcp_fuzz.cc: the tcp
  carrier alone: exchanges, sends bounded by the timeout, who may connect, and
  adversarial bytes (seeded, a few seconds). tests/cpp/test_region.cc: shared
  memory leaves nothing in /dev/shm however its process ends.
- The same under ThreadSanitizer (tcp only: see the note in test_core.cc), with
  no report allowed.
- The core cross-compiled for aarch64 (the first users run it on ARM CPUs).

CMake and a C++20 compiler are needed; the aarch64 build needs Debian's
g++-aarch64-linux-gnu (.ci/run installs it) and is skipped without it.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "cpp-tests"


def _cmake(build_dir, *defs, env=None):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *gen, "-DJAX_ARX_PYTHON=OFF",
                    "-DJAX_ARX_CUDA=OFF", *defs], check=True, capture_output=True, text=True, env=env)
    jobs = str(max(1, (os.cpu_count() or 2)))
    r = subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def _run(cmd, timeout):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def core_build():
    d = BUILD / "release"
    _cmake(d, "-DJAX_ARX_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release")
    return d


@pytest.fixture(scope="module")
def tsan_build():
    d = BUILD / "tsan"
    _cmake(d, "-DJAX_ARX_TESTS=ON", "-DJAX_ARX_TSAN=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo")
    return d


@pytest.mark.parametrize("carrier", ["shm", "tcp"])
def test_core(core_build, carrier):
    out = _run([str(core_build / "test_core"), carrier], timeout=600)
    assert f"{carrier}: ok" in out


@pytest.mark.parametrize("carrier", ["shm", "tcp"])
def test_bulk(core_build, carrier):
    out = _run([str(core_build / "test_bulk"), carrier], timeout=600)
    assert f"{carrier}: ok" in out


def test_core_under_thread_sanitizer(tsan_build):
    env_opts = "halt_on_error=1 second_deadlock_stack=1"
    os.environ.setdefault("TSAN_OPTIONS", env_opts)
    out = _run([str(tsan_build / "test_core"), "--quick", "tcp"], timeout=900)
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert "tcp: ok" in out
    out = _run([str(tsan_build / "test_bulk"), "--quick", "tcp"], timeout=900)
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert "tcp: ok" in out
    for cmd in (["test_tcp_transport"], ["test_tcp_auth", "--quick"], ["test_tcp_fuzz", "--iterations", "60"]):
        out = _run([str(tsan_build / cmd[0]), *cmd[1:]], timeout=900)
        assert "ThreadSanitizer" not in out, out[-6000:]
        assert "all passed" in out, out[-6000:]


def test_layout(core_build):
    out = _run([str(core_build / "test_layout")], timeout=120)
    assert "layout: ok" in out


@pytest.mark.parametrize("name", ["test_tcp_transport", "test_tcp_auth", "test_tcp_fuzz", "test_region"])
def test_carrier_unit_tests(core_build, name):
    exe = core_build / name
    if not exe.exists():
        pytest.skip(f"{name} is not built")
    _run([str(exe)], timeout=600)


def test_core_cross_compiles_for_aarch64():
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
    d = BUILD / "aarch64"
    env = dict(os.environ, CXX=cxx)
    _cmake(d, "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64", "-DJAX_ARX_TESTS=ON",
           f"-DCMAKE_CXX_COMPILER={cxx}", env=env)
    lib = d / "libarx_core.a"
    assert lib.exists()
    exe = d / "test_core"
    info = subprocess.run(["file", str(exe)], capture_output=True, text=True).stdout if shutil.which("file") else ""
    if info:
        assert "aarch64" in info or "ARM aarch64" in info, info
    # Run it too where user-mode qemu is installed: ARM reorders what x86 does not.
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu and Path("/usr/aarch64-linux-gnu").exists():
        out = _run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), "--quick", "shm"], timeout=900)
        assert "shm: ok" in out
        out = _run([qemu, "-L", "/usr/aarch64-linux-gnu", str(d / "test_bulk"), "--quick", "shm"], timeout=900)
        assert "shm: ok" in out
