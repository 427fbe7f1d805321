"""The encoder-decoder's objective and batches (config.model.kind = "seq2seq") and its evaluation.

    flaxgpt prepare-seq2seq --task reverse --out_dir data/reverse
    python train.py --config configs/reverse.py

train.tasks composes them with a full policy (train.policy.FullPolicy), as the GPT's: the loss
(Seq2SeqObjective) is the padding-masked, label-smoothed cross-entropy of teacher-forced targets;
batches (PairBatches of open_pairs' data) are padded pairs grouped by length.
`PairBatches.evaluate(params)` adds token accuracy, exact match and BLEU (sacrebleu) on val.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from flaxgpt.data import batches as data_lib
from flaxgpt.data import tokenizers
from flaxgpt.decode.translate import generate
from flaxgpt.models import registry as models
from flaxgpt.models.seq2seq import Transformer, TransformerConfig, unembedding
from flaxgpt.train import losses
from flaxgpt.train.lm_task import data_hint
from flaxgpt.train.losses import cross_entropy

# decoding options of the `seq2seq` config section, with their defaults
EVAL_DEFAULTS = {
    "eval_pairs": 1000,
    "eval_beam_size": 1,
    "beam_size": 4,
    "alpha": 0.6,
    "eval_batch": 100,
    "bleu_tokenize": "13a",
}


def open_pairs(config):
    """(the train and val pairs, model config, start None: always trained from scratch), checked."""
    hint = data_hint(config)
    data = {s: data_lib.ParallelData(config.data.dir, s, hint) for s in ("train", "val")}
    meta = data["train"].meta
    c = models.config_from(config.model, meta["vocab_size"])
    if meta["vocab_size"] > c.vocab_size:
        raise ValueError(
            f"the dataset's vocabulary ({meta['vocab_size']}) is larger than the model's "
            f"vocab_size ({c.vocab_size}); set --config.model.vocab_size=0 to use the dataset's"
        )
    if max(meta["max_src_len"], meta["max_tgt_len"]) > c.block_size:
        raise ValueError(
            f"{config.data.dir} has pairs of {meta['max_src_len']} / {meta['max_tgt_len']} "
            f"tokens, longer than block_size {c.block_size}; raise --config.model.block_size "
            "or prepare the data again with a smaller --max_len"
        )
    return data, c, None


def _lengths(data, model_config) -> tuple[int, int]:
    """(source, target) lengths batches are padded to: the data's longest, else block_size (aot)."""
    if data is None:
        return model_config.block_size, model_config.block_size
    meta = data["train"].meta
    return meta["max_src_len"], meta["max_tgt_len"]


class Seq2SeqObjective:
    """The padding-masked, label-smoothed cross-entropy of teacher-forced targets (full policy only)."""

    needs_reference = False

    def __init__(self, config, model_config: TransformerConfig, data=None):
        self.model_config, self.label_smoothing = model_config, config.optim.label_smoothing
        self.z_loss, self.loss_impl = config.optim.get("z_loss", 0.0), config.optim.get("loss_impl", "logits")
        self.loss_block = config.optim.get("loss_block", 0)
        losses.check_loss_impl(self.loss_impl)  # a bad optim.loss_impl fails here
        self.src_len, self.tgt_len = _lengths(data, model_config)  # fixed padded shapes
        self.tokens_per_row = self.tgt_len

    def batch_shapes(self, n_rows: int) -> dict:
        """{name: (shape, dtype)} of the largest batch (batches are bucketed up to these lengths)."""
        S, T = self.src_len, self.tgt_len
        return {
            "src": ((n_rows, S), "int32"),
            "src_lengths": ((n_rows,), "int32"),
            "inputs": ((n_rows, T), "int32"),
            "targets": ((n_rows, T), "int32"),
            "loss_mask": ((n_rows, T), "float32"),
        }

    def loss(self, policy, params, frozen, batch, rng, train: bool):
        model, fused = (
            Transformer(self.model_config, deterministic=not train),
            losses.use_fused(self.loss_impl),
        )
        out = model.apply(
            {"params": params},
            batch["src"],
            batch["src_lengths"],
            batch["inputs"],
            hidden=fused,
            rngs={"dropout": rng} if train else None,
        )
        targets_BT, mask_BT, ls = batch["targets"], batch["loss_mask"], self.label_smoothing
        if fused:  # the decoder's states and the output layer blockwise: no [B, T, V] logits
            unembed = unembedding(self.model_config, params)
            return losses.fused_cross_entropy(
                out, unembed, targets_BT, mask_BT, ls, self.z_loss, self.loss_block
            )
        return cross_entropy(out, targets_BT, mask_BT, ls, self.z_loss)


class PairBatches:
    """Padded pairs grouped by length: train batches follow the step; eval batch i of a split is the
    same at every evaluation. `evaluate` decodes val (token accuracy, exact match, BLEU)."""

    online = False
    splits = ("train", "val")

    def __init__(self, config, data, policy, objective=None):
        self.data, self.data_dir = data, data["train"].dir  # its meta.json (the tokenizer): the run dir's
        self.model_config, self.seed = policy.model_config, config.seed
        self.src_len, self.tgt_len = _lengths(data, policy.model_config)
        opts = config.get("seq2seq") or {}
        self.opts = {k: opts.get(k, v) for k, v in EVAL_DEFAULTS.items()}
        self.tokenizer = tokenizers.Seq2SeqTokenizer.from_meta(data["train"].meta["tokenizer"])
        self._batchers = {}

    def _batcher(self, split: str, rows: int, seed: int) -> data_lib.Batcher:
        key = (split, rows, seed)
        if key not in self._batchers:
            self._batchers[key] = data_lib.Batcher(self.data[split], rows, seed, self.src_len, self.tgt_len)
        return self._batchers[key]

    def batch(self, split: str, step: int, n_rows: int, process_index: int):
        n_proc = jax.process_count()
        if split == "val":
            rows, _ = data_lib.eval_rows(len(self.data["val"]), n_rows * n_proc, step)
            rows = rows[process_index * n_rows : (process_index + 1) * n_rows]
            return data_lib.make_batch(self.data["val"], rows, self.src_len, self.tgt_len)
        seed = self.seed if split == "train" else self.seed + 1  # train_eval: its own order
        return self._batcher("train", n_rows * n_proc, seed).batch(step, process_index, n_proc)

    def on_mesh(self, mesh, frozen) -> None:
        """Nothing follows the weights' placement."""

    def evaluate(self, params, frozen=None, n_pairs: int | None = None) -> dict:
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
    data: data_lib.ParallelData,
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
        rows, keep = data_lib.eval_rows(n_pairs, batch_size, i)
        b = data_lib.make_batch(data, rows, src_len, tgt_len)
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
                bos_id=tokenizers.BOS_ID,
                eos_id=tokenizers.EOS_ID,
                pad_id=tokenizers.PAD_ID,
            )
        )
        for r in np.flatnonzero(keep):
            hyp, ref = tokenizer.decode(out[r]), tokenizer.decode(b["targets"][r])
            exact += hyp == ref
            hyps.append(hyp)
            refs.append(ref)
    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize=bleu_tokenize).score
    return {"val_token_accuracy": hits / total, "val_exact_match": exact / n_pairs, "val_bleu": bleu}
