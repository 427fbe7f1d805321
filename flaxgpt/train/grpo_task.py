"""GRPO (Shao et al. 2024) and its variants: the policy-gradient objective on scored completions, as
TRL 1.16's GRPOTrainer computes it, over flaxgpt's model call (full fine-tuning or LoRA).

    prompts, completions = sample_groups(model_config, params, prompt_ids, G, rng=key, max_new_tokens=64)
    adv_N, zero_std_N = group_advantages(rewards_N, G, scale="group")   # N = prompts x G, grouped
    batch = rollout_batch(prompt_ids, completion_ids, T)                # one completion a row
    objective = GRPOObjective(GRPOOptions(loss_type="dapo", beta=0.04), row_tokens=T)
    logp_BT, entropy_BT = objective.token_logps(policy, params, frozen, batch)   # the policy's (train.policy)
    batch["ref_logp"] = objective.reference_logps(policy, frozen, batch)      # beta > 0: LoRA off / copy
    loss_sum, (weight, sums) = objective.loss(policy, params, frozen, batch, rng, train=True)

A batch row is a prompt then its completion, right-padded; `inputs` / `targets` are the row shifted by
one, `loss_mask` is 1 on the completion's tokens (targets), `advantages` one value a row. The
old policy's log-probs (`old_logp`, num_iterations > 1: taken once after the rollout and kept while
the same completions are trained on again) and the reference's (`ref_logp`) are optional batch
fields; without `old_logp` the ratio is against the detached current log-probs (1, with the
gradient of the plain policy gradient), as TRL does with num_iterations = 1. Off-policy rollouts
(grpo.off_policy_steps > 0: sampled by older weights) carry `behaviour_logp`, those weights' log-probs:
each token's loss is weighted by min(pi_old / pi_behaviour, tis_cap) (truncated importance sampling,
TRL's vLLM correction), before the KL term is added.

The objective per completion token t (ratio r = pi / pi_old, A the row's advantage):
- grpo, dr_grpo, dapo, bnpo, luspo: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r capped at
  delta when set (two-sided clipping); cispo: -min(r, epsilon_high) (no gradient) A log pi;
  sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos if A > 0 else _neg;
- importance_sampling_level sequence (GSPO): r = exp(mean over the completion of log r), one a row;
- beta > 0 adds beta k3, k3 = exp(ref - logp) - (ref - logp) - 1, times r (TRL's
  use_bias_correction_kl, its default);
- top_entropy_quantile < 1 keeps only tokens whose entropy reaches that quantile of the batch's.
How the token losses are averaged is what tells the loss types apart, written as (sum, weight) so
that the train step's sum over micro-batches divided by the summed weight is the step's loss:
- grpo, sapo: each completion's token mean, averaged over completions (weight: completions);
- bnpo, dapo, cispo: the sum over every completion token, over their number (weight: tokens);
- dr_grpo: the sum over tokens, over completions x max_completion_length (a constant);
- luspo: each completion's token sum, averaged over completions.
With one micro-batch this is TRL's loss exactly; with several, TRL's grpo / bnpo / dr_grpo average
the micro-batches' losses, this averages over the whole step.

Metrics (token means over the completions, sequence level: means over rows): clip_low, clip_high,
clip_region (the ratio outside the clip range on the side that matters for A's sign), kl,
entropy, completion_length (completion tokens a row, after mask_truncated_completions).

Shape letters: B rows (completions), T positions, N completions of a step (prompts x G), G group size.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from flaxgpt.decode import sampling
from flaxgpt.models import gpt
from flaxgpt.models.cache import KVCache
from flaxgpt.train import losses
from flaxgpt.train.typed import ConfigError, Section, opt

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo")
SCALES = ("group", "batch", "none")  # scale_rewards
LEVELS = ("token", "sequence")  # importance_sampling_level
ROLLOUTS = ("engine", "generate")  # grpo.rollout: the serving engine (grpo_rollout) | sample_groups
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclasses.dataclass(frozen=True)
class GRPOOptions(Section):
    """The objective's settings, each checked by its type and range when made (train/typed.py); names
    and defaults are TRL 1.16's. The recipe's grpo section (sections.GRPOSection) is these fields and
    the run's own (group size, rollouts, rewards): each field and its rule are written here once."""

    name: ClassVar[str] = "grpo"
    loss_type: Literal[LOSS_TYPES] = opt("dapo", "how token losses are averaged: docs/grpo.md")
    epsilon: float = opt(0.2, "the ratio's clip range starts at 1 - epsilon", 0)
    epsilon_high: float = opt(-1.0, "... and ends at 1 + epsilon_high, DAPO's clip-higher; -1 = epsilon")
    delta: float = opt(0.0, "two-sided clipping: the unclipped ratio capped at delta > 1; 0 = off")
    beta: float = opt(0.0, "weight of the k3 KL to the reference: LoRA's base, else init_from's weights", 0)
    importance_sampling_level: Literal[LEVELS] = opt("token", "sequence: GSPO, one ratio each")
    max_completion_length: int = opt(
        256, "sampled tokens a completion at most; prompt + this <= block_size; dr_grpo's normalizer", 1
    )
    temperature: float = opt(
        1.0, "sampling temperature; the log-probs are of the same softened distribution", 0, low_in=False
    )
    top_entropy_quantile: float = opt(
        1.0, "< 1: train only on the highest-entropy tokens", 0, 1, low_in=False, high_in=True
    )
    sapo_temperature_pos: float = opt(1.0, "SAPO's gate temperature for positive advantages", 0, low_in=False)
    sapo_temperature_neg: float = opt(1.05, "... and for negative ones", 0, low_in=False)
    tis_cap: float = opt(
        2.0, "off-policy rollouts: each token's loss times min(pi_old / pi_behaviour, tis_cap); 0 = off", 0
    )

    def check(self) -> None:
        if self.delta and self.delta <= 1:
            raise ConfigError(f"--config.grpo.delta={self.delta} caps the ratio: > 1, or 0 for off")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high < 0 else self.epsilon_high


