"""The evaluation tasks: local files -> scoring requests -> metrics. No model code here.

    docs = read_jsonl("hellaswag_val.jsonl", ("ctx", "endings", "label"))
    metrics = hellaswag(scorer, tokenizer, docs)          # acc, acc_norm (lm-eval), *_nanogpt
    metrics = lambada(scorer, tokenizer, docs)            # acc, ppl of the last word
    metrics = perplexity(scorer, tokenizer, texts, window=1024, stride=512)
    metrics = translation(config, params, tokenizer, pairs)   # encoder-decoder runs: BLEU, exact match

Conventions (each matches a reference tool to the example):
- lm-evaluation-harness (0.4): a context is encoded alone and with its continuation, the
  continuation's tokens being the rest of the joint encoding (trailing spaces of the context move to
  the continuation); HellaSwag's context and endings go through its `preprocess`; `acc_norm` divides
  the log-likelihood by the ending's length in characters; LAMBADA's perplexity is exp of minus the
  mean log-likelihood of the last word per text.
- build-nanogpt: HellaSwag's raw `ctx` and " " + ending encoded apart; `acc_norm` picks the lowest
  mean loss per ending token.
- Perplexity: the Hugging Face guide's sliding windows: each window scores the tokens the previous
  one did not, seeing up to `window` tokens; a document's first token is not scored.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

JSONL_KEYS = {
    "hellaswag": ("activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label"),
    "lambada": ("text",),
}
SCORED_TASKS = ("perplexity", "hellaswag", "lambada")  # the GPT's; translation is the encoder-decoder's


class EvalDataError(ValueError):
    """Bad evaluation input; the message is one line naming the file and, where known, the line."""


WHERE = "__where__"  # a read doc's file:line, for the errors its scoring may raise


def fits(scorer, docs, groups) -> None:
    """Each doc's (context, [continuations]) fits the scorer's window, else an EvalDataError naming
    the doc's file and line (the scorer's own error names no example)."""
    from flaxgpt.eval.scoring import check_request

    L = scorer.block_size  # Scorer's, ProcessShards' or _NoScorer's
    for doc, (context, conts) in zip(docs, groups, strict=True):
        for cont in conts:
            try:
                check_request(context, cont, L)
            except ValueError as e:
                raise EvalDataError(f"{doc.get(WHERE, 'an example')}: {e}") from None


def read_jsonl(path, keys: tuple[str, ...] = (), check=None) -> list[dict]:
    """The objects of a jsonl file (blank lines skipped), each checked for `keys` and by `check`
    (a doc -> what is wrong with it, or None)."""
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"{path} does not exist or is not a file")
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as e:
                raise EvalDataError(f"{path}:{lineno} is not valid JSON ({e})") from None
            if not isinstance(doc, dict):
                raise EvalDataError(f"{path}:{lineno} is a JSON {type(doc).__name__}, expected an object")
            missing = [k for k in keys if k not in doc]
            if missing:
                raise EvalDataError(f"{path}:{lineno} lacks {missing}; each line needs {list(keys)}")
            wrong = check(doc) if check is not None else None
            if wrong:
                raise EvalDataError(f"{path}:{lineno} {wrong}")
            docs.append({**doc, WHERE: f"{path}:{lineno}"})
    if not docs:
        raise EvalDataError(f"{path} is empty; expected one JSON object per line")
    return docs


def read_texts(path) -> list[tuple[str, str]]:
    """(name, text) of a text file, or of every file under a folder (sorted, hidden files skipped)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        raise EvalDataError(f"{path} does not exist")
    texts = []
    for p in files:
        try:
            texts.append((str(p), p.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise EvalDataError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    texts = [(name, t) for name, t in texts if t.strip()]
    if not texts:
        raise EvalDataError(f"{path} is empty; expected text")
    return texts


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into tokens (its HF backend's _encode_pair and
    loglikelihood): a tokenizer that starts text with BOS (Llama's, Gemma's: `add_bos`) starts the
    context with it; an empty context is BOS, or end-of-text without one (GPT-2's are the same)."""
    bos = getattr(tokenizer, "bos_id", None)
    if not context:
        prefix = bos if bos is not None else tokenizer.eot_id
        if prefix is None:
            raise EvalDataError("an empty context needs a tokenizer with a BOS or end-of-text token")
        ids = tokenizer.encode(continuation)
        return (ids[:1], ids[1:]) if ids[:1] == [prefix] else ([prefix], ids)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:  # only spaces, now the continuation's (lm-eval fails here): an empty context
        return encode_pair(tokenizer, "", continuation)
    context_ids = tokenizer.encode(context)
    lead = [bos] if getattr(tokenizer, "add_bos", False) and context_ids[:1] != [bos] else []  # not twice
    whole = lead + tokenizer.encode(context + continuation)
    return lead + context_ids, whole[len(lead) + len(context_ids) :]


def preprocess(text: str) -> str:
    """lm-eval's HellaSwag cleanup (tasks/hellaswag/utils.py): WikiHow's [title] and [step] artefacts."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _argmax(values) -> int:
    """numpy's argmax: the first of equal values."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def hellaswag(scorer, tokenizer, docs, conventions=("lm_eval", "nanogpt")) -> dict:
    """acc and acc_norm of lm-eval (acc, acc_norm) and of build-nanogpt (acc_nanogpt, acc_norm_nanogpt)."""
    labels = [int(d["label"]) for d in docs]
    metrics: dict = {"n": len(docs)}
    if "lm_eval" in conventions:
        groups, choices = [], []
        for d in docs:
            ctx = preprocess(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize())
            endings = [preprocess(e) for e in d["endings"]]
            pairs = [encode_pair(tokenizer, ctx, " " + e) for e in endings]
            groups.append((pairs[0][0], [p[1] for p in pairs]))
            choices.append(endings)
        fits(scorer, docs, groups)
        scores = scorer.score_choices(groups)
        metrics["acc"] = _mean(_argmax([s.logprob for s in ss]) == y for ss, y in zip(scores, labels))
        metrics["acc_norm"] = _mean(
            _argmax([s.logprob / len(e) for s, e in zip(ss, es)]) == y
            for ss, es, y in zip(scores, choices, labels)
        )
        metrics["loglikelihoods"] = [[s.logprob for s in ss] for ss in scores]
    if "nanogpt" in conventions:
        groups = [
            (tokenizer.encode(d["ctx"]), [tokenizer.encode(" " + e) for e in d["endings"]]) for d in docs
        ]
        fits(scorer, docs, groups)
        scores = scorer.score_choices(groups)
        metrics["acc_nanogpt"] = _mean(_argmax([s.logprob for s in ss]) == y for ss, y in zip(scores, labels))
        metrics["acc_norm_nanogpt"] = _mean(
            _argmax([s.logprob / s.n_tokens for s in ss]) == y for ss, y in zip(scores, labels)
        )
    return metrics


def lambada(scorer, tokenizer, docs) -> dict:
    """Last-word accuracy (every token of it greedy) and perplexity (lm-eval's lambada_openai)."""
    pairs = []
    for d in docs:
        words = d["text"].split(" ")
        pairs.append(encode_pair(tokenizer, " ".join(words[:-1]), " " + words[-1]))
    fits(scorer, docs, [(ctx, [cont]) for ctx, cont in pairs])
    scores = scorer.score(pairs)
    mean_ll = sum(s.logprob for s in scores) / len(scores)
    return {
        "n": len(docs),
        "acc": _mean(s.greedy for s in scores),
        "ppl": math.exp(-mean_ll),
        "loglikelihoods": [s.logprob for s in scores],
    }


def windows(n: int, window: int, stride: int | None) -> list[tuple[int, int, int]]:
    """(begin, first scored, end) token offsets covering n tokens, the HF perplexity guide's loop."""
    stride = stride or window
    if not 0 < stride <= window:
        raise EvalDataError(f"stride {stride} must be in [1, window {window}]")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        first = max(prev_end, begin + 1)  # a window's first token has nothing to be predicted from
        if first < end:
            out.append((begin, first, end))
        prev_end = end
        if end == n:
            break
    return out


def perplexity(scorer, tokenizer, texts, window: int, stride: int | None = None) -> dict:
    """Mean loss per token, perplexity, bits per byte and perplexity per word of (name, text) docs."""
    requests, n_bytes, n_words = [], 0, 0
    for name, text in texts:
        ids = tokenizer.encode(text)
        if len(ids) > window and not stride:
            raise EvalDataError(
                f"{name} has {len(ids)} tokens, more than the window of {window}; "
                "pass --stride (e.g. half the window) to score it in sliding windows"
            )
        requests += [(ids[b:f], ids[f:e]) for b, f, e in windows(len(ids), window, stride)]
        n_bytes += len(text.encode("utf-8"))
        n_words += len(re.split(r"\s+", text.strip()))
    if not requests:
        raise EvalDataError("the texts have no token to score (each needs at least two tokens)")
    scores = scorer.score(requests)
    nll = -sum(s.logprob for s in scores)
    tokens = sum(s.n_tokens for s in scores)
    return {
        "n": len(texts),
        "tokens": tokens,
        "loss": nll / tokens,
        "ppl": math.exp(nll / tokens),
        "bits_per_byte": nll / math.log(2) / n_bytes,
        "word_ppl": math.exp(nll / n_words),
    }


def _hellaswag_doc(doc) -> str | None:
    """What would break scoring: endings that are not at least two texts (or that preprocessing
    empties: acc_norm divides by their length), a label that is not one of their indices."""
    endings = doc["endings"]
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        return f"has endings {str(endings)[:80]}; expected a list of at least 2 strings"
    empty = [i for i, e in enumerate(endings) if not preprocess(e).strip()]
    if empty:
        return f"has ending {empty[0]} empty once preprocessed ({endings[empty[0]]!r}); drop the line"
    if not all(isinstance(doc[k], str) for k in ("activity_label", "ctx_a", "ctx_b", "ctx")):
        return "has a context field (activity_label, ctx_a, ctx_b, ctx) that is not a string"
    try:
        label = int(doc["label"])
    except (TypeError, ValueError):
        return f"has label {doc['label']!r}; expected the index of the right ending"
    if not 0 <= label < len(endings):
        return f"has label {label} for {len(endings)} endings; expected 0..{len(endings) - 1}"
    return None


def _lambada_doc(doc) -> str | None:
    return None if isinstance(doc["text"], str) else f"has text {str(doc['text'])[:60]}; expected a string"


DOC_CHECKS = {"hellaswag": _hellaswag_doc, "lambada": _lambada_doc}


def load_data(task: str, path, limit: int = 0):
    """A scored task's examples: the jsonl's objects, or perplexity's (name, text) documents."""
    if task not in SCORED_TASKS:
        raise EvalDataError(f"unknown task {task!r}; GPT tasks: {', '.join(SCORED_TASKS)}")
    if task == "perplexity":
        data = read_texts(path)
    else:
        data = read_jsonl(path, JSONL_KEYS[task], DOC_CHECKS[task])
    return data[: limit or None]


def score_task(task, scorer, tokenizer, data, *, window, stride=None, conventions=("lm_eval", "nanogpt")):
    """The metrics of one scored task on `load_data`'s examples."""
    if task == "perplexity":
        return perplexity(scorer, tokenizer, data, window, stride)
    if task == "lambada":
        return lambada(scorer, tokenizer, data)
    return hellaswag(scorer, tokenizer, data, conventions)


def parse_specs(spec: str) -> list[tuple[str, str]]:
    """'hellaswag:hellaswag_val.jsonl,lambada:lambada_test.jsonl' -> [(task, path), ...]."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        task, sep, path = item.partition(":")
        if not sep or task not in SCORED_TASKS or not path:
            raise EvalDataError(
                f"eval_tasks entry {item!r} is not TASK:FILE with TASK one of {', '.join(SCORED_TASKS)}"
            )
        out.append((task, path))
    return out


class TrainingEvaluator:
    """`config.eval_tasks` during training: the files are read once (bad input fails before the
    first step), then each call scores the current parameters -> {"<task>_<metric>": value}.
    Perplexity uses windows of block_size moved by half of it."""

    def __init__(
        self, spec: str, model_config, tokenizer, *, limit: int = 0, batch_tokens=8192, devices=None
    ):
        self.tasks = [(task, load_data(task, path, limit)) for task, path in parse_specs(spec)]
        self.config, self.tokenizer = model_config, tokenizer
        self.batch_tokens, self.devices = batch_tokens, devices
        for task, data in self.tasks:  # text the tokenizer cannot encode: an error now, not at step N
            L = model_config.block_size
            score_task(task, _NoScorer(L), tokenizer, data, window=L, stride=max(1, L // 2))

    def __call__(self, params) -> dict:
        from flaxgpt.eval.scoring import Scorer

        scorer = Scorer(
            self.config, params, batch_tokens=self.batch_tokens, devices=self.devices, progress=False
        )
        L = self.config.block_size
        out = {}
        for task, data in self.tasks:
            metrics = score_task(task, scorer, self.tokenizer, data, window=L, stride=max(1, L // 2))
            out.update(
                {f"{task}_{k}": v for k, v in metrics.items() if k not in ("n", "tokens", "loglikelihoods")}
            )
        return out


class _NoScorer:
    """Scores nothing (every log-likelihood 0): runs a task's tokenization and checks alone."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def score(self, requests):
        from flaxgpt.eval.scoring import Score, check_request

        for ctx, cont in requests:
            check_request(ctx, cont, self.block_size)
        return [Score(0.0, False, len(cont)) for _, cont in requests]

    def score_choices(self, groups):
        return [self.score([(ctx, c) for c in conts]) for ctx, conts in groups]


def read_pairs(path, tokenizer=None) -> list[tuple[str, str]]:
    """source<TAB>target lines of a parallel file (the reader `prepare` uses for training data); with
    `tokenizer`, a source it cannot encode is an error naming its file and line."""
    from flaxgpt.data.prepare_seq2seq import read_tsv

    if not Path(path).is_file():
        raise EvalDataError(f"{path} does not exist or is not a file")
    rows = read_tsv(path)
    for src, _, where in rows if tokenizer is not None else ():
        try:
            tokenizer.encode(src)
        except ValueError as e:
            raise EvalDataError(f"{where}: {e}") from None
    pairs = [(src, tgt) for src, tgt, _ in rows]
    if not pairs:
        raise EvalDataError(f"{path} is empty; expected source<TAB>target lines")
    return pairs


def translation(config, params, tokenizer, pairs, *, beam_size=4, alpha=0.6, truncate=False) -> dict:
    """BLEU (sacrebleu, 13a) and exact match of an encoder-decoder's translations of the sources."""
    import sacrebleu

    from flaxgpt.decode.translate import translate

    hyps = translate(
        config, params, tokenizer, [s for s, _ in pairs], beam_size=beam_size, alpha=alpha, truncate=truncate
    )
    refs = [t for _, t in pairs]
    return {
        "n": len(pairs),
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "exact_match": _mean(h == r for h, r in zip(hyps, refs)),
        "translations": hyps,  # per example: --output's file, not the printed summary
    }


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)
