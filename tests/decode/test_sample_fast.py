"""sample.py --quantize and --draft on tiny run directories: output and one-line errors."""

import json
import sys
from pathlib import Path

import jax
import pytest

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models.gpt import LLAMA_STYLE, GPTConfig, init_params
from flaxgpt.runs.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import sample  # noqa: E402

CHARS = sorted(set("abcdefghij ROMEO:\n"))


def write_run(out, chars, n_layer, n_embd, seed, **arch):
    cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=n_layer, n_head=2, n_embd=n_embd, **arch)
    (out / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **cfg.to_dict()}}))
    (out / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(chars).to_meta()}))
    # larger than the 0.02 init: peaked predictions, so greedy text is not a run of ties
    params = jax.tree_util.tree_map(lambda x: 6 * x, init_params(cfg, jax.random.key(seed)))
    ckpt = Checkpointer(out, async_save=False)
    ckpt.save(1, {"params": params}, extra={})
    ckpt.close()
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mk = lambda name: tmp_path_factory.mktemp(name)  # noqa: E731
    return {
        "target": write_run(mk("target"), CHARS, 2, 32, 0),
        "draft": write_run(mk("draft"), CHARS, 1, 16, 1),
        "other_vocab": write_run(mk("other"), CHARS[:-1], 1, 16, 2),
        "big": write_run(mk("big"), CHARS, 3, 32, 3),
        "other_chars": write_run(mk("chars"), sorted(set(CHARS[:-1] + ["z"])), 1, 16, 4),
        # a Mixtral-shaped mixture of experts: 4 experts, top-2
        "moe": write_run(mk("moe"), CHARS, 2, 32, 5, **LLAMA_STYLE, num_experts=4, expert_hidden=32),
    }


def run_sample(capsys, *args):
    code = sample.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


GREEDY = ["--start", "ROMEO:", "--max_new_tokens", "30", "--temperature", "0"]


def test_quantized_and_speculative_greedy(runs, capsys):
    code, plain, _ = run_sample(capsys, "--out_dir", runs["target"], *GREEDY)
    assert code == 0 and plain.startswith("ROMEO:")
    code, spec, err = run_sample(capsys, "--out_dir", runs["target"], *GREEDY, "--draft", runs["draft"])
    assert code == 0 and spec == plain  # speculative greedy is greedy
    assert "speculative:" in err and "accepted" in err
    # int8 weights for both models; greedy quantized text need not equal float32's
    args = ["--out_dir", runs["target"], *GREEDY, "--draft", runs["draft"], "--quantize", "int8"]
    code, out, _ = run_sample(capsys, *args)
    assert code == 0 and out.startswith("ROMEO:") and len(out) == len(plain)


def test_mixture_of_experts_run(runs, capsys):
    """sample.py over an MoE run: greedy text, and with int8 experts (speculative decoding with an MoE
    target: tests/decode/test_speculative.py)."""
    code, plain, _ = run_sample(capsys, "--out_dir", runs["moe"], *GREEDY)
    assert code == 0 and plain.startswith("ROMEO:")
    code, out, _ = run_sample(capsys, "--out_dir", runs["moe"], *GREEDY, "--quantize", "int8")
    assert code == 0 and out.startswith("ROMEO:") and len(out) == len(plain)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--quantize", "int3"], "unknown quantization mode 'int3'; choose one of int8, bf16, int4"),
        (
            ["--draft", "other_vocab"],
            f"the draft's vocabulary has {len(CHARS) - 1} tokens, the target's {len(CHARS)}",
        ),
        (["--draft", "other_chars"], "the draft's tokenizer (char) differs from the target's (char)"),
        (["--draft", "big"], "not fewer than the target's"),
        (  # the window speculative decoding does not slide, with the flags that fit it
            ["--draft", "draft", "--max_new_tokens", "60"],
            "is past the context of 64 tokens, which speculative decoding does not slide; "
            "pass --max_new_tokens 53, or drop --draft",
        ),
        (["--draft", "draft", "--draft_tokens", "60"], "pass --draft_tokens 27, or drop --draft"),
        (["--draft", "draft", "--draft_tokens", "-1"], "--draft_tokens must be >= 1, got -1"),
    ],
)
def test_bad_input_is_one_line(runs, capsys, args, message):
    args = [runs.get(x, x) for x in args]
    code, out, err = run_sample(capsys, "--out_dir", runs["target"], *GREEDY, *args)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_load_run_quantized(runs):
    from flaxgpt import loader
    from flaxgpt.models import quantize

    run = loader.load(runs["target"], quantize="int8")
    assert quantize.is_quantized(run.params) and not run.config.tie_embeddings
    assert run.params["lm_head"]["kernel"] is run.params["wte"]["embedding"]  # one table, shared
    with pytest.raises(ValueError, match="unknown quantization mode 'fp8'"):
        loader.load(runs["target"], quantize="fp8")


def test_one_tokenizer_json_in_two_directories_is_one_tokenizer(tmp_path):
    """--draft with a Llama/Qwen target: its draft's directory holds a copy of the same tokenizer.json
    (every such pair was refused: 'the draft's tokenizer (hf) differs from the target's (hf)')."""
    import shutil

    from flaxgpt.data.hf_tokenizer import HFTokenizer
    from tests.serve.test_tools import make_tool_dir

    target = HFTokenizer(make_tool_dir(tmp_path / "target", "hermes"))
    (tmp_path / "draft").mkdir()
    shutil.copy(tmp_path / "target" / "tokenizer.json", tmp_path / "draft" / "tokenizer.json")
    other = HFTokenizer(make_tool_dir(tmp_path / "other", "mistral"))
    assert (
        sample.identity(target) == sample.identity(HFTokenizer(tmp_path / "draft")) != sample.identity(other)
    )
