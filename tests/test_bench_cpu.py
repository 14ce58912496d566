"""The benchmarks on the CPU backend at small sizes, so that the scripts
cannot rot: examples/bench_psum.py's --check-only mode at world 3 (the
rank order of a sum matters from 3 ranks on), and examples/bench_prefill.py
timed at world 2, each as a user runs it. The benchmarks check every result
against numpy themselves (bit for bit for jax_arx, within rounding for
jax.lax); the tests read the JSON they wrote and assert that every cell
that runs on the CPU ran, was checked and came out right, that the series
ran the algorithm they ask for (Endpoint.stats()), and that what cannot run
on the CPU says why. About 30 s on 2 idle cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import launched

pytest.importorskip("ml_dtypes", reason="the benchmarks' references need ml_dtypes (pip install '.[test]')")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_bench(script, args, out, timeout=600):
    """``script args --out out`` as a user would run it (spinning proxies
    off: 2-core CI), from outside the source tree; returns its document."""
    env = launched.clean_env({"JAX_ARX_IDLE_SPIN_MS": "0"})
    cmd = [sys.executable, os.path.join(EXAMPLES, script), *args, "--out", str(out)]
    p = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}: status {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def test_bench_psum_cpu_check_only(tmp_path):
    sizes = [8 << 10, 64 << 10]
    stdout = run_bench("bench_psum.py", ["--cpu", "--check-only", "--world", "3", "--configs",
                                         "arx-shm,arx-tcp,nccl,arx-shm-host", "--sizes", "8KB,64KB"], tmp_path)
    with open(tmp_path / "bench_psum_check_world3.json") as f:
        doc = json.load(f)
    assert doc["meta"]["world"] == 3 and doc["meta"]["sizes"] == sizes
    assert doc["runs"]["arx-shm"]["route"] == "direct" and doc["runs"]["arx-shm"]["transport"] == "shm"
    assert doc["runs"]["arx-tcp"]["route"] == "proxy" and doc["runs"]["arx-tcp"]["transport"] == "tcp"
    assert "GPU series" in doc["runs"]["arx-shm-host"]["skipped"]
    for config in ("arx-shm", "arx-tcp"):
        assert doc["runs"][config]["errors"] == []
        for size in map(str, sizes):
            for series in ("jax_arx.psum", "one-shot"):
                check = doc["checks"][config][size][series]
                assert check["exact"] and check["as_intended"], (config, size, series, check)
                assert set(check["ran"]) == {"one_shot"} and check["planned"]["algorithm"] == "one_shot"
            assert "no two-shot" in doc["skipped"][config][size]["two-shot"]
    for size in map(str, sizes):
        assert doc["checks"]["nccl"][size]["jax.lax.psum"]["close"]
    assert doc["results"] == {}  # checked, not timed
    assert "every one as it should be" in stdout


def test_bench_prefill_cpu(tmp_path):
    ops = ("all_gather", "psum_scatter", "moe_combine_psum_scatter", "moe_combine + psum_scatter")
    stdout = run_bench("bench_prefill.py", ["--cpu", "--configs", "arx-shm,nccl,floor", "--sizes", "48KB", "--k",
                                            "2", "--reps", "1"], tmp_path)
    with open(tmp_path / "bench_prefill.json") as f:
        doc = json.load(f)
    assert doc["runs"]["arx-shm"]["errors"] == [] and doc["runs"]["arx-shm"]["route"] == "direct"
    for op in ops:
        check = doc["checks"]["arx-shm"]["49152"][op]
        assert check["exact"] and check["as_intended"] and set(check["ran"]) == {"bulk"}, (op, check)
        assert doc["results"]["arx-shm"]["49152"][op] >= 0
    lax = doc["checks"]["nccl"]["49152"]
    assert lax["all_gather"]["exact"] and lax["psum_scatter"]["close"] and lax["moe_combine + psum_scatter"]["close"]
    assert "moe_combine_psum_scatter" not in lax  # jax_arx's alone
    assert set(doc["results"]["nccl"]["49152"]) == {"all_gather", "psum_scatter", "moe_combine + psum_scatter"}
    assert "MoE combine: fused over the unfused pair, both jax_arx" in doc["ratios"]
    assert "GPU series" in doc["runs"]["floor"]["skipped"]
    assert "every one as it should be" in stdout


@pytest.fixture
def examples(monkeypatch):
    """The benchmarks' driver modules, imported from examples/ (no jax)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import bench_jobs
    import bench_psum
    import bench_worker

    return bench_jobs, bench_psum, bench_worker


