"""A Llama model directory through the tools: its tokenizer.json, prepare, sample.py.

A tiny random Llama and a byte-level BPE trained here (BOS added by its post-processor, as
Llama's tokenizer.json does) stand in for a published model: nothing is downloaded.
"""

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flaxgpt.data import prepare, tokenizers
from flaxgpt.data.hf_tokenizer import HFTokenizer
from flaxgpt.hf import pretrained as hf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import sample  # noqa: E402
from tests.hf.test_llama import make_hf_model, torch_greedy  # noqa: E402
from tests.serve.test_serve import serving_in_thread  # noqa: E402

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(100))


def make_tokenizer(directory):
    """Byte-level BPE of at most 300 ids; <unk> <s> </s> are ids 0 1 2 (the model's bos/eos)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(directory, "tokenizer.json"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_with_tokenizer")
    model = make_hf_model("llama", str(directory))
    make_tokenizer(str(directory))
    return directory, model


def test_tokenizer_json_bos_eos_and_meta(llama_dir):
    directory, _ = llama_dir
    tok = hf.load_tokenizer(str(directory))
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id, tok.eot_id) == (1, 2, 2)  # config.json
    assert tok.add_bos  # its post-processor starts sequences with <s>
    ids = tok.encode("the lazy dog")  # no special tokens, as tiktoken's encode
    assert 1 not in ids and tok.decode(ids) == "the lazy dog" and max(ids) < 300
    assert tokenizers.encode_prompt(tok, "the lazy dog", 100) == [1] + ids
    with pytest.warns(UserWarning, match=r"prompt of 4 tokens is longer than the context \(3\); keeping"):
        assert tokenizers.encode_prompt(tok, "the lazy dog", 3) == [1] + ids[-2:]  # BOS stays first
    assert tokenizers.encode_prompt(tok, "", 100) == [1]
    again = tokenizers.from_meta(json.loads(json.dumps(tok.to_meta())))
    assert again.encode("fox") == tok.encode("fox") and again.bos_id == 1
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(directory / "nowhere")


def test_prepare_with_the_models_tokenizer(llama_dir, tmp_path):
    directory, _ = llama_dir
    (tmp_path / "in.txt").write_text(TEXT)
    args = ["--dataset", "text", "--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "d")]
    meta = prepare.main(args + ["--tokenizer", str(directory)])
    assert meta["tokenizer"]["kind"] == "hf" and meta["vocab_size"] <= 300
    ids = np.concatenate([np.fromfile(tmp_path / f"d/{s}.bin", np.uint16) for s in ("train", "val")])
    assert ids[0] == 1 and tokenizers.from_meta(meta["tokenizer"]).decode(ids) == TEXT
    with pytest.raises(prepare.PrepareError, match="--tokenizer nope: no tokenizer.json"):
        prepare.main(args + ["--tokenizer", "nope", "--overwrite"])


def test_sample_cli_greedy_equals_transformers(llama_dir, capsys):
    directory, model = llama_dir
    tok = HFTokenizer(directory)
    prompt = "the quick"
    code = sample.main(
        ["--init_from", str(directory), "--start", prompt, "--temperature", "0", "--max_new_tokens", "8"]
    )
    out = capsys.readouterr().out
    ids = [tok.bos_id] + tok.encode(prompt)  # BOS first, as transformers' tokenizer gives it
    new = torch_greedy(model, ids, 8)
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new  # sample.py stops at EOS
    want = tok.decode(ids + new)
    assert code == 0 and out == want + "\n"


def test_sample_cli_stops_at_any_of_the_models_end_tokens(llama_dir, tmp_path, capsys):
    """generation_config's eos_token_id list (Llama 3.1 Instruct's three): the reply ends at the first
    of them to come, as transformers' generate ends it (it ran on past all but the first)."""
    directory, model = llama_dir
    tok = HFTokenizer(directory)
    ids = [tok.bos_id] + tok.encode("the quick")
    new = torch_greedy(model, ids, 8)
    k = next(i for i, t in enumerate(new) if i >= 2 and t not in new[:i] and t != tok.eos_id)
    for name in os.listdir(directory):  # copies: the tokenizer reads the ids beside its resolved file
        if name != "generation_config.json":
            shutil.copy(directory / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, new[k]]}))
    want = tok.decode(ids + new[: next(i for i, t in enumerate(new) if t in (tok.eos_id, new[k]))])
    for more in ([], ["--num_samples", "2"]):  # streamed, and whole
        args = ["--init_from", str(tmp_path), "--start", "the quick", "--temperature", "0"]
        assert sample.main([*args, "--max_new_tokens", "8", *more]) == 0
        assert capsys.readouterr().out.split("\n")[0] == want


