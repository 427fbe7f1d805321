"""flaxgpt aot on a GRPO recipe (configs/grpo_toy.py, tiny): the rollout's engine programs (prefill,
generate for batch_size slots) compile and are reported, over the training mesh's devices, over the
policy's parameters or, with LoRA, the adapters unmerged over a bfloat16 or an int8 base; with the
train step, their memory on each device."""

import dataclasses

from configs import grpo_toy
from flaxgpt.aot import compile as aot
from flaxgpt.aot import report, targets


def toy(**kw):
    c = grpo_toy.get_config()
    c.data.dir = "/nonexistent"  # never read: the vocabulary is the recipe's
    c.model.vocab_size, c.model.n_layer, c.batch_size = 16, 1, 16
    for k, v in kw.items():
        section, _, key = k.rpartition("__")
        (c[section] if section else c)[key] = v
    return c


def test_a_grpo_recipe_reports_its_rollout_programs():
    target = targets.get("cpu")
    assert "rollout" in aot.GROUPS  # flaxgpt aot's default: a GRPO recipe reports its train step and these
    rows, _ = aot.run(toy(), target, ("train", "rollout"), print_fn=lambda *_: None)
    names = ["train", "rollout.prefill", "rollout.generate", "grpo (train + rollouts)"]
    assert [r.program for r in rows] == names
    train, _, full, budget = rows
    assert full.parameters > 0 and full.total > full.parameters and "16 slots" in full.note
    # each phase holds the other's kept state; training on the 8 CPU devices, the engine (over the
    # same 8) holds its own copy of the weights, placed by SERVE_RULES, and its slots split by rows
    assert "over 8 devices" in full.note
    assert train.devices == 8 and budget.devices == 8
    assert budget.total == max(train.total + full.arguments, full.total + train.arguments)
    assert budget.total > max(train.total, full.total) and budget.fits()
    one = report.grpo_budget([dataclasses.replace(train, devices=1), full])  # training on one device
    assert one.total == max(
        train.total + full.arguments - full.parameters, full.total + train.arguments - full.parameters
    )
    over = {"lora__rank": 4, "lora__alpha": 8.0, "lora__base_dtype": "bfloat16"}
    rows, _ = aot.run(toy(**over), target, ("rollout",), print_fn=lambda *_: None)
    assert [r.program for r in rows] == ["rollout.prefill", "rollout.generate"]
    qlora = rows[1]
    assert "bfloat16 base" in qlora.note and qlora.parameters < full.parameters  # bf16 base, float32 adapters
    int8 = toy(**{**over, "lora__base_dtype": "int8"})
    rows, _ = aot.run(int8, target, ("rollout",), print_fn=lambda *_: None)
    assert "int8 base" in rows[1].note and rows[1].parameters < qlora.parameters  # int8 over 8 devices too
    generate_only = toy(grpo__rollout="generate")  # generate's rollouts: no engine program
    assert [
        r.program for r in aot.run(generate_only, target, ("train", "rollout"), print_fn=lambda *_: None)[0]
    ] == ["train"]


def test_the_engine_on_devices_of_its_own():
    """grpo.engine_devices=4 (asynchronous rollouts): the train step over the target's first 4
    devices, the engine's programs over the last 4, each side's memory its own; the generate step's
    note says what crosses each step (the adapters' bytes to every engine device, the rollout rows)."""
    over = {"lora__rank": 4, "lora__alpha": 8.0, "grpo__off_policy_steps": 1, "grpo__engine_devices": 4}
    config = toy(**over)
    rows, mc = aot.run(config, targets.get("cpu"), ("train", "rollout"), print_fn=lambda *_: None)
    assert [r.program for r in rows] == [
        "train",
        "rollout.prefill",
        "rollout.generate",
        "grpo (train | rollouts)",
    ]
    train, _, gen, budget = rows
    assert train.devices == 4 and gen.devices == 4 and "over 4 devices" in gen.note
    # a float32 base: the engine decodes the adapters merged into its copy of the base (grpo.merge_lora),
    # holding both; merge_lora=False decodes the pair (the base and the adapters) instead
    assert "LoRA r 4 merged into a float32 base" in gen.note
    unmerged = aot.run(
        toy(**over, grpo__merge_lora=False), targets.get("cpu"), ("rollout",), print_fn=lambda *_: None
    )
    pair = unmerged[0][1]
    assert "LoRA r 4 over a float32 base" in pair.note and pair.parameters < gen.parameters
    assert budget.devices == 8 and budget.total == max(train.total + train.parameters, gen.total)
    # LoRA r 4 on every linear layer of the one-layer toy: the adapters the trainer holds, sent whole
    adapters = train.parameters  # per trainer device: replicated over the data axis
    T = config.model.block_size
    assert f"LoRA adapters {adapters:,} bytes x 4 to the engine's own 4 devices" in gen.note
    assert f"rollouts back 16 rows x {T} tokens ({16 * T:,} tokens;" in gen.note


def test_engine_replicas_compile_one_replicas_programs():
    """grpo.engine_replicas=2 over the 8 CPU devices: a replica's programs on one device with half
    the slots, the note naming the replicas and the weights pushed whole to the 2 devices that hold
    them; 16 replicas: 2 a device, their 2 x 1 slots together."""
    rows, _ = aot.run(
        toy(grpo__engine_replicas=2), targets.get("cpu"), ("rollout",), print_fn=lambda *_: None
    )
    prefill, gen = rows
    assert gen.devices == 1 and prefill.devices == 1 and "8 slots" in gen.note
    assert "2 replicas over 2 devices, 1 a device" in gen.note and " x 2 to the engine" in gen.note
    many = aot.run(toy(grpo__engine_replicas=16), targets.get("cpu"), ("rollout",), print_fn=lambda *_: None)
    assert "2 slots" in many[0][1].note and "16 replicas over 8 devices, 2 a device" in many[0][1].note
    lora = {"lora__rank": 4, "lora__alpha": 8.0, "grpo__engine_replicas": 2}
    merged = aot.run(toy(**lora), targets.get("cpu"), ("rollout",), print_fn=lambda *_: None)[0][1]
    assert "merged into a float32 base" in merged.note and "each step parameters" in merged.note
    pair = aot.run(
        toy(**lora, grpo__merge_lora=False), targets.get("cpu"), ("rollout",), print_fn=lambda *_: None
    )
    assert "each step LoRA adapters" in pair[0][1].note
