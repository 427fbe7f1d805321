"""tools.summary: counts equal the model's own, published GPT-2 figures, memory and FLOPs arithmetic."""

import json

import jax
import pytest

from flaxgpt.models import gpt, seq2seq
from flaxgpt.models.gpt import GPTConfig
from flaxgpt.tools import summary

TINY = dict(vocab_size=67, block_size=16, n_layer=2, n_head=2, n_embd=16)
TINY_CONFIGS = [
    GPTConfig(**TINY),
    GPTConfig(**TINY, tie_embeddings=False, qkv_bias=False),
    GPTConfig(**TINY, bias=False, pos_embedding="sinusoidal"),
    GPTConfig(**TINY, pad_vocab_multiple=64, scan_layers=True),
]


def closed_form(c: GPTConfig) -> dict:
    """Parameters per part by hand, from the architecture (an independent count)."""
    V, D, L, T, b = c.padded_vocab_size, c.n_embd, c.n_layer, c.block_size, int(c.bias)
    attention = L * (3 * D * D + 3 * D * int(c.qkv_bias) + D * D + D * b)
    mlp = L * (2 * 4 * D * D + (4 * D + D) * b)
    norms = (2 * L + 1) * D * (1 + b)
    return {
        "token embeddings": V * D,
        "position embeddings": T * D if c.pos_embedding == "learned" else 0,
        "attention": attention,
        "MLP": mlp,
        "layer norms": norms,
        "head": 0 if c.tie_embeddings else V * D,
    }


@pytest.mark.parametrize(
    "config", TINY_CONFIGS, ids=["default", "untied", "nobias-sinusoidal", "padded-scan"]
)
def test_counts_equal_the_model_and_a_hand_count(config):
    s = summary.summarize(config)
    abstract = gpt.abstract_params(config)
    assert s["totals"]["total"] == gpt.count_params(abstract)
    assert s["totals"]["without_position_embeddings"] == gpt.count_params(abstract, exclude_embeddings=True)
    assert sum(s["parts"].values()) == s["totals"]["total"]
    assert {k: v for k, v in s["parts"].items() if k not in ("other", "cross-attention")} == closed_form(
        config
    )
    assert s["parts"]["other"] == s["parts"]["cross-attention"] == 0


def test_counts_equal_real_weights():
    config = TINY_CONFIGS[1]
    assert summary.summarize(config)["totals"]["total"] == gpt.count_params(
        jax.jit(lambda key: gpt.init_params(config, key))(jax.random.key(0))
    )


def test_gpt2_published_figures():
    untied = summary.summarize(GPTConfig.gpt2(tie_embeddings=False, qkv_bias=False))
    assert untied["totals"]["total"] == 163_009_536
    assert untied["totals"]["tied_head"] == 124_412_160
    assert f"{untied['memory_bytes']['float32']['params'] / summary.MB:.2f}" == "621.83"
    assert untied["totals"]["total"] == gpt.count_params(
        gpt.abstract_params(GPTConfig.gpt2(tie_embeddings=False, qkv_bias=False))
    )
    tied = summary.summarize(GPTConfig.gpt2(qkv_bias=False))
    assert tied["totals"]["total"] == 124_412_160
    assert tied["totals"]["untied_head"] == 163_009_536
    # Hugging Face's parameter counts of the released checkpoints (tied head, qkv bias)
    assert summary.summarize(GPTConfig.gpt2())["totals"]["total"] == 124_439_808
    assert summary.summarize(GPTConfig.gpt2_medium())["totals"]["total"] == 354_823_168
    # Kaplan et al.'s non-embedding N ~= 12 L D^2
    n = tied["totals"]["without_embeddings"]
    assert abs(n / (12 * 12 * 768**2) - 1) < 0.01


