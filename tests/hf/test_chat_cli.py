"""Chat SFT through the tools on a tiny Llama with a Llama 3 chat template: prepare --dataset chat
(packed rows, masks, errors), train.py --config configs/sft_llama.py, sample.py --chat, and
POST /v1/chat/completions through the official openai client. Nothing is downloaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from flaxgpt.data import chat, packing, prepare
from flaxgpt.data.hf_tokenizer import HFTokenizer
from tests.data.test_chat import make_chat_dir
from tests.hf.test_llama import make_hf_model, torch_greedy

ROOT = Path(__file__).resolve().parents[2]


def conversations(n):
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"what is {i} plus {i}?"}]
        turns.append({"role": "assistant", "content": f"it is {2 * i}."})
        if i % 3 == 0:  # some longer: several turns, a system prompt
            turns = [{"role": "system", "content": "Be brief."}, *turns]
            turns += [
                {"role": "user", "content": f"and {i} plus 1?"},
                {"role": "assistant", "content": f"{i + 1}."},
            ]
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_chat")
    model = make_hf_model("llama", str(directory))
    make_chat_dir(directory, "llama3")
    return directory, model


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prep(tmp_path, directory, records, *extra):
    convs = write_jsonl(tmp_path / "convs.jsonl", records)
    args = [
        "--dataset",
        "chat",
        "--input",
        str(convs),
        "--hf_dir",
        str(directory),
        "--out_dir",
        str(tmp_path / "d"),
    ]
    return prepare.main(args + list(extra))


def test_prepare_chat_packs_rows_with_assistant_masks(chat_dir, tmp_path):
    directory, _ = chat_dir
    records = conversations(12)
    meta = prep(tmp_path, directory, records, "--block_size", "128", "--val_fraction", "0.25")
    assert meta["kind"] == "packed" and (meta["train_examples"], meta["val_examples"]) == (9, 3)
    assert meta["train_rows"] < 9 and 0 <= meta["train_padding"] < 0.5
    data = packing.PackedData(tmp_path / "d")
    tok = HFTokenizer(directory)
    train = data.splits["train"]
    # every training conversation is one segment: its ids, and its targets masked as assistant_mask says
    want = {}
    for r in records[:9]:
        ids, mask = chat.assistant_mask(tok, chat.check_messages(r["messages"]))
        want[tuple(ids.tolist())] = mask.tolist()
    got = {}
    for r in range(len(train["inputs"])):
        for s in range(1, int(train["segment_ids"][r].max()) + 1):
            at = np.asarray(train["segment_ids"][r]) == s
            ids = np.r_[np.asarray(train["inputs"][r])[at][:1], np.asarray(train["targets"][r])[at]]
            got[tuple(ids.tolist())] = [0] + np.asarray(train["loss_mask"][r])[at].tolist()
    assert got == want
    b1 = data.batch("train", 3, 2, seed=5, process_index=1, process_count=2)
    b2 = data.batch("train", 3, 2, seed=5, process_index=1, process_count=2)
    assert all(
        np.array_equal(b1[k], b2[k]) for k in packing.FIELDS
    )  # a pure function of (seed, step, process)


def test_prepare_chat_bad_input_is_one_line_and_writes_nothing(chat_dir, tmp_path):
    directory, _ = chat_dir
    long = {"messages": [{"role": "user", "content": "hi " * 200}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(
        prepare.PrepareError, match=r"convs.jsonl line 2: the conversation has \d+ tokens, more "
    ):
        prep(tmp_path, directory, [*conversations(1), long, *conversations(2)], "--block_size", "128")
    assert not (tmp_path / "d").exists()
    cases = {
        "has no assistant turn": [{"messages": [{"role": "user", "content": "hi"}]}],
        "has role 'robot'": [{"messages": [{"role": "robot", "content": "hi"}]}],
    }
    for message, records in cases.items():
        with pytest.raises(prepare.PrepareError, match=f"convs.jsonl line 1.*{message}"):
            prep(tmp_path, directory, records, "--block_size", "128")
        assert not (tmp_path / "d").exists()
    bare = make_chat_dir(tmp_path / "bare", None)
    with pytest.raises(prepare.PrepareError, match="has no chat template"):
        prep(tmp_path, bare, conversations(3), "--block_size", "128")
    # --truncate: the long conversation is cut to a row; its assistant turn is gone, so it is dropped
    meta = prep(tmp_path, directory, [*conversations(3), long], "--block_size", "128", "--truncate")
    assert meta["truncated"] == 1 and meta["train_examples"] + meta["val_examples"] == 3


def test_sft_recipe_trains_end_to_end(chat_dir, tmp_path):
    from tests.train.test_train_cli import run

    directory, _ = chat_dir
    prep(tmp_path, directory, conversations(16), "--block_size", "128")
    overrides = dict(
        init_from=directory, out_dir=tmp_path / "run", max_iters=4, batch_size=4, grad_accum=1,
        eval_interval=4, eval_iters=1, **{"data.dir": tmp_path / "d", "model.block_size": 128,
        "model.dtype": "float32", "optim.warmup_steps": 0, "optim.learning_rate": 1e-2,
        "lora.base_dtype": "float32"},
    )  # fmt: skip
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    r = run([str(ROOT / "train.py"), f"--config={ROOT}/configs/sft_llama.py", *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [x["train_loss"] for x in lines if "train_loss" in x]  # evaluated at steps 0 and 4
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all("val_loss" in x for x in lines if "train_loss" in x)
    saved = json.loads((tmp_path / "run/config.json").read_text())
    assert saved["data"]["format"] == "packed" and saved["lora"]["rank"] == 16  # the recipe's LoRA


def expected_reply(model, tok, messages, n=12, every_end=False):
    """transformers' greedy continuation of the rendered prompt, cut at the end-of-turn token (and with
    every_end at any of the model's EOS ids, as generate and the server stop)."""
    ids = chat.render_ids(tok, messages, add_generation_prompt=True)
    new = torch_greedy(model, ids, n)
    ends = {chat.end_of_turn_id(tok)} | (set(tok.eos_ids) if every_end else set())
    return tok.decode(new[: next((i for i, t in enumerate(new) if t in ends), len(new))])


