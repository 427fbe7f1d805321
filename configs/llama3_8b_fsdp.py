"""Full fine-tune of Llama 3 8B (or a model of its shape) with parameters, gradients and Adam state
sharded over every device (FSDP, ZeRO-3).

Targets: v5p-64, h100-8

python -m flaxgpt.data.prepare --dataset hf --hf_name openwebtext --tokenizer path/to/Meta-Llama-3-8B \
    --out_dir data/openwebtext_llama3
python train.py --config configs/llama3_8b_fsdp.py --config.init_from=path/to/Meta-Llama-3-8B

`init_from` is the Hugging Face directory (config.json, safetensors, tokenizer.json); the model section
below is its published shape (GPTConfig preset "llama-3-8b"), which `init_from=scratch` trains from zero.
Memory per device: 16 bytes per parameter (fp32 weights, gradients, Adam mu and nu) / devices, plus
one micro-batch's activations (each block rematerialized, only its input kept) and the chunked loss.
"""

from configs import default
from flaxgpt.models.gpt_config import GPTConfig


def get_config():
    c = default.get_config()
    c.init_from = "path/to/Meta-Llama-3-8B"  # a Hugging Face Llama directory (scratch: random weights)
    c.out_dir = "out/llama3_8b_fsdp"
    c.data.dir = "data/openwebtext_llama3"  # prepared with the model's tokenizer (--tokenizer PATH)
    for field, value in GPTConfig.PRESETS["llama-3-8b"].items():
        c.model[field] = value
    c.model.vocab_size = 0  # the dataset's (Llama 3's tokenizer: 128256)
    c.model.block_size = 8192  # Llama 3's context
    c.model.dropout = 0.0
    c.model.dtype = "bfloat16"  # bf16 matmuls, float32 parameters and Adam state
    c.model.scan_layers = True  # one compiled block for the 32 layers
    c.model.remat = "full"  # keep each block's input only: 8k-token rows fit
    c.mesh.data, c.mesh.fsdp = 1, -1  # every device shards the model
    c.batch_size = 64  # 64 x 8192 = 524,288 tokens per step
    c.grad_accum = 2  # micro-batches of 32 rows: one per device on a v5p-64, four per H100 of eight
    c.max_iters = 1000
    c.eval_interval = 200
    c.eval_iters = 10
    c.log_interval = 10
    c.ckpt_interval = 200
    c.optim.learning_rate = 1e-5  # small: nudge the pretrained weights
    c.optim.min_lr = 1e-6
    c.optim.warmup_steps = 50
    c.optim.weight_decay = 0.0
    c.optim.loss_chunk = 512  # no [rows, 8192, 128256] fp32 logits
    return c