def test_jobs_on_the_gpus_there_are(examples):
    """Where the ranks of a GPU run go, checked without GPUs: the plans of
    jobs and the placement a worker makes of itself."""
    bench_jobs, bench_psum, bench_worker = examples
    names = ["arx-shm", "arx-tcp", "nccl", "nccl-p2p-off", "xla-oneshot", "xla-oneshot-1proc"]
    # One GPU, world 3, --check-only: the jax_arx configurations share a job of
    # 3 processes; NCCL's are skipped (it refuses two ranks on one GPU).
    jobs, skipped = bench_jobs.plan_jobs(names, bench_psum.CONFIGS, 3, ["0"], False, True)
    assert [(j["configs"], j["nprocs"]) for j in jobs] == [(["arx-shm", "arx-tcp"], 3)]
    assert "NCCL refuses" in skipped["nccl"] and "needs 3 GPUs" in skipped["xla-oneshot-1proc"]
    # Two GPUs, world 2, timed: a job each; XLA's one-process layout in one process.
    jobs, skipped = bench_jobs.plan_jobs(names, bench_psum.CONFIGS, 2, ["0", "1"], False, False)
    assert [(j["configs"], j["nprocs"]) for j in jobs] == [([n], 1 if n.endswith("1proc") else 2) for n in names]
    assert skipped == {}
    assert bench_jobs.json_path("d", "bench_psum", 2, False) == "d/bench_psum.json"
    # The algorithm series' settings: room for 4 MiB at every world, two-shot forced by the one-shot limit.
    from bench_common import parse_size
    for world in (2, 3, 4):
        one, two = (bench_psum.algorithm_env(a, 4 << 20, world) for a in ("one-shot", "two-shot"))
        assert parse_size(one["JAX_ARX_SLOT_BYTES"]) >= 4 << 20 and "JAX_ARX_ONESHOT_MAX_BYTES" not in one
        assert parse_size(two["JAX_ARX_SLOT_BYTES"]) * world >= 4 << 20 and two["JAX_ARX_ONESHOT_MAX_BYTES"] == "16"
        assert parse_size(two["JAX_ARX_SEND_BYTES"]) >= 4 << 20
    assert bench_jobs.json_path("d", "bench_psum", 4, True) == "d/bench_psum_check_world4.json"


def test_placement_and_environment(examples, monkeypatch):
    bench_jobs, bench_psum, bench_worker = examples
    for name in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    bench_worker.place_rank(dict(cpu=False, gpus=["4", "5"], world=4, nprocs=4))  # rank 3 -> GPU 3 % 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5" and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    bench_worker.place_rank(dict(cpu=False, gpus=["4", "5", "6"], world=2, nprocs=1))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    # A series is its own settings: the caller's series and retired variables stay out.
    monkeypatch.setenv("JAX_ARX_SLOT_BYTES", "64KiB")
    monkeypatch.setenv("JAX_ARX_CUDA_CHUNK_BYTES", "8KiB")
    monkeypatch.setenv("JAX_ARX_TIMEOUT_S", "60")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    env = bench_jobs.job_environment(bench_psum.CONFIGS["xla-oneshot"]["process_env"], False, bench_psum.XLA_WATCH)
    assert "JAX_ARX_SLOT_BYTES" not in env and "JAX_ARX_CUDA_CHUNK_BYTES" not in env
    assert env["JAX_ARX_TIMEOUT_S"] == "60" and env["JAX_PLATFORMS"] == "cuda"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + bench_psum.XLA_ONESHOT
