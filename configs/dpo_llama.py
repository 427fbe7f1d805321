"""DPO of a chat model (Llama 3, Qwen2, Mistral instruct) on preference pairs, after SFT: LoRA adapters on
the frozen SFT model, which with the adapters off is also the reference.

    flaxgpt prepare --dataset pairs --input pairs.jsonl --hf_dir out/sft_llama_merged \
        --block_size 2048 --out_dir data/dpo_llama
    python train.py --config configs/dpo_llama.py --config.init_from=out/sft_llama_merged
    python sample.py --out_dir out/dpo_llama --chat                # talk to it in the terminal
    python serve.py --out_dir out/dpo_llama                        # POST /v1/chat/completions

pairs.jsonl holds {"prompt", "chosen", "rejected"} a line, as text or as chat messages (rendered with
the model's chat template); a row of block_size holds whole pairs, each sequence at most
block_size // 2 tokens (TRL's max_length). The loss counts the response tokens only. batch_size counts
rows (several short pairs to a row). `--config.lora.rank=0` tunes every weight against a frozen copy
(with `--config.optim.learning_rate=5e-7 --config.optim.min_lr=5e-8`); `--config.dpo.loss=ipo` and
`--config.dpo.label_smoothing` are the variants. See docs/dpo.md.

Targets: h100-1, v5e-8 (check: flaxgpt aot --config configs/dpo_llama.py --target NAME)
"""

from configs import sft_llama


def get_config():
    c = sft_llama.get_config()
    c.init_from = "path/to/Llama-3.2-1B-Instruct"  # the SFT model (flaxgpt peft merge of an SFT run)
    c.out_dir = "out/dpo_llama"
    c.data.dir = "data/dpo_llama"  # prepare --dataset pairs --hf_dir (the same model directory)
    c.data.format = "pairs"  # preference pairs: DPO (flaxgpt/train/dpo_task.py)
    c.model.block_size = 2048  # a row: whole pairs, each sequence at most 1024 tokens
    c.model.remat = "full"  # two forward passes a step (policy, reference): an 8B base fits one H100
    c.batch_size = 8  # rows per step (a row holds one pair or more)
    c.grad_accum = 2
    c.max_iters = 200
    c.eval_interval = 50
    c.lora.rank = 16  # adapters on the frozen SFT model; the reference is that model (adapters off)
    c.lora.alpha = 32.0
    c.lora.dropout = 0.0  # the policy's log-probabilities as the reference's: no noise between them
    c.optim.learning_rate = 2e-5  # DPO moves little: ~10x below SFT's LoRA rate
    c.optim.min_lr = 2e-6
    c.optim.warmup_steps = 10
    c.dpo.beta = 0.1  # TRL's default
    c.dpo.loss = "sigmoid"  # DPO; ipo for IPO
    c.dpo.label_smoothing = 0.0  # conservative DPO when > 0
    return c
