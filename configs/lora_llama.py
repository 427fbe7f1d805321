"""LoRA fine-tuning of a Llama-family model (Llama, Mistral, Qwen2): adapters on every linear layer of
a frozen base, then a PEFT adapter out (or a merged model).

    python -m flaxgpt.data.prepare --dataset shakespeare --tokenizer path/to/SmolLM2-135M \
        --out_dir data/shakespeare_smollm2
    python train.py --config configs/lora_llama.py --config.init_from=path/to/SmolLM2-135M
    python sample.py --out_dir out/lora_llama --start "ROMEO:"          # base + the run's adapters
    python -m flaxgpt.hf.peft export --out_dir out/lora_llama --to out/lora_llama_adapter   # peft loads it
    python -m flaxgpt.hf.peft merge --base path/to/SmolLM2-135M --adapter out/lora_llama_adapter \
        --to out/lora_llama_merged                                        # a plain transformers model
    # QLoRA-style: the frozen base in int8 (adapters stay float32); an 8B base sharded over 8 devices
    python train.py --config configs/lora_llama.py --config.init_from=path/to/Llama-3-8B \
        --config.lora.base_dtype=int8 --config.mesh.fsdp=8

Only the adapters train and are checkpointed (with their AdamW state); the base is read from
init_from at every start, so keep that directory. See docs/fine_tuning.md.

Targets: h100-1, v5e-8 (check: flaxgpt aot --config configs/lora_llama.py --target NAME)
"""

from configs import finetune_llama


def get_config():
    c = finetune_llama.get_config()
    c.out_dir = "out/lora_llama"
    c.lora.rank = 16  # adapter rank r
    c.lora.alpha = 32.0  # scale alpha / r = 2
    c.lora.dropout = 0.05  # on each adapted layer's input, adapter path only
    c.lora.targets = "all-linear"  # q, k, v, o, gate, up, down
    c.lora.base_dtype = "bfloat16"  # the frozen base; int8 for QLoRA-style, float32 on CPU
    c.optim.learning_rate = 2e-4  # adapters start at zero: LoRA takes ~10x full fine-tuning's rate
    c.optim.min_lr = 2e-5
    c.optim.weight_decay = 0.0
    return c
