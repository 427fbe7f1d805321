"""GRPO's online batch source (data.format = prompts): each step's batch is sampled from the current
weights, scored and turned into advantages; the jitted train step then runs grpo_task.GRPOObjective's
loss on it (train.tasks composes them with the policy: full fine-tuning or LoRA).

    data, model_config, start = open_prompts(config)   # configs/grpo_toy.py (its `grpo` section), data
                                                       # from flaxgpt prepare --dataset prompts
    rollouts = Rollouts(config, data, policy, objective(config, model_config, data))
    batch, info = rollouts.rollout(params, frozen, step, n_rows, process_index)   # host arrays, metrics
    rollouts.evaluate(params, frozen)   # {"val_reward": ...}: one sampled completion a held-out prompt

A rollout: batch_size // G prompts of the step (PromptData.batch), G completions each sampled from
the policy's current weights by the serving engine (grpo.rollout = engine: grpo_rollout) or by
grpo_task.sample_groups (generate), LoRA's adapters merged into a float32 base or added unmerged over
any other (grpo_rollout.merged), the same tokens for the same seed (rollout_seed), decoded,
scored by the rewards (flaxgpt.train.rewards), group-normalised advantages, and rows of prompt +
completion (grpo_task.rollout_batch). With num_iterations > 1 the sampling policy's log-probs
(old_logp) are taken once and the same rollout trains that many optimizer steps; with beta > 0 the
reference's (ref_logp: LoRA's base with the adapters off, else a copy of init_from's weights) are
taken at the rollout too, as TRL takes both at generation time.

The trainer (flaxgpt.train.trainer) asks `online` tasks for their batch after each update (it cannot
be built while the step runs: it needs its weights) and logs `info` with the step: reward (mean),
reward_std (over the step's completions, TRL's), rewards/<name>/mean and /std per function,
frac_reward_zero_std, completions/mean_length, completions/clipped_ratio (hit the length limit),
rollout_time; the loss adds clip_*, kl, entropy, completion_length (grpo_task).
Shape letters: N completions of a step (prompts x G), G group size, T positions.
"""

from __future__ import annotations

import math
import time
import warnings

import jax
import numpy as np

from flaxgpt import sharding
from flaxgpt.data import prompts as prompts_lib
from flaxgpt.data import tokenizers
from flaxgpt.decode import sampling
from flaxgpt.decode.sampling import Sampling
from flaxgpt.envs import base as envs
from flaxgpt.models import gpt, lora
from flaxgpt.models import registry as models
from flaxgpt.train import grpo_async, grpo_dynamic, grpo_episodes, grpo_rollout, grpo_task, rewards, sections
from flaxgpt.train import policy as policy_lib
from flaxgpt.train.lm_task import data_hint, start_from

ALL_DROPPED_STEPS = 3  # steps in a row whose every group an environment's error dropped: then an error


def rollout_seed(seed: int, step: int, process_index: int) -> int:
    """The u32 seed of a step's rollout on a process (step -1: evaluations): an engine request's
    seed is a number (decode.sampling.Rows.of), so generate's rollouts take key(seed) too."""
    return int(np.random.SeedSequence([seed % 2**32, step + 1, process_index]).generate_state(1)[0])


def reward_names(specs) -> list[str]:
    """Short metric names of reward specs: format=... -> format, mod:fn -> fn (repeats numbered)."""
    names = []
    for spec in specs:
        name = spec.partition("=")[0].rpartition(":")[2] or spec
        names.append(name if name not in names else f"{name}_{len(names)}")
    return names


def open_prompts(config):
    """(prompts, model config, start): the recipe's prompts dataset, the model init_from gives with its
    weights (None: fresh), checked against each other."""
    s = sections.of(config)
    hint = data_hint(config)
    data = prompts_lib.PromptData(s.data.dir, hint)
    recipe = models.config_from(config.model, data.vocab_size)
    init = start_from(config.init_from, recipe, data.meta.get("tokenizer"))
    data.check(init.config.block_size, init.config.vocab_size, s.grpo.max_completion_length)
    return data, init.config, init.params


