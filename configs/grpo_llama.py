"""GRPO with LoRA on a Llama-family chat model: math word problems whose final answer a program checks
(GSM8K's "#### 42" or \\boxed{42}); G = 8 completions of up to 1,024 tokens a prompt, sampled by the
serving engine from the current adapters over the frozen base, in the training process.

    flaxgpt prepare --dataset prompts --input data/gsm8k.jsonl --hf_dir path/to/Qwen2.5-1.5B-Instruct \
        --block_size 1280 --out_dir data/gsm8k_prompts
    python train.py --config configs/grpo_llama.py --config.init_from=path/to/Qwen2.5-1.5B-Instruct
    python sample.py --out_dir out/grpo_llama --chat --temperature 0
    flaxgpt peft export --out_dir out/grpo_llama --to out/grpo_llama_adapter

data/gsm8k.jsonl holds {"messages": [{"role": "user", "content": "..."}], "answer": "42"} a line (the
"answer" reward reads that field). Start from a model that already answers in the checked form (an
instruct model, or your SFT run of configs/sft_llama.py): GRPO sharpens what the model sometimes does,
it does not teach a format from nothing. See docs/grpo.md.

Targets: h100-1, v5p-8 (check: flaxgpt aot --config configs/grpo_llama.py --config.init_from=llama-3-8b
--target NAME; the train step, the rollout programs and both on one device's memory)
"""

from configs import lora_llama


def get_config():
    c = lora_llama.get_config()
    c.out_dir = "out/grpo_llama"
    c.data.dir = "data/gsm8k_prompts"
    c.data.format = "prompts"  # GRPO (flaxgpt/train/grpo_online.py)
    c.model.block_size = 1280  # a prompt of up to 256 tokens + a 1,024-token completion
    c.lora.dropout = 0.0  # the update's log-probs against the rollout's: no noise in the ratio
    c.grpo.num_generations = 8
    c.grpo.max_completion_length = 1024
    c.grpo.reward_funcs = ("answer",)
    c.grpo.eval_prompts = 64
    c.batch_size = 64  # completions a step: 8 prompts x G 8, also the engine's slots
    c.grad_accum = 8  # micro-batches of one group (8 completions x 1,280 tokens)
    c.max_iters = 200
    c.eval_interval = 25
    c.eval_iters = 1
    c.log_interval = 1
    c.ckpt_interval = 50
    c.optim.learning_rate = 1e-5
    c.optim.min_lr = 1e-6
    c.optim.warmup_steps = 10
    return c
