"""`flaxgpt hf` and `flaxgpt peft`: models and adapters written as Hugging Face / PEFT directories.

    flaxgpt hf export --out_dir out/run --to out/hf     # a training run -> HF directory
    flaxgpt hf export --out_dir out/run --to out/hf --step 2000 --overwrite
    flaxgpt hf export --init_from path/to/SmolLM2 --to out/w4a16 --quantize int4   # compressed-tensors
    flaxgpt hf info gpt2                                 # the GPTConfig a checkpoint maps to
    flaxgpt hf info path/to/Llama-3.2-1B                 # any family of flaxgpt.hf.families
    flaxgpt peft merge --base base_dir --adapter adapter_dir --to merged_dir
    flaxgpt peft export --out_dir out/lora_llama --to out/lora_llama_adapter

A run is loaded with flaxgpt.load and written with flaxgpt.hf.pretrained.export_pretrained (a GPT-2,
or for a model with rotary positions the family that expresses it); with --quantize int4 a run or a
Hugging Face directory is loaded int4 and written by flaxgpt.hf.compressed (compressed-tensors
pack-quantized, which transformers, vLLM and flaxgpt.load read). Bad input is one line.

May import: flaxgpt.loader, flaxgpt.hf, flaxgpt.runs, flaxgpt.errors, flaxgpt.extras, flaxgpt.runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from flaxgpt import errors, extras

# jax, flax and the weight files' modules are imported when a command runs: `--help` stays instant


def export_run(out_dir, to: str, step=None, overwrite: bool = False) -> str:
    """A training run's checkpoint `step` (default the latest) as a Hugging Face directory."""
    from flaxgpt import loader
    from flaxgpt.hf import pretrained

    pretrained.check_export_target(to, overwrite, run=out_dir)  # before loading anything
    loader.require_run(out_dir)
    run = loader.load(out_dir, step=step)
    return pretrained.export_pretrained(
        run.config, run.params, to, overwrite=overwrite, tokenizer=_tokenizer(run, to)
    )


def _tokenizer(run, to: str):
    """The run's tokenizer.json tokenizer to write beside the weights, or None, said on stderr when the
    run's tokenizer (a character vocabulary) has no tokenizer.json form."""
    from flaxgpt.hf import families

    tok = run.tokenizer if getattr(run.tokenizer, "file", None) else None  # a model's tokenizer.json
    kind = run.tokenizer.to_meta().get("kind")
    if tok is None and kind not in ("tiktoken", None):
        gpt2 = families.family_of(run.config) == "gpt2"  # the others' loaders ask for a tokenizer.json
        alone = "reads as GPT-2's ids" if gpt2 else "has no tokenizer to sample with"
        print(
            f"note: the run's {kind} tokenizer has no tokenizer.json form, so {to} holds none; keep the "
            f"run to tokenize for it ({to} alone {alone})",
            file=sys.stderr,
        )
    return tok


def export_int4(source, to: str, mode: str, step=None, overwrite: bool = False) -> str:
    """A training run's checkpoint `step` or a Hugging Face directory, its decoder's linear layers
    quantized to int4 (`mode`: "int4" groups of 128, "int4_g64", "int4_g32"; the embeddings and the
    head float, as llm-compressor's W4A16 recipes leave them; an int4 source kept as it is, whatever
    its group), written as a compressed-tensors pack-quantized directory (hf.compressed)."""
    from flaxgpt import loader
    from flaxgpt.hf import compressed, pretrained

    if not mode.startswith("int4"):
        raise ValueError(
            f"--quantize {mode}: the compressed-tensors export writes int4, int4_g64 or int4_g32"
        )
    run_dir = source if loader.init_kind(source) == "run" else None
    pretrained.check_export_target(to, overwrite, run=run_dir)  # before loading anything
    compressed.family_of(loader.resolve_init(source, abstract=True).config)  # GPT-2, MoE: before any read
    run = loader.load(source, step=step)  # float, or an int4 source's weights as they are
    config, params = compressed.quantize_blocks(run.config, run.params, mode)
    return compressed.export(config, params, to, tokenizer=_tokenizer(run, to))


def export_run_adapter(out_dir, to: str, step=None, overwrite: bool = False) -> str:
    """A LoRA run's adapters (checkpoint `step`, default the latest) as a PEFT adapter directory."""
    from flaxgpt.hf import peft, pretrained
    from flaxgpt.runs import lora_run

    if not os.path.isdir(out_dir):
        raise ValueError(f"--out_dir {out_dir} does not exist; give the LoRA training run's directory")
    if lora_run.lora_section(out_dir) is None:
        raise ValueError(f"{out_dir} is not a LoRA run (its config.json has no lora.rank > 0)")
    files = f"{peft.ADAPTER_CONFIG} and {peft.ADAPTER_WEIGHTS}"
    pretrained.check_export_target(to, overwrite, run=out_dir, files=files)
    lr = lora_run.read_lora_run(out_dir, step)
    return peft.export_adapter(lr.config, lr.spec, lr.adapters, to, base=lr.base)


