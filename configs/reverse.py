"""The encoder-decoder Transformer reversing strings: a tiny model, about a minute on a CPU.

python -m flaxgpt.seq2seq_data --task reverse --out_dir data/reverse
python train.py --config configs/reverse.py
python sample.py --out_dir out/reverse --start "abcdefg"        # -> gfedcba
"""

import ml_collections

from configs import default


def seq2seq_default() -> ml_collections.ConfigDict:
    """configs/default.py with model.kind = "seq2seq", the encoder-decoder's own model fields and
    the `seq2seq` decoding section (shared by every seq2seq recipe)."""
    import flaxgpt.seq2seq_task  # noqa: F401  registers model.kind "seq2seq" with the trainer

    c = default.get_config()
    with c.unlocked():
        c.model.kind = "seq2seq"
        c.model.n_enc_layer = 6  # encoder layers
        c.model.n_dec_layer = 6  # decoder layers
        c.model.d_ff = 2048  # MLP hidden width
        c.model.attn_dropout = 0.0  # dropout on attention weights (model.dropout: embeddings, residuals)
        c.model.pre_ln = True  # LayerNorm before each sublayer; False = the paper's post-LN
        c.model.share_embeddings = True  # one matrix for source, target and output embeddings
        c.seq2seq = ml_collections.ConfigDict()
        c.seq2seq.eval_pairs = 1000  # val pairs decoded for exact match and BLEU at each evaluation
        c.seq2seq.eval_batch = 100  # sources decoded at once during evaluation
        c.seq2seq.eval_beam_size = 1  # 1 = greedy decoding during evaluation (fast)
        c.seq2seq.beam_size = 4  # beam width for translating (sample.py)
        c.seq2seq.alpha = 0.6  # GNMT length penalty ((5 + len) / 6) ** alpha
        c.seq2seq.bleu_tokenize = "13a"  # sacrebleu tokenizer: 13a (WMT standard) | char | intl | none
    c.model.activation = "relu"
    c.model.pos_embedding = "sinusoidal"
    c.model.pad_vocab_multiple = 1
    c.optim.label_smoothing = 0.1  # the paper's
    c.optim.weight_decay = 0.0
    return c


def get_config():
    c = seq2seq_default()
    c.out_dir = "out/reverse"
    c.data.dir = "data/reverse"
    c.model.n_layer = c.model.n_enc_layer = c.model.n_dec_layer = 2
    c.model.n_head, c.model.n_embd, c.model.d_ff = 4, 64, 256
    c.model.block_size = 16  # longest source / target in tokens (12 characters + EOS)
    c.model.dropout = 0.0
    # untied: a tied output layer starts out predicting its input token again (the sqrt(d) scaled
    # embedding dominates the residual stream), a bad prior for reversal; untied learns ~3x faster
    c.model.share_embeddings = False
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
