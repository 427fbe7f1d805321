"""Every training option, one comment each; recipes start from `get_config()` and change a few.

python train.py --config configs/default.py --config.data.dir=data/shakespeare_char

Targets: cpu (check: flaxgpt aot --config configs/default.py --target NAME)
"""

import ml_collections

from flaxgpt.models import registry as models


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # kind: gpt (decoder-only) | seq2seq (the encoder-decoder, configs/seq2seq_default.py); the other
    # fields are GPTConfig's own, with its defaults and comments (flaxgpt/models/gpt_config.py), except:
    # vocab_size 0 = take it from the dataset's meta.json; embedding rows padded to a multiple of 64
    # (faster matmuls; the dataclass's 1 keeps imported weights exact)
    c.model = ml_collections.ConfigDict(models.recipe_section("gpt", vocab_size=0, pad_vocab_multiple=64))

    c.data = ml_collections.ConfigDict()
    c.data.dir = "data/shakespeare_char"  # folder with train.bin, val.bin, meta.json (flaxgpt.data.prepare)
    # tokens (train.bin/val.bin, random windows) | shards (speedrun *.bin, in order) | packed (chat SFT)
    # | pairs (DPO preference pairs: flaxgpt prepare --dataset pairs; the `dpo` section below)
    # | prompts (GRPO: flaxgpt prepare --dataset prompts; the `grpo` section below)
    c.data.format = "tokens"
    c.data.align_to_bos = False  # shards: every training window starts at a document's first token
    c.data.val_tokens = 10_485_760  # shards: the fixed val set, the first this many val tokens

    c.optim = ml_collections.ConfigDict()
    c.optim.name = (
        "adamw"  # adamw | muon (Muon on hidden matrices, AdamW on the rest: flaxgpt/train/optim.py)
    )
    c.optim.learning_rate = 6e-4  # peak learning rate (with muon: of norms, biases and scalars)
    c.optim.min_lr = 6e-5  # learning rate at the end of the cosine decay
    c.optim.schedule = "cosine"  # cosine (warmup then cosine to min_lr) | constant | rsqrt | wsd
    c.optim.warmup_steps = 2000  # linear warmup steps
    c.optim.decay_steps = 0  # step where the cosine reaches min_lr; 0 = max_iters
    c.optim.weight_decay = 0.1  # AdamW decoupled weight decay, on >= 2-D weights only
    c.optim.beta1 = 0.9  # AdamW first-moment decay
    c.optim.beta2 = 0.95  # AdamW second-moment decay
    c.optim.eps = 1e-8  # AdamW epsilon
    c.optim.grad_clip = 1.0  # clip gradients to this global norm; 0 = off
    c.optim.label_smoothing = 0.0  # cross-entropy label smoothing
    c.optim.loss_chunk = 0  # GPT: logits computed this many positions at a time (no [B, T, V] fp32); 0 = all
    c.optim.cooldown_frac = 0.0  # wsd schedule: the final fraction of decay_steps that decays linearly
    c.optim.muon_learning_rate = 0.02  # muon: peak learning rate of the hidden 2-D kernels
    c.optim.muon_momentum = 0.95  # muon: momentum of the hidden kernels' gradients
    c.optim.muon_momentum_warmup = 0  # muon: steps over which momentum ramps up to muon_momentum; 0 = off
    c.optim.muon_momentum_start = 0.85  # muon: the momentum at step 0 when muon_momentum_warmup > 0
    c.optim.muon_nesterov = True  # muon: Nesterov momentum (the speedrun's)
    c.optim.muon_ns_steps = 5  # muon: Newton-Schulz iterations orthogonalising each update
    c.optim.muon_weight_decay = 0.0  # muon: decoupled weight decay of the hidden kernels (times lr)
    c.optim.embed_learning_rate = 0.0  # muon: AdamW peak learning rate of wte/wpe; 0 = learning_rate
    c.optim.head_learning_rate = 0.0  # muon: AdamW peak learning rate of an untied lm_head; 0 = learning_rate

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel devices; -1 = all devices left after fsdp
    c.mesh.fsdp = 1  # devices that shard parameters and optimizer state (ZeRO-3 style)
    c.mesh.expert = 1  # mixture of experts: devices that split the experts (expert parallelism)
    c.mesh.cpu_devices = 0  # CPU: split the host into this many devices; 0 = one per core (if batch divides)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # host:port of process 0 for multi-host GPU; "" = auto/none
    c.distributed.num_processes = 0  # processes in a multi-host run; 0 = auto
    c.distributed.process_id = -1  # this process's index; -1 = auto

    # LoRA (flaxgpt/models/lora.py): train low-rank adapters on a frozen pretrained base (init_from)
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0  # adapter rank r; 0 = off (full fine-tuning)
    c.lora.alpha = 16.0  # the adapters' output is scaled by alpha / r
    c.lora.dropout = 0.0  # dropout on each adapted layer's input, adapter path only (training)
    # all-linear | a comma list: q,k,v,o,gate,up,down (Llama family) or qkv,o,up,down (GPT-2)
    c.lora.targets = "all-linear"
    c.lora.base_dtype = "float32"  # the frozen base: float32 | bfloat16 | int8 (QLoRA-style)

    # DPO (data.format = pairs, flaxgpt/train/dpo_task.py): the policy is tuned toward chosen responses
    # against a frozen reference (LoRA: the base with the adapters off; full fine-tuning: a copy)
    c.dpo = ml_collections.ConfigDict()
    c.dpo.beta = 0.1  # how far the policy may move from the reference (TRL's beta; IPO's tau)
    c.dpo.loss = "sigmoid"  # sigmoid (DPO) | ipo (IPO, per-token averaged log-ratios as TRL)
    c.dpo.label_smoothing = 0.0  # sigmoid: conservative DPO, the probability a label is flipped; < 0.5
    c.dpo.reference = ""  # full fine-tuning: the reference's HF directory ("" = init_from's weights)

    # GRPO (data.format = prompts, flaxgpt/train/grpo_online.py): each step samples num_generations
    # completions of batch_size // num_generations prompts from the current weights, scores them with
    # the rewards and trains on the group-normalised advantages. Names and defaults are TRL 1.16's.
    c.grpo = ml_collections.ConfigDict()
    c.grpo.num_generations = 8  # G: completions a prompt (>= 2); batch_size counts completions
    c.grpo.max_completion_length = 256  # sampled tokens a completion at most (prompt + this <= block_size)
    c.grpo.temperature = 1.0  # sampling temperature (log-probs are of the same softened distribution)
    c.grpo.top_p = 1.0  # nucleus sampling of the rollouts; 1 = off
    # who samples: engine (serve.engine, continuous batching; LoRA unmerged, any base) | generate (merged)
    c.grpo.rollout = "engine"
    # how token losses are averaged: dapo | grpo | dr_grpo | bnpo | cispo | sapo | luspo (docs/grpo.md)
    c.grpo.loss_type = "dapo"
    c.grpo.scale_rewards = "group"  # advantages over the group's std | batch (the step's) | none
    c.grpo.epsilon = 0.2  # the ratio's clip range starts at 1 - epsilon
    c.grpo.epsilon_high = -1.0  # ... and ends at 1 + epsilon_high (DAPO's clip-higher); -1 = epsilon
    c.grpo.delta = 0.0  # two-sided clipping: the unclipped ratio capped at delta (> 1); 0 = off
    c.grpo.beta = 0.0  # weight of the k3 KL to the reference (LoRA: the base; else init_from's weights)
    c.grpo.num_iterations = 1  # optimizer steps on each rollout (> 1: the sampling policy's logps kept)
    c.grpo.importance_sampling_level = "token"  # token | sequence (GSPO: one ratio a completion)
    c.grpo.mask_truncated_completions = False  # completions that hit max_completion_length train nothing
    # rewards (flaxgpt/train/rewards.py): answer | format=REGEX | length=N | module:function
    c.grpo.reward_funcs = ("answer",)
    c.grpo.reward_weights = ()  # one weight a reward; () = all 1
    c.grpo.eval_prompts = 64  # held-out (val) prompts sampled once each at an evaluation: val_reward

    c.out_dir = "out"  # run directory: config.json, meta.json, metrics.jsonl, checkpoints
    c.seed = 1337  # parameter init, dropout and batch sampling all derive from it
    c.max_iters = 600000  # optimizer steps
    c.batch_size = 512  # global sequences per optimizer step (all devices, all micro-batches)
    c.grad_accum = 1  # micro-batches per step: each is batch_size // grad_accum sequences
    c.eval_interval = 2000  # evaluate every this many steps (and at the end)
    c.eval_iters = 200  # batches per split in each evaluation
    c.eval_only = False  # evaluate once and exit
    # GPT runs: benchmark tasks scored at evaluations (as `flaxgpt eval`), logged as <task>_<metric>;
    # comma-separated TASK:FILE, TASK hellaswag | lambada | perplexity: "hellaswag:hellaswag_val.jsonl"
    c.eval_tasks = ""
    c.eval_tasks_every = 0  # steps between task evaluations (0 = at every evaluation; and at the end)
    c.eval_tasks_limit = 0  # examples per task (0 = all)
    c.log_interval = 10  # print and record training metrics every this many steps
    c.ckpt_interval = 2000  # save a checkpoint every this many steps (0 = only at the end)
    c.keep_checkpoints = 3  # latest checkpoints kept on disk (oldest deleted first), plus the best val loss
    # resume: error if out_dir has no checkpoint; scratch: refuses an out_dir that has checkpoints;
    # gpt2*, a HF directory or a flaxgpt run directory (its latest checkpoint: SFT -> GRPO / DPO):
    # fine-tune from it (resuming that fine-tune's own checkpoints)
    c.init_from = "auto"  # auto (resume if out_dir has a checkpoint, else fresh) | resume | scratch | gpt2*
    c.peak_flops = 0.0  # per-device peak FLOP/s for MFU; 0 = guess from the device kind
    c.tensorboard = True  # write TensorBoard events when tensorboardX is installed
    c.plot = True  # metrics.png in out_dir at each eval (needs matplotlib)

    c.lock()
    return c
