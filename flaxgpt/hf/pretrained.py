"""Hugging Face checkpoints in and out, for every family in the table (flaxgpt.hf.families).

    config, params = load_pretrained("gpt2")            # hub or its cache (needs huggingface_hub)
    config, params = load_pretrained("path/to/dir")     # config.json + safetensors, any family
    config = read_config("path/to/Llama-3.2-1B")        # config.json alone, no weights
    export_pretrained(config, params, "out/hf", tokenizer=tok)  # then AutoModelForCausalLM.from_pretrained
    # tok: the model's own tokenizer (load_tokenizer): its files and bos / eos ids come along; without
    # it a rotary model's config.json has no bos / eos ids (generate would not stop at EOS)

config.json's model_type picks the family (its key table, config mapping and weight loop); export
picks the family that expresses the GPTConfig (`families.family_of`), or `model_type`. Casting and
quantizing are flaxgpt.load's (flaxgpt.loader.compact), merging a PEFT adapter flaxgpt.load_pretrained's.

Export never writes into a training run's directory (runs.run_dir.is_run_dir, or anything inside
one), and replaces an existing non-empty directory's files only with --overwrite (`overwrite=True`);
each file is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from flaxgpt.data import tokenizers
from flaxgpt.data.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from flaxgpt.hf import families
from flaxgpt.hf import files as hf_files
from flaxgpt.hf.files import CONFIG_FILE, WEIGHTS_FILE, resolve
from flaxgpt.models import registry as models
from flaxgpt.models.gpt_config import GPTConfig
from flaxgpt.runs.run_dir import is_run_dir

# a model's tokenizer files, copied along on export when the model has its own tokenizer.json
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _read_hf_config(directory: str) -> dict:
    return hf_files.read_json(os.path.join(directory, CONFIG_FILE), "a model's config object")


def read_config(name_or_path: str, cache_dir: str | None = None) -> GPTConfig:
    """The GPTConfig of a GPT-2 name or a Hugging Face directory, from its config.json alone (no weights)."""
    return families.config_from_hf(_read_hf_config(resolve(name_or_path, cache_dir)))


def load_pretrained(
    name_or_path: str,
    *,
    scan_layers: bool = False,
    pad_vocab_multiple: int = 1,
    param_dtype: str = "float32",
    cache_dir: str | None = None,
    place=None,
    **overrides,
):
    """A Hugging Face checkpoint -> (GPTConfig, params) for `GPT(config).apply(...)`, as stored.

    `name_or_path`: a directory with config.json + model.safetensors (or the index and its shards),
    or a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) found in the HF cache or downloaded.
    `overrides`: GPTConfig fields that do not change the architecture (dtype, dropout,
    block_size <= the checkpoint's context, attention_impl, remat). `place`: a sharding.Placement,
    where each leaf goes from host memory (default: whole onto the default device; over a mesh each
    device reads only its slices).
    """
    directory = resolve(name_or_path, cache_dir)
    if not os.path.exists(os.path.join(directory, CONFIG_FILE)):
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {directory}; a GPT-2 directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    hf = _read_hf_config(directory)
    family = families.family_for(hf)
    layout = dict(scan_layers=scan_layers, pad_vocab_multiple=pad_vocab_multiple, param_dtype=param_dtype)
    return family.load(directory, hf, family, **layout, place=place, **overrides)


def load_tokenizer(name_or_path: str, cache_dir: str | None = None):
    """The tokenizer of a pretrained model: GPT-2's BPE (shipped with flaxgpt, offline) for GPT-2,
    the directory's tokenizer.json for a Llama-family model (an error when it has none)."""
    directory = resolve(name_or_path, cache_dir)
    model_type = _read_hf_config(directory).get("model_type")
    if model_type == "gpt2":
        return tokenizers.get_tokenizer("gpt2")
    if not os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}; a {model_type} model needs its own")
    return HFTokenizer(directory)


def as_config(config) -> GPTConfig:
    """A GPTConfig, or a run's `model` section (config.json: GPTConfig fields + "kind")."""
    kind = models.kind_of(config) if dataclasses.is_dataclass(config) else dict(config).get("kind", "gpt")
    if kind != "gpt":
        raise ValueError(f"only GPT models export to GPT-2; this checkpoint is kind={kind!r}")
    return config if isinstance(config, GPTConfig) else models.config_from(config, saved=True)


def check_export_target(to, overwrite: bool = False, run=None, files: str = "") -> None:
    """Refuses, in one line, to export into the training run `run`, into any training run's directory
    (or below it), into a file, or into an existing non-empty directory unless `overwrite` (which
    replaces `files`: by default a model's config.json and weights)."""
    target = Path(to).resolve()
    if run is not None and Path(run).resolve() in (target, *target.parents):
        where = "is" if Path(run).resolve() == target else "is inside"
        raise ValueError(f"--to {to} {where} the training run being exported; export to another directory")
    for directory in (target, *target.parents):
        if directory.is_dir() and is_run_dir(directory):
            where = "is" if directory == target else f"is inside {directory},"
            raise ValueError(f"{to} {where} a flaxgpt training run; export to a directory outside it")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{to} is a file, not a directory; choose another --to")
    if not overwrite and target.is_dir() and any(target.iterdir()):
        raise FileExistsError(
            f"{to} exists and is not empty; pass --overwrite to replace its "
            f"{files or f'{CONFIG_FILE} and {WEIGHTS_FILE}'}, or choose another --to"
        )


def export_pretrained(config, params, out_dir: str, overwrite: bool = False, tokenizer=None) -> str:
    """Write out_dir/config.json + safetensors that transformers' AutoModelForCausalLM loads: a GPT-2,
    or for a model with rotary positions the family that expresses it (with the tokenizer's files when
    `tokenizer` is the model's own tokenizer.json). Refuses a training run's directory, and an existing
    non-empty out_dir unless `overwrite`."""
    check_export_target(out_dir, overwrite)
    return write(as_config(config), params, out_dir, tokenizer=tokenizer)


def write(config: GPTConfig, params, out_dir: str, model_type=None, tokenizer=None, max_shard_bytes=None):
    """The files of `export_pretrained` (no target check): `model_type` defaults to
    families.family_of(config); `max_shard_bytes` splits the weights into transformers' shards."""
    model_type = model_type or families.family_of(config)
    family = families.FAMILIES[model_type]
    special = special_ids(tokenizer, model_type)
    hf, tensors = family.export_state(config, params, model_type, family, special)
    hf_files.write_safetensors(tensors, out_dir, max_shard_bytes)  # each file renamed when complete
    hf_files.write_json(hf, os.path.join(out_dir, CONFIG_FILE))
    copy_tokenizer(tokenizer, special, out_dir)
    return out_dir


def special_ids(tokenizer, model_type: str) -> dict | None:
    """config.json's bos / eos ids from a model's own tokenizer.json (an HFTokenizer); None for GPT-2
    (its own ids) or without one."""
    if tokenizer is None or not hasattr(tokenizer, "file") or model_type == "gpt2":
        return None
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def copy_tokenizer(tokenizer, special: dict | None, out_dir: str) -> None:
    """The tokenizer's files (TOKENIZER_FILES) into out_dir, when `special_ids` gave its ids."""
    if special is None:
        return
    for name in TOKENIZER_FILES:
        source = tokenizer.file.parent / name
        if source.is_file():
            shutil.copyfile(source, os.path.join(out_dir, name))
