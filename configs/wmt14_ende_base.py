"""Transformer base on WMT'14 English -> German, with the paper's settings (27.3 BLEU on newstest2014
in "Attention Is All You Need"; base trained 100k steps on 8 P100s). For a GPU or TPU, not a CPU.

pip install 'flaxgpt[data]'      # Hugging Face datasets; preparing needs the network (~4.5M pairs)
flaxgpt prepare-seq2seq --task hf --hf_name wmt14 --hf_config de-en --src_lang en \
    --tgt_lang de --tokenizer gpt2 --max_len 128 --truncate --out_dir data/wmt14_ende
python train.py --config configs/wmt14_ende_base.py
python sample.py --out_dir out/wmt14_ende_base --start "The house is small."

Differences from the paper: GPT-2's BPE (50,257 tokens) instead of a 37k joint BPE, batches of a fixed
number of sentences (padded to block_size) instead of ~25k source + 25k target tokens, and val is
newstest2013 (the paper's dev set; it reports newstest2014).

Targets: v5e-8, h100-8
"""

from configs import seq2seq_default


def get_config():
    c = seq2seq_default.get_config()
    c.out_dir = "out/wmt14_ende_base"
    c.data.dir = "data/wmt14_ende"
    # the paper's Transformer base: 6 + 6 layers, n_embd (d_model) 512, d_ff 2048, 8 heads, P_drop 0.1
    c.model.n_enc_layer = c.model.n_dec_layer = 6
    c.model.n_head, c.model.n_embd, c.model.d_ff = 8, 512, 2048
    c.model.dropout = 0.1
    c.model.pre_ln = False  # the paper's post-LN (warmup makes it train)
    c.model.tie_embeddings = True  # a shared source/target vocabulary, one embedding matrix
    c.model.block_size = 128  # sentences longer than 127 BPE tokens are truncated when preparing
    c.model.pad_vocab_multiple = 64
    c.model.dtype = "bfloat16"
    c.batch_size = 768  # ~ the paper's 25k target tokens at ~30 tokens per sentence
    c.max_iters = 100_000
    c.eval_interval = 5000
    c.eval_iters = 20
    c.log_interval = 100
    c.ckpt_interval = 5000
    # Adam(0.9, 0.98, 1e-9); lr = d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), warmup 4000:
    # the rsqrt schedule peaking at 512^-0.5 * 4000^-0.5 = 7.0e-4
    c.optim.schedule = "rsqrt"
    c.optim.learning_rate = 512**-0.5 * 4000**-0.5
    c.optim.warmup_steps = 4000
    c.optim.beta1, c.optim.beta2, c.optim.eps = 0.9, 0.98, 1e-9
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 0.0  # the paper clips nothing
    c.optim.label_smoothing = 0.1
    c.seq2seq.eval_pairs = 3000  # all of newstest2013
    c.seq2seq.eval_batch = 250
    c.seq2seq.eval_beam_size = 4  # the paper: beam 4, alpha 0.6
    c.seq2seq.beam_size = 4
    c.seq2seq.alpha = 0.6
    c.seq2seq.bleu_tokenize = "13a"
    return c
