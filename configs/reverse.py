"""The encoder-decoder Transformer reversing strings: a tiny model, about a minute on a CPU.

flaxgpt prepare-seq2seq --task reverse --out_dir data/reverse
python train.py --config configs/reverse.py
python sample.py --out_dir out/reverse --start "abcdefg"        # -> gfedcba

Targets: cpu (check: flaxgpt aot --config configs/reverse.py --target NAME)
"""

from configs import seq2seq_default


def get_config():
    c = seq2seq_default.get_config()
    c.out_dir = "out/reverse"
    c.data.dir = "data/reverse"
    c.model.n_enc_layer = c.model.n_dec_layer = 2
    c.model.n_head, c.model.n_embd, c.model.d_ff = 4, 64, 256
    c.model.block_size = 16  # longest source / target in tokens (12 characters + EOS)
    c.model.dropout = 0.0
    # untied: a tied output layer starts out predicting its input token again (the sqrt(d) scaled
    # embedding dominates the residual stream), a bad prior for reversal; untied learns ~3x faster
    c.model.tie_embeddings = False
    c.batch_size = 64
    c.max_iters = 600
    c.eval_interval = 200
    c.eval_iters = 4
    c.log_interval = 50
    c.ckpt_interval = 0  # only at the end
    c.optim.schedule = "cosine"
    c.optim.learning_rate = 2e-3
    c.optim.min_lr = 1e-4
    c.optim.warmup_steps = 50
    c.optim.decay_steps = 600
    c.optim.beta2 = 0.98
    c.optim.label_smoothing = 0.0  # a deterministic task: nothing to smooth
    c.seq2seq.eval_pairs = 500
    c.seq2seq.bleu_tokenize = "char"  # one "word" per string: score characters
    return c
