r"""Sample text from a trained run or from GPT-2.

    python sample.py --out_dir out/shakespeare_char --start "ROMEO:" --num_samples 5 --max_new_tokens 500
    python sample.py --init_from gpt2 --start "The meaning of life is" --temperature 0.8 --top_k 200
    python sample.py --init_from gpt2 --start FILE:prompt.txt --top_p 0.9 --seed 7
    python sample.py --out_dir out/run --prompts_file prompts.txt --temperature 0     # greedy, one per line
    python sample.py --out_dir out/shakespeare_char --start "ROMEO:" --attention_png attn.png \
        --layers 0,5 --heads all --max_new_tokens 0        # attention map of the prompt only
    python sample.py --out_dir out/reverse --start "abcdef" --beam_size 4  # an encoder-decoder run
    python sample.py --out_dir out/reverse --prompts_file src.txt --beam_size 1 > hyp.txt
    python sample.py --init_from gpt2 --start "Hello" --quantize int8    # int8 weights: faster decoding
    python sample.py --init_from gpt2-medium --draft gpt2 --temperature 0   # speculative decoding
    python sample.py --init_from path/to/Llama-3.2-1B-Instruct --chat      # a conversation (stdin)
    echo "What is 2 + 2?" | python sample.py --out_dir out/sft_llama --chat --temperature 0
    python sample.py --init_from path/to/SmolLM2-135M --adapter path/to/peft_adapter --start "Hi"  # LoRA

A single sample streams to the terminal as it is decoded; several are printed one after another,
separated by a line of dashes. The same seed gives the same output. GPT-2 BPE samples stop at
<|endoftext|>. Bad input is a one-line error (exit code 1) or, where sampling can go on, a warning.

Attention maps (GPT models): --attention_png PATH draws the attention weights of the first prompt
for --layers x --heads ('all', '0,5', '-1' or '2:6') into a PNG grid, says where on stderr, then
samples as usual; --max_new_tokens 0 writes the PNG and samples nothing.

Faster decoding (GPT models): --quantize int8 (weight-only, per-output-channel scales), int4 (scales per
group of 128 inputs; int4_g64, int4_g32) or bf16
decodes with compact weights. --draft RUN_OR_GPT2 proposes --draft_tokens tokens per step with a
smaller model of the same tokenizer that the model then verifies in one call: greedy output is
unchanged, sampled output keeps the model's distribution; the acceptance rate goes to stderr.

Encoder-decoder runs (config.json model.kind "seq2seq", e.g. trained with configs/reverse.py):
every non-blank line of --start (text, or FILE:path) or of --prompts_file is a source; stdout gets
exactly one translation per source line, in order, and nothing else. Beam search with --beam_size
(1 = greedy) and length penalty --alpha; a source longer than the model's maximum is an error, or
is cut with a warning under --truncate. The sampling options (--temperature, --top_k, --top_p,
--num_samples, --seed, --dtype) apply to GPT models only.

Chat (--chat, a model or run whose tokenizer directory has a chat template): every line read from
stdin is a user turn; the conversation so far (after --system, if given) is rendered with the
model's own template and generation prompt (flaxgpt.data.chat), the reply is sampled until the
template's end-of-turn token (or --max_new_tokens) and printed as one block on stdout.

This script only parses: loading is flaxgpt.load, sampling flaxgpt.decode.sampling, translation
flaxgpt.decode.translate; their errors are printed as they are.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

SEPARATOR = "-" * 40
# flags an encoder-decoder run does not read: warned of, not dropped silently
GPT_ONLY = "temperature top_k top_p num_samples seed dtype quantize draft draft_tokens layers heads system"
GPT_ONLY = tuple(GPT_ONLY.split())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="a training run's directory (with --init_from resume)")
    p.add_argument("--init_from", default="resume", help="resume | a GPT-2 name (gpt2, gpt2-xl...) | a path")
    p.add_argument("--step", type=int, help="checkpoint step to load (default: the latest)")
    p.add_argument("--start", help='the prompt, or FILE:prompt.txt (default "\\n"; seq2seq: required)')
    p.add_argument("--prompts_file", help="one prompt per line (blank lines are skipped)")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=500,
        help="0 = no sampling (with --attention_png); seq2seq: the longest translation (default block_size)",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the run's own")
    p.add_argument(
        "--quantize", help="int8 | bf16 | int4 (int4_g64, int4_g32): weight-only quantized weights (decoding)"
    )
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory, merged into --init_from's weights")
    p.add_argument("--draft", help="speculative decoding: a smaller run directory or GPT-2 name/path")
    p.add_argument("--draft_tokens", type=int, default=4, help="tokens the draft proposes per step")
    p.add_argument("--attention_png", help="write the first prompt's attention map here")
    p.add_argument("--layers", default="all", help="layers of the attention map: all | 0,5 | -1 | 2:6")
    p.add_argument("--heads", default="all", help="heads of the attention map: all | 0,5 | -1 | 2:6")
    p.add_argument("--beam_size", type=int, help="seq2seq runs: beam width, 1 = greedy (the run's, else 4)")
    p.add_argument("--alpha", type=float, help="seq2seq runs: length penalty exponent (the run's, else 0.6)")
    p.add_argument("--truncate", action="store_true", help="seq2seq runs: cut long sources (else error)")
    p.add_argument("--chat", action="store_true", help="a conversation: user turns from stdin, one a line")
    p.add_argument("--system", help="--chat: a system message first")
    return p


def load(a, source=None):
    """--out_dir (with --init_from resume), --init_from or `source` (the draft) as a flaxgpt.loader.Run,
    weights as saved: an attention map sees them; loader.compact applies --dtype and --quantize."""
    from flaxgpt import loader

    if source is not None:
        return loader.load(source)
    if a.init_from == "resume":
        if a.adapter:
            raise ValueError("--adapter DIR goes with --init_from BASE (a LoRA run's --out_dir has its own)")
        loader.require_run(a.out_dir)
    return loader.load(a.out_dir if a.init_from == "resume" else a.init_from, step=a.step, adapter=a.adapter)


def loaded(a) -> str:
    """What load(a) loaded: `out/x step 2000 (the latest)`, or the weights' name."""
    if a.init_from != "resume":
        return a.init_from + (f" with adapter {a.adapter}" if a.adapter else "")
    if a.step is not None:
        return f"{a.out_dir} step {a.step}"
    from flaxgpt.runs.checkpoint import Checkpointer

    ckpt = Checkpointer(a.out_dir, read_only=True, async_save=False)
    step = ckpt.latest_step()
    ckpt.close()
    return f"{a.out_dir} step {step} (the latest)"


