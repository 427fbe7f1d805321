"""`flaxgpt hf`: Hugging Face weights from the command line.

    flaxgpt hf export --out_dir out/run --to out/hf     # a training run -> HF directory
    flaxgpt hf export --out_dir out/run --to out/hf --step 2000 --overwrite
    flaxgpt hf info gpt2                                 # the GPTConfig a checkpoint maps to
    flaxgpt hf info path/to/Llama-3.2-1B                 # Llama, Mistral, Qwen2 too

export loads the run with flaxgpt.load and writes it with flaxgpt.hf.gpt2.export_pretrained (a GPT-2,
or for a model with rotary positions the Llama-family model that expresses it). Bad input is one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flaxgpt import extras
from flaxgpt.hf import files, gpt2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flaxgpt hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a training run as a Hugging Face GPT-2 / Llama-family dir")
    ex.add_argument("--out_dir", required=True, help="flaxgpt training run directory")
    ex.add_argument("--to", required=True, help="directory to write config.json + model.safetensors into")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ex.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --to")
    info = sub.add_parser("info", help="print the GPTConfig a GPT-2 name or a HF directory maps to")
    info.add_argument("name_or_path")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        extras.require_hf(args.name_or_path, "flaxgpt hf info")
    try:
        if args.cmd == "export":
            from flaxgpt import loader

            gpt2.check_export_target(args.to, args.overwrite, run=args.out_dir)  # before loading anything
            loader.require_run(args.out_dir)
            run = loader.load(args.out_dir, step=args.step)
            tok = run.tokenizer if getattr(run.tokenizer, "file", None) else None  # a model's tokenizer.json
            gpt2.export_pretrained(run.config, run.params, args.to, overwrite=args.overwrite, tokenizer=tok)
            with open(os.path.join(args.to, files.CONFIG_FILE)) as fh:
                arch = json.load(fh)["architectures"][0]
            print(
                f"wrote {args.to} ({arch}); load it with "
                f"transformers.AutoModelForCausalLM.from_pretrained({args.to!r})"
            )
        else:
            print(json.dumps(gpt2.read_config(args.name_or_path).to_dict(), indent=2))
    except (ValueError, OSError, ImportError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flaxgpt import runtime

    runtime.setup()
    sys.exit(main())
