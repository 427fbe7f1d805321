"""GRPO against TRL 1.16's GRPOTrainer (torch, CPU, float32) on a tiny random Llama: both fed the same
prompts, completions and rewards (TRL's generation replaced by the fixed completions, so TRL's own
code computes the advantages, the masks, the old and the reference log-probs). Per-token log-probs,
advantages, the loss, the metrics and the parameter change of plain SGD steps (two with
num_iterations = 2: the old policy's log-probs kept) for each loss type and option. Nothing is
downloaded."""

import dataclasses
import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flaxgpt.hf import families  # noqa: E402
from flaxgpt.hf import peft as hf_peft  # noqa: E402
from flaxgpt.hf.pretrained import load_pretrained  # noqa: E402
from flaxgpt.train import grpo_task  # noqa: E402
from flaxgpt.train.policy import Frozen, FullPolicy, LoraPolicy  # noqa: E402
from tests.data.test_chat import make_chat_dir  # noqa: E402
from tests.hf.test_llama import make_hf_model  # noqa: E402

LR = 0.5  # plain SGD: a parameter's change is -LR * its gradient
G, C = 3, 6  # completions a prompt, completion tokens at most (TRL's max_completion_length)
PROMPTS = [[20, 21, 22, 23], [30, 31, 32, 33]]  # equal lengths: TRL left-pads, positions would shift
EOS = 2  # make_chat_dir's <|eot_id|>
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def completions():
    """G completions a prompt: some end with EOS, some hit C tokens (truncated), lengths differ."""
    return [[40, 41, EOS], [42, 43, 44, 45, 46, 47], [48, EOS],
            [50, 51, 52, 53, 54, 55], [56, EOS], [57, 58, 59, 60, EOS]]  # fmt: skip


REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 0.25]

CASES = {  # name -> TRL GRPOConfig options (ours: the same names); *_iter2: a second step's ratios != 1
    "grpo_entropy_quantile_temperature": dict(loss_type="grpo", top_entropy_quantile=0.5, temperature=0.7),
    "dr_grpo_batch_truncated": dict(
        loss_type="dr_grpo", scale_rewards="batch", mask_truncated_completions=True
    ),
    "dapo_none_iter2_delta": dict(loss_type="dapo", scale_rewards="none", num_iterations=2, delta=1.002),
    "bnpo_beta_iter2_clip": dict(
        loss_type="bnpo", num_iterations=2, epsilon=0.002, epsilon_high=0.004, beta=0.1
    ),
    "gspo_beta_iter2_clip": dict(
        loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, epsilon=3e-4, beta=0.04
    ),  # fmt: skip
    "cispo_iter2": dict(loss_type="cispo", num_iterations=2, epsilon_high=1.001),
    "sapo_iter2": dict(loss_type="sapo", num_iterations=2),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "lora_dapo_beta_iter2": dict(
        loss_type="dapo", beta=0.1, num_iterations=2, lora_rank=4
    ),  # ref: adapters off
}
OURS = {f.name for f in dataclasses.fields(grpo_task.GRPOOptions)}
METRICS = {"kl": "kl", "entropy": "entropy", "clip_low": "clip_ratio/low_mean",
           "clip_high": "clip_ratio/high_mean", "clip_region": "clip_ratio/region_mean"}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_grpo")
    make_hf_model("llama", str(directory))
    make_chat_dir(directory, None)
    return directory


def trl_side(directory, tmp_path, options, rank):
    """TRL's per-token log-probs, inputs, loss and metrics, and the trained tensors, before and after
    each SGD step (num_iterations of them on the same completions); LoRA: PEFT's fresh adapter
    (random A, B = 0) saved to tmp_path / "adapter", our start too."""
    import peft
    import torch
    import transformers

    # the reference itself: installed by the dev extra (CI); an accelerator image without it skips
    pytest.importorskip("trl", reason="TRL, the reference, is not installed (pip install -e '.[dev]')")
    pytest.importorskip("datasets", reason="datasets (TRL's input) is not installed")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    tok.pad_token = tok.eos_token
    n_iter = options.get("num_iterations", 1)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(REWARDS), num_generations=G,
        max_completion_length=C, report_to="none", use_cpu=True, bf16=False, learning_rate=LR,
        save_strategy="no", seed=0, **options,
    )  # fmt: skip
    table = {tuple(c): r for c, r in zip(completions(), REWARDS, strict=True)}

    def fixed_reward(prompts, completions, completion_ids, **row):
        return [table[tuple(c)] for c in completion_ids]

    rows = [{"prompt": f"p{i // G}"} for i in range(len(REWARDS))]
    lora = peft.LoraConfig(r=rank, lora_alpha=8.0, target_modules=LLAMA_TARGETS) if rank else None
    trainer = GRPOTrainer(model=model, reward_funcs=fixed_reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows), peft_config=lora)  # fmt: skip
    completion_ids = completions()
    texts = tok.batch_decode(completion_ids)
    prompt_ids = [PROMPTS[i // G] for i in range(len(REWARDS))]
    # the rollout: the fixed completions instead of sampling
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, None)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    if rank:
        model.save_pretrained(str(tmp_path / "adapter"))
    model.train()
    inputs = trainer._generate_and_score_completions(rows)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def trained():  # in Hugging Face's names (PEFT's, less the adapter's name)
        named = model.named_parameters()
        return {k.replace(".default.", "."): v.detach().numpy().copy() for k, v in named if v.requires_grad}

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], torch.ones_like(inputs["completion_mask"])], 1)
    steps = []
    for _ in range(n_iter):
        with torch.no_grad():
            logp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
        before = trained()
        trainer._metrics["train"].clear()
        sgd.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        sgd.step()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        steps.append(
            dict(logp=logp.numpy(), loss=loss.item(), metrics=metrics, before=before, after=trained())
        )
    return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in inputs.items()}, steps


