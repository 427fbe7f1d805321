"""Fine-tune OpenAI's GPT-2 on Tiny Shakespeare (GPT-2 BPE tokens), as nanoGPT's finetune recipe.

    flaxgpt prepare --dataset shakespeare --tokenizer gpt2 --out_dir data/shakespeare
    python train.py --config configs/finetune_shakespeare.py
    python sample.py --out_dir out/finetune_shakespeare --start "ROMEO:"
    # the biggest GPT-2 (1.5B) if the accelerator holds it:
    python train.py --config configs/finetune_shakespeare.py --config.init_from=gpt2-xl --config.grad_accum=32

The architecture (n_layer, n_head, n_embd, vocab_size, ...) comes from the pretrained
checkpoint; the model fields set here are the ones it leaves free (dropout, dtypes, layout,
block_size up to GPT-2's 1024). ~300k training tokens: 20 steps of 32 x 1024 tokens is
about two passes over the play, enough to take on its style without forgetting English.

Targets: v5e-1, h100-1
"""

from configs import default


def get_config():
    c = default.get_config()
    c.init_from = "gpt2"  # gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a directory with a HF GPT-2
    c.out_dir = "out/finetune_shakespeare"
    c.data.dir = "data/shakespeare"  # prepared with --tokenizer gpt2: the same ids GPT-2 was trained on
    c.model.block_size = 1024  # GPT-2's full context
    c.model.dropout = 0.0  # few steps at a small learning rate: nothing to regularise
    c.model.dtype = "bfloat16"  # bf16 matmuls, float32 parameters (use float32 on CPU)
    c.model.pad_vocab_multiple = 64  # 50257 -> 50304 rows (zeros), faster matmuls
    c.batch_size = 32  # sequences per step (32 x 1024 = 32,768 tokens, as nanoGPT)
    c.grad_accum = 4  # micro-batches of 8 sequences; raise it if memory runs out
    c.max_iters = 20
    c.eval_interval = 5  # evaluate often: the run is short and overfits quickly
    c.eval_iters = 40
    c.log_interval = 1
    c.ckpt_interval = 0  # a checkpoint at the end only
    c.optim.learning_rate = 3e-5  # small: nudge the pretrained weights, do not retrain them
    c.optim.min_lr = 3e-5
    c.optim.schedule = "constant"  # no decay over 20 steps
    c.optim.warmup_steps = 0
    return c
