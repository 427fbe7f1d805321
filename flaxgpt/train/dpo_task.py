"""DPO (Rafailov et al. 2023) as an objective: preference tuning on pairs (data.format = pairs; the
batches are lm_task.TokenBatches of flaxgpt prepare --dataset pairs, flaxgpt.data.preference).

    objective = DPOObjective(config, model_config)   # config: configs/dpo_llama.py (its `dpo` section)
    loss_sum, (n_pairs, sums) = objective.loss(policy, params, frozen, batch, rng, train=True)
    logps = objective.pair_logps(policy, params, frozen, batch)   # policy / reference, chosen / rejected

The policy's model call is lm_task.forward's (train.policy: LoRA or full fine-tuning); the reference is
- LoRA: the same frozen base with the adapters off (Frozen.base, as for SFT);
- full fine-tuning: a frozen copy of init_from's weights, or of dpo.reference's (same architecture):
  Frozen.reference (`reference`), placed with the parameters' shardings.
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
import typing

import jax
import jax.numpy as jnp

from flaxgpt.models import gpt
from flaxgpt.train import sections
from flaxgpt.train.lm_task import LossPath, forward, start_from
from flaxgpt.train.losses import chunked_token_logprobs, fused_token_logprobs, token_logprobs
from flaxgpt.train.policy import Frozen

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
    else:  # a caller past the recipe's section: its rule, said the same way
        sections.typed("dpo.loss", loss, typing.get_type_hints(sections.DPOSection)["loss"], {})
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


def reference(config, model_config: gpt.GPTConfig, start, mode):
    """Frozen.reference of full fine-tuning: dpo.reference's weights (its architecture checked), else
    a copy of init_from's (`start`; the policy's start is donated and updated in place). ABSTRACT
    mode reads no checkpoint: the start's shapes are the reference's."""
    name = sections.of(config).dpo.reference
    if name and mode.name == "real":
        ref = start_from(name, model_config)
        check_reference(model_config, ref.config, name)
        return ref.params
    if start is None:
        raise ValueError(
            "DPO needs a reference: set --config.init_from to the model to tune (its SFT checkpoint)"
        )
    return start if name else mode.copy(start)


class DPOObjective:
    """DPO / IPO on preference pairs, over a policy's model call (lm_task.forward)."""

    needs_reference = True  # full fine-tuning: Frozen.reference (LoRA: the base, adapters off)

    def __init__(self, config, model_config: gpt.GPTConfig, data=None):
        self.model_config, self.tokens_per_row = model_config, model_config.block_size
        self.path = LossPath(config)
        c = sections.of(config).dpo
        self.beta, self.dpo_loss, self.dpo_smoothing = float(c.beta), c.loss, float(c.label_smoothing)

    def reference(self, config, start, mode):
        return reference(config, self.model_config, start, mode)

    def batch_shapes(self, n_rows: int) -> dict:
        T = self.model_config.block_size
        return {
            "inputs": ((n_rows, T), "int32"),
            "targets": ((n_rows, T), "int32"),
            "loss_mask": ((n_rows, T), "float32"),
            "segment_ids": ((n_rows, T), "int32"),
        }

    def _completion_logps(self, policy, params, frozen, batch, rng, train):
        """Each pair's summed completion log-probabilities: (chosen_BP, rejected_BP)."""
        fused, p = self.path.fused(), self.path
        out, head, _ = forward(policy, params, frozen, batch, rng, train, p.chunk, fused)
        if fused:  # the log-probs blockwise over the vocabulary (losses.fused_token_logprobs)
            logp_BT, _ = fused_token_logprobs(out, head, batch["targets"], block=p.block)
        elif head is None:
            logp_BT = token_logprobs(out, batch["targets"])
        else:  # never the whole [B, T, V] float32 logits
            logp_BT = chunked_token_logprobs(out, head, batch["targets"], p.chunk)
        return pair_sums(logp_BT * batch["loss_mask"], batch["segment_ids"])

    def pair_logps(self, policy, params, frozen: Frozen, batch, rng=None, train: bool = False) -> dict:
        """{policy,ref}_{chosen,rejected} log-probabilities and n_{chosen,rejected} tokens, [B, P]."""
        policy_lp = self._completion_logps(policy, params, frozen, batch, rng, train)
        ref = self._completion_logps(policy, policy.reference_params(frozen), frozen, batch, None, False)
        ref = jax.lax.stop_gradient(ref)
        n = pair_sums(batch["loss_mask"], batch["segment_ids"])
        names = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected", "n_chosen", "n_rejected")
        return dict(zip(names, (*policy_lp, *ref, *n), strict=True))

    def loss(self, policy, params, frozen: Frozen, batch, rng, train: bool):
        logps = self.pair_logps(policy, params, frozen, batch, rng, train)
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
