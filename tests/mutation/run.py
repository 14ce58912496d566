"""Planted bugs the tests must catch: each mutation below is applied, alone,
to a copy of the tree, and the tests named with it must then fail.

    python tests/mutation/run.py            # the Python mutations (a few minutes)
    python tests/mutation/run.py --cpp      # and the C++ ones (builds the core: a few more)
    python tests/mutation/run.py --quick    # the issue's four Python ones (CI runs these)
    python tests/mutation/run.py --list
    python tests/mutation/run.py NAME ...   # those only

Python mutations: jax_arx's Python files and tests/ are copied to a
temporary directory with the installed C++ module (``pip install .`` first),
and pytest runs there, so the copy's jax_arx is the one imported: only the
tests that run in the pytest process can see a Python mutation (the
multi-process tests import the installed package). The same tests must
pass on the unmutated copy first. C++ mutations: ffi/, tests/cpp and
CMakeLists.txt are copied and the C++ test named is built and run, before
and after.

Exit status 0 when every mutation made its tests fail; it prints one line
per mutation: "caught" or "SURVIVED".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # in the tree
    old: str  # occurs exactly once in path
    new: str
    tests: tuple[str, ...]  # pytest arguments (Python), or the C++ test's name and arguments
    cpp: bool = False
    quick: bool = False  # one of the bugs issue 19 found surviving


M = Mutation
BULK = "tests/test_bulk_unit.py"
MUTATIONS = [
    # The six planted bugs issue 19 reported (the two-shot one is C++).
    M(
        "vmap: all_gather's batch axis not shifted past the stacked one",
        "jax_arx/_bulk.py",
        "            d += 1 if gathered else -1",
        "            d += 0 if gathered else -1",
        (BULK, "-k", "vmap_all_gather"),
        quick=True,
    ),
    M(
        "vmap: psum_scatter's batch axis not shifted past the dropped one",
        "jax_arx/_bulk.py",
        "            d += 1 if gathered else -1",
        "            d += 1 if gathered else 0",
        (BULK, "-k", "vmap_psum_scatter"),
    ),
    M(
        "JAX_ARX_FALLBACK=error ignored by the bulk ops",
        "jax_arx/_policy.py",
        '    if _config.load().fallback == "error":',
        '    if _config.load().fallback == "error" and op == "psum":',
        (BULK, "-k", "falls_back"),
        quick=True,
    ),
    M(
        "JAX_ARX_ONESHOT_MAX_BYTES not passed to the core",
        "jax_arx/config.py",
        '            options["oneshot_max_bytes"] = str(self.oneshot_max_bytes)',
        "            pass",
        ("tests/test_psum_rules.py", "-k", "oneshot_max"),
    ),
    M(
        "two-shot never chosen",
        "ffi/comm/plan.cc",
        "const uint64_t twoshot_max = cuda ? std::min<uint64_t>(L.send_bytes, (uint64_t)L.world * L.slot_bytes) : 0;",
        "const uint64_t twoshot_max = 0;",
        ("test_plan",),
        cpp=True,
    ),
    M(
        "padded_tokens not checked",
        "jax_arx/_moe.py",
        "    if tpad < T or tpad % world:",
        "    if False:",
        (BULK, "-k", "padded_tokens"),
        quick=True,
    ),
    M(
        "the fused combine takes H not a multiple of 8",
        "jax_arx/_moe.py",
        "    elif H % 8:",
        "    elif False:",
        (BULK, "-k", "outside_its_kernel"),
        quick=True,
    ),
    # More of the same kind.
    M(
        "the fused combine takes topk past 16",
        "jax_arx/_moe.py",
        "    if topk < 1 or topk > MAX_TOPK:",
        "    if topk < 1:",
        (BULK, "-k", "outside_its_kernel"),
    ),
    M(
        "all_gather's envelope: its input, not world times it",
        "jax_arx/_bulk.py",
        "np.dtype(\n            aval.dtype).itemsize * (world if gathered else 1)",
        "np.dtype(\n            aval.dtype).itemsize",
        (BULK, "-k", "envelope"),
    ),
    M(
        "psum_scatter takes any dtype",
        "jax_arx/_bulk.py",
        'PSUM_SCATTER = _policy.Op("psum_scatter", "jax.lax.psum_scatter", _policy.reducing_dtype_refusal)',
        'PSUM_SCATTER = _policy.Op("psum_scatter", "jax.lax.psum_scatter", lambda aval: None)',
        (BULK, "-k", "unsupported_dtypes"),
    ),
    M(
        "a fallback logs nothing",
        "jax_arx/_policy.py",
        "    if first:\n",
        "    if False:\n",
        (BULK, "-k", "falls_back"),
    ),
    M(
        "a psum past the envelope falls back without its notice",
        "jax_arx/_notice.py",
        "    if not isinstance(decision, _policy.Notice) or not isinstance(x, _compat.Tracer):",
        "    if True:",
        ("tests/test_psum_lowering.py", "-k", "announces"),
    ),
    M(
        "a partially manual shard_map runs jax_arx",
        "jax_arx/_policy.py",
        "    if auto:\n",
        "    if False:\n",
        (BULK, "-k", "partially_manual"),
    ),
    M(
        "a shut-down axis lowers jax_arx's call",
        "jax_arx/_bulk.py",
        '    why = _policy.lowering_refusal(ctx, params["comm_id"], params["axis_name"])',
        "    why = None",
        (BULK, "-k", "shut_down"),
    ),
    M(
        "moe_combine adds each term with one rounding",
        "jax_arx/_moe.py",
        "        acc = acc + hi[:, k] * rows[:, k]\n"
        "        acc = jnp.where(lo[:, k] != 0, acc + lo[:, k] * rows[:, k], acc)",
        "        acc = acc + (hi[:, k] + lo[:, k]) * rows[:, k]",
        (BULK, "-k", "documented_arithmetic"),
    ),
    M(
        "the host combine adds each term with one rounding",
        "ffi/host/bulk.cc",
        "      for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(f.hi, bf16_to_f32(y[h]), acc[h]);\n"
        "      if (f.lo != 0.f)\n"
        "        for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(f.lo, bf16_to_f32(y[h]), acc[h]);",
        "      for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(wq, bf16_to_f32(y[h]), acc[h]);",
        ("test_bulk", "--quick", "shm"),
        cpp=True,
    ),
    M(
        "the combine's dtypes unchecked",
        "jax_arx/_moe.py",
        "    if wrong:\n",
        "    if False:\n",
        (BULK, "-k", "argument_errors"),
    ),
    M(
        "an axis's endpoints fail one at a time (fail_together links nothing)",
        "ffi/comm/endpoint.cc",
        "  for (const std::shared_ptr<Endpoint>& p : partners) "
        "p->fail_from(partner_failure(*p, *this, message), true);",
        "  (void)partners;",
        ("test_core", "--quick", "shm"),
        cpp=True,
    ),
    M(
        "the shm carrier's flag word goes before its copy helpers finish",
        "ffi/transport/copy_pool.cc",
        "    while (h.finished.load(std::memory_order_acquire) != want) std::this_thread::yield();",
        "    (void)want;",
        ("test_copy_pool",),
        cpp=True,
    ),
    M(
        "a stop within a wait counts as the peer's lateness",
        "ffi/host/steps.h",
        "    if (gap > kNotRunning) {",
        "    if (false) {",
        ("test_poll",),
        cpp=True,
    ),
    M(
        "work between two waits of a collective counts as not running",
        "ffi/host/steps.h",
        "(now - ended) - std::chrono::nanoseconds(thread_cpu_ns() - ended_cpu);",
        "(now - ended);",
        ("test_poll",),
        cpp=True,
    ),
    M(
        "a stop between two waits of a collective counts as the next peer's lateness",
        "ffi/host/steps.h",
        "    if (off > kNotRunning) {",
        "    if (false) {",
        ("test_poll",),
        cpp=True,
    ),
    M(
        "a beginning collective wakes no napping proxy (wake_proxy does nothing)",
        "ffi/comm/endpoint.cc",
        "  if (proxy_ && !route_.direct) proxy_->wake();",
        "  (void)route_;",
        ("test_core", "--quick", "tcp"),
        cpp=True,
    ),
    M(
        "JAX_ARX_ONESHOT_MAX_BYTES ignored by the plan",
        "ffi/comm/plan.cc",
        "const uint64_t oneshot_max = cfg.oneshot_max_bytes ? std::min(cfg.oneshot_max_bytes, L.slot_bytes)\n",
        "const uint64_t oneshot_max = false ? (uint64_t)0\n",
        ("test_plan",),
        cpp=True,
    ),
    M(
        "host inboxes: the one-shot runs up to the slot",
        "ffi/comm/plan.cc",
        ": host_inboxes       ? std::min(kOneShotMaxHostInboxes, L.slot_bytes)",
        ": false ? (uint64_t)0",
        ("test_plan",),
        cpp=True,
    ),
    M(
        "the call-site tag ignores the operands' shapes",
        "jax_arx/_ordering.py",
        '|{_compat.call_site(ctx, _PACKAGE_DIR)}|{operands}|{attributes}"',
        '|{_compat.call_site(ctx, _PACKAGE_DIR)}|{attributes}"',
        ("tests/test_psum_lowering.py", "-k", "shapes_of_one_size"),
    ),
    M(
        "the bulk envelope is one lane, not every rank's",
        "ffi/comm/plan.cc",
        "if (lane_bytes * (uint64_t)L.world <= ep.spec().config.bulk_bytes) {",
        "if (lane_bytes <= ep.spec().config.bulk_bytes) {",
        ("test_plan",),
        cpp=True,
    ),
    M(
        "the MoE plan never steps aside for the unfused pair",
        "ffi/comm/plan.cc",
        "  if (p.algorithm != Algorithm::kBulk || ep.spec().config.moe_fused) return p;",
        "  if (true) return p;",
        ("test_plan",),
        cpp=True,
    ),
    M(
        "the plan's unfused pair is a fallback",
        "jax_arx/_policy.py",
        "        planned(op, why_not)  # why_not holds the plan's reason here\n",
        '        return fallback(op, ("unfused", axis), why_not)\n',
        (BULK, "-k", "steps_aside"),
    ),
]


def installed_core() -> Path:
    """The installed jax_arx's C++ module, found from outside the tree."""
    code = "import jax_arx._core as c; print(c.__file__)"
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if p.returncode != 0:
        sys.exit(f"jax_arx is not installed with its C++ module (pip install . first): {p.stderr.strip()[-300:]}")
    return Path(p.stdout.strip())


