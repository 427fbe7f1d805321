"""The `flaxgpt` command: one entry for the tools (training, sampling and serving are train.py,
sample.py and serve.py at the top of the repository).

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    flaxgpt eval --init_from gpt2 --task hellaswag --data hellaswag_val.jsonl
    flaxgpt hf export --out_dir out/run --to out/hf
    flaxgpt summary --preset gpt2
    flaxgpt <command> --help

COMMANDS is a static table of "module:function"; a command's module is imported only when it runs,
so `flaxgpt --help` imports no jax. Each function takes the arguments after the command and returns
an exit status (or a result, which means 0); each module also runs as `python -m <module>`.

May import: flaxgpt.runtime (the commands' modules only by name, through COMMANDS).
"""

from __future__ import annotations

import importlib
import sys

# command -> ("module:function", one line for `flaxgpt --help`)
COMMANDS = {
    "prepare": ("flaxgpt.data.prepare:cli", "tokenize a corpus into train.bin, val.bin and meta.json"),
    "prepare-seq2seq": ("flaxgpt.data.prepare_seq2seq:cli", "source/target pairs for the encoder-decoder"),
    "eval": ("flaxgpt.eval.evaluate:cli", "perplexity, HellaSwag, LAMBADA or translation scores of a model"),
    "hf": ("flaxgpt.hf_cli:main", "Hugging Face weights: export a run, or info on a model's config"),
    "peft": ("flaxgpt.hf_cli:peft_main", "LoRA adapters: export a run's as PEFT, or merge one into its base"),
    "summary": ("flaxgpt.tools.summary:main", "parameters, memory and FLOPs of a model config"),
    "plot": ("flaxgpt.runs.plot:main", "draw a run's metrics.jsonl as a PNG"),
    "attention-map": ("flaxgpt.tools.attention_map:main", "draw a model's attention weights for a prompt"),
    "aot": ("flaxgpt.aot.compile:main", "compile a recipe ahead of time for its target and check its memory"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return (
        "usage: flaxgpt <command> [options]   (flaxgpt <command> --help for its options)\n\ncommands:\n"
        + "\n".join(lines)
    )


def resolve(command: str):
    """The function that runs `command`; a one-line SystemExit when there is none."""
    if command not in COMMANDS:
        raise SystemExit(f"error: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}")
    target = COMMANDS[command][0]
    module_name, _, function = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):  # the command's own module is missing
            raise SystemExit(
                f"error: flaxgpt {command} needs {module_name}, which this installation of flaxgpt "
                "does not have; update flaxgpt"
            ) from None
        raise
    return getattr(module, function)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    fn = resolve(argv[0])
    from flaxgpt import runtime

    runtime.setup()
    status = fn(argv[1:])
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
