"""The decoder-only GPT's language-model objective and its fixed batches (config.model.kind = "gpt"):
next-token prediction on a prepared token dataset (flaxgpt.data.prepare), or on the speedrun's token
shards (data.format = shards, flaxgpt.data.fineweb: windows in order, evaluated on the fixed val set
only), or on packed rows (data.format = packed, flaxgpt.data.packing: chat SFT or packed documents;
the loss counts the rows' loss_mask tokens and attention stays inside each example's segment).

    data, model_config, start = open_data(config)   # config: a configs/*.py recipe (ml_collections)
    objective = LMObjective(config, model_config)
    batches = TokenBatches(config, data, policy)    # policy: train.policy.make_policy(config, model_config)
    batch = batches.batch("train", step, rows, 0)
    loss_sum, n_tokens = objective.loss(policy, params, frozen, batch, rng, train=True)

(train.tasks composes them with a policy: train.policy's FullPolicy or LoraPolicy.)

init_from (`start_from`: loader.resolve_init with the recipe's model config) = auto | resume | scratch
builds the model from the recipe's `model` section (models.config_from); a GPT-2 name or a Hugging Face
directory of any family (hf.families) takes the architecture and weights from that checkpoint, read in
the recipe's layout (loader.LAYOUT_FIELDS), and the recipe's run-time fields (models.RUNTIME_FIELDS); a
flaxgpt run directory its latest checkpoint as saved (SFT, then GRPO or DPO from it; its tokenizer must
be the dataset's), with the recipe's run-time fields.

With `lora.rank` > 0 the pretrained weights become the frozen base (train.policy.Frozen.base, in
lora.base_dtype) and the trained parameters are LoRA adapters only (flaxgpt/models/lora.py).

A mixture of experts (model.num_experts > 0) trains on the loss + router_aux_loss_coef x the load-balancing
loss + router_z_loss_coef x the z-loss (models/moe.py), logged as router_aux and router_z; evaluations and
LoRA runs use the language-model loss alone.

The loss is the fused linear + cross-entropy (losses.fused_cross_entropy: no [B, T, V] logits) when
optim.loss_impl says so (losses.use_fused; default "logits"), else the logits' cross-entropy,
optim.loss_chunk positions at a time when that is set; optim.z_loss adds PaLM's z-loss on either path.
"""

from __future__ import annotations

import functools

import jax

from flaxgpt import loader
from flaxgpt.data import batches as data_lib
from flaxgpt.data import fineweb, hints, packing
from flaxgpt.models import gpt, moe
from flaxgpt.models import registry as models
from flaxgpt.train import losses, sections
from flaxgpt.train.losses import chunked_cross_entropy, cross_entropy
from flaxgpt.train.policy import Frozen


def data_hint(config) -> str:
    """'prepare it with: COMMAND': the command this recipe's data needs, with the tokenizer its
    init_from's model reads (every task's missing-data error ends with it)."""
    return hints.prepare_hint(config, loader.data_tokenizer(config.get("init_from", "")))


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


def open_data(config):
    """(data, model config, start): the recipe's dataset (data.format tokens | shards | packed | pairs),
    the model init_from gives with the start's weights (None: fresh), checked against each other."""
    d = sections.of(config).data
    hint = data_hint(config)
    if d.format in ("packed", "pairs"):
        data = packing.PackedData(d.dir, kind=d.format, hint=hint)
    elif d.format == "shards":  # shards need the window length, which the model section fixes
        data = fineweb.ShardData(d.dir, config.model.block_size, d.align_to_bos, d.val_tokens)
    else:
        data = data_lib.TokenData(d.dir, hint)
    recipe = models.config_from(config.model, data.vocab_size)
    init = start_from(config.init_from, recipe, data.meta.get("tokenizer"))
    if d.format != "shards":
        data.check(init.config.block_size, init.config.vocab_size)
    return data, init.config, init.params


class TokenBatches:
    """The fixed batches of a prepared dataset: train batches follow the step; eval batch i of a split
    is the same at every evaluation."""

    online = False

    def __init__(self, config, data, policy, objective=None):
        self.data, self.data_dir = data, data.dir  # its meta.json (the tokenizer) goes into the run directory
        self.format, self.seed = sections.of(config).data.format, config.seed
        self.block_size = policy.model_config.block_size
        # shards: the fixed val set; training loss is logged every step anyway
        self.splits = ("val",) if self.format == "shards" else ("train", "val")

    def batch(self, split: str, step: int, n_rows: int, process_index: int):
        if self.format == "shards":
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
            tokens, self.block_size, n_rows, self.seed, step, process_index, stream, jax.process_count()
        )

    def on_mesh(self, mesh, frozen) -> None:
        """Nothing follows the weights' placement."""

    def evaluate(self, params, frozen) -> dict:
        return {}  # the loss is all: benchmark tasks are config.eval_tasks (eval.tasks.TrainingEvaluator)


