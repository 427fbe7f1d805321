"""Every training option, one comment each; recipes start from `get_config()` and change a few.

python train.py --config configs/default.py --config.data.dir=data/shakespeare_char
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "gpt"  # gpt (decoder-only) | seq2seq (encoder-decoder Transformer)
    c.model.vocab_size = 0  # 0 = take it from the dataset's meta.json
    c.model.block_size = 1024  # context length T of every training window
    c.model.n_layer = 12  # transformer blocks
    c.model.n_head = 12  # attention heads per block
    c.model.n_embd = 768  # model width D
    c.model.dropout = 0.0  # embedding, attention and residual dropout (training only)
    c.model.embd_dropout = -1.0  # dropout on token + position embeddings; -1 = model.dropout
    c.model.attn_dropout = -1.0  # dropout on the attention weights; -1 = model.dropout
    c.model.resid_dropout = -1.0  # dropout on each residual branch's output; -1 = model.dropout
    c.model.bias = True  # biases in Linear layers and LayerNorms
    c.model.pos_embedding = "learned"  # learned | sinusoidal
    c.model.activation = "gelu"  # gelu (tanh approx.) | gelu_exact | relu
    c.model.tie_embeddings = True  # the LM head reuses the token embedding
    c.model.dtype = "float32"  # compute dtype; bfloat16 on TPU/GPU (params stay param_dtype)
    c.model.param_dtype = "float32"  # parameter and optimizer-state dtype
    c.model.pad_vocab_multiple = 64  # round embedding rows up to a multiple of this (faster matmuls)
    c.model.attention_impl = "auto"  # auto | xla | cudnn (cuDNN flash attention on NVIDIA GPUs)
    c.model.scan_layers = False  # nn.scan over blocks: compile time independent of depth
    c.model.remat = "none"  # none | full | dots | dots_no_batch (activation checkpointing)

    c.data = ml_collections.ConfigDict()
    c.data.dir = "data/shakespeare_char"  # folder with train.bin, val.bin, meta.json (flaxgpt.prepare)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 6e-4  # peak learning rate
    c.optim.min_lr = 6e-5  # learning rate at the end of the cosine decay
    c.optim.schedule = "cosine"  # cosine (warmup then cosine to min_lr) | constant | rsqrt
    c.optim.warmup_steps = 2000  # linear warmup steps
    c.optim.decay_steps = 0  # step where the cosine reaches min_lr; 0 = max_iters
    c.optim.weight_decay = 0.1  # AdamW decoupled weight decay, on >= 2-D weights only
    c.optim.beta1 = 0.9  # AdamW first-moment decay
    c.optim.beta2 = 0.95  # AdamW second-moment decay
    c.optim.eps = 1e-8  # AdamW epsilon
    c.optim.grad_clip = 1.0  # clip gradients to this global norm; 0 = off
    c.optim.label_smoothing = 0.0  # cross-entropy label smoothing

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