def merge_to(base_dir: str, adapter_dir: str, to: str, overwrite: bool = False) -> str:
    """Write base + adapter as a plain Hugging Face model directory (config, safetensors, tokenizer)."""
    from flaxgpt import loader
    from flaxgpt.hf import pretrained

    if loader.is_run_dir(base_dir):  # a run's config.json has no model_type: say what --base takes
        raise ValueError(
            f"--base {base_dir} is a flaxgpt training run; give a Hugging Face model directory (export a "
            f"run with: flaxgpt hf export --out_dir {shlex.quote(base_dir)} --to HF_DIR)"
        )
    pretrained.check_export_target(to, overwrite)
    config, params = loader.load_pretrained(base_dir, adapter=adapter_dir)
    has_tokenizer = os.path.isfile(os.path.join(base_dir, "tokenizer.json"))
    tokenizer = pretrained.load_tokenizer(base_dir) if config.glu and has_tokenizer else None
    return pretrained.export_pretrained(config, params, to, overwrite=True, tokenizer=tokenizer)


def _hf(args) -> None:
    from flaxgpt.hf import files, pretrained

    if args.cmd == "info":
        print(json.dumps(pretrained.read_config(args.name_or_path).to_dict(), indent=2))
        return
    if (args.out_dir is None) == (args.init_from is None):
        raise ValueError("name one source: --out_dir RUN or --init_from HF_DIR")
    if args.quantize:
        if args.out_dir is not None:
            from flaxgpt import loader

            loader.require_run(args.out_dir)
        export_int4(args.out_dir or args.init_from, args.to, args.quantize, args.step, args.overwrite)
    elif args.out_dir is None:
        raise ValueError("--init_from is already a Hugging Face directory; add --quantize int4 to write int4")
    else:
        export_run(args.out_dir, args.to, args.step, args.overwrite)
    with open(os.path.join(args.to, files.CONFIG_FILE)) as fh:
        written = json.load(fh)
    arch = written["architectures"][0]
    if args.quantize:  # the group written: an int4 source keeps its own
        group = written["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
        arch += f", int4 groups of {group} compressed-tensors pack-quantized"
    print(
        f"wrote {args.to} ({arch}); load it with flaxgpt.load({args.to!r}) or "
        f"transformers.AutoModelForCausalLM.from_pretrained({args.to!r})"
    )


def main(argv=None) -> int:
    """`flaxgpt hf`."""
    parser = argparse.ArgumentParser(
        prog="flaxgpt hf", description="Hugging Face weights from the command line"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a training run as a Hugging Face GPT-2 / Llama-family dir")
    ex.add_argument("--out_dir", help="flaxgpt training run directory")
    ex.add_argument("--init_from", help="with --quantize: a Hugging Face directory instead of a run")
    ex.add_argument(
        "--quantize",
        choices=("int4", "int4_g64", "int4_g32"),
        help="write int4 weights (groups of 128, 64, 32) in compressed-tensors' pack-quantized format",
    )
    ex.add_argument("--to", required=True, help="directory to write config.json + model.safetensors into")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ex.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --to")
    info = sub.add_parser("info", help="print the GPTConfig a GPT-2 name or a HF directory maps to")
    info.add_argument("name_or_path")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        extras.require_hf(args.name_or_path, "flaxgpt hf info")
    return errors.run_cli(lambda _: _hf(args))


def _peft(args) -> None:
    if args.cmd == "merge":
        print(f"wrote {merge_to(args.base, args.adapter, args.to, args.overwrite)}")
    else:
        print(f"wrote {export_run_adapter(args.out_dir, args.to, args.step, args.overwrite)}")


def peft_main(argv=None) -> int:
    """`flaxgpt peft`."""
    p = argparse.ArgumentParser(prog="flaxgpt peft", description="LoRA adapters both ways, and merged")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="base + PEFT adapter -> a plain Hugging Face model directory")
    m.add_argument("--base", required=True, help="the base model directory (config.json + safetensors)")
    m.add_argument("--adapter", required=True, help="the PEFT adapter directory")
    m.add_argument("--to", required=True, help="the new model directory")
    m.add_argument("--overwrite", action="store_true")
    e = sub.add_parser("export", help="a LoRA run's adapter -> a PEFT adapter directory")
    e.add_argument("--out_dir", required=True, help="the LoRA training run")
    e.add_argument("--to", required=True, help="the adapter directory to write")
    e.add_argument("--step", type=int, default=None, help="the checkpoint to export (default: the latest)")
    e.add_argument("--overwrite", action="store_true", help="replace the adapter files in an existing --to")
    args = p.parse_args(argv)
    return errors.run_cli(lambda _: _peft(args), errors=(ValueError, OSError))


if __name__ == "__main__":
    from flaxgpt import runtime

    runtime.setup()
    sys.exit(main())