class LossPath:
    """How a GPT task turns hidden states into its loss: optim.loss_impl, loss_chunk, loss_block."""

    def __init__(self, config):
        self.impl = config.optim.get("loss_impl", "logits")
        losses.check_loss_impl(self.impl)  # a bad name fails here, not at the first step
        self.chunk = config.optim.get("loss_chunk", 0)  # positions per logits chunk; 0 = all at once
        self.block = config.optim.get("loss_block", 0)  # the fused loss's vocabulary block; 0 = default

    def fused(self) -> bool:
        return losses.use_fused(self.impl)


def forward(policy, params, frozen: Frozen, batch, rng, train: bool, loss_chunk: int = 0, fused=False):
    """(out, head, router): the policy on batch["inputs"] (segment ids when packed). out is the logits
    [B, T, V]; with loss_chunk the hidden states [B, T, D] and head(hidden_BtD) -> logits; with `fused`
    the hidden states and head = gpt.unembedding (a kernels.linear_xent.Head); router a mixture of
    experts' sown statistics (models/moe.py; None for a dense model). With LoRA too: adapters change
    what the router sees."""
    mutable = [moe.ROUTER] if policy.model_config.num_experts else False
    kw = dict(segment_ids_BT=batch.get("segment_ids"), hidden=bool(loss_chunk) or fused)
    out = policy.apply(params, frozen, batch["inputs"], rng=rng, train=train, mutable=mutable, **kw)
    router = None
    if mutable:
        out, router = out[0], out[1][moe.ROUTER]
    if fused:
        return out, gpt.unembedding(policy.model_config, policy.head_params(params, frozen)), router
    if not loss_chunk:
        return out, None, router
    head = functools.partial(gpt.head_logits, policy.model_config, policy.head_params(params, frozen))
    return out, head, router


class LMObjective:
    """Next-token prediction: windows of block_size tokens, loss on every position (packed rows: on
    their loss_mask tokens)."""

    needs_reference = False

    def __init__(self, config, model_config: gpt.GPTConfig, data=None):
        self.model_config = model_config
        self.label_smoothing = config.optim.label_smoothing
        self.z_loss = config.optim.get("z_loss", 0.0)
        self.path = LossPath(config)
        self.tokens_per_row = model_config.block_size

    def batch_shapes(self, n_rows: int) -> dict:
        """{name: (shape, dtype)} of a batch of n_rows."""
        T = self.model_config.block_size
        return {"inputs": ((n_rows, T), "int32"), "targets": ((n_rows, T), "int32")}

    def loss(self, policy, params, frozen: Frozen, batch, rng, train: bool):
        fused, p = self.path.fused(), self.path
        out, head, router = forward(policy, params, frozen, batch, rng, train, p.chunk, fused)
        targets_BT, mask_BT, ls, z = (
            batch["targets"],
            batch.get("loss_mask"),
            self.label_smoothing,
            self.z_loss,
        )
        if fused:  # no [B, T, V] logits, forward or backward: blocks of the vocabulary
            loss_sum, weight = losses.fused_cross_entropy(out, head, targets_BT, mask_BT, ls, z, p.block)
        elif head is None:
            loss_sum, weight = cross_entropy(out, targets_BT, mask_BT, ls, z)
        else:  # the [B, T, V] float32 logits never exist: the head runs one chunk of positions at a time
            loss_sum, weight = chunked_cross_entropy(out, head, targets_BT, mask_BT, ls, p.chunk, z)
        if router is None or not train:  # evaluations compare the language-model loss alone
            return loss_sum, weight
        # the router losses are means over the batch: times the weight, as the summed loss is
        c = self.model_config
        aux, z = moe.router_losses(router, c.num_experts)
        loss_sum = loss_sum + (c.router_aux_loss_coef * aux + c.router_z_loss_coef * z) * weight
        return loss_sum, (weight, {"router_aux": aux * weight, "router_z": z * weight})
