"""Fine-tune a Llama-family model (Llama, Mistral, Qwen2 and 3, Gemma 2 and 3) on your text, export it back.

    flaxgpt prepare --dataset shakespeare --tokenizer path/to/SmolLM2-135M \
        --out_dir data/shakespeare_smollm2
    python train.py --config configs/finetune_llama.py --config.init_from=path/to/SmolLM2-135M
    python sample.py --out_dir out/finetune_llama --start "ROMEO:"
    flaxgpt hf export --out_dir out/finetune_llama --to out/finetune_llama_hf
    # a model that does not fit one device: shard parameters and Adam state over 8 of them
    python train.py --config configs/finetune_llama.py --config.init_from=path/to/Llama-3.2-1B \
        --config.mesh.fsdp=8

`init_from` is a directory with the model's config.json, safetensors (one file, or the index
and its shards) and tokenizer.json; prepare the data with that tokenizer (--tokenizer PATH) so
the ids are the ones the model was trained on. The architecture (layers, heads, grouped-query
key/value heads, RoPE, RMSNorm, SwiGLU ...) comes from the checkpoint; the model fields set
here are the ones it leaves free (dropout, dtypes, layout, block_size up to its context). Gemma's
layers differ (sliding-window and global ones): pass --config.model.scan_layers=False for it.

Targets: v5e-1, h100-1 (check: flaxgpt aot --config configs/finetune_llama.py --target NAME)
"""

from configs import default


def get_config():
    c = default.get_config()
    c.init_from = "path/to/SmolLM2-135M"  # a Hugging Face Llama / Mistral / Qwen2 directory
    c.out_dir = "out/finetune_llama"
    c.data.dir = "data/shakespeare_smollm2"  # prepared with --tokenizer PATH (the model's tokenizer.json)
    c.model.block_size = 1024  # training window; at most the model's max_position_embeddings
    c.model.dropout = 0.0  # Llama-family models are trained without dropout
    c.model.dtype = "bfloat16"  # bf16 matmuls, float32 parameters (use float32 on CPU)
    c.model.pad_vocab_multiple = 64  # Llama-family vocabularies already are multiples of 64
    c.model.scan_layers = True  # one compiled block: 16-30 layers compile in seconds
    c.model.remat = "dots"  # keep the matmul outputs, recompute the rest: long windows fit
    c.batch_size = 16  # sequences per step (16 x 1024 = 16,384 tokens)
    c.grad_accum = 2  # micro-batches of 8 sequences; raise it if memory runs out
    c.mesh.cpu_devices = 1  # on a CPU: Llama-sized layers run faster as one device (docs/fine_tuning.md)
    c.max_iters = 100
    c.eval_interval = 25
    c.eval_iters = 20
    c.log_interval = 5
    c.ckpt_interval = 0  # a checkpoint at the end only
    c.optim.learning_rate = 2e-5  # small: nudge the pretrained weights, do not retrain them
    c.optim.min_lr = 2e-6
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    return c