def announce(a) -> None:
    """Which run and step (or which weights) the output comes from, on stderr."""
    print(f"loaded {a.loaded}", file=sys.stderr, flush=True)


def read_texts(a, kind: str) -> list[str]:
    """Non-blank lines of --prompts_file, else --start (text or FILE:path): one GPT prompt, or
    (seq2seq) one source per non-blank line."""
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"{a.prompts_file} has no non-blank lines")
        return lines
    if a.start is None and kind == "seq2seq":
        raise ValueError(f"{a.out_dir} is a seq2seq run: give the sources with --start or --prompts_file")
    text = "\n" if a.start is None else a.start
    if text.startswith("FILE:"):
        try:
            text = Path(text[5:]).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--start {a.start}: not UTF-8 text ({e}); save it as UTF-8") from None
    if kind == "gpt":
        return [text]
    from flaxgpt.data.dataset_files import text_lines  # (U+2028 in a sentence is text, not a line end)

    lines = [line for line in text_lines(text) if line.strip()]
    if not lines:
        raise ValueError(f"--start {a.start!r} has no non-blank line to translate")
    return lines


def translate(a, parser, run):
    """Encoder-decoder runs: one translation per source line on stdout."""
    from flaxgpt.decode.translate import translate

    for name in GPT_ONLY:
        if getattr(a, name) != parser.get_default(name):
            warnings.warn(
                f"--{name} applies to GPT models; {a.out_dir} is decoded with --beam_size", stacklevel=2
            )
    if a.attention_png:
        raise ValueError("--attention_png draws GPT self-attention; drop it for an encoder-decoder run")
    lines = read_texts(a, "seq2seq")
    from flaxgpt.runs.run_dir import translation_settings  # the flags, else the run's recipe

    settings = translation_settings(a.out_dir, a.beam_size, a.alpha)
    if a.max_new_tokens != parser.get_default("max_new_tokens"):  # else the model's block_size
        if a.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1 for a translation, got {a.max_new_tokens}")
        settings["max_len"] = a.max_new_tokens
    for hyp in translate(*run[1:], lines, truncate=a.truncate, **settings):
        print(hyp)


