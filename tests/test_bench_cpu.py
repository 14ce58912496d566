"""The benchmarks on the CPU backend, so that the scripts cannot rot:
examples/bench_psum.py, examples/bench_prefill.py and examples/bench_norm.py
in their --check mode at world 2, each as a user runs it, and their driver's decisions (where
ranks go, which configurations run, what the tables say, when the exit
status is 1) without jax processes.

The benchmarks check every result against numpy themselves (bit for bit
for jax_arx, within rounding for jax.lax); the tests read the JSON they
wrote and assert that every cell that runs on the CPU ran, was checked and
came out right, that the series ran the algorithm they ask for
(Endpoint.stats()), and that what cannot run on the CPU says why. About
30 CPU-seconds.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import launched

pytest.importorskip("ml_dtypes", reason="the benchmarks' references need ml_dtypes (pip install '.[test]')")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NO_SUCH_SETTING = "this jax_arx has no such setting"


def run_bench(script, args, cwd, timeout=300):
    """``script args`` as a user would run it (spinning proxies off: 2-core
    CI), from outside the source tree; returns the finished process."""
    env = launched.clean_env({"JAX_ARX_IDLE_SPIN_MS": "0"})
    return launched.run_launcher([sys.executable, os.path.join(EXAMPLES, script), *args], env, str(cwd), timeout)


def run_ok(script, args, cwd):
    p = run_bench(script, args, cwd)
    detail = f"{script} {' '.join(args)}: status {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    assert p.returncode == 0, detail
    return p.stdout


def test_bench_psum_check(tmp_path):
    sizes = [8 << 10, 64 << 10]
    stdout = run_ok(
        "bench_psum.py",
        [
            "--cpu",
            "--check",
            "--world",
            "2",
            "--configs",
            "arx-shm,arx-tcp,arx-shm-ring,arx-shm-host,nccl",
            "--sizes",
            "8KB,64KB",
            "--out",
            str(tmp_path),
        ],
        tmp_path,
    )
    with open(tmp_path / "bench_psum_check.json") as f:
        doc = json.load(f)
    assert doc["meta"]["world"] == 2 and doc["meta"]["sizes"] == sizes and doc["meta"]["check_only"]
    runs = doc["runs"]
    assert runs["arx-shm"]["route"] == "direct" and runs["arx-shm"]["transport"] == "shm"
    assert runs["arx-tcp"]["route"] == "proxy" and runs["arx-tcp"]["transport"] == "tcp"
    assert "GPU series" in runs["arx-shm-host"]["skipped"]
    arx = ["arx-shm", "arx-tcp"]
    if NO_SUCH_SETTING in runs["arx-shm-ring"].get("skipped", ""):
        print("arx-shm-ring skipped:", runs["arx-shm-ring"]["skipped"])
    else:  # a ring never maps its peers: through the proxy
        assert runs["arx-shm-ring"]["route"] == "proxy", runs["arx-shm-ring"]
        arx.append("arx-shm-ring")
    for config in arx:
        assert runs[config]["errors"] == []
        for size in map(str, sizes):
            for series in ("jax_arx.psum", "one-shot"):
                check = doc["checks"][config][size][series]
                assert check["exact"] and check["as_intended"], (config, size, series, check)
                assert set(check["ran"]) == {"one_shot"} and check["planned"]["algorithm"] == "one_shot"
            assert "no two-shot" in doc["skipped"][config][size]["two-shot"]
    for size in map(str, sizes):
        assert doc["checks"]["nccl"][size]["jax.lax.psum"]["close"]
    assert doc["results"] == {}  # checked, not timed
    # The table of the checks: a row per series, the algorithm that ran in each cell.
    assert any(line.split() == ["arx-tcp", "jax_arx.psum", "1-shot", "1-shot"] for line in stdout.splitlines())
    assert any(line.split() == ["arx-shm", "two-shot", "skip", "skip"] for line in stdout.splitlines())
    assert "every one as it should be" in stdout


def test_bench_prefill_check(tmp_path):
    ops = ("all_gather", "psum_scatter", "moe_combine_psum_scatter", "moe_combine + psum_scatter")
    stdout = run_ok(
        "bench_prefill.py",
        ["--cpu", "--check", "--configs", "arx-shm,nccl,floor", "--sizes", "48KB", "--out", str(tmp_path)],
        tmp_path,
    )
    with open(tmp_path / "bench_prefill_check.json") as f:
        doc = json.load(f)
    assert doc["runs"]["arx-shm"]["errors"] == [] and doc["runs"]["arx-shm"]["route"] == "direct"
    for op in ops:
        check = doc["checks"]["arx-shm"]["49152"][op]
        assert check["exact"] and check["as_intended"] and set(check["ran"]) == {"bulk"}, (op, check)
    lax = doc["checks"]["nccl"]["49152"]
    assert lax["all_gather"]["exact"] and lax["psum_scatter"]["close"] and lax["moe_combine + psum_scatter"]["close"]
    assert "moe_combine_psum_scatter" not in lax  # jax_arx's alone
    assert doc["results"] == {}
    assert "GPU series" in doc["runs"]["floor"]["skipped"]
    assert any(line.split() == ["psum_scatter", "|", "arx-shm", "bulk"] for line in stdout.splitlines())
    assert "every one as it should be" in stdout


def test_bench_norm_check(tmp_path):
    stdout = run_ok(
        "bench_norm.py",
        [
            "--cpu",
            "--check",
            "--configs",
            "arx-shm,arx-shm-proxy,floor",
            "--sizes",
            "8KB,24KB",
            "--kind",
            "layer",
            "--out",
            str(tmp_path),
        ],
        tmp_path,
    )
    with open(tmp_path / "bench_norm_check.json") as f:
        doc = json.load(f)
    assert doc["meta"]["kind"] == "layer" and doc["runs"]["arx-shm"]["errors"] == []
    for size in ("8192", "24576"):
        for series in ("psum_add_norm", "psum + add + norm", "psum + add"):
            check = doc["checks"]["arx-shm"][size][series]
            assert check["close"] and check["as_intended"] and set(check["ran"]) == {"one_shot"}, (size, series, check)
    assert doc["results"] == {}
    assert "GPU series" in doc["runs"]["arx-shm-proxy"]["skipped"] and "GPU series" in doc["runs"]["floor"]["skipped"]
    assert any(line.split() == ["arx-shm", "psum_add_norm", "1-shot", "1-shot"] for line in stdout.splitlines())
    assert "every one as it should be" in stdout


def test_a_run_cut_short_fails(tmp_path):
    """Jobs past their --timeout are stopped, and jobs past the run's
    --max-seconds are not started; each is named, the exit status is 1 and
    no check is claimed that did not run."""
    args = ["--cpu", "--configs", "arx-shm,nccl", "--sizes", "8KB", "--out", str(tmp_path)]
    # A job is two processes that each import jax (over half a CPU-second):
    # none ends within 0.3 s, however fast the machine.
    for limit, said in (
        (["--timeout", "0.3"], "after the 0.3 s limit"),
        (["--max-seconds", "0.01"], "not started: the run's --max-seconds 0.01 had passed"),
    ):
        p = run_bench("bench_psum.py", args + limit, tmp_path)
        assert p.returncode == 1, (limit, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
        with open(tmp_path / "bench_psum.json") as f:
            doc = json.load(f)
        for config in ("arx-shm", "nccl"):
            assert said in doc["runs"][config]["job_failed"] and said in p.stdout, (limit, doc["runs"])
        assert doc["checks"] == {} and doc["results"] == {}


@pytest.fixture
def examples(monkeypatch):
    """The benchmarks' driver modules, imported from examples/."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import bench_jobs
    import bench_psum
    import bench_report
    import bench_worker

    return bench_jobs, bench_psum, bench_report, bench_worker


