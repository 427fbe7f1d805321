"""flaxgpt.eval.evaluate against the references: lm-evaluation-harness (HellaSwag, LAMBADA) and a direct
transformers computation (perplexity, build-nanogpt's HellaSwag), on a tiny random GPT-2 and task
files the tests write. No download."""

import json
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flaxgpt.data.tokenizers import get_tokenizer  # noqa: E402
from flaxgpt.eval import evaluate as fe  # noqa: E402
from flaxgpt.eval import tasks as et  # noqa: E402

WORDS = (
    "the a cat dog runs quickly over lazy fox jumps into house then water, she he cuts bowl [title]".split()
)
BLOCK = 64


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_hellaswag(path, rng, n: int) -> None:
    """n random HellaSwag-format examples (4 endings each) drawn with rng."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = sentence(rng, rng.randint(3, 12)), sentence(rng, rng.randint(1, 4))
            endings = [sentence(rng, rng.randint(1, 8)) + rng.choice(["", ".", " [step]"]) for _ in range(4)]
            doc = {"activity_label": "Baking [x]", "ctx_a": a, "ctx_b": b, "ctx": a + " " + b.capitalize()}
            f.write(json.dumps({**doc, "endings": endings, "label": str(rng.randint(0, 3)), "ind": i}) + "\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random GPT-2 (block 64) saved as Hugging Face files, and small task files."""
    from flaxgpt.eval.reference import write_gpt2_tokenizer

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=BLOCK)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(root / "model")
    write_gpt2_tokenizer(root / "model")
    rng = random.Random(0)
    write_hellaswag(root / "hellaswag.jsonl", rng, 10)
    with open(root / "lambada.jsonl", "w") as f:
        for n in (5, 9, 14, 3, 20, 7, 11, 90):  # 90 words: more than the window, cut on the left
            f.write(json.dumps({"text": sentence(rng, n)}) + "\n")
    (root / "text.txt").write_text(" ".join(sentence(rng, 12) + "." for _ in range(12)))
    return root, model


def run_eval(root, *args):
    out = root / "out.json"
    fe.main(["--init_from", str(root / "model"), "--no_progress", "--output", str(out), *args])
    return json.loads(out.read_text())


def test_matches_lm_eval_example_by_example(files, tmp_path):
    pytest.importorskip("lm_eval")
    from flaxgpt.eval.reference import run_lm_eval

    root, _ = files
    data = {"hellaswag": root / "hellaswag.jsonl", "lambada": root / "lambada.jsonl"}
    ref = run_lm_eval(root / "model", data, tmp_path / "tasks", batch_size=8)
    ours = {
        t: run_eval(root, "--task", t, "--data", str(p), "--convention", "lm_eval") for t, p in data.items()
    }
    np.testing.assert_allclose(
        ours["hellaswag"]["loglikelihoods"], ref["hellaswag"]["loglikelihoods"], atol=1e-4
    )
    np.testing.assert_allclose(ours["lambada"]["loglikelihoods"], ref["lambada"]["loglikelihoods"], atol=1e-4)
    assert ours["hellaswag"]["acc"] == ref["hellaswag"]["acc"]
    assert ours["hellaswag"]["acc_norm"] == ref["hellaswag"]["acc_norm"]
    assert ours["lambada"]["acc"] == ref["lambada"]["acc"]
    assert ours["lambada"]["ppl"] == pytest.approx(ref["lambada"]["perplexity"], rel=1e-5)


