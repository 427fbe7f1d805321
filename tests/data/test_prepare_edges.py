"""Data preparation at its edges: what a bug hunt found (each test fails with its fix reverted).

Lines split at "\\n" alone, an opening assistant turn's mask, a model without an end-of-text token,
special_tokens_map.json, files that are not what they claim, a pair's tools, and a fineweb run that
must not replace another dataset. Tokenizers are test_chat's tiny byte-level BPE; nothing downloads.
"""

import json
import os
import shutil

import numpy as np
import pytest

from flaxgpt.data import chat, preference, prepare, prepare_seq2seq, prompts
from flaxgpt.data.dataset_files import PrepareError, jsonl_records
from flaxgpt.data.hf_tokenizer import HFTokenizer
from tests.data.test_chat import make_chat_dir, reference

LS, NEL = "\u2028", "\u0085"  # a line separator and a next-line character: text, not line ends


def test_lines_split_at_newline_alone(tmp_path):
    """str.splitlines cut a JSON string or a sentence holding U+2028 / U+0085: a chat line was "not
    JSON", prepared prompts could not be read back, and aligned files shifted every later pair."""
    record = {"messages": [{"role": "user", "content": f"a{LS}b"}, {"role": "assistant", "content": "c"}]}
    path = tmp_path / "convs.jsonl"
    path.write_text("\ufeff" + json.dumps(record, ensure_ascii=False) + "\r\n\n", encoding="utf-8")
    assert jsonl_records(path) == [(f"{path} line 1", record)]  # a BOM and CRLF too
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text(f"one{LS}still one\ntwo\nthree\n", encoding="utf-8")
    tgt.write_text(f"eins\nzwei{NEL}noch zwei\ndrei\n", encoding="utf-8")
    pairs = prepare_seq2seq.read_aligned(src, tgt)
    assert [(s, t) for s, t, _ in pairs][2] == ("three", "drei") and len(pairs) == 3
    # GRPO prompts: prepared, then read back by the trainer's PromptData
    prompt_file = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"question {i}{LS}next", "answer": str(i)} for i in range(4)]
    prompt_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare.main(["--dataset", "prompts", "--input", str(prompt_file), "--out_dir", str(tmp_path / "p")])
    data = prompts.PromptData(tmp_path / "p")
    assert [r["prompt"] for r in data.splits["train"] + data.splits["val"]] == [r["prompt"] for r in rows]


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_an_opening_assistant_turn_trains_its_text_alone(tmp_path, name):
    """A conversation that opens with the assistant (a greeting): BOS, the template's default system
    block and the header are prompt, not trained (they were all in the mask)."""
    tok = HFTokenizer(make_chat_dir(tmp_path, name))
    messages = [
        {"role": "assistant", "content": "Welcome!"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "it is 4."},
    ]
    ids, mask = chat.assistant_mask(tok, messages)
    assert list(ids) == list(
        reference(tmp_path).apply_chat_template(messages, tokenize=True, return_dict=False)
    )
    cuts = np.flatnonzero(np.diff(mask.astype(int))) + 1
    runs = [r for r, m in zip(np.split(ids, cuts), np.split(mask, cuts)) if m[0]]
    assert [tok.decode(r).strip() for r in runs] == ["Welcome!", "it is 4."]
    assert not mask[: int(np.argmax(mask))].any() and tok.decode(ids[: int(np.argmax(mask))]).strip() != ""


def _without_eos(tmp_path):
    directory = make_chat_dir(tmp_path / "m")
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = json.load(open(config_path))
    del config["eos_token"]
    json.dump(config, open(config_path, "w"))
    return directory


def test_a_tokenizer_without_an_end_of_text_token_is_one_line(tmp_path):
    """Documents end with EOS: a model that names none wrote id 0 as every separator (hf), or failed
    with a traceback (text --pack, prompts); a character vocabulary has none for --pack either."""
    directory = _without_eos(tmp_path)
    (tmp_path / "doc.txt").write_text("user 1: what is 1 plus 1? assistant: it is 2.\n" * 20)
    base = ["--dataset", "text", "--pack", "--input", str(tmp_path / "doc.txt"), "--block_size", "16"]
    for tokenizer, says in ((directory, "names no end-of-text token"), ("char", "a character vocabulary")):
        with pytest.raises(PrepareError, match=says) as e:
            prepare.main(base + ["--tokenizer", tokenizer, "--out_dir", str(tmp_path / "d")])
        assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    (tmp_path / "p.jsonl").write_text('{"prompt": "what is 1 plus 1?"}\n' * 4)
    args = ["--dataset", "prompts", "--input", str(tmp_path / "p.jsonl"), "--hf_dir", directory]
    with pytest.raises(PrepareError, match="names no end-of-text token"):
        prepare.main(args + ["--out_dir", str(tmp_path / "p")])


def test_special_tokens_map_names_the_tokens_a_template_reads(tmp_path):
    """bos_token / eos_token kept only in special_tokens_map.json (older saves): transformers reads
    them there; the template lost its BOS and the EOS id was None."""
    directory = make_chat_dir(tmp_path)
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = json.load(open(config_path))
    special = {k: config.pop(k) for k in ("bos_token", "eos_token")}
    json.dump(config, open(config_path, "w"))
    json.dump(special, open(os.path.join(directory, "special_tokens_map.json"), "w"))
    tok = HFTokenizer(directory)
    assert tok.special_tokens == special and tok.eos_id == tok.tok.token_to_id("<|eot_id|>")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = reference(directory).apply_chat_template(messages, tokenize=True, return_dict=False)
    assert chat.render_ids(tok, messages, False) == list(want) and want[0] == tok.bos_id