def sample(a, run):
    """GPT runs: one sample streams as it is decoded; several are printed between dashes."""
    if a.beam_size is not None or a.alpha is not None:
        warnings.warn("--beam_size and --alpha apply to encoder-decoder runs; this one samples", stacklevel=2)
    import jax
    import numpy as np

    from flaxgpt import gpt_step_fn, loader
    from flaxgpt.data.tokenizers import TextStream, encode_prompt
    from flaxgpt.decode import sampler, sampling
    from flaxgpt.models import quantize
    from flaxgpt.models.cache import KVCache

    sampler.check_sampling_args(a.temperature, a.top_k, a.top_p)
    if a.quantize is not None:
        quantize.check_mode(a.quantize)
    if a.max_new_tokens < 0 or (a.max_new_tokens == 0 and not a.attention_png):
        raise ValueError(f"--max_new_tokens must be >= 1 (0 with --attention_png), got {a.max_new_tokens}")
    if a.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {a.num_samples}")
    tok = run.tokenizer
    texts = read_texts(a, "gpt")
    encoded = [encode_prompt(tok, text, run.config.block_size) for text in texts]  # a warning each, once
    rows = [ids for ids in encoded for _ in range(a.num_samples)]
    if a.attention_png:  # float32 weights, before any --dtype cast; the ids sampling starts from
        from flaxgpt.tools.attention_map import write_attention_png

        write_attention_png(*run[1:], rows[0], a.layers, a.heads, a.attention_png)
        print(
            f"attention map (layers {a.layers}, heads {a.heads}) written to {a.attention_png}",
            file=sys.stderr,
        )
        if a.max_new_tokens == 0:
            return
    if not a.draft:  # with a draft: once the draft is checked against the target (speculate)
        announce(a)
    config, params, _ = loader.compact(run, dtype=a.dtype, quantize=a.quantize)[1:]
    B, P = len(rows), max(map(len, rows))
    prompt_BP, lengths_B = np.zeros((B, P), np.int32), np.array([len(r) for r in rows], np.int32)
    for b, ids in enumerate(rows):
        prompt_BP[b, : len(ids)] = ids
    step = gpt_step_fn(config, params)
    kw = dict(max_new_tokens=a.max_new_tokens, rng=jax.random.key(a.seed), eos_id=tok.eot_id)
    kw.update(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)

    def visible(ids):  # without the end-of-text an empty prompt starts from, or a row stops at
        return [int(t) for t in ids if t != tok.eot_id]

    # the model's other end tokens (Llama 3.1 Instruct's <|eot_id|>, <|eom_id|>) end a reply too, as in
    # transformers' generate; decoding stops at eot_id, so a reply is cut at the others on the host
    ends = set(getattr(tok, "eos_ids", ())) - {tok.eot_id}

    def reply(ids):
        ids = [int(t) for t in ids]
        return visible(ids[: next((i for i, t in enumerate(ids) if t in ends), len(ids))])

    if a.draft:
        tokens_BN, n_B = speculate(a, run, config, step, prompt_BP, lengths_B, kw)
        for b in range(B):
            print(tok.decode(visible(rows[b]) + reply(tokens_BN[b, : n_B[b]])))
            if B > 1:
                print(SEPARATOR)
        return
    cache = KVCache.for_config(config, B, sampling.cache_length(config.block_size, P, a.max_new_tokens))
    if B == 1:
        stream = TextStream(tok)
        print(stream.add(visible(rows[0])), end="")
        for out_BC, n_B in sampling.stream_generate(step, cache, prompt_BP, lengths_B, chunk=16, **kw):
            new = [int(t) for t in out_BC[0, : n_B[0]]]
            print(stream.add(reply(new)), end="", flush=True)
            if ends.intersection(new):
                break
        print(stream.flush())  # a character max_new_tokens cut in half: as decode shows it
        return
    tokens_BN, n_B = sampling.generate(step, cache, prompt_BP, lengths_B, **kw)
    for b in range(B):
        print(tok.decode(visible(rows[b]) + reply(tokens_BN[b, : n_B[b]])))
        print(SEPARATOR)


def chat(a, run):
    """--chat: user lines from stdin, each reply sampled until the template's end-of-turn token."""
    import jax
    import numpy as np

    from flaxgpt import gpt_step_fn, loader
    from flaxgpt.data import chat as chat_lib
    from flaxgpt.decode import sampler, sampling
    from flaxgpt.models.cache import KVCache

    sampler.check_sampling_args(a.temperature, a.top_k, a.top_p)
    if a.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {a.max_new_tokens}")
    tok = run.tokenizer
    chat_lib.template_of(tok)  # a tokenizer without a template: the one-line error, before loading more
    eot = chat_lib.end_of_turn_id(tok)
    announce(a)
    config, params, _ = loader.compact(run, dtype=a.dtype, quantize=a.quantize)[1:]
    step = gpt_step_fn(config, params)
    messages = [] if a.system is None else [{"role": "system", "content": a.system}]
    rng = jax.random.key(a.seed)
    for turn in range(1 << 30):
        if sys.stdin.isatty():  # a prompt for a person; none when stdin is piped
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = chat_lib.render_ids(tok, messages, add_generation_prompt=True)
        if len(ids) >= config.block_size:
            raise ValueError(
                f"the conversation has {len(ids)} tokens, the model's block_size is {config.block_size}"
            )
        new = min(a.max_new_tokens, config.block_size - len(ids))
        cache = KVCache.for_config(config, 1, sampling.cache_length(config.block_size, len(ids), new))
        out_BN, n_B = sampling.generate(
            step, cache, np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32), max_new_tokens=new,
            rng=jax.random.fold_in(rng, turn), eos_id=eot,
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
        )  # fmt: skip
        reply_ids = [int(t) for t in out_BN[0, : n_B[0]]]
        reply = tok.decode(reply_ids[:-1] if reply_ids[-1:] == [eot] else reply_ids)
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})


