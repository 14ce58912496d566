"""The C++ core's own tests: built with CMake and run here.

- tests/cpp/test_core.cc: endpoints, proxies, carriers and the host device side
  with ranks as threads, over shm and tcp, against an independent reference.
- tests/cpp/test_bulk.cc: the bulk collectives (all-gather, reduce-scatter,
  the fused MoE combine) over the channels, the same way; test_layout.cc: the
  layout; test_plan.cc: what runs a collective of each size (comm/plan.h);
  test_config.cc: what the core reads from the options Python sends;
  test_poll.cc: the host's waits leave out the time their thread did not run.
- tests/cpp/test_tcp_transport.cc, test_tcp_faults.cc, test_tcp_auth.cc,
  test_tcp_fuzz.cc: the tcp carrier alone: exchanges, peers that misbehave
  (sends bounded by the timeout), who may connect, and adversarial bytes
  (seeded, a few seconds). tests/cpp/test_region.cc: shared
  memory leaves nothing in /dev/shm however its process ends.
- The same under ThreadSanitizer (tcp only: see the note in test_core.cc), with
  no report allowed.
- The core cross-compiled for aarch64 (the first users run it on ARM CPUs),
  and its tests run there under user-mode qemu (see that test for what this
  shows and what it cannot).

CMake and a C++20 compiler are needed; the aarch64 leg needs Debian's
g++-aarch64-linux-gnu and qemu-user. .ci/run installs them all; each is
skipped without it, saying what is missing (failed in CI: tests/needs.py).
"""

import fcntl
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

import needs

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "cpp-tests"


