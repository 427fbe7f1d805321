"""Chat templates: our ids and assistant masks against transformers' apply_chat_template.

Tokenizers are built here (a byte-level BPE with the templates' control tokens) and the templates
written here: Llama 3's (no generation marks: masks prefix by prefix), Qwen2's ChatML (the same),
and a ChatML variant that marks {% generation %} and uses the environment's extras (whitespace
control, raise_exception, strftime_now, tojson with non-ASCII). Nothing is downloaded.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flaxgpt.data import chat
from flaxgpt.data.hf_tokenizer import HFTokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MARKED = """{%- if messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }} (year {{ strftime_now('%Y') }}) {{ {'lang': 'fr', 'm': 'été'} | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message.role) }}
    {% elif message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

    {% elif message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "marked": MARKED}
CONTROL = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
CONTROL += ["<|eot_id|>", "<|im_start|>", "<|im_end|>"]
CORPUS = "".join(f"user {i}: what is {i} plus {i}? assistant: it is {2 * i}. été\n" for i in range(200))
CONVERSATIONS = [
    [{"role": "user", "content": "what is 2 plus 2?"}, {"role": "assistant", "content": "it is 4."}],
    [
        {"role": "system", "content": "Be brief. été"},
        {"role": "user", "content": "what is 3 plus 3?"},
        {"role": "assistant", "content": " it is 6. "},
        {"role": "user", "content": "and 5 plus 5?"},
        {"role": "assistant", "content": "it is 10."},
    ],
]


def make_chat_dir(directory, template: str | None = "llama3", eos="<|eot_id|>"):
    """tokenizer.json (byte-level BPE, the control tokens as ids 0..7) + tokenizer_config.json."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=CONTROL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": eos,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None:
        config["chat_template"] = TEMPLATES.get(template, template)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def reference(directory):
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_ids_equal_apply_chat_template(tmp_path, name):
    directory = make_chat_dir(tmp_path, name)
    ours, ref = HFTokenizer(directory), reference(directory)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            want = ref.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert chat.render_ids(ours, messages, gen) == list(want)
        prompt = messages[:-1]  # ending on a user turn: the generation prompt is what differs
        with_gen, without = (chat.render_ids(ours, prompt, g) for g in (True, False))
        assert len(with_gen) > len(without) and with_gen[: len(without)] == without


def test_generation_marks_give_transformers_assistant_mask(tmp_path):
    directory = make_chat_dir(tmp_path, "marked")
    ours, ref = HFTokenizer(directory), reference(directory)
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
        ids, mask = chat.assistant_mask(ours, messages)
        assert list(ids) == list(want["input_ids"]) and list(mask) == list(want["assistant_masks"])
        assert 0 < mask.sum() < len(mask)


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_prefix_mask_is_the_assistant_turns_and_never_the_generation_prompt(tmp_path, name):
    directory = make_chat_dir(tmp_path, name)
    tok = HFTokenizer(directory)
    eot = tok.tok.token_to_id("<|eot_id|>" if name == "llama3" else "<|im_end|>")
    header = chat.render_ids(tok, CONVERSATIONS[1][:1], True)[
        len(chat.render_ids(tok, CONVERSATIONS[1][:1], False)) :
    ]
    for messages in CONVERSATIONS:
        ids, mask = chat.assistant_mask(tok, messages)
        # the masked runs, decoded, are exactly each assistant turn's text and its end-of-turn token
        runs = np.split(ids, np.flatnonzero(np.diff(mask.astype(int))) + 1)
        trained = [
            r for r, m in zip(runs, np.split(mask, np.flatnonzero(np.diff(mask.astype(int))) + 1)) if m[0]
        ]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(trained) == len(replies)
        for run, reply in zip(trained, replies):
            assert eot in run.tolist()
            assert tok.decode(run).strip() == reply.strip()  # (+ ChatML's newline after <|im_end|>)
        # the generation prompt's tokens sit just before each run, outside the mask
        starts = np.flatnonzero(np.diff(np.r_[0, mask.astype(int)]) == 1)
        for s in starts:
            assert ids[s - len(header) : s].tolist() == header and not mask[s - len(header) : s].any()
    assert chat.end_of_turn_id(tok) == eot


def test_bad_conversations_and_templates_are_one_line_errors(tmp_path):
    tok = HFTokenizer(make_chat_dir(tmp_path / "a", "llama3"))
    with pytest.raises(chat.ChatError, match="x line 3 has no assistant turn"):
        chat.check_messages([{"role": "user", "content": "hi"}], "x line 3")
    with pytest.raises(chat.ChatError, match="message 1 has role 'robot'; roles are system, user"):
        chat.check_messages([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    bare = HFTokenizer(make_chat_dir(tmp_path / "b", None))
    with pytest.raises(chat.ChatError, match="has no chat template"):
        chat.render_ids(bare, CONVERSATIONS[0], True)
    marked = HFTokenizer(make_chat_dir(tmp_path / "c", "marked"))
    with pytest.raises(chat.ChatError, match="refused it: unknown role tool"):
        chat.render_ids(marked, [{"role": "tool", "content": "42"}], False)
    path = tmp_path / "convs.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n\n" + '{"msgs": []}\n')
    with pytest.raises(chat.ChatError, match='convs.jsonl line 3 has no "messages" list'):
        chat.read_conversations(path)
    assert tok.chat_template == LLAMA3 and tok.special_tokens["bos_token"] == "<|begin_of_text|>"


def test_content_parts_and_the_developer_role_render_as_openai_clients_mean_them(tmp_path):
    # what SDKs and agent frameworks send: text parts (joined by a newline, as vLLM joins them) and
    # the developer role (the system turn of newer OpenAI models)
    tok = HFTokenizer(make_chat_dir(tmp_path, "llama3"))
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Quick."}]},
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\nQuick."}]
    assert chat.check_messages(parts, need_assistant=False) == plain
    assert chat.render_ids(tok, chat.check_messages(parts, need_assistant=False), True) == list(
        reference(tmp_path).apply_chat_template(
            plain, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(
        chat.ChatError, match="message 0: content part 1 has type 'image_url'; this model reads text"
    ):
        chat.check_messages(
            [{"role": "user", "content": [{"type": "text", "text": "?"}, image]}], need_assistant=False
        )
    with pytest.raises(chat.ChatError, match="content part 0 has no 'type'"):
        chat.check_messages([{"role": "user", "content": ["hi"]}], need_assistant=False)


def test_a_lines_tools_are_rendered_as_transformers_renders_them(tmp_path):
    """OpenAI's fine-tuning format puts the functions on each line ("tools"): the rendered ids are
    apply_chat_template(messages, tools=...)'s, as serving renders a request with tools (they were
    dropped once, so training and serving prompts differed)."""
    from tests.serve import tool_templates

    directory = make_chat_dir(tmp_path / "m", tool_templates.QWEN25, eos="<|im_end|>")
    tools = [{"type": "function", "function": {"name": "add", "description": "x + y", "parameters": {}}}]
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = tmp_path / "convs.jsonl"
    path.write_text(
        json.dumps({"messages": messages, "tools": tools}) + "\n" + json.dumps({"messages": messages})
    )
    (name, got, got_tools), (_, _, none) = chat.read_conversations(path)
    assert got_tools == tools and none is None
    ids, _ = chat.assistant_mask(HFTokenizer(directory), got, name, got_tools)
    want = reference(directory).apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert list(ids) == list(want) and len(ids) > len(
        chat.render_ids(HFTokenizer(directory), messages, False)
    )
    path.write_text(json.dumps({"messages": messages, "tools": "add"}) + "\n")
    with pytest.raises(chat.ChatError, match='line 1: "tools" must be a list of'):
        chat.read_conversations(path)


def test_prepare_text_pack_one_segment_per_document(tmp_path):
    from flaxgpt.data import packing, prepare
    from flaxgpt.data.tokenizers import get_tokenizer

    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["a short note.", "a longer document " * 30, "the third one, of middling length " * 3]
    for i, text in enumerate(texts):
        (docs / f"{i}.txt").write_text(text)
    args = ["--dataset", "text", "--pack", "--input", str(docs), "--block_size", "64", "--out_dir"]
    meta = prepare.main(args + [str(tmp_path / "d"), "--val_fraction", "0.2"])
    tok = get_tokenizer("gpt2")
    pieces = []  # each document (+ EOS), cut into rows' worth of 65 tokens overlapping by one
    for text in texts:
        ids = tok.encode(text) + [tok.eot_id]
        pieces += [ids[i : i + 65] for i in range(0, len(ids) - 1, 64)]
    assert meta["train_examples"] + meta["val_examples"] == len(pieces) and 0 < meta["train_padding"] < 1
    data = packing.PackedData(tmp_path / "d")
    got = []
    for split in ("train", "val"):
        a = data.splits[split]
        for r in range(len(a["inputs"])):
            for s in range(1, int(a["segment_ids"][r].max()) + 1):
                at = np.asarray(a["segment_ids"][r]) == s
                assert (
                    np.asarray(a["loss_mask"][r])[at].all()
                    and not np.asarray(a["loss_mask"][r])[~at & (np.asarray(a["segment_ids"][r]) == 0)].any()
                )
                got.append(
                    np.r_[np.asarray(a["inputs"][r])[at][:1], np.asarray(a["targets"][r])[at]].tolist()
                )
    assert sorted(got) == sorted(pieces)
