"""DPO (Rafailov et al. 2023) as a trainer task: preference tuning on pairs (data.format = pairs).

    task = DPOTask(config)          # config: configs/dpo_llama.py (its `dpo` section), data from
                                    # flaxgpt prepare --dataset pairs (flaxgpt.data.preference)
    loss_sum, (n_pairs, sums) = task.loss(params, batch, rng, train=True, frozen=reference)
    logps = task.pair_logps(params, batch, frozen)   # per pair: policy / reference, chosen / rejected

The policy is LMTask's model call (LoRA or full fine-tuning); the reference is
- LoRA: the same frozen base with the adapters off (`frozen` is the base, as for SFT);
- full fine-tuning: a frozen copy of init_from's weights, or of dpo.reference's (same architecture),
  held in `frozen` and placed with the parameters' shardings.
Both run in the same jitted step; the reference's log-probabilities are a stop_gradient.

A sequence's log-probability is the sum over its completion tokens (loss_mask) of log p(token), as
TRL's DPOTrainer sums them; a row holds pairs as segments 2p + 1 (chosen) and 2p + 2 (rejected),
summed per segment. With d = (policy - reference)(chosen) - (policy - reference)(rejected):
- sigmoid (DPO): -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d), e = dpo.label_smoothing
  (conservative DPO, Mitchell 2023; TRL 1.16's "sigmoid" has no smoothing: e = 0 is its loss);
- ipo: ((chosen / n_chosen - rejected / n_rejected) of the log-ratios - 1 / (2 beta))^2, the
  per-token averaged form TRL uses.
Rewards are beta (policy - reference); logged as means over the step's pairs: reward_chosen,
reward_rejected, reward_accuracy (chosen above rejected), reward_margin, logp_chosen, logp_rejected.
The loss is a sum over pairs and the weight the number of pairs, so gradient accumulation averages
over every pair of the step (TRL's mean over the batch's pairs).

Shape letters: B rows, T positions, P pairs a row can hold (T // 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt import sharding
from flaxgpt.models import gpt
from flaxgpt.train import sections
from flaxgpt.train.lm_task import LMTask, start_from
from flaxgpt.train.losses import chunked_token_logprobs, token_logprobs

LOSSES = sections.DPO_LOSSES  # config.dpo.loss


def pair_sums(x_BT, segment_ids_BT):
    """Per-token values [B, T] -> (chosen_BP, rejected_BP): sums over each pair's two segments."""
    P = x_BT.shape[1] // 2
    sums = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=2 * P + 1))  # per row: shards stay
    sums_BS = sums(x_BT, segment_ids_BT)  # segment 0 (padding) first
    return sums_BS[:, 1::2], sums_BS[:, 2::2]