def test_sample_chat_reads_stdin_and_stops_at_end_of_turn(chat_dir, tmp_path):
    from tests.train.test_train_cli import run

    directory, model = chat_dir
    tok = HFTokenizer(directory)
    lines = ["what is 2 plus 2?", "", "and 3 plus 3?"]
    args = [str(ROOT / "sample.py"), "--init_from", str(directory), "--chat", "--temperature", "0"]
    args += ["--max_new_tokens", "12", "--system", "Be brief."]
    env_input = "\n".join(lines) + "\n"
    r = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, input=env_input, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    messages = [{"role": "system", "content": "Be brief."}]
    want = []
    for line in (lines[0], lines[2]):
        messages.append({"role": "user", "content": line})
        want.append(expected_reply(model, tok, messages))
        messages.append({"role": "assistant", "content": want[-1]})
    assert any(want) and r.stdout == "".join(w + "\n" for w in want)
    bare = make_chat_dir(tmp_path / "bare", None)
    make_hf_model("llama", str(bare))
    r = run([str(ROOT / "sample.py"), "--init_from", str(bare), "--chat"], tmp_path)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "has no chat template" in r.stderr


def test_chat_completions_with_the_openai_client(chat_dir):
    """serve's app on the tiny chat model: greedy replies equal transformers' continuation of the
    rendered messages (stopped at <|eot_id|>), streamed and whole, n choices, 400s for bad input."""
    openai = pytest.importorskip("openai")
    from flaxgpt.serve import launch, server
    from tests.serve.test_serve import serving_in_thread

    directory, model = chat_dir
    run, name = launch.load(init_from=str(directory))
    tok = run.tokenizer
    # chunks of 32 prompt tokens: 3 prefill programs to compile, not one per bucket up to 128
    sched = launch.scheduler_for(run.config, run.params, tok, slots=2, max_len=128, prefill_chunk=32)
    sched.start()
    app = server.create_app(sched, tok, model=name, max_len=128, vocab_size=run.config.vocab_size)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 7 plus 7?"}]
    want = expected_reply(model, tok, messages, n=10, every_end=True)
    try:
        with serving_in_thread(app) as url:
            assert sched.ready.wait(timeout=300)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            r = client.chat.completions.create(
                model=name, messages=messages, max_tokens=10, temperature=0, n=2
            )
            assert [c.message.content for c in r.choices] == [want, want]
            assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
            ids = chat.render_ids(tok, messages, add_generation_prompt=True)
            assert r.usage.prompt_tokens == len(ids)  # once, whatever n (OpenAI)
            ends = {chat.end_of_turn_id(tok), *tok.eos_ids}  # stopped at <|eot_id|> or an EOS?
            hit = bool(ends & set(torch_greedy(model, ids, 10)))
            assert [c.finish_reason for c in r.choices] == ["stop" if hit else "length"] * 2
            chunks = list(
                client.chat.completions.create(
                    model=name, messages=messages, max_tokens=10, temperature=0, stream=True
                )
            )
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            with pytest.raises(openai.BadRequestError, match="role 'robot'"):
                client.chat.completions.create(model=name, messages=[{"role": "robot", "content": "x"}])
            with pytest.raises(openai.BadRequestError, match="non-empty list"):
                client.chat.completions.create(model=name, messages=[])
    finally:
        sched.close()