def torch_logprobs(model, ids):
    """Log-probabilities of ids[1:] given the prefix, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_hellaswag_nanogpt_convention_matches_transformers(files):
    root, model = files
    ours = run_eval(
        root, "--task", "hellaswag", "--data", str(root / "hellaswag.jsonl"), "--convention", "nanogpt"
    )
    tok = get_tokenizer("gpt2")
    hits = hits_norm = 0
    docs = et.read_jsonl(root / "hellaswag.jsonl")
    for d in docs:  # build-nanogpt's hellaswag.py: raw ctx, " " + ending, losses over ending tokens
        ctx = tok.encode(d["ctx"])
        losses = [-torch_logprobs(model, ctx + tok.encode(" " + e))[len(ctx) - 1 :] for e in d["endings"]]
        hits += int(np.argmin([x.sum() for x in losses])) == int(d["label"])
        hits_norm += int(np.argmin([x.mean() for x in losses])) == int(d["label"])
    assert ours["acc_nanogpt"] == hits / len(docs)
    assert ours["acc_norm_nanogpt"] == hits_norm / len(docs)
    assert "acc" not in ours


def test_perplexity_matches_the_hf_guide_with_transformers(files):
    root, model = files
    text = (root / "text.txt").read_text()
    ids = get_tokenizer("gpt2").encode(text)
    window, stride = 40, 16
    assert len(ids) > 3 * window
    nll, n, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):  # the Hugging Face perplexity guide, token-weighted
        end = min(begin + window, len(ids))
        trg = end - prev_end
        lp = torch_logprobs(model, ids[begin:end])
        nll, n = nll - lp[-min(trg, len(lp)) :].sum(), n + min(trg, len(lp))
        prev_end = end
        if end == len(ids):
            break
    ours = run_eval(
        root, "--task", "perplexity", "--data", str(root / "text.txt"), "--window", "40", "--stride", "16"
    )
    assert ours["tokens"] == n == len(ids) - 1
    assert ours["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert ours["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert ours["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-5)
    assert ours["word_ppl"] == pytest.approx(math.exp(nll / len(text.split())), rel=1e-5)


def test_windows_score_every_token_once():
    for n, window, stride in [(1, 8, 4), (2, 8, None), (8, 8, None), (50, 8, 3), (50, 8, 7), (17, 16, 5)]:
        spans = et.windows(n, window, stride)
        scored = [t for _, first, end in spans for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= window and begin < first for begin, first, end in spans)
    # no overlap (the guide's stride = window): a window's first token has no context, so is skipped
    scored = [t for _, first, end in et.windows(20, 8, 8) for t in range(first, end)]
    assert scored == [t for t in range(1, 20) if t % 8]


def test_encode_pair_and_preprocess_are_lm_eval_s():
    lm_eval_utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils")
    for text in ["Baking [title] How to bake. [step]  Mix it.", "  a  [x] b [title] c  "]:
        assert et.preprocess(text) == lm_eval_utils.preprocess(text)
    tok = get_tokenizer("gpt2")
    ctx, cont = et.encode_pair(tok, "The cat sat ", "on the mat")
    assert (ctx, cont) == (tok.encode("The cat sat"), tok.encode(" on the mat"))
    assert et.encode_pair(tok, "", "hi") == ([tok.eot_id], tok.encode("hi"))


def test_encode_pair_starts_with_bos_where_the_tokenizer_does(tmp_path):
    """lm-eval's rules for a Llama-style tokenizer (its post-processor adds <s>; lm-eval >= 0.4.13
    leaves BOS to the tokenizer): the context starts with BOS, once; an empty context is BOS (GPT-2's
    BOS and end-of-text are one token). The reference: transformers' encode with its defaults."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from flaxgpt.data.hf_tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([" ".join(WORDS * 20)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ours = HFTokenizer(tmp_path)
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>"
    )
    for context, continuation in [("the cat runs ", "over the dog"), ("<s>the cat", " runs"), ("a", " b")]:
        kw = {"add_special_tokens": not context.startswith("<s>")}  # lm-eval's has_bos_prefix
        context_ids = ref.encode(context.rstrip(), **kw)
        whole = ref.encode(context.rstrip() + context[len(context.rstrip()) :] + continuation, **kw)
        assert et.encode_pair(ours, context, continuation) == (context_ids, whole[len(context_ids) :])
    assert et.encode_pair(ours, "", " the cat") == ([1], ref.encode(" the cat", add_special_tokens=False))
    assert et.encode_pair(ours, "", "<s> the") == ([1], ref.encode(" the", add_special_tokens=False))
    assert et.encode_pair(ours, "  ", "cat") == ([1], ref.encode("  cat", add_special_tokens=False))


def test_scores_are_the_models_own_soft_capped_log_probabilities():
    """Gemma 2's final soft-cap: the scorer's log-probabilities are the model's own logits' (it took the
    head's raw output: 0.76 nats off on LAMBADA for a cap of 2)."""
    import jax

    from flaxgpt.eval.scoring import Scorer
    from flaxgpt.models.gpt import GPT, GPTConfig, init_params

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32, logit_softcap=2.0)
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: 8 * x, params)  # logits well past the cap
    ids = [int(t) for t in jax.random.randint(jax.random.key(1), (12,), 0, 64)]
    logits = GPT(cfg).apply({"params": params}, np.array([ids[:-1]]))[0]
    want = float(jax.nn.log_softmax(logits.astype(np.float32))[np.arange(7, 11), ids[8:]].sum())
    scorer = Scorer(cfg, params, progress=False)
    assert scorer.score([(ids[:8], ids[8:])])[0].logprob == pytest.approx(want, rel=1e-5)
    assert scorer.score_choices([(ids[:8], [ids[8:]])])[0][0].logprob == pytest.approx(want, rel=1e-5)