# ---------------------------------------------------------------- rewards -> advantages


def _nanstd(x, axis=None):
    """Bessel-corrected standard deviation ignoring NaN (TRL's nanstd): NaN for fewer than 2 values."""
    n = np.sum(~np.isnan(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a group of NaNs (dropped): NaN, said nowhere
        var = np.nanmean((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis) * n / (n - 1)
    return np.where(n > 1, np.sqrt(var), np.nan)


def check_group_size(G: int) -> None:
    """The one refusal of groups too small to compare (a recipe's grpo section and group_advantages)."""
    if G < 2:
        raise ValueError(
            f"grpo.num_generations={G}: a group needs >= 2 completions (G = 1: every advantage is 0)"
        )


def group_advantages(rewards_N, group_size: int, scale: str = "group"):
    """(advantages [N], zero_std [N]) of rewards [N] laid out as N // G groups of G completions of one
        prompt: the reward less its group's mean, over the group's (scale group) or the step's (batch)
    standard deviation + 1e-4, or not scaled (none). A NaN reward (unscorable) is left out of the
    statistics and gets advantage 0. zero_std: the group's rewards are all equal, or fewer than two of
    them are numbers (logged: no signal; dynamic sampling refills such groups)."""
    if scale not in SCALES:
        raise ValueError(f"grpo.scale_rewards={scale!r}; choose one of {', '.join(SCALES)}")
    G = int(group_size)
    check_group_size(G)
    r_N = np.asarray(rewards_N, np.float64)
    if r_N.ndim != 1 or r_N.size % G:
        raise ValueError(f"{r_N.size} rewards are not groups of num_generations={G}")
    r_PG = r_N.reshape(-1, G)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_N = np.repeat(np.nanmean(r_PG, axis=1), G)
    if scale == "batch":
        std_N = np.full_like(r_N, _nanstd(r_N) if r_N.size > 1 else 0.0)
    else:  # "none" still reports which groups carry no signal
        std_N = np.repeat(_nanstd(r_PG, axis=1), G)
    adv_N = r_N - mean_N
    if scale != "none":
        adv_N = adv_N / (std_N + STD_EPS)
    zero_std_N = np.isclose(std_N, 0.0) | np.isnan(std_N)  # (all NaN, or one reward: no signal either)
    return np.nan_to_num(adv_N, nan=0.0).astype(np.float32), zero_std_N


def truncated(completion_ids, eos_ids) -> np.ndarray:
    """[N] bool: the completion did not end with an end-of-sequence token (it hit the length limit), or
    a Completion that says so (an episode the environment did not end: max_turns, the token budget).
    mask_truncated_completions zeroes these rows' loss_mask, as TRL does (EOS ids include its pad)."""
    eos = set(int(e) for e in np.atleast_1d(eos_ids))

    def cut(ids) -> bool:
        said = getattr(ids, "truncated", None)
        return said if said is not None else len(ids) == 0 or int(ids[-1]) not in eos

    return np.array([cut(ids) for ids in completion_ids], bool)


class Completion(list):
    """A completion's tokens (a list) with what the sampler knew of them: a multi-turn episode's replies
    with the environment's observations between them (train/grpo_episodes.py), model[i] 1 where token i
    is the model's (trained), 0 where the environment wrote it (masked out of the loss; None: all the
    model's); reward the environment's (NaN: its group was dropped); logp each token's log-probability
    under the weights that sampled it (the engine's, grpo_rollout: an off-policy batch's behaviour_logp
    without a forward pass), or None; truncated whether it was cut short (None: no EOS at its end)."""

    def __init__(self, tokens, model=None, reward: float = float("nan"), logp=None, truncated=None):
        super().__init__(tokens)
        self.truncated = truncated
        self.model, self.reward = [1] * len(self) if model is None else list(model), reward
        self.logp = None if logp is None else [float(x) for x in logp]
        for name, xs in (("model flags", self.model), ("log-probs", self.logp or self)):
            if len(xs) != len(self):
                raise ValueError(f"{len(xs)} {name} for {len(self)} tokens")


def rollout_batch(prompt_ids, completion_ids, T: int, advantages=None, pad: int = 0) -> dict:
    """Rows of prompt + completion, right-padded to T + 1 tokens and split into inputs / targets [N, T];
    loss_mask [N, T] marks the completion's targets (a Completion's: only the model's own tokens);
    behaviour_logp [N, T] their sampler's log-probs where every completion carries them (Completion.logp).
    A row longer than T + 1 is an error naming it."""
    N = len(prompt_ids)
    if len(completion_ids) != N:
        raise ValueError(f"{N} prompts but {len(completion_ids)} completions")
    tokens = np.full((N, T + 1), pad, np.int32)
    mask = np.zeros((N, T), np.float32)
    logged = N > 0 and all(getattr(c, "logp", None) is not None for c in completion_ids)
    logp = np.zeros((N, T), np.float32) if logged else None
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        n = len(p) + len(c)
        if n > T + 1:
            raise ValueError(
                f"row {i}: prompt {len(p)} + completion {len(c)} tokens > block_size + 1 = {T + 1}"
            )
        if not len(p):
            raise ValueError(
                f"row {i}: an empty prompt (the first completion token needs a position before it)"
            )
        tokens[i, :n] = np.concatenate([np.asarray(p, np.int32), np.asarray(c, np.int32)])
        mask[i, len(p) - 1 : n - 1] = 1.0  # target j is token j + 1: the completion starts at len(p)
        if isinstance(c, Completion):  # an episode's observations are the environment's: not trained
            mask[i, len(p) - 1 : n - 1] = np.asarray(c.model, np.float32)
        if logp is not None:
            logp[i, len(p) - 1 : n - 1] = c.logp
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    if logp is not None:
        batch["behaviour_logp"] = logp
    if advantages is not None:
        batch["advantages"] = np.asarray(advantages, np.float32).reshape(N)
    return batch


def sample_groups(model_config, params, prompt_ids, group_size: int, *, rng, max_new_tokens: int,
                  temperature: float = 1.0, top_p: float = 1.0, eos_id=None, step_fn=None):  # fmt: skip
    """G completions of each prompt sampled from `params` (full weights) by flaxgpt's decode loop
    (decode.sampling.generate, one cache row each) -> N = prompts x G token lists, prompt-major
    (completion n is prompt n // G's), each ending with eos_id when it stopped there. step_fn: the
    decoders' step to sample from instead (LoRA: models.lora.step_fn, the adapters unmerged over any
    base, int8 included; params is then unused)."""
    prompts = [list(p) for p in prompt_ids for _ in range(group_size)]
    N, P = len(prompts), max(len(p) for p in prompts)
    W = sampling.cache_length(model_config.block_size, P, max_new_tokens)
    if P + max_new_tokens > model_config.block_size:
        raise ValueError(
            f"a prompt of {P} tokens + max_completion_length {max_new_tokens} > block_size "
            f"{model_config.block_size}"
        )
    prompt_NP = np.zeros((N, P), np.int32)
    for i, p in enumerate(prompts):
        prompt_NP[i, : len(p)] = p
    cache = KVCache.for_config(model_config, batch=N, max_len=W)
    tokens_NM, lengths_N = sampling.generate(
        step_fn or gpt.step_fn(model_config, params), cache, prompt_NP, [len(p) for p in prompts],
        max_new_tokens=max_new_tokens, rng=rng, temperature=temperature, top_p=top_p, eos_id=eos_id,
    )  # fmt: skip
    return prompts, [tokens_NM[i, : lengths_N[i]].tolist() for i in range(N)]


# ---------------------------------------------------------------- log-probs and the objective


def completion_logps(logits_BTV, targets_BT, temperature: float = 1.0):
    """(log p(target) [B, T], entropy [B, T]) of softmax(logits / temperature), in float32."""
    logits_BTV = logits_BTV.astype(jnp.float32) / temperature
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, entropy_BT


def _entropy_mask(entropy_BT, mask_BT, quantile: float):
    """1 where a completion token's entropy is at least the (1 - quantile) quantile of the batch's."""
    values = jnp.where(mask_BT > 0, jax.lax.stop_gradient(entropy_BT), jnp.nan)
    threshold = jnp.nanquantile(values, 1.0 - quantile)  # linear interpolation, as torch.quantile
    return ((entropy_BT >= threshold) & (mask_BT > 0)).astype(jnp.float32)


def grpo_loss(logp_BT, mask_BT, advantages_B, opts: GRPOOptions, old_logp_BT=None, ref_logp_BT=None,
              entropy_BT=None, behaviour_logp_BT=None):  # fmt: skip
    """(loss_sum, weight, metrics): the loss is loss_sum / weight (see the module docstring).
    behaviour_logp_BT: the log-probs of the weights that sampled the batch (off-policy rollouts)."""
    mask_BT = mask_BT.astype(jnp.float32)
    adv_B1 = advantages_B.astype(jnp.float32)[:, None]
    old_BT = jax.lax.stop_gradient(logp_BT) if old_logp_BT is None else old_logp_BT
    log_ratio_BT = logp_BT - old_BT
    n_B1 = jnp.maximum(mask_BT.sum(-1, keepdims=True), 1.0)
    if opts.importance_sampling_level == "sequence":
        log_w = jnp.sum(log_ratio_BT * mask_BT, -1, keepdims=True) / n_B1  # [B, 1]
    else:
        log_w = log_ratio_BT  # [B, T]
    ratio = jnp.exp(log_w)
    metrics, kl_BT = {}, None
    if opts.beta:  # k3, importance-corrected by the uncapped ratio (TRL's use_bias_correction_kl default)
        d_BT = ref_logp_BT - logp_BT
        kl_BT = (jnp.exp(d_BT) - d_BT - 1) * ratio
        metrics["kl"] = _masked_mean(jax.lax.stop_gradient(kl_BT), mask_BT)
    lo, hi = 1.0 - opts.epsilon, 1.0 + opts.eps_high
    if opts.loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, opts.eps_high)) * adv_B1 * logp_BT
    elif opts.loss_type == "sapo":
        tau = jnp.where(adv_B1 > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)
        loss = -jax.nn.sigmoid(tau * (ratio - 1)) * 4 / tau * adv_B1
    else:
        clipped = jnp.clip(ratio, lo, hi)
        # capped for the clip metrics too, as TRL's (its KL above keeps the uncapped ratio)
        ratio = jnp.minimum(ratio, opts.delta) if opts.delta else ratio
        loss = -jnp.minimum(ratio * adv_B1, clipped * adv_B1)
    if entropy_BT is not None and opts.top_entropy_quantile < 1.0:
        loss = loss * _entropy_mask(entropy_BT, mask_BT, opts.top_entropy_quantile)
    if behaviour_logp_BT is not None and opts.tis_cap:  # truncated importance sampling, before the KL
        tis_BT = jnp.minimum(jnp.exp(jax.lax.stop_gradient(old_BT) - behaviour_logp_BT), opts.tis_cap)
        loss = loss * tis_BT
        metrics["tis_weight"] = _masked_mean(tis_BT, mask_BT)
    if kl_BT is not None:
        loss = loss + opts.beta * kl_BT
    B = mask_BT.shape[0]
    if opts.loss_type in ("grpo", "sapo"):
        loss_sum, weight = jnp.sum(jnp.sum(loss * mask_BT, -1) / n_B1[:, 0]), float(B)
    elif opts.loss_type == "dr_grpo":
        loss_sum, weight = jnp.sum(loss * mask_BT), B * opts.max_completion_length
    elif opts.loss_type == "luspo":
        loss_sum, weight = jnp.sum(loss * mask_BT), B
    else:  # bnpo, dapo, cispo: a token mean over the step
        loss_sum, weight = jnp.sum(loss * mask_BT), jnp.maximum(jnp.sum(mask_BT), 1.0)
    if opts.loss_type not in ("cispo", "sapo"):
        r = jax.lax.stop_gradient(ratio)
        low, high = (r < lo) & (adv_B1 < 0), (r > hi) & (adv_B1 > 0)
        for name, x in (("clip_low", low), ("clip_high", high), ("clip_region", low | high)):
            metrics[name] = _masked_mean(x.astype(jnp.float32), mask_BT)
    if entropy_BT is not None:
        metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(entropy_BT), mask_BT)
    metrics["completion_length"] = jnp.mean(mask_BT.sum(-1))
    return loss_sum, jnp.float32(weight), metrics


