"""Long-context LoRA fine-tuning of Llama 3 8B (or a model of its shape): 32k-token sequences split over
a mesh "context" axis of 8 devices (Ulysses: each device attends 4 of the 32 heads over the whole row
with cuDNN's flash kernel), adapters on every linear layer of a frozen bfloat16 base.

Targets: h100-8 (check: flaxgpt aot --config configs/llama3_8b_long.py --target h100-8
--config.init_from=llama-3-8b --vocab_size 128256); on TPUs (v5p-64) take --config.model.context_impl=ring:
Ulysses cannot run the splash kernel (a one-line error), and the v5p-64 compile is not in docs/fit.md yet.
A context group must be one process's devices (each process loads whole rows): on a v5p pod (one process
a host of 4 chips) --config.mesh.context=4 at most, and not under a launcher of one process a GPU.

    flaxgpt prepare --dataset hf --hf_name openwebtext --tokenizer path/to/Meta-Llama-3.1-8B \
        --out_dir data/openwebtext_llama3
    python train.py --config configs/llama3_8b_long.py --config.init_from=path/to/Meta-Llama-3.1-8B
    # 128k tokens a sequence (Llama 3.1's whole context)
    python train.py --config configs/llama3_8b_long.py --config.init_from=path/to/Meta-Llama-3.1-8B \
        --config.model.block_size=131072

The data must hold rows of block_size tokens (prepared with the model's tokenizer). Each step's rows
are split over mesh.data, each row's tokens over mesh.context; block_size must be a multiple of 2 x
mesh.context (the ring's balanced chunks: a one-line error otherwise). Full fine-tuning at these
lengths needs the state over fsdp (16 bytes a parameter), which leaves fewer devices for context:
docs/fit.md has what each layout compiles to per device (compiled, not measured).
"""

from configs import llama3_8b_fsdp


def get_config():
    c = llama3_8b_fsdp.get_config()
    c.out_dir = "out/llama3_8b_long"
    c.init_from = "path/to/Meta-Llama-3.1-8B"  # a Hugging Face directory; its tokenizer is Llama 3's
    c.model.block_size = 32768  # tokens a sequence: a multiple of 2 x mesh.context
    c.model.rope_scaling = "llama3"  # Llama 3.1's long-context RoPE (init_from's config.json decides)
    c.model.rope_factor = 8.0
    c.model.rope_original_max_len = 8192
    # ulysses: n_head (32) % context == 0; on an h100-8 19.61 GB a GPU at 32k, 26.77 at 128k, where the
    # ring (XLA's attention per block) takes 20.33 and 37.55 (docs/fit.md, compiled, not measured)
    c.model.context_impl = "ulysses"
    c.lora.rank = 16  # adapters: the frozen base in bf16 (16 GB) on each device, no optimizer state
    c.lora.alpha = 32.0
    c.lora.dropout = 0.0
    c.lora.targets = "all-linear"
    c.lora.base_dtype = "bfloat16"
    c.mesh.data, c.mesh.fsdp, c.mesh.context = -1, 1, 8  # h100-8: a row over all 8; v5p-64: 4 rows over 8
    c.batch_size = 8  # rows a step: 8 x 32768 = 262,144 tokens
    c.grad_accum = 8  # micro-batches of one row per context group on an h100-8
    c.optim.learning_rate = 2e-4  # adapters start at zero: LoRA takes ~10x full fine-tuning's rate
    c.optim.min_lr = 2e-5
    c.optim.loss_chunk = 1024  # no [rows, T, 128256] float32 logits
    return c