def objective(config, model_config: gpt.GPTConfig, data=None) -> grpo_task.GRPOObjective:
    """The recipe's GRPO objective. A row is a prompt and its completion (T + 1 tokens): T as long as
    the longest prompt and a whole completion need, not the model's whole window (without prompts to
    measure, flaxgpt aot's: the window); a multiple of 8, and of what a mesh context axis splits
    (ring: 2 x mesh.context chunks; Ulysses: mesh.context), as the window already is."""
    g = sections.of(config).grpo  # a grpo_task.GRPOOptions: the objective's options and the run's
    T, max_new = model_config.block_size, int(g.max_completion_length)
    if data is not None:
        n = max(1, sections.of(config).mesh.context)
        step = math.lcm(8, 2 * n if model_config.context_impl == "ring" else n)
        T = min(T, -(-(data.max_prompt_tokens + max_new - 1) // step) * step)
    o = config.optim
    return grpo_task.GRPOObjective(
        g, T, int(g.num_iterations), o.get("loss_impl", "logits"), o.get("loss_block", 0),
        off_policy=g.off_policy_steps > 0,
    )  # fmt: skip


class Rollouts:
    """GRPO's batch source: each train batch sampled from the policy's current weights, scored and
    turned into advantages (see the module docstring)."""

    online = True  # the trainer takes each batch from rollout(), after the previous update
    splits = ()  # no loss to evaluate on fixed batches: evaluations sample the held-out prompts

    def __init__(self, config, data, policy, objective: grpo_task.GRPOObjective):
        g = sections.of(config).grpo
        self.data, self.data_dir, self.seed = data, data.dir, config.seed
        self.policy, self.objective, self.model_config = policy, objective, policy.model_config
        self.tokenizer = tokenizers.from_meta(data.meta["tokenizer"])
        self.G, self.num_iterations = int(g.num_generations), int(g.num_iterations)
        self.max_new, self.temperature, self.top_p = int(g.max_completion_length), g.temperature, g.top_p
        self.scale, self.eval_prompts = g.scale_rewards, g.eval_prompts
        self.mask_truncated = g.mask_truncated_completions
        self.dynamic_rounds = g.dynamic_sampling_rounds if g.dynamic_sampling else None
        self.pipeline = None  # off_policy_steps > 0: rollouts k steps ahead on a thread of their own
        self.engine_devices, self.own_devices = int(g.engine_devices), None  # the engine's own: reserve
        self.replicas = int(g.engine_replicas)  # > 1: grpo_rollout.Replicas over the engine's devices
        if g.off_policy_steps:
            grpo_rollout.check_over_devices(jax.process_count(), g.off_policy_steps)
            self.pipeline = grpo_async.Pipeline(self.sampled, g.off_policy_steps, config.max_iters)
        # an environment's episodes may be scored by it alone; its reward is the first column, "env"
        funcs = list(g.reward_funcs)
        self.rewards = None  # none with an environment that scores alone; else Rewards says what to name
        if funcs or not g.env:
            self.rewards = rewards.Rewards.make(funcs, list(g.reward_weights) or None)
        self.names = ["env"] * bool(g.env) + reward_names(funcs)
        self._logps = jax.jit(lambda p, b, f: objective.token_logps(policy, p, f, b)[0])
        self.local = grpo_rollout.LocalWeights()  # several processes: a rollout reads its own copy
        # LoRA: the rollouts decode the merged weights (policy.weights, once a step) or (base, adapters)
        self.merged = grpo_rollout.merged(policy, g.merge_lora)
        self.engine = None
        if g.rollout == "engine":  # one engine for the run: slots for a step's completions
            mc = self.model_config
            self.engine = grpo_rollout.EngineRollouts(
                mc,
                Sampling(temperature=g.temperature, top_p=g.top_p, eos_id=data.eos_id),
                max_new_tokens=self.max_new,
                slots=max(config.batch_size // jax.process_count(), 1),
                max_len=sampling.cache_length(mc.block_size, data.max_prompt_tokens, self.max_new),
                lora_spec=None if self.merged else policy.lora,
                # an off-policy batch's behaviour log-probs as the engine samples (no forward pass for
                # them): its log-probs are the model's logits', the sampled distribution's at temperature
                # 1 only; an episode's turns keep the forward pass
                logprobs=bool(g.off_policy_steps) and g.temperature == 1.0 and not g.env,
            )
        self.episodes = self._episodes(g, data)
        self.all_dropped = 0  # steps in a row whose every group the environment's errors dropped

    def _episodes(self, g, data) -> grpo_episodes.Episodes | None:
        """grpo.env: each completion an episode against it (grpo_episodes), on the engine."""
        if not g.env:
            return None
        return grpo_episodes.Episodes(g.env, self.tokenizer, data.eos_id, self.max_new, g.max_turns)

    def reserve(self, devices) -> list:
        """The devices the trainer's mesh takes (tasks.Task.devices): `devices` (None: all) less the
        last grpo.engine_devices, which the engine keeps for itself (on_mesh puts it there)."""
        if not self.engine_devices:
            return devices
        devices = jax.devices() if devices is None else devices
        trainer, self.own_devices = grpo_rollout.split_devices(devices, self.engine_devices)
        return trainer

    def on_mesh(self, mesh, frozen) -> None:
        """The trainer placed the weights on `mesh`: the engine follows them over several devices,
        or goes to its own (grpo.engine_devices)."""
        if self.engine is not None and self.replicas > 1:
            self._replicas_over(self.own_devices or list(mesh.devices.flat))
        elif self.engine is not None and self.own_devices is not None:
            self._engine_over(self.own_devices, frozen)
        elif self.engine is not None and mesh.size > 1:
            self._engine_over(list(mesh.devices.flat), frozen)

    def _replicas_over(self, devices) -> None:
        """grpo.engine_replicas engines over `devices` (this process's), round robin."""
        self.engine = grpo_rollout.Replicas(self.engine, grpo_rollout.engine_devices(devices), self.replicas)

    def _engine_over(self, devices, frozen) -> None:
        """The engine over `devices` (the training mesh's, or its own), on a (data 1, fsdp n) mesh of
        them as serve.py --mesh runs: its weights placed by SERVE_RULES (MLP and vocabulary split, so a
        decoding step all-gathers no weight), LoRA's frozen base once (a second copy of it over the
        devices), the trained weights at each rollout (`_engine_weights`: on devices of its own, the
        trained parameters cross from the trainer's devices then, LoRA's adapters alone)."""
        devices = grpo_rollout.engine_devices(devices)  # this process's
        emesh, frozen = sharding.make_mesh(1, len(devices), devices), self.local.frozen_of(frozen)
        self.engine.mesh = emesh
        boxed = gpt.abstract_params(self.model_config)
        self._serve_shardings = sharding.param_shardings(boxed, emesh, sharding.SERVE_RULES)
        self._engine_base = None
        if frozen.base is not None:
            # a copy, never the trainer's buffers: the train step donates its state (the base too), and
            # a leaf placed alike (an int8 base's) would alias a donated buffer
            shardings = lora.base_shardings(self._serve_shardings, frozen.base)
            self._engine_base = jax.device_put(frozen.base, shardings, may_alias=False)

    def _engine_weights(self, params, frozen):
        """The engine's weights: the parameters, or LoRA's base and adapters (merged, or the pair);
        over several devices placed for the engine's mesh (the adapters, small, whole on every
        device, merged there into its copy of the base)."""
        if self.engine.mesh is None:
            return params if self.policy.lora is None else self._lora_weights(frozen.base, params)
        if self.policy.lora is None:
            return jax.device_put(params, self._serve_shardings)
        adapters = jax.device_put(params, sharding.replicated(self.engine.mesh))
        return self._lora_weights(self._engine_base, adapters)

    def _lora_weights(self, base, adapters):
        """What a rollout decodes with LoRA: the merged weights, or (base, adapters)."""
        if self.merged:
            return self.policy.weights(adapters, policy_lib.Frozen(base=base))
        return base, adapters

    def batch(self, split: str, step: int, n_rows: int, process_index: int) -> dict:
        """The trainer's fixed batch (a checkpoint's recorded loss): no completion token, loss 0."""
        shapes = self.objective.batch_shapes(n_rows)
        return {k: np.zeros(shape, dtype) for k, (shape, dtype) in shapes.items()}

    def sample(self, params, frozen, rows, group_size: int, seed: int):
        """(prompt ids, completion ids, completion texts) of group_size completions a row, prompt-major;
        completion n drawn with the key fold_in(key(seed), n) by the engine or by generate alike."""
        ids = [r["ids"] for r in rows]
        if self.episodes is not None:  # texts: the final replies, which the reward functions score
            weights = self._engine_weights(params, frozen)
            return self.episodes.sample(self.engine, weights, ids, rows, group_size, seed=seed)
        if self.engine is not None:
            weights = self._engine_weights(params, frozen)
            prompt_ids, completion_ids = self.engine.sample(weights, ids, group_size, seed=seed)
        else:  # LoRA: merged or unmerged as the engine's (grpo_rollout.merged), an int8 base too
            spec = self.policy.lora
            weights = params if spec is None else self._lora_weights(frozen.base, params)
            step = grpo_rollout.decoder_step(self.model_config, None if self.merged else spec, weights)
            prompt_ids, completion_ids = grpo_task.sample_groups(
                self.model_config, None, ids, group_size,
                rng=jax.random.key(seed), max_new_tokens=self.max_new, temperature=self.temperature,
                top_p=self.top_p, eos_id=self.data.eos_id, step_fn=step,
            )  # fmt: skip
        eos = self.data.eos_id  # the text a reward reads ends before the end-of-sequence token
        texts = [self.tokenizer.decode(c[:-1] if c and c[-1] == eos else c) for c in completion_ids]
        return prompt_ids, completion_ids, texts

    def score(self, rows, group_size: int, texts, completion_ids):
        """(total [N], per function [N, K]) of completions, row n // group_size's."""
        rows_N = [r for r in rows for _ in range(group_size)]
        names = [f"prompt {r['prompt']!r}" for r in rows_N]
        total_N, per_NK = np.zeros(len(texts)), np.zeros((len(texts), 0))
        if self.rewards is not None:  # as TRL passes them: a chat prompt's completion is a message too
            completions = [
                [{"role": "assistant", "content": t}] if isinstance(r["prompt"], list) else t
                for r, t in zip(rows_N, texts)
            ]
            total_N, per_NK = self.rewards(
                [r["prompt"] for r in rows_N],
                completions,
                [r["fields"] for r in rows_N],
                completion_ids,
                names,
            )
        if self.episodes is None:
            return total_N, per_NK
        # the environment's reward (NaN: its group dropped) and the functions' on the final reply
        env_N = np.array([c.reward for c in completion_ids], np.float64)
        return env_N + np.nan_to_num(total_N), np.concatenate([env_N[:, None], per_NK], axis=1)

    def rollout(self, params, frozen, step: int, n_rows: int, process_index: int = 0):
        """(host batch of n_rows completions for `step`, metrics of the rollout); off-policy
        (grpo_async.Pipeline) sampled k steps earlier by older weights, on the rollout thread."""
        if self.pipeline is not None:
            return self.pipeline.take(params, frozen, step, n_rows, process_index)
        with self.local.scope(params, frozen) as (params, frozen):  # several processes: this one's
            return self.sampled(params, frozen, step, n_rows, process_index)

    def before_update(self, params, step: int) -> None:
        """The trainer's hook before update `step` is dispatched (it donates `params`)."""
        if self.pipeline is not None:
            self.pipeline.before_update(params, step)

    def draw(self, params, frozen, step: int, n_prompts: int, process_index: int, r: int = 0):
        """A step's prompts sampled and scored: (prompt ids, completion ids, total [N], per function
        [N, K]); round r > 0 (dynamic sampling's refills): other prompts and keys, fixed by the seed."""
        seed, data_seed = rollout_seed(self.seed, step, process_index), self.seed
        if r:
            seed = data_seed = rollout_seed(self.seed, step, process_index + r * jax.process_count())
        rows = self.data.batch("train", step * jax.process_count() + process_index, n_prompts, data_seed)
        prompt_ids, completion_ids, texts = self.sample(params, frozen, rows, self.G, seed)
        return prompt_ids, completion_ids, *self.score(rows, self.G, texts, completion_ids)

    def sampled(self, params, frozen, step: int, n_rows: int, process_index: int = 0):
        """rollout's (batch, info), sampled now by `params` (the rewards logged: the step's prompts')."""
        t0 = time.perf_counter()
        G, extra = self.G, {}
        drawn = self.draw(params, frozen, step, n_rows // G, process_index)
        prompt_ids, completion_ids, total_N, per_NK = drawn
        # the step's own episodes' metrics, as its rewards (not dynamic sampling's refills')
        episodes = dict(self.episodes.stats) if self.episodes is not None else {}
        if self.episodes is not None and self.episodes.errors:  # a broken environment: not a run of zeros
            self.all_dropped = self.all_dropped + 1 if np.isnan(total_N).all() else 0
            if self.all_dropped >= ALL_DROPPED_STEPS:
                raise envs.EnvError(
                    f"the environment's errors dropped every group of {ALL_DROPPED_STEPS} steps in a row: "
                    f"the run trains nothing; fix it ({self.episodes.errors[-1]})"
                )
        _, zero_std_N = grpo_task.group_advantages(total_N, G, self.scale)
        if self.dynamic_rounds is not None:  # DAPO: groups of equal rewards dropped and refilled
            more = lambda r: self.draw(params, frozen, step, n_rows // G, process_index, r)  # noqa: E731
            (prompt_ids, completion_ids, total, trains_N), extra = grpo_dynamic.fill(
                more, drawn, G, self.dynamic_rounds
            )
        adv_N, _ = grpo_task.group_advantages(total if extra else total_N, G, self.scale)
        batch = grpo_task.rollout_batch(prompt_ids, completion_ids, self.objective.T, adv_N)
        cut_N = grpo_task.truncated(completion_ids, [self.data.eos_id])
        if self.mask_truncated:  # TRL: a completion cut by the length limit teaches nothing
            batch["loss_mask"][cut_N] = 0.0
        if extra:  # groups left equal after every refill round train nothing
            batch["loss_mask"][~trains_N] = 0.0
        # the sampling weights' log-probs, the loss's TIS weights: the engine's where it kept them
        if self.objective.off_policy and "behaviour_logp" not in batch:
            batch["behaviour_logp"] = np.asarray(self._logps(params, batch, frozen))
        if self.num_iterations > 1:  # the sampling policy's, kept while this rollout trains
            batch["old_logp"] = np.asarray(self._logps(params, batch, frozen))
        if self.objective.opts.beta:  # LoRA: the base, adapters off; else Frozen.reference
            batch["ref_logp"] = np.asarray(self._logps(self.policy.reference_params(frozen), batch, frozen))
        info = {
            "reward": _nan_stat(np.nanmean, total_N),
            "reward_std": _nan_stat(np.nanstd, total_N, ddof=1),  # over the step's completions, as TRL
            "frac_reward_zero_std": float(np.mean(zero_std_N)),
            "completions/mean_length": float(np.mean([len(c) for c in completion_ids])),
            "completions/clipped_ratio": float(np.mean(cut_N)),
        }
        kept_N = ~np.isnan(total_N)  # a dropped group (its environment failed) has no reward: not counted
        for k, name in enumerate(self.names):
            info[f"rewards/{name}/mean"] = _nan_stat(np.nanmean, per_NK[kept_N, k])
            info[f"rewards/{name}/std"] = _nan_stat(np.nanstd, per_NK[kept_N, k], ddof=1)
        info["rollout_time"] = time.perf_counter() - t0
        return batch, {**info, **episodes, **extra}

    def evaluate(self, params, frozen) -> dict:
        """Mean reward of one completion sampled (fixed key) for each of the first eval_prompts
        held-out prompts: val_reward and val_rewards/<name> per function."""
        if self.pipeline is not None:  # the engine is the rollout thread's
            return self.pipeline.call(self._evaluate, params, frozen)
        with self.local.scope(params, frozen) as (params, frozen):
            return self._evaluate(params, frozen)

    def _evaluate(self, params, frozen) -> dict:
        rows = self.data.splits["val"][: self.eval_prompts]
        if not rows:
            return {}
        _, completion_ids, texts = self.sample(params, frozen, rows, 1, rollout_seed(self.seed, -1, 0))
        total_N, per_NK = self.score(rows, 1, texts, completion_ids)
        out = {"val_reward": _nan_stat(np.nanmean, total_N)}
        kept_N = ~np.isnan(total_N)
        out.update(
            {f"val_rewards/{n}": _nan_stat(np.nanmean, per_NK[kept_N, k]) for k, n in enumerate(self.names)}
        )
        return out


def _nan_stat(stat, x, **kw) -> float:
    """stat over x's numbers; NaN (logged as null) when there are none, without numpy's warning."""
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stat(x, **kw)) if np.any(~np.isnan(x)) else math.nan
