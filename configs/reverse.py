"""The encoder-decoder Transformer reversing strings: a tiny model, about a minute on a CPU.

python -m flaxgpt.data.prepare_seq2seq --task reverse --out_dir data/reverse
python train.py --config configs/reverse.py
python sample.py --out_dir out/reverse --start "abcdefg"        # -> gfedcba
"""

import ml_collections

from configs import default


def seq2seq_default() -> ml_collections.ConfigDict:
    """configs/default.py with the encoder-decoder's `model` section (TransformerConfig's fields,
    the paper's base sizes) and the `seq2seq` decoding section; every seq2seq recipe starts here."""
    c = default.get_config()
    m = ml_collections.ConfigDict()
    m.kind = "seq2seq"  # the encoder-decoder Transformer (flaxgpt.train.seq2seq_task)
    m.vocab_size = 0  # 0 = take it from the dataset's meta.json (one vocabulary for source and target)
    m.block_size = 256  # longest source and longest target in tokens (EOS / BOS included)
    m.n_enc_layer = 6  # encoder layers
    m.n_dec_layer = 6  # decoder layers
    m.n_embd = 512  # model width D (the paper's d_model)
    m.d_ff = 2048  # MLP hidden width
    m.n_head = 8  # attention heads per layer
    m.dropout = 0.1  # the paper's P_drop: on embeddings + positions and each residual branch
    m.attn_dropout = 0.0  # dropout on the attention weights
    m.pre_ln = True  # LayerNorm before each sublayer; False = the paper's post-LN
    m.tie_embeddings = True  # one matrix for source, target and output embeddings
    m.activation = "relu"  # relu (paper) | gelu | gelu_exact
    m.bias = True  # biases in Linear layers and LayerNorms
    m.layer_norm_epsilon = 1e-6  # LayerNorm's epsilon
    m.dtype = "float32"  # compute dtype; bfloat16 on TPU/GPU (params stay param_dtype)
    m.param_dtype = "float32"  # parameter and optimizer-state dtype
    m.pad_vocab_multiple = 1  # round embedding rows up to a multiple of this (64: faster matmuls)
    m.attention_impl = "auto"  # auto | xla | cudnn (cuDNN flash attention on NVIDIA GPUs)
    m.sinusoid_layout = "interleaved"  # interleaved (the paper's sin, cos, ...) | halves (older runs)
    with c.unlocked():
        c.model = m
        c.seq2seq = ml_collections.ConfigDict()
        c.seq2seq.eval_pairs = 1000  # val pairs decoded for exact match and BLEU at each evaluation
        c.seq2seq.eval_batch = 100  # sources decoded at once during evaluation
        c.seq2seq.eval_beam_size = 1  # 1 = greedy decoding during evaluation (fast)
        c.seq2seq.beam_size = 4  # beam width for translating (sample.py)
        c.seq2seq.alpha = 0.6  # GNMT length penalty ((5 + len) / 6) ** alpha
        c.seq2seq.bleu_tokenize = "13a"  # sacrebleu tokenizer: 13a (WMT standard) | char | intl | none
    c.optim.label_smoothing = 0.1  # the paper's
    c.optim.weight_decay = 0.0
    return c


def get_config():
    c = seq2seq_default()
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
