"""Chat SFT of a Llama-family model (Llama 3, Qwen2, Mistral instruct) on packed conversations.

    flaxgpt prepare --dataset chat --input convs.jsonl \
        --hf_dir path/to/Llama-3.2-1B-Instruct --block_size 2048 --out_dir data/chat_llama
    python train.py --config configs/sft_llama.py --config.init_from=path/to/Llama-3.2-1B-Instruct
    python sample.py --out_dir out/sft_llama --chat           # talk to it in the terminal
    python serve.py --out_dir out/sft_llama                   # POST /v1/chat/completions

The data are conversations ({"messages": [{"role", "content"}, ...]} per line) rendered with the
model's own chat template, packed several to a row of block_size with segment ids (attention and
positions restart in each), and the loss counts the assistant tokens only (flaxgpt.data.chat).
`--block_size` of prepare and `model.block_size` here must agree. LoRA adapters on every linear layer
of the frozen bf16 base (configs/lora_llama.py's); `--config.lora.rank=0` fine-tunes every weight instead
(with `--config.optim.learning_rate=1e-5`). See docs/chat.md and docs/fine_tuning.md.

Targets: h100-1, v5e-8 (check: flaxgpt aot --config configs/sft_llama.py --target NAME)
"""

from configs import default


def get_config():
    c = default.get_config()
    c.init_from = "path/to/Llama-3.2-1B-Instruct"  # a Hugging Face Llama / Mistral / Qwen2 directory
    c.out_dir = "out/sft_llama"
    c.data.dir = "data/chat_llama"  # prepare --dataset chat --hf_dir (the same model directory)
    c.data.format = "packed"  # rows of whole conversations, loss mask + segment ids
    c.model.block_size = 2048  # the packed row length (prepare's --block_size)
    c.model.dropout = 0.0  # Llama-family models are trained without dropout
    c.model.dtype = "bfloat16"  # bf16 matmuls, float32 parameters (use float32 on CPU)
    c.model.pad_vocab_multiple = 64  # Llama-family vocabularies already are multiples of 64
    c.model.scan_layers = True  # one compiled block: 16-30 layers compile in seconds
    c.model.remat = "dots"  # keep the matmul outputs, recompute the rest: long rows fit
    c.batch_size = 8  # packed rows per step (8 x 2048 = 16,384 tokens, a fraction of them trained)
    c.grad_accum = 2  # micro-batches of 4 rows
    c.mesh.cpu_devices = 1  # on a CPU: Llama-sized layers run faster as one device (docs/fine_tuning.md)
    c.max_iters = 300
    c.eval_interval = 50
    c.eval_iters = 10
    c.log_interval = 5
    c.ckpt_interval = 0  # a checkpoint at the end only
    c.lora.rank = 16  # adapters on a frozen base (0: full fine-tuning)
    c.lora.alpha = 32.0  # scale alpha / r = 2
    c.lora.targets = "all-linear"  # q, k, v, o, gate, up, down
    c.lora.base_dtype = "bfloat16"  # the frozen base; int8 for QLoRA-style, float32 on CPU
    c.optim.loss_chunk = 256  # Llama 3's 128k vocabulary: never the whole [B, T, V] float32 logits
    c.optim.learning_rate = 2e-4  # adapters start at zero: LoRA takes ~10x full fine-tuning's rate
    c.optim.min_lr = 1e-6
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.0
    return c
