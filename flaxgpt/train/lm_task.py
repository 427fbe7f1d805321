"""The decoder-only GPT as a trainer task (config.model.kind = "gpt"): next-token prediction on a
prepared token dataset (flaxgpt.data.prepare), or on the speedrun's token shards (data.format = shards,
flaxgpt.data.fineweb: windows in order, evaluated on the fixed val set only), or on packed rows
(data.format = packed, flaxgpt.data.packing: chat SFT or packed documents; the loss counts the
rows' loss_mask tokens and attention stays inside each example's segment).

    task = LMTask(config)     # config: a configs/*.py recipe (ml_collections)
    loss_sum, n_tokens = task.loss(params, task.batch("train", step, rows, 0), rng, train=True)

init_from (`start_from`: loader.resolve_init with the recipe's model config) = auto | resume | scratch
builds the model from the recipe's `model` section (models.config_from); a GPT-2 name or a Hugging Face
directory of any family (hf.families) takes the architecture and weights from that checkpoint, read in
the recipe's layout (loader.LAYOUT_FIELDS), and the recipe's run-time fields (models.RUNTIME_FIELDS); a
flaxgpt run directory its latest checkpoint as saved (SFT, then GRPO or DPO from it; its tokenizer must
be the dataset's), with the recipe's run-time fields.

With `lora.rank` > 0 the pretrained weights become the frozen base (`frozen`, in lora.base_dtype) and
the trained parameters are LoRA adapters only (flaxgpt/models/lora.py): `loss(adapters, ..., frozen=base)`.

A mixture of experts (model.num_experts > 0) trains on the loss + router_aux_loss_coef x the load-balancing
loss + router_z_loss_coef x the z-loss (models/moe.py), logged as router_aux and router_z; evaluations and
LoRA runs use the language-model loss alone.
"""

from __future__ import annotations

import functools

import jax
from flax import linen as nn

from flaxgpt import loader, sharding
from flaxgpt.data import batches as data_lib
from flaxgpt.data import fineweb, packing
from flaxgpt.models import gpt, lora, moe
from flaxgpt.models import registry as models
from flaxgpt.train import sections
from flaxgpt.train.losses import chunked_cross_entropy, cross_entropy

FORMATS = ("tokens", "shards", "packed")  # config.data.format


def start_from(init_from: str, recipe, data_tokenizer=None) -> loader.Init:
    """loader.resolve_init of init_from with the recipe's model config: the recipe's own model, or a
    checkpoint's architecture with the recipe's layout and run-time fields and its weights. A flaxgpt
    run's tokenizer must be the dataset's (`data_tokenizer`, its meta.json entry): same text, same ids."""
    try:
        init = loader.resolve_init(init_from, recipe, tokenizer=False)
    except ConnectionError as e:  # offline, or not a name at all (a mistyped "resume"?)
        raise ValueError(
            f"init_from={init_from!r}: {e}; init_from is auto | resume | scratch | a GPT-2 name | a directory"
        ) from None
    if init.kind == "run" and models.kind_of(init.config) != "gpt":
        raise ValueError(
            f"init_from={init_from!r} is a {models.kind_of(init.config)} run; a GPT task starts from a GPT"
        )
    if init.kind == "run" and data_tokenizer is not None and init.tokenizer.to_meta() != data_tokenizer:
        raise ValueError(
            f"init_from={init_from!r} was trained with another tokenizer than the dataset's; prepare "
            f"the data with the run's own: flaxgpt prepare ... --tokenizer {init_from}"
        )
    return init


