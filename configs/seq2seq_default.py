"""The encoder-decoder's base recipe: configs/default.py with the `model` section of TransformerConfig
(its fields, defaults and comments: the paper's base sizes) and the `seq2seq` decoding section. Every
seq2seq recipe starts here (configs/reverse.py, numbers_to_words.py, wmt14_ende_base.py).

Targets: cpu (check: flaxgpt aot --config configs/seq2seq_default.py --target NAME)
"""

import ml_collections

from configs import default
from flaxgpt.models import registry as models


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    with c.unlocked():
        # vocab_size 0 = take it from the dataset's meta.json (one vocabulary for source and target)
        c.model = ml_collections.ConfigDict(models.recipe_section("seq2seq", vocab_size=0))
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