def test_jobs_on_the_gpus_there_are(examples):
    """Where the ranks of a GPU run go, checked without GPUs: the plans of
    jobs and what a run says about its times."""
    bench_jobs, bench_psum, _, _ = examples
    names = ["arx-shm", "arx-tcp", "nccl", "nccl-p2p-off", "xla-oneshot", "xla-oneshot-1proc"]
    # One GPU, world 3, --check: the jax_arx configurations share a job of
    # 3 processes; NCCL's are skipped (it refuses two ranks on one GPU).
    jobs, skipped = bench_jobs.plan_jobs(names, bench_psum.CONFIGS, 3, ["0"], False, True)
    assert [(j["configs"], j["nprocs"]) for j in jobs] == [(["arx-shm", "arx-tcp"], 3)]
    assert "NCCL refuses" in skipped["nccl"] and "needs 3 GPUs" in skipped["xla-oneshot-1proc"]
    assert "NOT meaningful" in bench_jobs.timing_caveat(3, ["0"], False)
    # Two GPUs, world 2, timed: a job each; XLA's one-process layout in one process.
    jobs, skipped = bench_jobs.plan_jobs(names, bench_psum.CONFIGS, 2, ["0", "1"], False, False)
    assert [(j["configs"], j["nprocs"]) for j in jobs] == [([n], 1 if n.endswith("1proc") else 2) for n in names]
    assert skipped == {} and bench_jobs.timing_caveat(2, ["0", "1"], False) is None
    assert bench_jobs.json_path("d", "bench_psum", 2, False) == "d/bench_psum.json"
    assert bench_jobs.json_path("d", "bench_psum", 4, True) == "d/bench_psum_check_world4.json"
    # The algorithm series' settings: room for 4 MiB at every world, one-shot
    # and two-shot forced by the one-shot limit, jax_arx.psum's own limit kept.
    from bench_common import parse_size
    from jax_arx.config import Config

    for world in (2, 3, 4):
        own, one, two = (bench_psum.algorithm_env(a, 4 << 20, world) for a in bench_psum.ALGORITHMS)
        assert parse_size(one["JAX_ARX_SLOT_BYTES"]) >= 4 << 20
        # ... and the one-shot limit with it (over GPU host inboxes it is lower unless set).
        assert parse_size(one["JAX_ARX_ONESHOT_MAX_BYTES"]) == parse_size(one["JAX_ARX_SLOT_BYTES"])
        assert parse_size(two["JAX_ARX_SLOT_BYTES"]) * world >= 4 << 20 and two["JAX_ARX_ONESHOT_MAX_BYTES"] == "16"
        assert parse_size(two["JAX_ARX_SEND_BYTES"]) >= 4 << 20
        assert parse_size(own["JAX_ARX_SLOT_BYTES"]) * world >= 4 << 20
        assert parse_size(own.get("JAX_ARX_ONESHOT_MAX_BYTES", own["JAX_ARX_SLOT_BYTES"])) == Config().slot_bytes
    assert bench_psum.algorithm_env("jax_arx.psum", 64 << 10, 2) == {
        "JAX_ARX_SLOT_BYTES": "1MiB",
        "JAX_ARX_SEND_BYTES": "4MiB",
    }