def one_line_error(capsys, *args):
    assert fe.cli([*args, "--no_progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_input_is_one_line(files, tmp_path, capsys):
    root, _ = files
    model = ["--init_from", str(root / "model")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\n\n{"text": "a b\n')
    assert f"{bad}:3 is not valid JSON" in one_line_error(
        capsys, *model, "--task", "lambada", "--data", str(bad)
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    assert "is empty" in one_line_error(capsys, *model, "--task", "lambada", "--data", str(empty))
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"ctx": "x"}\n')
    assert "missing.jsonl:1 lacks" in one_line_error(
        capsys, *model, "--task", "hellaswag", "--data", str(missing)
    )
    err = one_line_error(capsys, *model, "--task", "perplexity", "--data", str(root / "text.txt"))
    assert "more than the window of 64; pass --stride" in err
    # docs that scored as a traceback (IndexError, ZeroDivisionError) or silently as a miss
    doc = {
        "activity_label": "A",
        "ctx_a": "a b",
        "ctx_b": "c",
        "ctx": "a b c",
        "endings": ["x", "y"],
        "label": 0,
    }
    for change, needle in [
        ({"endings": []}, "expected a list of at least 2 strings"),
        ({"endings": ["x", "[title]"]}, "ending 1 empty once preprocessed"),
        ({"label": 7}, "label 7 for 2 endings"),
        ({"label": ""}, "label ''; expected the index of the right ending"),
    ]:
        bad.write_text(json.dumps(doc) + "\n" + json.dumps({**doc, **change}) + "\n")
        err = one_line_error(capsys, *model, "--task", "hellaswag", "--data", str(bad))
        assert f"{bad}:2 has " in err and needle in err, err
    # an ending longer than the model's window: the scorer's error named no example
    bad.write_text(json.dumps(doc) + "\n\n" + json.dumps({**doc, "endings": ["x", "y " * 100]}) + "\n")
    err = one_line_error(capsys, *model, "--task", "hellaswag", "--data", str(bad))
    assert f"{bad}:3: a continuation of " in err, err
    bad.write_text('{"text": ["a", "list"]}\n')
    assert "has text ['a', 'list']; expected a string" in one_line_error(
        capsys, *model, "--task", "lambada", "--data", str(bad)
    )


def test_tokenizer_mismatch_is_one_line(files, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root, _ = files
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((root / "model" / name).read_bytes())
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(other / "tokenizer.json"))
    args = ["--init_from", str(other), "--task", "lambada", "--data", str(root / "lambada.jsonl")]
    assert "tokenizer mismatch" in one_line_error(capsys, *args)


def save_run(out, model_config, tokenizer_meta, params, step=3):
    from flaxgpt.models import registry as models
    from flaxgpt.runs.checkpoint import Checkpointer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model": models.section_of(model_config)}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_meta}))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(step, {"params": params}, extra={})
    ckpt.close()
    return out


def test_run_directory_perplexity_and_metrics_line(tmp_path, capsys):
    import jax

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.models.gpt import GPTConfig, init_params

    chars = sorted(set("abcdefgh .\n"))
    cfg = GPTConfig(vocab_size=len(chars), block_size=32, n_layer=1, n_head=2, n_embd=16)
    params = init_params(cfg, jax.random.key(0))
    run = save_run(tmp_path / "run", cfg, CharTokenizer(chars).to_meta(), params)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("abc def. " * 10)
    (tmp_path / "texts" / "b.txt").write_text("hgf edc\n" * 3)
    args = ["--out_dir", str(run), "--task", "perplexity", "--data", str(tmp_path / "texts"), "--stride", "8"]
    r = fe.main([*args, "--no_progress"])
    assert r["n"] == 2 and r["tokens"] == 90 - 1 + 24 - 1 and r["step"] == 3
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 3 and row["perplexity_ppl"] == pytest.approx(r["ppl"])
    # a run it may not write to (here metrics.jsonl cannot be opened, even by root): the scores print,
    # with a note, and the command succeeds; an --output it could not write fails before scoring
    (run / "metrics.jsonl").rename(run / "kept.jsonl")
    (run / "metrics.jsonl").mkdir()
    capsys.readouterr()
    assert fe.cli([*args, "--no_progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ppl"] == pytest.approx(r["ppl"])
    assert err.startswith("note: the scores were not added")
    (run / "metrics.jsonl").rmdir()
    err = one_line_error(capsys, *args, "--output", str(tmp_path / "nowhere" / "r.json"))
    assert "which does not exist; pass a file path in an existing directory" in err
    # a run whose tokenizer has more tokens than its model's vocabulary
    (run / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer([*chars, "z"]).to_meta()}))
    assert "tokenizer mismatch" in one_line_error(capsys, *args)


def test_translation_bleu_and_exact_match_of_a_seq2seq_run(tmp_path, capsys, monkeypatch):
    import jax
    import sacrebleu

    from flaxgpt.data.tokenizers import CharTokenizer, Seq2SeqTokenizer
    from flaxgpt.decode.translate import translate
    from flaxgpt.models import seq2seq

    tok = Seq2SeqTokenizer(CharTokenizer(list("abcd")))
    cfg = seq2seq.TransformerConfig.from_dict(
        dict(
            vocab_size=tok.vocab_size,
            block_size=12,
            n_enc_layer=1,
            n_dec_layer=1,
            n_embd=16,
            d_ff=32,
            n_head=2,
        )
    )
    params = seq2seq.init_params(cfg, jax.random.key(0))
    run = save_run(tmp_path / "run", cfg, tok.to_meta(), params)
    pairs = [("abc", "cba"), ("dd", "dd"), ("abcd", "dcba")]
    (tmp_path / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    args = ["--out_dir", str(run), "--task", "translation", "--data", str(tmp_path / "pairs.tsv")]
    r = fe.main([*args, "--beam_size", "1", "--output", str(tmp_path / "out.json")])
    hyps = translate(cfg, params, tok, [s for s, _ in pairs], beam_size=1)
    assert r["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [[t for _, t in pairs]]).score)
    assert r["exact_match"] == sum(h == t for h, (_, t) in zip(hyps, pairs)) / 3
    # --output holds each translation (it held the summary alone); the printed summary does not
    assert json.loads((tmp_path / "out.json").read_text())["translations"] == hyps
    assert '"translations"' not in capsys.readouterr().out
    assert "does not apply to a 'seq2seq' model" in one_line_error(
        capsys, *args[:2], "--task", "lambada", "--data", "x"
    )
    # --dtype is the encoder-decoder's compute dtype too (it was left float32); another task's flags are
    # refused, not left unused
    seen, real = [], et.translation
    monkeypatch.setattr(
        et, "translation", lambda config, *a, **k: seen.append(config.dtype) or real(config, *a, **k)
    )
    fe.main([*args, "--beam_size", "1", "--dtype", "bfloat16"])
    assert seen == ["bfloat16"]
    err = one_line_error(capsys, *args, "--batch_tokens", "64", "--window", "4")
    assert "--window, --batch_tokens apply to perplexity, hellaswag and lambada only" in err
    err = one_line_error(capsys, *args[:3], "perplexity", "--data", "x", "--beam_size", "2")
    assert "--beam_size applies to translation only, not --task perplexity" in err
    (tmp_path / "pairs.tsv").write_text("abc\tcba\nabz\tzba\n")  # a character the run never saw: where
    assert "pairs.tsv:2: characters not in the vocabulary: 'z'" in one_line_error(capsys, *args)


def test_training_evaluator_reads_once_and_scores(files):
    from flaxgpt.hf import pretrained as hf

    root, _ = files
    config, params = hf.load_pretrained(str(root / "model"))
    spec = f"hellaswag:{root / 'hellaswag.jsonl'}, perplexity:{root / 'text.txt'}"
    evaluator = et.TrainingEvaluator(spec, config, get_tokenizer("gpt2"), limit=4)
    out = evaluator(params)
    assert {"hellaswag_acc_norm", "hellaswag_acc_norm_nanogpt", "perplexity_ppl", "perplexity_loss"} <= set(
        out
    )
    assert out == evaluator(params)
    with pytest.raises(et.EvalDataError, match="not TASK:FILE"):
        et.TrainingEvaluator("hellaswag", config, get_tokenizer("gpt2"))
    with pytest.raises(et.EvalDataError, match="does not exist"):
        et.TrainingEvaluator("lambada:nowhere.jsonl", config, get_tokenizer("gpt2"))