@functools.cache
def logps_program(cfg, temperature, spec):
    """The policy's per-token log-probs, jitted once for the cases that share them (compiles are slow)."""
    objective = grpo_task.GRPOObjective(grpo_task.GRPOOptions(temperature=temperature))
    policy = policy_of(cfg, spec)
    return jax.jit(lambda p, b, frozen: objective.token_logps(policy, p, frozen, b)[0])


def policy_of(cfg, spec):
    """The policy our trainer composes: LoRA's over a float32 base, or full fine-tuning."""
    return FullPolicy(cfg) if spec is None else LoraPolicy(cfg, spec, "float32")


def hf_state(cfg, params, spec, where):
    """The trained tensors in Hugging Face's names: the model's, or PEFT's adapter's."""
    if spec is None:
        llama = families.FAMILIES["llama"]
        return llama.export_state(cfg, jax.tree.map(np.asarray, params), "llama", llama)[1]
    from safetensors.numpy import load_file

    hf_peft.export_adapter(cfg, spec, jax.tree.map(np.asarray, params), str(where))
    return load_file(str(where / "adapter_model.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_trl(model_dir, tmp_path, case):
    options = dict(CASES[case])
    rank = options.pop("lora_rank", 0)
    inputs, trl_steps = trl_side(model_dir, tmp_path, options, rank)
    cfg, params = load_pretrained(str(model_dir))
    spec, base = None, None
    if rank:  # params: TRL's fresh adapters; the frozen base: the model's
        base, (spec, params) = params, hf_peft.load_adapter(str(tmp_path / "adapter"), cfg)
    ours = {k: v for k, v in options.items() if k in OURS}
    opts = grpo_task.GRPOOptions(max_completion_length=C, **ours)
    adv, _ = grpo_task.group_advantages(REWARDS, G, options.get("scale_rewards", "group"))
    prompt_ids = [PROMPTS[i // G] for i in range(len(REWARDS))]
    T = len(PROMPTS[0]) + C
    batch = grpo_task.rollout_batch(prompt_ids, completions(), T, adv)
    if options.get("mask_truncated_completions"):
        cut = grpo_task.truncated(completions(), [EOS])
        assert cut.tolist() == [False, True, False, True, False, False]
        batch["loss_mask"] = batch["loss_mask"] * ~cut[:, None]
    reference = jax.tree.map(jnp.array, params) if opts.beta and not rank else None  # a frozen copy
    frozen, policy = Frozen(base=base, reference=reference), policy_of(cfg, spec)
    objective = grpo_task.GRPOObjective(opts)
    logps = functools.partial(logps_program(cfg, opts.temperature, spec), frozen=frozen)
    if opts.beta:
        batch["ref_logp"] = objective.reference_logps(policy, frozen, batch)
    if options.get("num_iterations", 1) > 1:  # the old policy's: taken once, kept for every iteration
        batch["old_logp"] = logps(params, batch)

    def loss_fn(p, b):
        loss_sum, (weight, sums) = objective.loss(policy, p, frozen, b, None, False)
        return loss_sum / weight, {k: v / weight for k, v in sums.items()}

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    P = len(PROMPTS[0])
    # our row's target j is token j + 1: completion token k is target P - 1 + k
    cols = np.arange(P - 1, P - 1 + C)
    diffs = {"advantages": float(np.abs(adv - inputs["advantages"]).max())}
    mask_NC = inputs["completion_mask"].astype(bool)
    assert np.array_equal(np.asarray(batch["loss_mask"])[:, cols], inputs["completion_mask"])
    for i, trl in enumerate(trl_steps):
        logp = np.asarray(logps(params, batch))[:, cols]
        diffs[f"logp{i}"] = float(np.abs(logp - trl["logp"])[mask_NC].max())
        if "ref_logp" in batch:
            ref = np.asarray(batch["ref_logp"])[:, cols]
            diffs["ref_logp"] = float(np.abs(ref - inputs["ref_per_token_logps"])[mask_NC].max())
        (loss, metrics), grads = grad_fn(params, batch)
        if i and opts.delta:  # the cap binds: a ratio of a negative advantage's token passes delta
            ratio = np.exp(logp - np.asarray(batch["old_logp"])[:, cols])
            assert (ratio[mask_NC & (adv[:, None] < 0)] > opts.delta).any()
        diffs[f"loss{i}"] = abs(float(loss) - trl["loss"])
        for name, trl_name in METRICS.items():
            if name in metrics:
                value = trl["metrics"][trl_name]  # relative for the KL: a big step's is large
                diffs[f"{name}{i}"] = abs(float(metrics[name]) - value) / max(1.0, abs(value))
        new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        p0, p1 = hf_state(cfg, params, spec, tmp_path / "p0"), hf_state(cfg, new, spec, tmp_path / "p1")
        assert set(p1) == set(trl["after"]), sorted(set(p1) ^ set(trl["after"]))[:4]
        moved = {k: np.asarray(p1[k]) - np.asarray(p0[k]) for k in p1}
        diffs[f"step{i}"] = max(
            float(np.abs(moved[k] - (trl["after"][k] - trl["before"][k])).max()) for k in moved
        )
        assert max(np.abs(v).max() for v in moved.values()) > 1e-3  # the step did move them
        params = new
    if case.endswith("clip"):  # the second iteration's ratios leave the clip range
        assert trl_steps[-1]["metrics"]["clip_ratio/region_mean"] > 0
    print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
    tolerance = {"logp": 1e-5, "ref_logp": 1e-5, "advantages": 1e-5}
    bad = {k: v for k, v in diffs.items() if v > tolerance.get(k.rstrip("01"), 1e-4)}
    assert not bad, diffs