def test_files_that_are_not_what_they_claim_are_one_line(tmp_path):
    """A tokenizer.json that is a git-lfs pointer, a run's meta.json that is a list, a jsonl that is
    not UTF-8: one line each (tracebacks before)."""
    directory = make_chat_dir(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(PrepareError, match="its files cannot be read .*git-lfs pointer"):
        prepare.make_tokenizer(directory)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "meta.json").write_text("[1, 2]")
    with pytest.raises(PrepareError, match="names no usable tokenizer"):
        prepare.make_tokenizer(str(tmp_path / "run"))
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(PrepareError, match=r"is not UTF-8 text: byte 15 \(line 1\)"):
        jsonl_records(tmp_path / "latin1.jsonl")


def test_a_pairs_tools_are_rendered_and_a_pair_equal_once_tokenized_is_refused(tmp_path):
    """TRL's DPOTrainer renders a line's tools into the prompt; they were dropped. Text replies that
    differ only by the EOS written out are the same tokens: nothing to prefer."""
    from tests.serve import tool_templates

    directory = make_chat_dir(tmp_path / "m", tool_templates.QWEN25, eos="<|im_end|>")
    tok = HFTokenizer(directory)
    tools = [{"type": "function", "function": {"name": "add", "description": "x + y", "parameters": {}}}]
    prompt = [{"role": "user", "content": "2+2?"}]
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
        "tools": tools,
    }
    got, _, _ = preference.tokenize_pair(tok, preference.check_pair(dict(record), "x"), 4096, "x")
    want = reference(directory).apply_chat_template(
        prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert got == list(want)
    text = {"prompt": "what is 2 plus 2?", "chosen": " it is 4.", "rejected": " it is 4.<|im_end|>"}
    with pytest.raises(PrepareError, match="chosen and rejected are the same tokens"):
        preference.tokenize_pair(tok, preference.check_pair(dict(text), "x"), 4096, "x")


def test_fineweb_into_another_dataset_is_refused_and_keeps_it(tmp_path):
    """--dataset fineweb over a prepared dataset replaced its meta.json (the only copy of a character
    vocabulary) without --overwrite."""
    out = tmp_path / "ds"
    prepare.main(["--dataset", "shakespeare_char", "--out_dir", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i} " * 9}) + "\n" for i in range(8)))
    args = ["--dataset", "fineweb", "--hf_name", "json", "--hf_data_files", str(docs), "--out_dir", str(out)]
    with pytest.raises(PrepareError, match="already holds a prepared dataset"):
        prepare.main(args + ["--num_proc", "1"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)


@pytest.mark.parametrize("name", ["llama3", "marked"])
def test_openai_weight_zero_keeps_a_turn_untrained(tmp_path, name):
    """OpenAI's fine-tuning format: an assistant turn with "weight": 0 is context (it was trained)."""
    tok = HFTokenizer(make_chat_dir(tmp_path, name))
    messages = [
        {"role": "user", "content": "what is 2 plus 2?"},
        {"role": "assistant", "content": "it is 5.", "weight": 0},
        {"role": "user", "content": "and 3 plus 3?"},
        {"role": "assistant", "content": "it is 6.", "weight": 1},
    ]
    ids, mask = chat.assistant_mask(tok, chat.check_messages(messages))
    cuts = np.flatnonzero(np.diff(mask.astype(int))) + 1
    runs = [r for r, m in zip(np.split(ids, cuts), np.split(mask, cuts)) if m[0]]
    assert [tok.decode(r).strip() for r in runs] == ["it is 6."]
    with pytest.raises(chat.ChatError, match="message 0 has weight 0; a weight is 0 or 1, on assistant"):
        chat.check_messages([{**messages[0], "weight": 0}, messages[1]])


def test_flags_a_dataset_does_not_read_are_refused(tmp_path):
    """--hf_dir with --dataset text wrote GPT-2 ids for a model with another vocabulary; --pack with
    shakespeare wrote an unpacked dataset: both silently."""
    (tmp_path / "doc.txt").write_text("some text " * 50)
    text = ["--dataset", "text", "--input", str(tmp_path / "doc.txt"), "--out_dir", str(tmp_path / "d")]
    with pytest.raises(PrepareError, match="takes the model's tokenizer as --tokenizer m"):
        prepare.main(text + ["--hf_dir", "m"])
    with pytest.raises(PrepareError, match="--pack packs --dataset text's documents; --dataset shakespeare"):
        prepare.main(["--dataset", "shakespeare", "--pack", "--out_dir", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()


def test_a_character_vocabulary_can_write_a_numeric_answer(tmp_path):
    """{"answer": 900}: the digits were left out of the vocabulary, so the answer reward (str(answer))
    could never be earned."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}>", "answer": 900 + i}) + "\n" for i in range(4)))
    prepare.main(
        [
            "--dataset",
            "prompts",
            "--input",
            str(path),
            "--tokenizer",
            "char",
            "--out_dir",
            str(tmp_path / "p"),
        ]
    )
    from flaxgpt.data.tokenizers import from_meta

    tok = from_meta(prompts.PromptData(tmp_path / "p").meta["tokenizer"])
    assert tok.decode(tok.encode("903")) == "903"