def identity(tokenizer) -> dict:
    """What makes two tokenizers one: their meta, a tokenizer.json by its bytes, not by its path (a
    target's and its draft's directories each hold a copy)."""
    meta = tokenizer.to_meta()
    if meta.get("kind") == "hf":
        import hashlib

        meta = {**meta, "path": hashlib.sha256(Path(meta["path"]).read_bytes()).hexdigest()}
    return meta


def speculate(a, run, config, step, prompt_BP, lengths_B, kw):
    """Speculative decoding with the --draft model; the acceptance rate goes to stderr."""
    from flaxgpt import count_params, loader
    from flaxgpt.decode import sampling, speculative
    from flaxgpt.models import gpt
    from flaxgpt.models.cache import KVCache

    if a.draft_tokens < 1:  # before the caches it sizes (their error named a window's rewind)
        raise ValueError(f"--draft_tokens must be >= 1, got {a.draft_tokens}")
    draft = load(a, a.draft)
    if draft.kind != "gpt":
        raise ValueError(f"--draft {a.draft} is a {draft.kind} run; a draft must be a GPT")
    speculative.check_draft(
        target_vocab=run.config.vocab_size,
        draft_vocab=draft.config.vocab_size,
        target_params=count_params(run.params),
        draft_params=count_params(draft.params),
        target_tokenizer=identity(run.tokenizer),
        draft_tokenizer=identity(draft.tokenizer),
    )
    P, need = prompt_BP.shape[1], a.max_new_tokens + a.draft_tokens + 1
    room = min(config.block_size, draft.config.block_size)  # speculative decoding does not slide the window
    if P + need > room:
        most_new, most_k = room - P - a.draft_tokens - 1, room - P - a.max_new_tokens - 1
        fix = (
            f"--max_new_tokens {most_new}" if most_new >= 1
            else f"--draft_tokens {most_k}" if most_k >= 1
            else "a shorter prompt or fewer --draft_tokens"
        )  # fmt: skip
        raise ValueError(
            f"--draft: prompt {P} + --max_new_tokens {a.max_new_tokens} + --draft_tokens {a.draft_tokens} "
            f"+ 1 is past the context of {room} tokens, which speculative decoding does not slide; "
            f"pass {fix}, or drop --draft"
        )
    announce(a)
    dconfig, dparams, _ = loader.compact(draft, dtype=a.dtype, quantize=a.quantize)[1:]
    B = prompt_BP.shape[0]
    k = a.draft_tokens  # window layers' rings keep k extra slots: a rejected draft takes back k
    cache = KVCache.for_config(config, B, sampling.cache_length(config.block_size, P, need), rewind=k)
    dcache = KVCache.for_config(dconfig, B, sampling.cache_length(dconfig.block_size, P, need), rewind=k)
    tokens_BN, n_B, stats = speculative.speculative_generate(
        step, cache, gpt.step_fn(dconfig, dparams), dcache, prompt_BP, lengths_B,
        draft_tokens=a.draft_tokens, **kw,
    )  # fmt: skip
    print(
        f"speculative: {stats.acceptance:.1%} of drafted tokens accepted; "
        f"{stats.rounds} verifying calls for up to {n_B.max()} new tokens per row",
        file=sys.stderr,
    )
    return tokens_BN, n_B


def run_command(a, parser) -> None:
    run = load(a)
    a.loaded = loaded(a)  # said (announce) once the input is checked: an error stays one line
    if a.chat and run.kind != "gpt":
        raise ValueError(f"--chat needs a GPT-family model; {a.out_dir} is a {run.kind} run")
    if a.chat:
        chat(a, run)
    else:
        translate(a, parser, run) if run.kind == "seq2seq" else sample(a, run)


def main(argv=None) -> int:
    from flaxgpt import errors, runtime

    runtime.setup()
    parser = build_parser()
    a = parser.parse_args(argv)
    from flaxgpt import extras

    extras.require_hf(a.init_from, "--init_from")  # before loading anything
    extras.require_hf(a.draft, "--draft")
    if a.attention_png:
        extras.require("plot", "--attention_png")
    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)  # every call of main() shows its own warnings
        warnings.showwarning = lambda message, *_, **__: print(f"warning: {message}", file=sys.stderr)
        # bad input (CheckpointError and RunError are ValueErrors) is one line, exit status 1
        return errors.run_cli(lambda _: run_command(a, parser))


if __name__ == "__main__":
    sys.exit(main())