def test_sample_cli_needs_the_tokenizer(llama_dir, tmp_path, capsys):
    directory, _ = llama_dir
    for name in os.listdir(directory):
        if name != "tokenizer.json":
            os.symlink(directory / name, tmp_path / name)
    assert sample.main(["--init_from", str(tmp_path), "--start", "a", "--max_new_tokens", "2"]) == 1
    assert "no tokenizer.json in" in capsys.readouterr().err


def test_finetune_with_fsdp_then_export_back(llama_dir, tmp_path):
    """prepare -> train.py --config configs/finetune_llama.py (init_from the directory, FSDP over 2
    devices) -> flaxgpt hf export -> transformers loads it, logits equal to the checkpoint's."""
    import jax
    import torch
    import transformers

    from flaxgpt.runs.run_dir import load_run
    from tests.hf.test_llama import flax_logits
    from tests.train.test_train_cli import run

    directory, _ = llama_dir
    (tmp_path / "in.txt").write_text(TEXT)
    args = ["--dataset", "text", "--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "d")]
    prepare.main(args + ["--tokenizer", str(directory)])
    overrides = dict(
        init_from=directory, out_dir=tmp_path / "run", max_iters=3, batch_size=4, grad_accum=1,
        eval_interval=3, eval_iters=1, **{"data.dir": tmp_path / "d", "model.block_size": 32,
        "model.dtype": "float32", "mesh.fsdp": 2, "optim.warmup_steps": 0},
    )  # fmt: skip
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    r = run([str(ROOT / "train.py"), f"--config={ROOT}/configs/finetune_llama.py", *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((tmp_path / "run/config.json").read_text())["model"]
    assert (saved["n_kv_head"], saved["pos_embedding"], saved["scan_layers"]) == (2, "rope", True)
    from flaxgpt import hf_cli

    assert hf_cli.main(["export", "--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf/tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    run = load_run(tmp_path / "run")
    assert isinstance(run.tokenizer, HFTokenizer)  # meta.json's "hf" tokenizer, read back
    tokens = np.asarray([run.tokenizer.encode("the lazy dog jumps")])
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = flax_logits(run.config, jax.device_get(run.params), tokens)
    np.testing.assert_allclose(ref, ours, atol=1e-4, rtol=0)


def test_serve_a_llama_directory_over_http(llama_dir):
    """serve.py's loader on a Llama directory: its tokenizer.json (BOS first), greedy == transformers."""
    import httpx

    from flaxgpt.serve import launch, server

    directory, model = llama_dir
    run, name = launch.load(init_from=str(directory))
    tok = run.tokenizer
    assert isinstance(tok, HFTokenizer) and name == Path(directory).name
    # chunks of 32 prompt tokens: 3 prefill programs to compile, not one per bucket up to 64
    sched = launch.scheduler_for(run.config, run.params, tok, slots=2, max_len=64, prefill_chunk=32)
    sched.start()
    app = server.create_app(sched, tok, model=name, max_len=64, vocab_size=run.config.vocab_size)
    prompt = "the quick"
    with serving_in_thread(app) as url:
        assert sched.ready.wait(timeout=300)
        body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    sched.close()
    ids = [tok.bos_id] + tok.encode(prompt)
    new = torch_greedy(model, ids, 8)
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new  # the server stops at EOS
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(new)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