def test_chat_request_validation(tmp_path):
    from flaxgpt.serve import openai_api as api

    tok, bare = HFTokenizer(make_chat_dir(tmp_path / "a")), HFTokenizer(make_chat_dir(tmp_path / "b", None))
    kw = dict(model="m", vocab_size=300, max_len=128)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "n": 3}
    req = api.parse_chat(body, tokenizer=tok, **kw)
    assert req.prompts == [chat.render_ids(tok, body["messages"], True)] and (req.max_tokens, req.n) == (5, 3)
    with pytest.raises(api.BadRequest, match="has no chat template"):
        api.parse_chat(body, tokenizer=bare, **kw)
    with pytest.raises(api.BadRequest, match="'prompt' belongs to /v1/completions"):
        api.parse_chat({**body, "prompt": "x"}, tokenizer=tok, **kw)
    with pytest.raises(api.BadRequest, match="max_completion_tokens .200. exceeds the context window") as e:
        api.parse_chat({**body, "max_completion_tokens": 200}, tokenizer=tok, **kw)
    assert e.value.param == "max_completion_tokens"  # the field the request used (it named max_tokens)
    with pytest.raises(api.BadRequest, match="'max_tokens' must be >= 1"):
        api.parse_chat({**body, "max_completion_tokens": None, "max_tokens": 0}, tokenizer=tok, **kw)
    # no max_tokens: the rest of the window (OpenAI's chat has no 16-token default), the server's cap
    bare_body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    prompt = len(req.prompts[0])
    assert api.parse_chat(bare_body, tokenizer=tok, **kw).max_tokens == 128 - prompt
    assert api.parse_chat(bare_body, tokenizer=tok, max_tokens_limit=10, **kw).max_tokens == 10
    assert (
        api.parse_completion({"prompt": "hi"}, tokenizer=tok, **kw).max_tokens == 16
    )  # completions' default
    with pytest.raises(api.BadRequest, match="'echo' belongs to /v1/completions"):
        api.parse_chat({**body, "echo": True}, tokenizer=tok, **kw)
    assert api.parse_chat({**body, "best_of": 3}, tokenizer=tok, **kw).n == 3  # best_of == n: all returned
    with pytest.raises(api.BadRequest, match="'best_of' must be >= n"):
        api.parse_chat({**body, "best_of": 1}, tokenizer=tok, **kw)
    with pytest.raises(api.BadRequest, match="'best_of' > n is not supported"):
        api.parse_chat({**body, "best_of": 4}, tokenizer=tok, **kw)
    with pytest.raises(api.BadRequest, match="'stream_options' must be an object"):
        api.parse_chat({**body, "stream_options": []}, tokenizer=tok, **kw)
