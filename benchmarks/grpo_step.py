"""A GRPO step (rollout and update): flaxgpt's trainer (the online GRPO task, train.py's path) against
TRL 1.16's GRPOTrainer, same model, prompts and shapes, this CPU, side by side with the alternating
harness.

    python benchmarks/grpo_step.py                          # 4 rounds: engine, generate, TRL
    python benchmarks/grpo_step.py --quick                  # a smoke run (< 2 min): tiny, each side once
    python benchmarks/grpo_step.py --rollouts engine        # one flaxgpt side only
    python benchmarks/grpo_step.py --rollouts engine --off_policy_steps 1   # flaxgpt's rollouts async
    python benchmarks/grpo_step.py --rollouts engine,async  # the synchronous engine and the async row
    python benchmarks/grpo_step.py --multi_turn             # episodes: grpo.env vs TRL's rollout_func
    python benchmarks/grpo_step.py --grad_accum 4           # both updates in 4 micro-batches

One random Llama (--layers x --dim, a byte-level BPE trained here) saved with transformers is the
policy's start on both sides; the prompts are arithmetic questions of one token length ({prompt,
answer}). Both sides: float32, LoRA r --lora_rank (alpha 2r, no dropout) on every linear layer of
the blocks, --prompts prompts x G --generations completions a step of exactly --completion tokens
(the end-of-sequence token's output row is zeroed and the others scaled up, so its probability is
< 1e-10 a token and no completion ends early: both sides report the completions' mean length),
temperature 1, top-p 1, no top-k, beta 0, one iteration (no old log-probs kept), the dapo loss,
group-scaled rewards, AdamW lr 1e-5 constant, no weight decay, clipping at norm 1, the step's
completions in --grad_accum micro-batches (flaxgpt's grad_accum; TRL's per_device_train_batch_size
N / grad_accum with gradient_accumulation_steps grad_accum: one generation batch a step on both).
The reward: the shipped `answer` and `length=160` on flaxgpt's side, the same two in Python on TRL's.
flaxgpt: configs/grpo_toy.py turned to the model (trainer.train's path: flaxgpt prepare --dataset
prompts, a Trainer, its rollout then its jitted step), grpo.rollout = engine and = generate as two
sides; a step's wall time is between two `after_step` hooks (each after the step's update finished),
with the run's logged rollout_time / update_time beside it; its rollouts decode the adapters merged into
the float32 base (grpo.merge_lora, the default: once a step; --merge_lora 0 decodes them unmerged, as
TRL's generate over the PEFT model does); the synchronous engine side's rollouts and the multi-turn
episodes by --engine_replicas engines (grpo.engine_replicas, 2 by default: on this 2-core CPU's one
device, one decoding on each core; --engine_replicas 1: one engine), the others' by one.
TRL: GRPOTrainer(use_cpu=True), a step's wall time between a callback's on_step_begin and
on_step_end (its generation, rewards and update), its rollout the time in
`_generate_and_score_completions` (generation, rewards, advantages) and its update the rest of the step.
Each side times --steps steps after --warmup untimed ones (compiles) and reports their median.
Figures: seconds a step, a rollout and an update (TRL / flaxgpt: > 1 means flaxgpt is faster).
--multi_turn: the multi-turn row instead. Each completion is an episode of `Turns` (below, plain
Python, the same object on both sides): TURNS replies, each ended by the end-of-sequence token (the
model is made so that about one token in 16 is EOS), each but the last answered by the same short
observation, whose tokens are masked out of the loss; the reward is 1 a reply that holds the
answer; --completion bounds replies and observations together (completion_len: TRL's counts the
model's tokens, flaxgpt's all, its model_len the model's). flaxgpt:
grpo.env = grpo_step:Turns (train/grpo_episodes.py: the engine's rows kept between turns, an
observation inserted as prompt tokens, no re-prefill). TRL 1.16 offers two ways: `environment_factory`
(an environment's methods as tools, called through the chat template's tool-call format: this
tokenizer has no chat template) and `rollout_func` (a user function returning prompt_ids,
completion_ids, logprobs and `env_mask`, 0 on the environment's tokens); the row uses rollout_func,
turn by turn with TRL's own generation (GRPOTrainer._generate_single_turn, what its tool loop calls:
each turn re-reads the whole history, as the tool loop does).
--off_policy_steps k > 0 runs flaxgpt's sides with grpo.off_policy_steps = k (docs/grpo.md: the
rollout of step n + k on a thread while update n runs; TRL's side stays synchronous, so the two no
longer do the same work: the step is then the figure to read, rollout_s the rollout thread's time).
The `async` side (in the default --rollouts) is that for k = 1 beside the synchronous sides: an extra
row, not a replacement (its algorithm differs: each step trains on completions one update old).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)

LR = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LENGTH = 160  # the length reward's limit, characters
WORDS = "what is plus minus times the answer of one two three four five six seven eight nine".split()
EOS_TEXT = "<|eot_id|>"
TURNS = 3  # the multi-turn row: replies an episode
OBSERVATION = " the answer is"  # the environment's answer to every reply but the last
# the multi-turn row's model: EOS's head weight on feature 0 (1 in every embedding): EOS's logit about
# 16.3 against the other tokens' logsumexp 19.0 +- 0.6 (measured with torch), one token in 16 ends a reply
EOS_WEIGHT = 3.5


class Turns:
    """The multi-turn row's environment (flaxgpt.envs.base's interface, without importing it: TRL's
    side runs it as it is): TURNS replies, each but the last answered by OBSERVATION, reward 1 a reply
    that holds the answer."""

    max_turns, stop = TURNS, None  # a reply ends at its end of sequence

    def reset(self, prompt, answer="", **_):
        self.answer = str(answer)

    def step(self, action):
        return OBSERVATION, float(self.answer in action), False


def questions(tok, n: int) -> list[dict]:
    """n arithmetic prompts of one token length (TRL left-pads a batch; equal lengths on both sides)."""
    import random

    rng = random.Random(0)
    out, length = [], None
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"what is {a} plus {b}? the answer is"
        ids = tok.encode(prompt).ids
        if length is None:
            length = len(ids)
        if len(ids) == length:
            out.append({"prompt": prompt, "answer": str(a + b)})
    return out


def make_model(directory: Path, layers: int, dim: int, vocab: int, n_prompts: int, eos_weight=0.0) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<unk>", "<|begin_of_text|>", EOS_TEXT]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = " ".join(WORDS * 20) + " " + " ".join(str(i) for i in range(200))
    tok.train_from_iterator([corpus], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": special[1], "eos_token": EOS_TEXT, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    eos = tok.token_to_id(EOS_TEXT)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 16 * 16,
        num_hidden_layers=layers, num_attention_heads=dim // 64, num_key_value_heads=dim // 64,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=eos,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of std ~6 (RMS-normed hidden x rows of std 0.4), EOS's always 0
        model.lm_head.weight.normal_(0.0, 0.4 * 16 / dim**0.5)
        model.lm_head.weight[eos] = 0.0
        if eos_weight:  # multi-turn: feature 0 of every embedding 1, so the final norm's feature 0 is
            # about the same at every position (EOS's logit: std 0.12 per unit weight) and only EOS reads it
            model.model.embed_tokens.weight[:, 0] = 1.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[eos, 0] = eos_weight
    model.save_pretrained(directory)
    rows = questions(tok, n_prompts)
    (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def timed_steps(ends: dict[int, float], warmup: int, last: int) -> list[float]:
    return [ends[s] - ends[s - 1] for s in range(warmup + 1, last + 1)]


def run_flaxgpt(a) -> dict:

    from configs import grpo_toy
    from flaxgpt.data import prepare
    from flaxgpt.train import trainer as trainer_lib
    from flaxgpt.train.config_check import check

    model, data = Path(a.dir), Path(a.dir) / f"data_{os.getpid()}"
    flags = ["--dataset", "prompts", "--input", model / "prompts.jsonl", "--hf_dir", model, "--out_dir", data]
    prepare.main([*map(str, flags), "--val_fraction", "0.01"])
    prompt_len = len(json.loads((data / "train.prompts.jsonl").read_text().splitlines()[0])["ids"])
    c = grpo_toy.get_config()
    c.init_from, c.data.dir, c.out_dir = str(model), str(data), str(model / f"run_{os.getpid()}")
    c.model.block_size = -(-(prompt_len + a.completion) // 16) * 16
    c.model.dtype, c.model.remat, c.model.scan_layers = "float32", "none", False
    c.grpo.num_generations, c.grpo.max_completion_length = a.generations, a.completion
    rollout = "engine" if a.side in ("flaxgpt_episodes", "flaxgpt_async") else a.side.split("_")[1]
    c.grpo.rollout, c.grpo.temperature, c.grpo.top_p, c.grpo.beta = rollout, 1.0, 1.0, 0.0
    c.grpo.num_iterations, c.grpo.loss_type, c.grpo.scale_rewards = 1, "dapo", "group"
    c.grpo.off_policy_steps = max(a.off_policy_steps, 1) if a.side == "flaxgpt_async" else a.off_policy_steps
    c.grpo.merge_lora = bool(a.merge_lora)
    # replicas: the synchronous engine side's and the episodes' (the async one's rollout thread shares
    # the cores with the update already; generate has no engine)
    c.grpo.engine_replicas = a.engine_replicas if a.side in ("flaxgpt_engine", "flaxgpt_episodes") else 1
    c.mesh.cpu_devices = a.cpu_devices
    c.grpo.reward_funcs, c.grpo.reward_weights, c.grpo.eval_prompts = ("answer", f"length={LENGTH}"), (), 0
    if a.side == "flaxgpt_episodes":  # the environment's reward (config_check wants a reward function)
        c.grpo.env, c.grpo.reward_funcs = "grpo_step:Turns", ("grpo_step:no_reward",)
    c.batch_size, c.grad_accum = a.prompts * a.generations, a.grad_accum
    # one step more: the trainer samples step k + 1's completions before after_step(k + 1), so the
    # interval between after_step(k) and after_step(k + 1) is update k + rollout k + 1, except the last
    # one (no rollout after the last update), which is left out
    c.max_iters, c.eval_interval, c.eval_iters, c.log_interval = a.warmup + a.steps + 1, 10**6, 1, 1
    c.ckpt_interval, c.tensorboard, c.plot = 0, False, False
    c.lora.rank, c.lora.alpha, c.lora.base_dtype = a.lora_rank, 2.0 * a.lora_rank, "float32"
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = LR, "constant", 0
    c.optim.weight_decay, c.optim.grad_clip = 0.0, 1.0
    check(c)
    trainer_lib.start_process(c)  # as `train` does
    ends = {}

    class Timed(trainer_lib.Trainer):
        def after_step(self, step, state):  # online: the step's update has finished (block_until_ready)
            ends[step] = time.perf_counter()

    t = Timed(c, print_fn=lambda *_: None)
    t.run(t.init_state())
    t.close()
    logged = [json.loads(x) for x in (Path(c.out_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x for x in logged if "rollout_time" in x}  # logged step k: rollout and update k - 1
    last = a.warmup + a.steps
    median = lambda k, first: statistics.median(steps[s][k] for s in range(first, first + a.steps))  # noqa: E731
    return {
        "step_s": statistics.median(timed_steps(ends, a.warmup, last)),
        "rollout_s": median("rollout_time", a.warmup + 2), "update_s": median("update_time", a.warmup + 1),
        "completion_len": median("completions/mean_length", a.warmup + 1), "prompt_len": prompt_len,
        "model_len": median("completion_length", a.warmup + 1),  # the loss mask's: the model's tokens
        "reward": median("reward", a.warmup + 1), "devices": len(t.mesh.devices.flat),
    }  # fmt: skip


def trl_reward(completions, answer, **_):
    """flaxgpt's `answer` + `length=LENGTH` (flaxgpt/train/rewards.py), for TRL's text completions."""
    out = []
    for text, want in zip(completions, answer, strict=True):
        found = re.findall(r"####\s*(\S+)", text)
        right = 1.0 if found and found[-1].strip() == want else 0.0
        out.append(right - min(1.0, max(0, len(text.strip()) - LENGTH) / LENGTH))
    return out


def trl_episodes(prompts, trainer, answers: dict, budget: int) -> dict:
    """TRL's rollout_func for the multi-turn row: every episode's next reply by TRL's own generation
    (left-padded histories, one batch a turn), cut after its first EOS and to its budget, then Turns'
    observation appended (env_mask 0) while the episode goes on (the rules of train/grpo_episodes.py)."""
    tok = trainer.processing_class
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    n = len(prompts)
    envs = [Turns() for _ in range(n)]
    for env, prompt in zip(envs, prompts, strict=True):
        env.reset(prompt, answers[prompt])
    ids, mask, reward, turns = [[] for _ in range(n)], [[] for _ in range(n)], [0.0] * n, [0] * n
    live, eos = list(range(n)), trainer.eos_token_ids
    while live:
        trainer.generation_config.max_new_tokens = max(budget - len(ids[i]) for i in live)
        replies, _ = trainer._generate_single_turn([prompt_ids[i] + ids[i] for i in live], None, {}, 1)
        going = []
        for i, reply in zip(live, replies, strict=True):
            reply = reply[: budget - len(ids[i])]
            ids[i], mask[i] = ids[i] + reply, mask[i] + [1] * len(reply)
            if not reply or reply[-1] not in eos:
                continue  # its budget ran out inside a reply: truncated
            turns[i] += 1
            obs, r, done = envs[i].step(tok.decode(reply[:-1]))
            reward[i] += r
            obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
            if done or turns[i] >= TURNS or budget - len(ids[i]) - len(obs_ids) < 1:
                continue
            ids[i], mask[i] = ids[i] + obs_ids, mask[i] + [0] * len(obs_ids)
            going.append(i)
        live = going
    trainer.generation_config.max_new_tokens = budget
    return {"prompt_ids": prompt_ids, "completion_ids": ids, "logprobs": None, "env_mask": mask,
            "env_reward": reward}  # fmt: skip


def trl_env_reward(completions, env_reward, **_):
    return list(env_reward)


def no_reward(completions, **_):
    """flaxgpt's multi-turn side: 0 on top of the environment's reward (as TRL's side scores)."""
    return [0.0] * len(completions)


def run_trl(a) -> dict:
    import peft
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model_dir = Path(a.dir)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    rows = [json.loads(x) for x in (model_dir / "prompts.jsonl").read_text().splitlines()]
    n = a.prompts * a.generations
    args = GRPOConfig(  # a step: one generation batch of n completions, in grad_accum micro-batches
        output_dir=str(model_dir / f"trl_{os.getpid()}"), per_device_train_batch_size=n // a.grad_accum,
        gradient_accumulation_steps=a.grad_accum,
        num_generations=a.generations, max_completion_length=a.completion, max_steps=a.warmup + a.steps,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo",
        scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, bf16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    lora = peft.LoraConfig(
        r=a.lora_rank, lora_alpha=2.0 * a.lora_rank, lora_dropout=0.0, target_modules=TARGETS
    )
    begins, ends, logged, generation = {}, {}, [], {}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begins[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            ends[state.global_step] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            logged.append(dict(logs or {}))

    class Timed(GRPOTrainer):  # its rollout (generation and rewards) timed apart from the update
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generation[self.state.global_step + 1] = time.perf_counter() - t0
            return out

    rewards, episodes = trl_reward, {}
    if a.side == "trl_episodes":  # the multi-turn row: rollout_func, the environment's reward
        answers = {r["prompt"]: r["answer"] for r in rows}
        episodes = {"rollout_func": lambda prompts, t: trl_episodes(prompts, t, answers, a.completion)}
        rewards = trl_env_reward
    trainer = Timed(
        model=str(model_dir), reward_funcs=rewards, args=args, processing_class=tok,
        train_dataset=Dataset.from_list(rows), peft_config=lora, callbacks=[Timer()], **episodes,
    )  # fmt: skip
    trainer.train()
    last = a.warmup + a.steps
    timed = range(a.warmup + 1, last + 1)
    steps = [ends[s] - begins[s] for s in timed]
    lengths = [x["completions/mean_length"] for x in logged if "completions/mean_length" in x]
    prompt_len = len(tok(rows[0]["prompt"], add_special_tokens=False)["input_ids"])
    return {
        "step_s": statistics.median(steps), "rollout_s": statistics.median(generation[s] for s in timed),
        "update_s": statistics.median(ends[s] - begins[s] - generation[s] for s in timed),
        "completion_len": statistics.median(lengths[a.warmup :]),
        "prompt_len": prompt_len, "threads": torch.get_num_threads(),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_arguments(p)
    p.add_argument("--steps", type=int, default=3, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiles)")
    p.add_argument("--prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--generations", type=int, default=8, help="G: completions a prompt")
    p.add_argument("--completion", type=int, default=64, help="tokens a completion (exactly)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches an update (both sides)")
    p.add_argument(
        "--rollouts", default="engine,generate,async",
        help="flaxgpt sides: engine, generate, async (engine rollouts, grpo.off_policy_steps >= 1)",
    )  # fmt: skip
    p.add_argument("--off_policy_steps", type=int, default=0, help="flaxgpt's grpo.off_policy_steps")
    p.add_argument("--merge_lora", type=int, default=1, choices=(0, 1), help="flaxgpt's grpo.merge_lora")
    p.add_argument("--cpu_devices", type=int, default=1, help="flaxgpt's mesh.cpu_devices")
    # this 2-core CPU's fastest synchronous step: an engine a core (one CPU device, two threads)
    p.add_argument(
        "--engine_replicas",
        type=int,
        default=2,
        help="grpo.engine_replicas of the synchronous engine and episodes sides",
    )
    p.add_argument("--multi_turn", action="store_true", help="the multi-turn row (episodes of Turns)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 layers x 128, 8-token completions")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the TRL side")
    sides = ["flaxgpt_engine", "flaxgpt_generate", "flaxgpt_async", "flaxgpt_episodes", "trl", "trl_episodes"]
    p.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.grad_accum < 1 or (a.prompts * a.generations) % a.grad_accum:
        p.error(f"--grad_accum {a.grad_accum} must divide the step's {a.prompts * a.generations} completions")
    if a.side:
        return harness.print_result((run_trl if a.side.startswith("trl") else run_flaxgpt)(a))
    if a.quick:  # each side once, no harness rounds (at least 4 of them would not fit 2 minutes)
        a.layers, a.dim, a.completion, a.steps, a.warmup = 2, 128, 24 if a.multi_turn else 8, 1, 1
        a.rollouts = a.rollouts if a.rollouts != "engine,generate,async" else "engine"
    keep = ["--steps", a.steps, "--warmup", a.warmup, "--prompts", a.prompts, "--generations", a.generations,
            "--completion", a.completion, "--lora_rank", a.lora_rank, "--grad_accum", a.grad_accum,
            "--off_policy_steps", a.off_policy_steps, "--merge_lora", a.merge_lora,
            "--engine_replicas", a.engine_replicas, "--cpu_devices", a.cpu_devices]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        eos_weight = EOS_WEIGHT if a.multi_turn else 0.0
        make_model(Path(tmp), a.layers, a.dim, a.vocab, 64 * a.prompts, eos_weight)
        args = [__file__, *map(str, keep), "--dir", tmp, "--side"]
        env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        ours = [f"flaxgpt_{r}" for r in a.rollouts.split(",")]
        theirs = "trl"
        if a.multi_turn:
            ours, theirs = ["flaxgpt_episodes"], "trl_episodes"
        sides = [harness.Side(s, [sys.executable, *args, s], env=env) for s in ours]
        sides.append(harness.Side(theirs, [a.torch_python, *args, theirs], env=env))
        what = (
            f"Llama {a.layers} x {a.dim}, {a.prompts} prompts x G {a.generations}, "
            f"{a.completion} tokens, LoRA r {a.lora_rank}"
            + (f", {TURNS}-turn episodes" if a.multi_turn else "")
        )
        figures = [
            harness.Figure(f"{what}: s/{part} ({s})", s, f"{part}_s", theirs, f"{part}_s", False)
            for part in ("step", "rollout", "update")
            for s in ours
        ]
        if a.quick:
            got = {s.name: harness.run_side(s, 0) for s in sides}
            for f in figures:
                print(f"{f.label}: {f.ratio(got[f.side][f.key], got[f.ref][f.ref_key]):.2f}x, {got}")
            return
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(report.table())
    print()
    for r, results in enumerate(report.results):
        print(f"round {r + 1}: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in results.items()))


if __name__ == "__main__":
    main()