class LMTask:
    """Next-token prediction: windows of block_size tokens, loss on every position."""

    kind = "gpt"
    splits = ("train", "val")
    formats = FORMATS  # the data.format values this task reads (DPOTask: pairs)

    def __init__(self, config):
        d = sections.of(config).data
        self.format = d.format
        if self.format not in self.formats:
            raise ValueError(f"data.format={self.format!r}; choose one of {', '.join(self.formats)}")
        self.shards = self.format == "shards"
        if self.format in ("packed", "pairs"):
            self.data = packing.PackedData(d.dir, kind=self.format)
        elif self.shards:  # shards need the window length, which the model section fixes
            block_size = config.model.block_size
            self.data = fineweb.ShardData(d.dir, block_size, d.align_to_bos, d.val_tokens)
            self.splits = ("val",)  # the fixed val set; training loss is logged every step anyway
        else:
            self.data = data_lib.TokenData(d.dir)
        self.data_dir = self.data.dir  # its meta.json (the tokenizer) goes into the run directory
        self._start_from(config)
        if not self.shards:
            self.data.check(self.model_config.block_size, self.model_config.vocab_size)
        self._set_model(config, self.model_config)

    def _start_from(self, config) -> None:
        """model_config and pretrained (the parameters to start from, None for a fresh model) of
        init_from: the recipe's model, or the checkpoint's architecture with the recipe's rest (a
        run directory's tokenizer checked against the data's)."""
        recipe = models.config_from(config.model, self.data.vocab_size)
        init = start_from(config.init_from, recipe, self.data.meta.get("tokenizer"))
        self.model_config, self.pretrained = init.config, init.params

    @classmethod
    def without_data(cls, config, model_config: gpt.GPTConfig) -> LMTask:
        """The task's model and loss with no dataset read (flaxgpt.aot compiles its steps); no batches."""
        task = cls.__new__(cls)
        task.shards, task.data, task.data_dir = False, None, None
        # LoRA's frozen base as shapes: lora.quantize_base and place_frozen keep them abstract
        lora_on = sections.of(config).lora.rank
        task.pretrained = nn.unbox(gpt.abstract_params(model_config)) if lora_on else None
        task._set_model(config, model_config)
        return task

    def _set_model(self, config, model_config: gpt.GPTConfig) -> None:
        self.model_config = model_config
        self.model = gpt.GPT(model_config)
        self.lora, self.frozen = None, None  # LoRA: the adapters' spec and the frozen base
        c = sections.of(config).lora
        if c.rank:
            self.lora = lora.LoraSpec.make(self.model_config, c.rank, c.alpha, c.dropout, c.targets)
            self.frozen, self.pretrained = lora.quantize_base(self.pretrained, c.base_dtype), None
        self.seed = config.seed
        self.label_smoothing = config.optim.label_smoothing
        self.loss_chunk = config.optim.get("loss_chunk", 0)  # positions per logits chunk; 0 = all at once
        self.tokens_per_row = model_config.block_size

    def batch_shapes(self, n_rows: int) -> dict:
        """{name: (shape, dtype)} of `batch(split, step, n_rows, ...)`."""
        T = self.model_config.block_size
        return {"inputs": ((n_rows, T), "int32"), "targets": ((n_rows, T), "int32")}

    def place_frozen(self, mesh):
        """LoRA: (the frozen base on `mesh`, its shardings), sharded as full fine-tuning shards the
        parameters (FSDP); (None, None) without LoRA."""
        if self.frozen is None:
            return None, None
        boxed = gpt.abstract_params(self.model_config)
        shardings = lora.base_shardings(sharding.param_shardings(boxed, mesh), self.frozen)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.frozen)):  # flaxgpt.aot
            place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
            return jax.tree.map(place, self.frozen, shardings), shardings
        return jax.device_put(self.frozen, shardings), shardings

    def abstract_params(self):
        """The trained parameters, boxed with their logical axes (LoRA: the adapters, replicated)."""
        if self.lora is not None:
            return jax.eval_shape(self.init_params, jax.random.key(0))
        return gpt.abstract_params(self.model_config)

    def init_params(self, rng):
        if self.lora is not None:
            return lora.init_adapters(self.model_config, self.lora, rng)
        return gpt.init_params(self.model_config, rng)

    def forward(self, params, batch, rng, train: bool, frozen=None):
        """(out, head): the model on batch["inputs"] (segment ids when packed). out is the logits
        [B, T, V], or with loss_chunk the hidden states [B, T, D] and head(hidden_BtD) -> logits."""
        out, head, _ = self.forward_with_router(params, batch, rng, train, frozen)
        return out, head

    def forward_with_router(self, params, batch, rng, train: bool, frozen=None):
        """(out, head, router): forward's, and a mixture of experts' sown "router" statistics
        (models/moe.py; None for a dense model). With LoRA too: adapters change what the router sees."""
        kw = dict(
            deterministic=not train, segment_ids_BT=batch.get("segment_ids"), hidden=bool(self.loss_chunk)
        )
        router = None
        mutable = [moe.ROUTER] if self.model_config.num_experts else False
        if self.lora is not None:  # params are the adapters; the base is not differentiated
            spec, tokens_BT = self.lora, batch["inputs"]
            out = lora.apply(
                self.model_config, spec, frozen, params, tokens_BT, rng=rng, mutable=mutable, **kw
            )
        else:
            out = self.model.apply(
                {"params": params},
                batch["inputs"],
                rngs={"dropout": rng} if train else None,
                mutable=mutable,
                **kw,
            )
        if mutable:
            out, router = out[0], out[1][moe.ROUTER]
        if not self.loss_chunk:
            return out, None, router
        return (
            out,
            functools.partial(gpt.head_logits, self.model_config, params if self.lora is None else frozen),
            router,
        )

    def loss(self, params, batch, rng, train: bool, frozen=None):
        out, head, router = self.forward_with_router(params, batch, rng, train, frozen)
        targets_BT, mask_BT = batch["targets"], batch.get("loss_mask")
        if head is None:
            loss_sum, weight = cross_entropy(out, targets_BT, mask_BT, self.label_smoothing)
        else:  # the [B, T, V] float32 logits never exist: the head runs one chunk of positions at a time
            loss_sum, weight = chunked_cross_entropy(
                out, head, targets_BT, mask_BT, self.label_smoothing, self.loss_chunk
            )
        if router is None or not train:  # evaluations compare the language-model loss alone
            return loss_sum, weight
        # the router losses are means over the batch: times the weight, as the summed loss is
        c = self.model_config
        aux, z = moe.router_losses(router, c.num_experts)
        loss_sum = loss_sum + (c.router_aux_loss_coef * aux + c.router_z_loss_coef * z) * weight
        return loss_sum, (weight, {"router_aux": aux * weight, "router_z": z * weight})

    def batch(self, split: str, step: int, n_rows: int, process_index: int):
        """Train batches follow the step; eval batch i of a split is the same at every evaluation."""
        if self.shards:
            return self.data.batch(split, step, n_rows, process_index, jax.process_count())
        if self.format in ("packed", "pairs"):
            return self.data.batch(split, step, n_rows, self.seed, process_index, jax.process_count())
        tokens = self.data.splits["train" if split != "val" else "val"]
        stream = {
            "train": data_lib.TRAIN_STREAM,
            "val": data_lib.VAL_STREAM,
            "train_eval": data_lib.TRAIN_EVAL_STREAM,
        }[split]
        return data_lib.get_batch(
            tokens, self.model_config.block_size, n_rows, self.seed, step, process_index, stream
        )

    def evaluate(self, params) -> dict:
        return {}  # the loss is all: benchmark tasks are config.eval_tasks (eval.tasks.TrainingEvaluator)