def apply(tree: Path, m: Mutation) -> None:
    f = tree / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        sys.exit(
            f"mutation {m.name!r}: its text occurs {text.count(m.old)} times in {m.path}, not once; "
            "update the list in tests/mutation/run.py"
        )
    f.write_text(text.replace(m.old, m.new))


def python_tree(work: Path, core: Path) -> Path:
    tree = work / "tree"
    shutil.copytree(ROOT / "jax_arx", tree / "jax_arx", ignore=shutil.ignore_patterns("_core*", "__pycache__"))
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__", "mutation"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(core, tree / "jax_arx" / core.name)
    return tree


def pytest(tree: Path, args) -> tuple[int, str]:
    # No bytecode: a mutation and its undoing may land within one second,
    # the resolution by which a stale .pyc would be taken as fresh.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return p.returncode, p.stdout + p.stderr


def cpp_build(tree: Path, target: str) -> str:
    build = tree / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", tree, "-B", build, *gen, "-DJAX_ARX_PYTHON=OFF", "-DJAX_ARX_TESTS=ON", "-DJAX_ARX_CUDA=OFF"],
        check=True,
        capture_output=True,
    )
    r = subprocess.run(
        ["cmake", "--build", build, "--target", target, "-j", str(os.cpu_count() or 2)], capture_output=True, text=True
    )
    if r.returncode != 0:
        sys.exit(f"building {target} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return str(build / target)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only the mutations whose name contains one of these")
    ap.add_argument("--cpp", action="store_true", help="the C++ mutations too (builds the core)")
    ap.add_argument("--quick", action="store_true", help="the issue's four Python mutations only")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    chosen = [
        m
        for m in MUTATIONS
        if (args.cpp or not m.cpp)
        and (not args.quick or m.quick)
        and (not args.names or any(n in m.name for n in args.names))
    ]
    if args.list:
        for m in MUTATIONS:
            print(f"{'C++   ' if m.cpp else 'Python'} {'quick ' if m.quick else '      '}{m.name}")
        return 0
    survived = []
    with tempfile.TemporaryDirectory(prefix="arx-mutation-") as tmp:
        work = Path(tmp)
        py = [m for m in chosen if not m.cpp]
        if py:
            tree = python_tree(work, installed_core())
            baseline = [a for m in py for a in m.tests if a.startswith("tests/")]
            selection = " or ".join(sorted({m.tests[2] for m in py}))
            rc, out = pytest(tree, [*sorted(set(baseline)), "-k", selection])
            if rc != 0:
                print(out[-4000:])
                sys.exit("the tests fail without any mutation; fix that first")
            for m in py:
                start = time.monotonic()
                pristine = (tree / m.path).read_text()
                apply(tree, m)
                rc, out = pytest(tree, m.tests)
                (tree / m.path).write_text(pristine)
                # 1: tests failed. 2-5 (interrupted, internal or usage
                # error, nothing collected) would be a broken check.
                caught = rc == 1
                print(
                    f"{'caught  ' if caught else 'SURVIVED'} {m.name} ({' '.join(m.tests)}; "
                    f"{time.monotonic() - start:.0f} s)",
                    flush=True,
                )
                if not caught:
                    survived.append(m.name)
                    print(out[-2000:])
        cpp = [m for m in chosen if m.cpp]
        if cpp:
            tree = work / "cpp"
            for part in ("ffi", "tests/cpp"):
                shutil.copytree(ROOT / part, tree / part)
            shutil.copy(ROOT / "CMakeLists.txt", tree)
            for m in cpp:
                start = time.monotonic()
                exe = cpp_build(tree, m.tests[0])
                if subprocess.run([exe, *m.tests[1:]], capture_output=True).returncode != 0:
                    sys.exit(f"{m.tests[0]} fails without any mutation; fix that first")
                pristine = (tree / m.path).read_text()
                apply(tree, m)
                exe = cpp_build(tree, m.tests[0])
                r = subprocess.run([exe, *m.tests[1:]], capture_output=True, text=True)
                (tree / m.path).write_text(pristine)
                caught = r.returncode != 0
                print(
                    f"{'caught  ' if caught else 'SURVIVED'} {m.name} ({' '.join(m.tests)}; "
                    f"{time.monotonic() - start:.0f} s)",
                    flush=True,
                )
                if not caught:
                    survived.append(m.name)
    if survived:
        print(f"{len(survived)} of {len(chosen)} mutations survived: {survived}")
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