def dpo_losses(logps: dict, beta: float, loss: str, label_smoothing: float = 0.0):
    """(per-pair loss [B, P], rewards (chosen, rejected) [B, P]) from pair_logps' sums."""
    chosen_BP = logps["policy_chosen"] - logps["ref_chosen"]  # log-ratios
    rejected_BP = logps["policy_rejected"] - logps["ref_rejected"]
    if loss == "sigmoid":
        z_BP = beta * (chosen_BP - rejected_BP)
        e = label_smoothing
        losses_BP = -(1 - e) * jax.nn.log_sigmoid(z_BP) - e * jax.nn.log_sigmoid(-z_BP)
    elif loss == "ipo":  # per-token averages: the squared loss does not grow with the response's length
        n_chosen_BP, n_rejected_BP = (jnp.maximum(logps[k], 1) for k in ("n_chosen", "n_rejected"))
        d_BP = chosen_BP / n_chosen_BP - rejected_BP / n_rejected_BP
        losses_BP = (d_BP - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss={loss!r}; choose one of {', '.join(LOSSES)}")
    rewards = jax.lax.stop_gradient((beta * chosen_BP, beta * rejected_BP))
    return losses_BP, rewards


def check_reference(policy: gpt.GPTConfig, reference: gpt.GPTConfig, name: str) -> None:
    """A one-line error unless the reference has the policy's architecture."""
    a, b = dataclasses.asdict(policy), dataclasses.asdict(reference)
    diff = [f"{k} {b[k]} (policy {a[k]})" for k in a if a[k] != b[k]]
    if diff:
        raise ValueError(
            f"dpo.reference={name} is not the policy's architecture: {'; '.join(diff[:4])}; "
            "the reference must be the policy's own model before DPO (its SFT checkpoint); '' = init_from"
        )


class DPOTask(LMTask):
    """DPO / IPO on preference pairs; the model, LoRA and batches are LMTask's."""

    formats = ("pairs",)

    @classmethod
    def without_data(cls, config, model_config: gpt.GPTConfig) -> DPOTask:
        """The task with the reference (or LoRA's base) as shapes: flaxgpt.aot compiles its steps."""
        task = cls.__new__(cls)
        task.shards, task.data, task.data_dir = False, None, None
        task.pretrained = nn.unbox(gpt.abstract_params(model_config))
        task._set_model(config, model_config)
        return task

    def _set_model(self, config, model_config: gpt.GPTConfig) -> None:
        reference = self.pretrained  # init_from's weights (LMTask.__init__ loaded them)
        super()._set_model(config, model_config)
        c = sections.of(config).dpo
        self.beta, self.dpo_loss, self.dpo_smoothing = float(c.beta), c.loss, float(c.label_smoothing)
        if self.lora is not None:
            return  # the reference is the base, adapters off
        if c.reference:
            ref = start_from(c.reference, model_config)
            check_reference(model_config, ref.config, c.reference)
            reference = ref.params
        if reference is None:
            raise ValueError(
                "DPO needs a reference: set --config.init_from to the model to tune (its SFT checkpoint)"
            )
        # init_from's weights: a copy of their own, as the policy's start is donated and updated in place
        shared = not c.reference and not isinstance(jax.tree.leaves(reference)[0], jax.ShapeDtypeStruct)
        self.frozen = jax.tree.map(lambda x: np.array(x, copy=True), reference) if shared else reference

    def batch_shapes(self, n_rows: int) -> dict:
        T = self.model_config.block_size
        shapes = super().batch_shapes(n_rows)
        return {**shapes, "loss_mask": ((n_rows, T), "float32"), "segment_ids": ((n_rows, T), "int32")}

    def place_frozen(self, mesh):
        """LoRA: the base (LMTask's); full fine-tuning: the reference, sharded as the parameters."""
        if self.lora is not None:
            return super().place_frozen(mesh)
        shardings = sharding.param_shardings(gpt.abstract_params(self.model_config), mesh)
        if isinstance(jax.tree.leaves(self.frozen)[0], jax.ShapeDtypeStruct):  # flaxgpt.aot
            place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
            return jax.tree.map(place, self.frozen, shardings), shardings
        return jax.device_put(self.frozen, shardings), shardings

    def _completion_logps(self, params, batch, rng, train, frozen):
        """Each pair's summed completion log-probabilities: (chosen_BP, rejected_BP)."""
        out, head = self.forward(params, batch, rng, train, frozen)
        if head is None:
            logp_BT = token_logprobs(out, batch["targets"])
        else:  # never the whole [B, T, V] float32 logits
            logp_BT = chunked_token_logprobs(out, head, batch["targets"], self.loss_chunk)
        return pair_sums(logp_BT * batch["loss_mask"], batch["segment_ids"])

    def pair_logps(self, params, batch, frozen, rng=None, train: bool = False) -> dict:
        """{policy,ref}_{chosen,rejected} log-probabilities and n_{chosen,rejected} tokens, [B, P]."""
        if self.lora is not None:  # the reference: the same base, no adapter
            policy = self._completion_logps(params, batch, rng, train, frozen)
            ref = self._completion_logps({}, batch, None, False, frozen)
        else:
            policy = self._completion_logps(params, batch, rng, train, None)
            ref = self._completion_logps(frozen, batch, None, False, None)
        ref = jax.lax.stop_gradient(ref)
        n = pair_sums(batch["loss_mask"], batch["segment_ids"])
        names = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected", "n_chosen", "n_rejected")
        return dict(zip(names, (*policy, *ref, *n), strict=True))

    def loss(self, params, batch, rng, train: bool, frozen=None):
        logps = self.pair_logps(params, batch, frozen, rng, train)
        losses_BP, (chosen_BP, rejected_BP) = dpo_losses(logps, self.beta, self.dpo_loss, self.dpo_smoothing)
        pair_BP = (logps["n_chosen"] > 0).astype(jnp.float32)  # the row's pair slots that hold a pair
        sums = {
            "reward_chosen": chosen_BP,
            "reward_rejected": rejected_BP,
            "reward_accuracy": (chosen_BP > rejected_BP).astype(jnp.float32),
            "reward_margin": chosen_BP - rejected_BP,
            "logp_chosen": jax.lax.stop_gradient(logps["policy_chosen"]),
            "logp_rejected": jax.lax.stop_gradient(logps["policy_rejected"]),
        }
        sums = {k: jnp.sum(v * pair_BP) for k, v in sums.items()}
        return jnp.sum(losses_BP * pair_BP), (jnp.sum(pair_BP), sums)
