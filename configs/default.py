"""Every training option, one comment each (the model's and the typed sections' fields where they are
defined); recipes start from `get_config()` and change a few.

python train.py --config configs/default.py --config.data.dir=data/shakespeare_char

Targets: cpu (check: flaxgpt aot --config configs/default.py --target NAME)
"""

import ml_collections

from flaxgpt.models import registry as models
from flaxgpt.train import sections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # kind: gpt (decoder-only) | seq2seq (the encoder-decoder, configs/seq2seq_default.py); the other
    # fields are GPTConfig's own, with its defaults and comments (flaxgpt/models/gpt_config.py), except:
    # vocab_size 0 = take it from the dataset's meta.json; embedding rows padded to a multiple of 64
    # (faster matmuls; the dataclass's 1 keeps imported weights exact)
    c.model = ml_collections.ConfigDict(models.recipe_section("gpt", vocab_size=0, pad_vocab_multiple=64))

    # the data, mesh, lora, dpo and grpo sections are typed (flaxgpt/train/sections.py: each field with its
    # type, default and why): data.dir (prepared by flaxgpt prepare) and data.format (tokens | shards |
    # packed | pairs: DPO | prompts: GRPO) say what the run reads
    c.data = ml_collections.ConfigDict(sections.defaults("data"))

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
    c.optim.loss_impl = "logits"  # logits | fused: linear + cross-entropy over vocab blocks, no [B, T, V]
    c.optim.loss_block = 0  # the fused loss's vocabulary columns per block; 0 = kernels.linear_xent.BLOCK
    c.optim.z_loss = 0.0  # PaLM's z-loss: + this x logsumexp(logits)^2 per token; 0 = off
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

    # data x fsdp x expert x context devices (context: each sequence split, docs/training.md); cpu_devices
    c.mesh = ml_collections.ConfigDict(sections.defaults("mesh"))

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # host:port of process 0 for multi-host GPU; "" = auto/none
    c.distributed.num_processes = 0  # processes in a multi-host run; 0 = auto
    c.distributed.process_id = -1  # this process's index; -1 = auto

    c.lora = ml_collections.ConfigDict(sections.defaults("lora"))  # LoRA adapters: rank > 0 turns them on
    c.dpo = ml_collections.ConfigDict(sections.defaults("dpo"))  # DPO (data.format = pairs)
    c.grpo = ml_collections.ConfigDict(sections.defaults("grpo"))  # GRPO (data.format = prompts), TRL's names

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
