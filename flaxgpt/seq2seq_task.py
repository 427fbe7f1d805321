"""The encoder-decoder as a trainer task (config.model.kind = "seq2seq"), its evaluation, and
translation from a run directory.

    python -m flaxgpt.seq2seq_data --task reverse --out_dir data/reverse
    python train.py --config configs/reverse.py

The trainer sees the same interface as the GPT's (flaxgpt.trainer): the loss is the padding-masked,
label-smoothed cross-entropy of teacher-forced targets; batches are padded pairs grouped by length.
`Seq2SeqTask.evaluate(params)` adds token accuracy, exact match and BLEU (sacrebleu) on val.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np

from flaxgpt import seq2seq_data as sd
from flaxgpt.gpt import count_params
from flaxgpt.metrics import flops_per_token
from flaxgpt.seq2seq import Transformer, TransformerConfig, abstract_params, generate, init_params, translate
from flaxgpt.trainer import cross_entropy, register_task

# decoding options of the `seq2seq` config section, with their defaults
EVAL_DEFAULTS = {
    "eval_pairs": 1000,
    "eval_beam_size": 1,
    "beam_size": 4,
    "alpha": 0.6,
    "eval_batch": 100,
    "bleu_tokenize": "13a",
}


def transformer_config_from(m, vocab_size: int) -> TransformerConfig:
    """config.model -> TransformerConfig. The GPT's names carry over (n_embd is d_model, block_size
    the longest source or target); n_enc_layer, n_dec_layer, d_ff, pre_ln, share_embeddings and
    attn_dropout default to n_layer, 4 * n_embd, True, tie_embeddings and 0."""
    get = lambda key, default: m[key] if key in m else default  # noqa: E731
    return TransformerConfig(
        vocab_size=vocab_size, max_len=m.block_size, n_enc_layer=get("n_enc_layer", m.n_layer),
        n_dec_layer=get("n_dec_layer", m.n_layer), d_model=m.n_embd, d_ff=get("d_ff", 4 * m.n_embd),
        n_head=m.n_head, dropout=m.dropout, attn_dropout=get("attn_dropout", 0.0),
        pre_ln=get("pre_ln", True), share_embeddings=get("share_embeddings", m.tie_embeddings),
        activation=m.activation, bias=m.bias, dtype=m.dtype, param_dtype=m.param_dtype,
        pad_vocab_multiple=m.pad_vocab_multiple, attention_impl=m.attention_impl,
    )  # fmt: skip


class Seq2SeqTask:
    kind = "seq2seq"
    splits = ("train", "val")

    def __init__(self, config):
        self.data = {s: sd.ParallelData(config.data.dir, s) for s in ("train", "val")}
        meta = self.data["train"].meta
        vocab = config.model.vocab_size or meta["vocab_size"]
        if meta["vocab_size"] > vocab:
            raise ValueError(
                f"the dataset's vocabulary ({meta['vocab_size']}) is larger than the model's "
                f"vocab_size ({vocab}); set --config.model.vocab_size=0 to use the dataset's"
            )
        run_meta = Path(config.out_dir) / "meta.json"
        if run_meta.exists() and json.loads(run_meta.read_text()).get("tokenizer") != meta["tokenizer"]:
            raise ValueError(
                f"{run_meta} (the run's vocabulary) differs from {config.data.dir}/meta.json; "
                "resume with the data the run was trained on, or use a new out_dir"
            )
        self.model_config = transformer_config_from(config.model, vocab)
        c = self.model_config
        if max(meta["max_src_len"], meta["max_tgt_len"]) > c.max_len:
            raise ValueError(
                f"{config.data.dir} has pairs of {meta['max_src_len']} / {meta['max_tgt_len']} "
                f"tokens, longer than block_size {c.max_len}; raise --config.model.block_size "
                "or prepare the data again with a smaller --max_len"
            )
        self.src_len, self.tgt_len = meta["max_src_len"], meta["max_tgt_len"]  # fixed padded shapes
        self.tokens_per_row = self.tgt_len
        self.seed, self.label_smoothing = config.seed, config.optim.label_smoothing
        opts = config.get("seq2seq") or {}
        self.opts = {k: opts.get(k, v) for k, v in EVAL_DEFAULTS.items()}
        self.tokenizer = sd.Seq2SeqTokenizer.from_meta(meta["tokenizer"])
        self._batchers = {}

    def abstract_params(self):
        return abstract_params(self.model_config)

    def init_params(self, rng):
        return init_params(self.model_config, rng)

    def loss(self, params, batch, rng, train: bool):
        model = Transformer(self.model_config, deterministic=not train)
        logits_BTV = model.apply(
            {"params": params},
            batch["src"],
            batch["src_lengths"],
            batch["inputs"],
            rngs={"dropout": rng} if train else None,
        )
        return cross_entropy(logits_BTV, batch["targets"], batch["loss_mask"], self.label_smoothing)

    def _batcher(self, split: str, rows: int, seed: int) -> sd.Batcher:
        key = (split, rows, seed)
        if key not in self._batchers:
            self._batchers[key] = sd.Batcher(self.data[split], rows, seed, self.src_len, self.tgt_len)
        return self._batchers[key]

    def batch(self, split: str, step: int, n_rows: int, process_index: int):
        """Train batches follow the step; eval batch i of a split is the same at every evaluation."""
        n_proc = jax.process_count()
        if split == "val":
            rows, _ = sd.eval_rows(len(self.data["val"]), n_rows * n_proc, step)
            rows = rows[process_index * n_rows : (process_index + 1) * n_rows]
            return sd.make_batch(self.data["val"], rows, self.src_len, self.tgt_len)
        seed = self.seed if split == "train" else self.seed + 1  # train_eval: its own order
        return self._batcher("train", n_rows * n_proc, seed).batch(step, process_index, n_proc)

    def flops_per_token(self) -> float:
        c = self.model_config
        n = count_params(self.abstract_params()) - c.padded_vocab_size * c.d_model
        return flops_per_token(n, c.n_enc_layer + 2 * c.n_dec_layer, c.n_head, c.head_dim, self.tgt_len)

    def model_dict(self) -> dict:
        return {"kind": self.kind, **self.model_config.to_dict()}

    def run_files(self, out_dir: Path) -> None:
        shutil.copyfile(self.data["train"].dir / "meta.json", Path(out_dir) / "meta.json")

    def evaluate(self, params, n_pairs: int | None = None) -> dict:
        """Token accuracy (teacher forcing), exact match and BLEU of decoded outputs on val."""
        return evaluate(
            self.model_config,
            params,
            self.data["val"],
            self.tokenizer,
            self.src_len,
            self.tgt_len,
            n_pairs or self.opts["eval_pairs"],
            self.opts["eval_batch"],
            self.opts["eval_beam_size"],
            self.opts["alpha"],
            self.opts["bleu_tokenize"],
        )


@functools.partial(jax.jit, static_argnums=0)
def _token_hits(config: TransformerConfig, params, batch, keep_B):
    """Teacher-forced argmax hits and counted target tokens (padding and filler rows excluded)."""
    logits_BTV = Transformer(config).apply(
        {"params": params}, batch["src"], batch["src_lengths"], batch["inputs"]
    )
    mask_BT = batch["loss_mask"] * keep_B[:, None]
    return ((logits_BTV.argmax(-1) == batch["targets"]) * mask_BT).sum(), mask_BT.sum()


def evaluate(
    config: TransformerConfig,
    params,
    data: sd.ParallelData,
    tokenizer,
    src_len: int,
    tgt_len: int,
    n_pairs: int,
    batch_size: int,
    beam_size: int = 1,
    alpha: float = 0.6,
    bleu_tokenize: str = "13a",
) -> dict:
    """Metrics over the first n_pairs pairs of `data` (decoded up to tgt_len tokens)."""
    import sacrebleu

    n_pairs = min(n_pairs, len(data))
    hits = total = exact = 0.0
    hyps, refs = [], []
    for i in range(-(-n_pairs // batch_size)):
        rows, keep = sd.eval_rows(n_pairs, batch_size, i)
        b = sd.make_batch(data, rows, src_len, tgt_len)
        h, t = _token_hits(config, params, b, keep)
        hits, total = hits + float(h), total + float(t)
        out = np.asarray(
            generate(
                params,
                b["src"],
                b["src_lengths"],
                config=config,
                beam_size=beam_size,
                max_len=tgt_len,
                alpha=alpha,
                bos_id=sd.BOS_ID,
                eos_id=sd.EOS_ID,
                pad_id=sd.PAD_ID,
            )
        )
        for r in np.flatnonzero(keep):
            hyp, ref = tokenizer.decode(out[r]), tokenizer.decode(b["targets"][r])
            exact += hyp == ref
            hyps.append(hyp)
            refs.append(ref)
    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize=bleu_tokenize).score
    return {"val_token_accuracy": hits / total, "val_exact_match": exact / n_pairs, "val_bleu": bleu}


def load_run(out_dir, step: int | None = None):
    """(TransformerConfig, params, Seq2SeqTokenizer) of a seq2seq training run."""
    from flaxgpt.checkpoint import load_for_inference

    model, params, meta = load_for_inference(out_dir, step)
    kind = model.pop("kind", "gpt")
    if kind != "seq2seq":
        raise ValueError(f"{out_dir} holds a {kind!r} model, not an encoder-decoder ('seq2seq') run")
    if not meta or "tokenizer" not in meta:
        raise ValueError(
            f"{out_dir}/meta.json with a 'tokenizer' entry is missing; copy the data "
            "directory's meta.json into the run directory"
        )
    return TransformerConfig.from_dict(model), params, sd.Seq2SeqTokenizer.from_meta(meta["tokenizer"])


def translate_run(
    out_dir,
    lines,
    *,
    step: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | None = None,
    truncate: bool = False,
) -> list[str]:
    """sample.py's hook for seq2seq runs: one output line per input line."""
    config, params, tokenizer = load_run(out_dir, step)
    return translate(
        config, params, tokenizer, lines, beam_size=beam_size, alpha=alpha, max_len=max_len, truncate=truncate
    )


register_task("seq2seq", Seq2SeqTask)