def _masked_mean(x, mask_BT):
    """A token mean over the completions; [B, 1] (one value a row: sequence level) is a row mean."""
    if x.shape[-1] == 1:
        return jnp.mean(x)
    return jnp.sum(x * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)


# ---------------------------------------------------------------- the objective over a policy


class GRPOObjective:
    """GRPO's loss over a policy's model call (train.policy: full fine-tuning, the reference a frozen
    copy in Frozen.reference; or LoRA, the reference the base with the adapters off).
    loss(policy, params, frozen, batch, rng, train) -> (loss_sum, (weight, metric sums)), the contract
    of train.steps (metrics are scaled by the weight, so the step's division gives them). Rows are
    T tokens (`row_tokens`), num_iterations > 1 adds old_logp to a batch, beta > 0 ref_logp."""

    def __init__(self, opts: GRPOOptions, row_tokens: int = 0, num_iterations: int = 1,
                 loss_impl: str = "logits", loss_block: int = 0, off_policy: bool = False):  # fmt: skip
        self.opts, self.T, self.num_iterations = opts, row_tokens, num_iterations
        self.off_policy = off_policy  # rollouts sampled by older weights: behaviour_logp in a batch
        losses.check_loss_impl(loss_impl)  # a bad optim.loss_impl fails here
        self.loss_impl, self.loss_block = loss_impl, loss_block  # the log-probs' path (losses.use_fused)
        self.tokens_per_row = row_tokens
        self.needs_reference = bool(opts.beta)  # full fine-tuning: a frozen copy of the start

    def reference(self, config, start, mode):
        """Frozen.reference of full fine-tuning with beta > 0: a copy of the start's weights."""
        if start is None:
            raise ValueError("grpo.beta > 0 needs a reference: LoRA (the base) or a frozen copy of the start")
        return mode.copy(start)

    def batch_shapes(self, n_rows: int) -> dict:
        T = self.T
        shapes = {
            "inputs": ((n_rows, T), "int32"),
            "targets": ((n_rows, T), "int32"),
            "loss_mask": ((n_rows, T), "float32"),
            "advantages": ((n_rows,), "float32"),
        }
        if self.num_iterations > 1:
            shapes["old_logp"] = ((n_rows, T), "float32")
        if self.opts.beta:
            shapes["ref_logp"] = ((n_rows, T), "float32")
        if self.off_policy:
            shapes["behaviour_logp"] = ((n_rows, T), "float32")
        return shapes

    def token_logps(self, policy, params, frozen, batch, rng=None, train: bool = False):
        """(logp_BT, entropy_BT) of the batch's targets under the policy (temperature-scaled)."""
        if losses.use_fused(self.loss_impl):  # blocks of the vocabulary: no [B, T, V] logits
            hidden_BTD = policy.apply(params, frozen, batch["inputs"], rng=rng, train=train, hidden=True)
            unembed = gpt.unembedding(policy.model_config, policy.head_params(params, frozen))
            t, block = self.opts.temperature, self.loss_block
            return losses.fused_token_logprobs(hidden_BTD, unembed, batch["targets"], t, block)
        logits_BTV = policy.apply(params, frozen, batch["inputs"], rng=rng, train=train)
        return completion_logps(logits_BTV, batch["targets"], self.opts.temperature)

    def reference_logps(self, policy, frozen, batch):
        """The reference's log-probs [B, T], no gradient: LoRA's base alone, or the frozen copy."""
        logp_BT, _ = self.token_logps(policy, policy.reference_params(frozen), frozen, batch)
        return jax.lax.stop_gradient(logp_BT)

    def loss(self, policy, params, frozen, batch, rng, train: bool):
        logp_BT, entropy_BT = self.token_logps(policy, params, frozen, batch, rng, train)
        loss_sum, weight, metrics = grpo_loss(
            logp_BT, batch["loss_mask"], batch["advantages"], self.opts,
            old_logp_BT=batch.get("old_logp"), ref_logp_BT=batch.get("ref_logp"), entropy_BT=entropy_BT,
            behaviour_logp_BT=batch.get("behaviour_logp"),
        )  # fmt: skip
        return loss_sum, (weight, {k: v * weight for k, v in metrics.items()})