def _cmake(build_dir, *defs, env=None, targets=()):
    """Configures and builds ``build_dir``: every target, or only ``targets``
    (the slow suites build only the tests they run)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        needs.missing("cmake is not installed (apt-get install cmake ninja-build)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers each set this module's fixtures up: one builds a
    # folder at a time, and the next finds it built.
    with open(build_dir.parent / f"{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [cmake, "-S", str(ROOT), "-B", str(build_dir), *gen, "-DJAX_ARX_PYTHON=OFF", "-DJAX_ARX_CUDA=OFF", *defs],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        jobs = str(max(1, (os.cpu_count() or 2)))
        only = ["--target", *targets] if targets else []
        r = subprocess.run(
            [cmake, "--build", str(build_dir), "-j", jobs, *only], capture_output=True, text=True, env=env
        )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def _run(cmd, timeout, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


def _package_compiler():
    """The environment with the compiler that scikit-build-core gives the
    package's build (Python's, sysconfig's CXX) where the caller names none:
    ccache keys an object by the compiler's name too (c++ and g++ are one
    program under two names), so with the names alike the core's objects that
    ``pip install .`` compiled serve this build."""
    env = dict(os.environ)
    cxx = (sysconfig.get_config_var("CXX") or "").split()
    if "CXX" not in env and cxx and shutil.which(cxx[0]):
        env["CXX"] = cxx[0]
    return env


@pytest.fixture(scope="module")
def core_build():
    d = BUILD / "release"
    _cmake(d, "-DJAX_ARX_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release", env=_package_compiler())
    return d


@pytest.fixture(scope="module")
def tsan_build():
    d = BUILD / "tsan"
    _cmake(d, "-DJAX_ARX_TESTS=ON", "-DJAX_ARX_TSAN=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo", targets=TSAN_TESTS)
    return d


@pytest.mark.parametrize("carrier", ["shm", "tcp"])
def test_core(core_build, carrier):
    out = _run([str(core_build / "test_core"), carrier], timeout=600)
    assert f"{carrier}: ok" in out


# The fast tier runs test_bulk with --quick (fewer and smaller calls, every
# path: a fifth of the time); the whole of it is the slow suite's.
@pytest.mark.parametrize(
    "size", [pytest.param(["--quick"], id="quick"), pytest.param([], id="whole", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("carrier", ["shm", "tcp"])
def test_bulk(core_build, carrier, size):
    out = _run([str(core_build / "test_bulk"), *size, carrier], timeout=600)
    assert f"{carrier}: ok" in out


# What the tsan suite builds and runs: the tests whose ranks and carriers are
# threads of one process. The rest of tests/cpp runs one thread per process
# (test_region forks), where ThreadSanitizer has nothing to see.
TSAN_TESTS = (
    "test_core",
    "test_bulk",
    "test_copy_pool",
    "test_tcp_transport",
    "test_tcp_faults",
    "test_tcp_auth",
    "test_tcp_fuzz",
)


@pytest.mark.tsan
def test_core_under_thread_sanitizer(tsan_build):
    env = dict(os.environ, TSAN_OPTIONS=os.environ.get("TSAN_OPTIONS", "halt_on_error=1 second_deadlock_stack=1"))
    out = _run([str(tsan_build / "test_core"), "--quick", "tcp"], timeout=900, env=env)
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert "tcp: ok" in out
    out = _run([str(tsan_build / "test_bulk"), "--quick", "tcp"], timeout=900, env=env)
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert "tcp: ok" in out
    for cmd in (
        ["test_copy_pool", "--quick"],
        ["test_tcp_transport"],
        ["test_tcp_faults"],
        ["test_tcp_auth", "--quick"],
        ["test_tcp_fuzz", "--iterations", "60"],
    ):
        out = _run([str(tsan_build / cmd[0]), *cmd[1:]], timeout=900, env=env)
        assert "ThreadSanitizer" not in out, out[-6000:]
        assert "all passed" in out, out[-6000:]


def test_layout(core_build):
    out = _run([str(core_build / "test_layout")], timeout=120)
    assert "layout: ok" in out


def test_plan(core_build):
    out = _run([str(core_build / "test_plan")], timeout=120)
    assert "plan: ok" in out


def test_poll(core_build):
    out = _run([str(core_build / "test_poll")], timeout=120)
    assert "poll: ok" in out


def test_copy_pool(core_build):
    out = _run([str(core_build / "test_copy_pool")], timeout=300)
    assert "test_copy_pool: all passed" in out


def test_config(core_build):
    out = _run([str(core_build / "test_config")], timeout=120)
    assert "config: ok" in out


@pytest.mark.parametrize(
    "name", ["test_tcp_transport", "test_tcp_faults", "test_tcp_auth", "test_tcp_fuzz", "test_region"]
)
def test_carrier_unit_tests(core_build, name):
    # Every tests/cpp/*.cc is built (CMakeLists.txt): one missing is a build that went wrong.
    _run([str(core_build / name)], timeout=600)


@pytest.mark.aarch64
def test_core_on_aarch64_under_qemu_user():
    """The core and its tests cross-compiled for aarch64, then run under
    qemu-user: test_layout, test_plan, and test_core and test_bulk (--quick)
    over shm and tcp.

    What this shows: the code GCC emits for ARM (its atomics as
    load-acquire / store-release instructions, 64-bit words, alignment)
    computes the same results as on x86, through every carrier path the
    suites take. What it cannot show: ARM's memory reorderings. qemu-user
    runs each guest thread on a host thread and gives guest loads and
    stores the host's ordering, which on x86 is stronger than ARM's, so a
    missing fence or a relaxed access that must be acquire passes here as
    on x86. The project's check of orderings is ThreadSanitizer
    (test_core_under_thread_sanitizer): it tracks happens-before through
    the C++ memory model, not through the CPU, so a flag published or read
    with too weak an order shows as a race on the bytes it guards, on any
    host, in the interleavings it sees. A litmus test of the flag protocol
    under ARM's model needs ARM hardware (the GB10's Grace CPU) or a model
    checker (herd7, GenMC); the project has neither in its tests, and the
    device side's PTX orderings are checked by no tool here."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        needs.missing("no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    sysroot = Path("/usr/aarch64-linux-gnu")
    if qemu is None or not (sysroot / "lib").is_dir():
        needs.missing(
            "no user-mode qemu for aarch64 or no aarch64 C library (apt-get install qemu-user libc6-dev-arm64-cross)"
        )
    d = BUILD / "aarch64"
    env = dict(os.environ, CXX=cxx)
    _cmake(
        d,
        "-DCMAKE_SYSTEM_NAME=Linux",
        "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
        "-DJAX_ARX_TESTS=ON",
        f"-DCMAKE_CXX_COMPILER={cxx}",
        env=env,
        targets=("test_layout", "test_plan", "test_core", "test_bulk"),
    )
    assert (d / "libarx_core.a").exists()
    # The ELF header's machine field: 183 is EM_AARCH64.
    with open(d / "test_core", "rb") as f:
        assert int.from_bytes(f.read(20)[18:20], "little") == 183, "test_core is not an aarch64 binary"
    run = [qemu, "-L", str(sysroot)]
    assert "layout: ok" in _run([*run, str(d / "test_layout")], timeout=300)
    assert "plan: ok" in _run([*run, str(d / "test_plan")], timeout=300)
    for exe in ("test_core", "test_bulk"):
        out = _run([*run, str(d / exe), "--quick", "shm", "tcp"], timeout=1200)
        assert "shm: ok" in out and "tcp: ok" in out, out[-3000:]