def test_memory_and_flops_arithmetic():
    c = GPTConfig(**TINY, tie_embeddings=False)
    s = summary.summarize(c, seq_len=8)
    N = s["totals"]["total"]
    f32, bf16 = s["memory_bytes"]["float32"], s["memory_bytes"]["bfloat16"]
    assert f32 == {"params": 4 * N, "grads": 4 * N, "adam": 8 * N, "total": 16 * N}
    assert bf16 == {k: v // 2 for k, v in f32.items()}
    # untied: the wte lookup costs nothing, lm_head is a matmul; wpe is a lookup
    n_matmul = N - 16 * 16 - 67 * 16
    attn = 2 * 2 * 8 * 8  # L * H * Q * T
    assert s["flops"] == {
        "seq_len": 8,
        "n_matmul": n_matmul,
        "attention_layers": 2,
        "train": 6 * n_matmul + 12 * attn,
        "forward": 2 * n_matmul + 4 * attn,
    }
    # tied GPT-2 at T=1024: nanoGPT's estimate_mfu count, 6 N + 12 L H Q T with N = params - wpe
    g = summary.summarize(GPTConfig.gpt2())
    assert g["flops"]["train"] == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 12 * 64 * 1024


def test_seq2seq_counts_equal_the_model():
    for share in (True, False):
        c = seq2seq.TransformerConfig.preset("tiny", vocab_size=50, tie_embeddings=share)
        s = summary.summarize(c)
        assert s["totals"]["total"] == gpt.count_params(seq2seq.abstract_params(c))
        assert s["parts"]["cross-attention"] > 0 and s["parts"]["other"] == 0
        assert s["parts"]["position embeddings"] == 0  # sinusoidal
        assert s["totals"]["tied_head"] + 2 * 50 * 64 == s["totals"]["untied_head"]
        # per target token, source as long: 2 encoder layers + 2 x 2 decoder layers of attention
        n = s["totals"]["total"] - (0 if share else 2 * 50 * 64)  # untied: both lookups are free
        assert s["flops"]["train"] == 6 * n + 12 * (2 + 2 * 2) * 4 * 16 * 256


def test_cli_preset_with_overrides(capsys):
    s = summary.main(["--preset", "gpt2", "--tie_embeddings=false", "--qkv_bias", "false"])
    out = capsys.readouterr().out
    assert s["totals"]["total"] == 163_009_536
    assert "163,009,536" in out and "621.83" in out and "6N + 12*L*H*Q*T" in out
    summary.main(["--preset", "gpt2", "--json", "--n_layer=2"])
    assert json.loads(capsys.readouterr().out)["config"]["n_layer"] == 2
    s = summary.main(["--preset", "tiny", "--vocab_size=50", "--pre_ln=false"])  # the encoder-decoder
    assert s["config"]["n_embd"] == 64 and "cross-attention" in capsys.readouterr().out


def test_cli_config_file_and_run_dir(tmp_path, capsys):
    # a recipe in the style of configs/default.py: one dropout, one bias, vocab from the data
    (tmp_path / "recipe.py").write_text(
        "import ml_collections\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
        "    c.model = ml_collections.ConfigDict(dict(kind='gpt', vocab_size=0, block_size=16, n_layer=2,\n"
        "        n_head=2, n_embd=16, dropout=0.1, bias=True, pos_embedding='learned', activation='gelu',\n"
        "        tie_embeddings=True, dtype='float32', param_dtype='float32', pad_vocab_multiple=1,\n"
        "        attention_impl='xla', scan_layers=False, remat='none'))\n"
        f"    c.data = ml_collections.ConfigDict(dict(dir={str(tmp_path)!r}))\n    return c\n"
    )
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 67}))
    s = summary.main(["--config", str(tmp_path / "recipe.py"), "--tie_embeddings=false"])
    expected = GPTConfig(**TINY, tie_embeddings=False)
    assert s["totals"]["total"] == gpt.count_params(gpt.abstract_params(expected))
    assert "vocab_size 67 from the dataset's meta.json" in capsys.readouterr().out
    # a run directory's config.json holds GPTConfig's own fields
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **expected.to_dict()}}))
    assert summary.main(["--run", str(run)])["totals"] == s["totals"]


def test_cli_errors_are_one_line(capsys):
    with pytest.raises(SystemExit):
        summary.main(["--preset", "gpt2", "--n_layr=3"])
    assert "unknown model field 'n_layr'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main(["--preset", "gpt2", "--tie_embeddings=maybe"])
    assert "expected true or false" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main(["--preset", "gpt2", "--n_embd=abc"])
    assert "--n_embd=abc: invalid literal for int()" in capsys.readouterr().err