def test_configurations_this_jax_arx_cannot_run(examples):
    """A configuration whose setting jax_arx does not read is skipped,
    never run as the default under its name."""
    bench_jobs, bench_psum, _, _ = examples
    assert bench_jobs.unmet_needs({"JAX_ARX_TRANSPORT": "tcp"}, {"transport": "tcp"}) is None
    why = bench_jobs.unmet_needs({}, {"transport": "tcp"})
    assert "transport is None, not 'tcp'" in why and NO_SUCH_SETTING in why
    jobs, skipped = bench_jobs.plan_jobs(["arx-shm-ring"], bench_psum.CONFIGS, 2, [], True, True)
    from jax_arx.config import Config

    if hasattr(Config, "topology"):
        assert skipped == {} and jobs[0]["configs"] == ["arx-shm-ring"]
    else:
        assert jobs == [] and NO_SUCH_SETTING in skipped["arx-shm-ring"]


def test_placement_and_environment(examples, monkeypatch):
    bench_jobs, bench_psum, _, bench_worker = examples
    for name in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    bench_worker.place_rank(dict(cpu=False, gpus=["4", "5"], world=4, nprocs=4))  # rank 3 -> GPU 3 % 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5" and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.400"  # 2 processes per GPU
    bench_worker.place_rank(dict(cpu=False, gpus=["4", "5", "6"], world=2, nprocs=1))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    # A series is its own settings: the caller's series and retired variables stay out.
    monkeypatch.setenv("JAX_ARX_SLOT_BYTES", "64KiB")
    monkeypatch.setenv("JAX_ARX_TOPOLOGY", "ring")
    monkeypatch.setenv("JAX_ARX_CUDA_CHUNK_BYTES", "8KiB")
    monkeypatch.setenv("JAX_ARX_TIMEOUT_S", "60")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    env = bench_jobs.job_environment(bench_psum.CONFIGS["xla-oneshot"]["process_env"], False, bench_psum.XLA_WATCH)
    assert not {"JAX_ARX_SLOT_BYTES", "JAX_ARX_TOPOLOGY", "JAX_ARX_CUDA_CHUNK_BYTES"} & set(env)
    assert env["JAX_ARX_TIMEOUT_S"] == "60" and env["JAX_PLATFORMS"] == "cuda"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + bench_psum.XLA_ONESHOT


def test_tables_and_verdict(examples):
    """What a run prints and whether it passes, from a document: a wrong
    result or an algorithm not asked for fails the run, a skip does not."""
    _, _, report, _ = examples
    planned = {"algorithm": "one_shot", "pieces": 4}
    doc = {
        "results": {"a": {"8192": {"s": 12.34}}},
        "checks": {
            "a": {
                "8192": {"s": {"exact": True, "as_intended": True, "planned": planned}},
                "65536": {"s": {"exact": True, "as_intended": False, "planned": planned}},
            },
            "lax": {"8192": {"x": {"close": True}}, "65536": {"x": {"close": False}}},
        },
        "skipped": {"a": {"1024": {"s": "too small"}}},
        "runs": {"a": {"errors": []}, "b": {"skipped": "why"}},
    }
    sizes, rows = [1024, 8192, 65536], [("a", "s", "a s"), ("lax", "x", "lax")]
    table = report.check_table(doc, sizes, rows, 10).splitlines()
    assert table[2].split() == ["a", "s", "skip", "1-shot/4", "1-shot/4?"]
    assert table[3].split() == ["lax", "-", "ok", "ok!"]
    assert report.latency_table(doc, sizes, rows, 10).splitlines()[2].split() == ["a", "s", "-", "12.3", "-"]
    text, ok = report.check_summary(doc)
    assert not ok and "2 problem(s)" in text and "skipped b: why" in text
    doc["checks"]["a"]["65536"]["s"]["as_intended"] = True
    doc["checks"]["lax"]["65536"]["x"]["close"] = True
    assert report.check_summary(doc)[1]
    doc["runs"]["a"]["errors"].append("a jax_arx.psum: JaxArxFallbackError: ...")
    assert not report.check_summary(doc)[1]
