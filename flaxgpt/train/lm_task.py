"""The decoder-only GPT as a trainer task (config.model.kind = "gpt"): next-token prediction on a
prepared token dataset (flaxgpt.data.prepare), or on the speedrun's token shards (data.format = shards,
flaxgpt.data.fineweb: windows in order, evaluated on the fixed val set only).

    task = LMTask(config)     # config: a configs/*.py recipe (ml_collections)
    loss_sum, n_tokens = task.loss(params, task.batch("train", step, rows, 0), rng, train=True)

init_from = auto | resume | scratch builds the model from the recipe's `model` section
(models.config_from); a GPT-2 name or directory takes the architecture and weights from that
checkpoint and only the recipe's run-time fields (RUN_FIELDS) from the recipe; so does a Llama,
Mistral or Qwen2 directory (hf.load_pretrained dispatches on its config.json's model_type).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from flaxgpt.data import batches as data_lib
from flaxgpt.data import fineweb
from flaxgpt.hf import gpt2 as hf
from flaxgpt.models import gpt
from flaxgpt.models import registry as models
from flaxgpt.train.losses import chunked_cross_entropy, cross_entropy

FRESH_STARTS = ("auto", "resume", "scratch")  # init_from values that build the model from config.model
# what a pretrained checkpoint leaves to the recipe: the layout of the loaded arrays ...
LAYOUT_FIELDS = ("block_size", "scan_layers", "pad_vocab_multiple", "param_dtype")
# ... and how the model runs
RUN_FIELDS = ("dropout", "embd_dropout", "attn_dropout", "resid_dropout", "dtype", "remat", "attention_impl")


def load_pretrained(init_from: str, recipe: gpt.GPTConfig) -> tuple[gpt.GPTConfig, dict]:
    """(config, params) of a GPT-2 name or a HF directory, with the recipe's layout and run-time fields."""
    try:
        pretrained, params = hf.load_pretrained(init_from, **{f: getattr(recipe, f) for f in LAYOUT_FIELDS})
    except ConnectionError as e:  # offline, or not a name at all (a mistyped "resume"?)
        raise ValueError(
            f"init_from={init_from!r}: {e}; init_from is auto | resume | scratch | a GPT-2 name | a directory"
        ) from None
    return dataclasses.replace(pretrained, **{f: getattr(recipe, f) for f in RUN_FIELDS}), params


class LMTask:
    """Next-token prediction: windows of block_size tokens, loss on every position."""

    kind = "gpt"
    splits = ("train", "val")

    def __init__(self, config):
        self.shards = config.data.get("format", "tokens") == "shards"
        if self.shards:  # shards need the window length, which the model section fixes
            block_size = config.model.block_size
            d = config.data
            self.data = fineweb.ShardData(d.dir, block_size, d.align_to_bos, d.val_tokens)
            self.splits = ("val",)  # the fixed val set; training loss is logged every step anyway
        else:
            self.data = data_lib.TokenData(config.data.dir)
        self.data_dir = self.data.dir  # its meta.json (the tokenizer) goes into the run directory
        self.pretrained = None  # parameters to start from (init_from a GPT-2 name or a HF directory)
        recipe = models.config_from(config.model, self.data.vocab_size)
        if config.init_from in FRESH_STARTS:
            self.model_config = recipe
        else:  # the checkpoint fixes the architecture; the recipe the rest
            self.model_config, self.pretrained = load_pretrained(config.init_from, recipe)
        if not self.shards:
            self.data.check(self.model_config.block_size, self.model_config.vocab_size)
        self.model = gpt.GPT(self.model_config)
        self.seed = config.seed
        self.label_smoothing = config.optim.label_smoothing
        self.loss_chunk = config.optim.get("loss_chunk", 0)  # positions per logits chunk; 0 = all at once
        self.tokens_per_row = self.model_config.block_size

    def abstract_params(self):
        return gpt.abstract_params(self.model_config)

    def init_params(self, rng):
        return gpt.init_params(self.model_config, rng)

    def loss(self, params, batch, rng, train: bool):
        out = self.model.apply(
            {"params": params},
            batch["inputs"],
            deterministic=not train,
            rngs={"dropout": rng} if train else None,
            hidden=bool(self.loss_chunk),
        )
        targets_BT, mask_BT = batch["targets"], batch.get("loss_mask")
        if not self.loss_chunk:
            return cross_entropy(out, targets_BT, mask_BT, self.label_smoothing)
        # the [B, T, V] float32 logits never exist: the head runs one chunk of positions at a time
        head = functools.partial(gpt.head_logits, self.model_config, params)
        return chunked_cross_entropy(out, head, targets_BT, mask_BT, self.label_smoothing, self.loss_chunk)

    def batch(self, split: str, step: int, n_rows: int, process_index: int):
        """Train batches follow the step; eval batch i of a split is the same at every evaluation."""
        if self.shards:
            return self.data.batch(split, step, n_rows, process_index, jax.process_count())
        tokens = self.data.splits["train" if split != "val" else "val"]
        stream = {
            "train": data_lib.TRAIN_STREAM,
            "val": data_lib.VAL_STREAM,
            "train_eval": data_lib.TRAIN_EVAL_STREAM,
        }[split]
        return data_lib.get_batch(
            tokens, self.model_config.block_size, n_rows, self.seed, step, process_index, stream
        )
