"""Every training option, one comment each; recipes start from `get_config()` and change a few.

python train.py --config configs/default.py --config.data.dir=data/shakespeare_char
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "gpt"  # gpt (decoder-only) | seq2seq (encoder-decoder Transformer, configs/reverse.py)
    # the other model fields are flaxgpt.models.gpt.GPTConfig's own, same names
    c.model.vocab_size = 0  # 0 = take it from the dataset's meta.json
    c.model.block_size = 1024  # context length T of every training window
    c.model.n_layer = 12  # transformer blocks
    c.model.n_head = 12  # attention heads per block
    c.model.n_embd = 768  # model width D
    c.model.pos_embedding = "learned"  # learned | sinusoidal | rope (rotary, Llama)
    c.model.sinusoid_layout = "interleaved"  # interleaved (the paper's sin, cos, ...) | halves (older runs)
    c.model.activation = "gelu"  # gelu (tanh approx.) | gelu_exact | relu | silu | relu2 (relu(x)^2)
    c.model.tie_embeddings = True  # the LM head reuses the token embedding
    c.model.bias = True  # biases in Linear layers and LayerNorms
    c.model.qkv_bias = True  # bias of the fused qkv projection c_attn (bias=False leaves it on)
    c.model.dropout = 0.0  # the rate of the three dropouts below that are -1 (training only)
    c.model.embd_dropout = -1.0  # dropout on token + position embeddings; -1 = model.dropout
    c.model.attn_dropout = -1.0  # dropout on the attention weights; -1 = model.dropout
    c.model.resid_dropout = -1.0  # dropout on each residual branch's output; -1 = model.dropout
    c.model.layer_norm_epsilon = 1e-5  # LayerNorm's epsilon (GPT-2's)
    c.model.dtype = "float32"  # compute dtype; bfloat16 on TPU/GPU (params stay param_dtype)
    c.model.param_dtype = "float32"  # parameter and optimizer-state dtype
    c.model.pad_vocab_multiple = 64  # round embedding rows up to a multiple of this (faster matmuls)
    c.model.attention_impl = "auto"  # auto | xla | cudnn | pallas (see flaxgpt.models.layers.attend)
    c.model.scan_layers = False  # nn.scan over blocks: compile time independent of depth
    c.model.remat = (
        "none"  # none | full | dots | dots_no_batch | offload_dots_no_batch (flaxgpt/models/gpt.py)
    )
    # modern decoders (Llama, Mistral, Qwen2: see README); the values here are GPT-2's
    c.model.norm = "layernorm"  # layernorm | rmsnorm (layer_norm_epsilon is its epsilon)
    c.model.glu = False  # gated MLP act(x W_gate) * (x W_up); with activation=silu: SwiGLU
    c.model.mlp_hidden = 0  # the MLP's hidden size; 0 = 4 * n_embd
    c.model.n_kv_head = 0  # key/value heads: 0 = n_head, 1 = multi-query, else grouped-query
    c.model.qk_norm = False  # normalise each head's queries and keys before attention
    c.model.rope_theta = 10000.0  # pos_embedding=rope: base of the rotary frequencies
    c.model.rope_scaling = "none"  # none | llama3 (Llama 3.1's long-context frequency scaling)
    c.model.rope_factor = 1.0  # llama3: context extension factor
    c.model.rope_low_freq_factor = 1.0  # llama3: wavelengths above original_max_len / this are scaled
    c.model.rope_high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept
    c.model.rope_original_max_len = 8192  # llama3: the pretraining context
    c.model.sliding_window = 0  # each query sees the last sliding_window keys (Mistral); 0 = all
    c.model.logit_softcap = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2); 0 = off
    # the modded-nanogpt speedrun's (README "The modern recipe")
    c.model.zero_init_proj = False  # attention/MLP output projections and an untied lm_head start at 0
    c.model.unet_skips = False  # U-net skips: block L-1-i also gets block i's output (learned weight)
    c.model.value_embeds = 0  # N token tables mixed into the values of the first and last N blocks

    c.data = ml_collections.ConfigDict()
    c.data.dir = "data/shakespeare_char"  # folder with train.bin, val.bin, meta.json (flaxgpt.data.prepare)
    c.data.format = "tokens"  # tokens (train.bin/val.bin, random windows) | shards (speedrun *.bin, in order)
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
    c.mesh.cpu_devices = 0  # CPU: split the host into this many devices; 0 = one per core (if batch divides)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # host:port of process 0 for multi-host GPU; "" = auto/none
    c.distributed.num_processes = 0  # processes in a multi-host run; 0 = auto
    c.distributed.process_id = -1  # this process's index; -1 = auto

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
    # gpt2* or a HF GPT-2 directory: fine-tune from it (resuming that fine-tune's own checkpoints)
    c.init_from = "auto"  # auto (resume if out_dir has a checkpoint, else fresh) | resume | scratch | gpt2*
    c.peak_flops = 0.0  # per-device peak FLOP/s for MFU; 0 = guess from the device kind
    c.tensorboard = True  # write TensorBoard events when tensorboardX is installed
    c.plot = True  # metrics.png in out_dir at each eval (needs matplotlib)

    c.lock()
    return c
