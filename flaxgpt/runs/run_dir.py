"""The run directory: what a training run writes next to its checkpoints, and loading it back.

    write_run_files(out_dir, config_dict, data_dir)     # the trainer, on process 0, before step 0
    changed = check_resume(extra, step, model_config, meta)   # before a resume writes anything
    run = load_run("out/shakespeare_char")              # Run(kind, config, params, tokenizer)
    run = load_run("out/reverse", step=2000)            # (flaxgpt.load: also a dtype, quantized weights)
    is_run_dir(path), require_run(path)                 # the one rule for "a training run's directory"

out_dir/ holds config.json (the resolved run config; its "model" entry is `models.section_of` of the
model config: "kind" plus every field), meta.json (copied from the data directory: the tokenizer),
checkpoints/ (flaxgpt.runs.checkpoint), metrics.jsonl, plots and, while a run trains, train.lock
(flaxgpt.runs.run_lock). `load_run` needs nothing else: flaxgpt.load (sample.py, serve.py,
`flaxgpt eval`, `flaxgpt hf export`), attention maps and translation load a run through it.

Each checkpoint also carries the run config and data meta.json it was trained with (its extra's
"config" and "meta"). A resume may change training settings (learning rate, batch size, max_iters,
evaluation, dropout, compute dtype...) but not the model's weights-defining fields or the tokenizer:
`check_resume` refuses those, naming the keys. So config.json's model section and meta.json's tokenizer
hold for every checkpoint of the run; config.json's training settings are the latest session's
(`train` prints what changed), and each checkpoint's own are in its extra. `load_run` builds the model
and tokenizer from the loaded checkpoint's own record when it has one (older checkpoints: the files).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from flaxgpt.data import tokenizers
from flaxgpt.models import registry as models
from flaxgpt.runs import checkpoint

HINT = "point out_dir at a flaxgpt training run (config.json, meta.json, checkpoints/)"


class RunError(ValueError):
    """A run directory that cannot be written or loaded; the message is one line."""


class Run(NamedTuple):
    kind: str  # "gpt" | "seq2seq"
    config: Any  # GPTConfig | TransformerConfig
    params: Any
    tokenizer: Any  # a tokenizers.Tokenizer; Seq2SeqTokenizer for "seq2seq"


FRESH_STARTS = ("auto", "resume", "scratch")  # init_from values that build the recipe's own model


def is_run_dir(source) -> bool:
    """The one rule for "is this a flaxgpt training run?": meta.json or checkpoints/, or a config.json
    with a `model` entry (a Hugging Face config.json has `model_type` instead)."""
    path = Path(source)
    if (path / "meta.json").is_file() or (path / "checkpoints").is_dir():
        return True
    try:
        return "model" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_out_dir(out_dir, init_from: str = "auto") -> None:
    """Before a run writes into `out_dir`: a RunError when it holds something else's config.json (a
    Hugging Face model's: the run's would replace it) or is the directory init_from reads weights from."""
    out = Path(out_dir)
    if (
        init_from not in FRESH_STARTS
        and Path(init_from).is_dir()
        and out.resolve() == Path(init_from).resolve()
    ):
        raise RunError(
            f"out_dir {out_dir} is init_from's directory: the run would write over the weights it "
            "reads; use another out_dir"
        )
    config = out / "config.json"
    if config.is_file() and not is_run_dir(out):
        raise RunError(
            f"{config} is not a flaxgpt run's (a Hugging Face model's?): the run's config.json would replace "
            "it; use another out_dir"
        )


def require_run(source) -> None:
    """A one-line RunError unless `source` is a training run's directory: where the user named a run
    (--out_dir), before flaxgpt.load, which would look a missing directory's name up on the hub."""
    if not is_run_dir(source):
        what = "is not a training run" if Path(source).is_dir() else "is not a directory"
        raise RunError(f"{source} {what}; {HINT}")


def _write_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def check_data(out_dir, data_dir) -> dict:
    """The data directory's meta.json, refused when the run already holds another vocabulary
    (its checkpoints decode with the old one). Called before anything is written."""
    out_dir, data_meta = Path(out_dir), Path(data_dir) / "meta.json"
    try:
        meta = json.loads(data_meta.read_text())
    except (OSError, ValueError) as e:
        raise RunError(
            f"{data_meta} cannot be read ({type(e).__name__}); prepare the dataset first"
        ) from None
    run_meta = out_dir / "meta.json"
    if run_meta.exists() and _read(run_meta).get("tokenizer") != meta.get("tokenizer"):
        raise RunError(
            f"{run_meta} (the run's vocabulary) differs from {data_meta}; resume with the data "
            "the run was trained on, or use a new out_dir"
        )
    return meta


def _plain(v):
    """A value as its JSON record holds it: tuples are lists (a saved config reads its tuples back as
    lists, and ('answer',) is the setting ['answer'] was)."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _flat(d, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}, leaves as JSON holds them (_plain)."""
    if not isinstance(d, dict):
        return {prefix: _plain(d)}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _differing(a: dict, b: dict) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<missing>") != fb.get(k, "<missing>"))


LORA_MODEL_KEYS = ("rank", "alpha", "targets")  # a LoRA run's adapters are these; the rest may change


def check_resume(
    extra: dict, step: int, model_config, meta: dict, config_dict: dict | None = None
) -> list[str]:
    """Refuses (a one-line RunError naming the keys) to resume checkpoint `step` (its `extra`) with a
    model config or a data tokenizer other than those it was trained with; `models.RUNTIME_FIELDS` may change.
    Returns the training settings that change ("optim.learning_rate: 0.0006 -> 0.0001"), comparing the
    checkpoint's run config with `config_dict`. Checkpoints saved without a record pass (shapes are
    still checked on restore)."""
    saved = extra.get("config") or {}
    diffs = []
    if isinstance(saved.get("model"), dict):
        # fields added since take their saved-config defaults (e.g. the old sinusoid layout)
        before = models.section_of(models.config_from(saved["model"], saved=True))
        now = models.section_of(model_config)
        for k in sorted(set(before) | set(now)):
            if k not in models.RUNTIME_FIELDS + models.EXPORT_ONLY_FIELDS and before.get(k) != now.get(k):
                diffs.append(f"model.{k} ({before.get(k)!r} in the checkpoint, {now.get(k)!r} now)")
    # what the adapters mean: another rank or targets fail the restore's shapes, another alpha would
    # rescale what they learned without a word
    was, now_lora = saved.get("lora") or {}, (config_dict or {}).get("lora") or {}
    if was.get("rank") and config_dict is not None:
        for k in LORA_MODEL_KEYS:
            if _plain(was.get(k)) != _plain(now_lora.get(k)):
                diffs.append(f"lora.{k} ({was.get(k)!r} in the checkpoint, {now_lora.get(k)!r} now)")
    saved_tok = (extra.get("meta") or {}).get("tokenizer")
    if saved_tok is not None and saved_tok != meta.get("tokenizer"):
        keys = ", ".join(f"tokenizer.{k}" for k in _differing(saved_tok, meta.get("tokenizer") or {}))
        diffs.append(f"the data's meta.json ({keys} differ)")
    if diffs:
        fix = "resume with the config and data it was trained with, or use a new out_dir"
        source = saved.get("init_from")
        if (
            source is not None
            and source not in FRESH_STARTS
            and (config_dict or {}).get("init_from") != source
        ):
            # a fine-tune's model comes from its init_from: init_from=resume alone takes the defaults'
            fix = (
                f"it fine-tuned {source}: continue it with --config.init_from={source}, or use a new out_dir"
            )
        raise RunError(
            f"checkpoint step {step} was trained with another model or data: {'; '.join(diffs)}; {fix}"
        )
    if config_dict is None or not saved:
        return []
    now = {**config_dict, "model": models.section_of(model_config)}
    fixed = {f"model.{k}" for k in now["model"] if k not in models.RUNTIME_FIELDS}  # equal, checked above
    fixed |= {f"model.{k}" for k in models.EXPORT_ONLY_FIELDS}  # not a training setting either
    before, now = _flat(saved), _flat(now)
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in _differing(before, now) if k not in fixed]


def write_run_files(out_dir, config_dict: dict, data_dir, meta: dict | None = None) -> Path:
    """Writes out_dir/config.json and copies data_dir/meta.json to out_dir/meta.json.

    `config_dict` is the resolved run config; its "model" entry is the model config (GPTConfig /
    TransformerConfig), stored as `models.section_of` it, or that section already as a dict.
    A run resumed with data of another vocabulary is refused: its checkpoints decode with the old one.
    `meta`: data_dir's meta.json as `check_data` returned it, when the caller checked it already.
    """
    out_dir = Path(out_dir)
    model = config_dict.get("model")
    if dataclasses.is_dataclass(model):
        config_dict = {**config_dict, "model": models.section_of(model)}
    meta = meta if meta is not None else check_data(out_dir, data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "config.json", json.dumps(config_dict, indent=2) + "\n")
    _write_atomic(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return out_dir


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path} is missing; {HINT}") from None
    except (OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(f"{path} cannot be read ({why}); {HINT}") from None


def model_section(out_dir) -> dict:
    """config.json's `model` entry (`models.section_of` the model config), one-line RunErrors."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise RunError(f"{out_dir} is not a directory; {HINT}")
    section = _read(out_dir / "config.json").get("model")
    if not isinstance(section, dict):
        raise RunError(f"{out_dir / 'config.json'} has no 'model' entry; is it a flaxgpt run config?")
    return section


def translation_settings(out_dir=None, beam_size=None, alpha=None) -> dict:
    """{beam_size, alpha} for translating a seq2seq run (sample.py, `flaxgpt eval`): the flags given,
    else the run's recipe (config.json's seq2seq section: they were never read), else 4 and 0.6."""
    section = _read(Path(out_dir) / "config.json").get("seq2seq") if out_dir else None
    recipe = {"beam_size": 4, "alpha": 0.6}
    for key, value in (section if isinstance(section, dict) else {}).items():
        if key in recipe and isinstance(value, (int, float)) and not isinstance(value, bool):
            recipe[key] = value
    given = {"beam_size": beam_size, "alpha": alpha}
    kinds = {"beam_size": int, "alpha": float}  # (a recipe's alpha of 1 must not make --alpha 0.5 an int)
    return {k: kinds[k](v if (v := given[k]) is not None else recipe[k]) for k in recipe}


def checkpoint_step(out_dir, step: int | None = None) -> int | None:
    """The checkpoint step `load_run(out_dir, step)` reads: `step`, or the latest one."""
    if step is not None:
        return step
    ckpt = checkpoint.Checkpointer(out_dir, read_only=True, async_save=False)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def load_run(out_dir, step: int | None = None, place=None) -> Run:
    """The run in `out_dir` at checkpoint `step` (default: the latest), params on one local device
    or, with `place` (a sharding.Placement over a mesh), restored straight into each device's slices;
    as saved (flaxgpt.load casts and quantizes)."""
    out_dir = Path(out_dir)
    section = model_section(out_dir)
    tok_meta = _read(out_dir / "meta.json").get("tokenizer")
    if not tok_meta:
        raise RunError(
            f"{out_dir / 'meta.json'} has no 'tokenizer' entry; copy the data directory's meta.json "
            "into the run directory"
        )
    # a config.json that does not map (or a mesh that does not divide it) is named before loading weights
    saved = models.config_from(section, saved=True)
    shardings = place.shardings(models.abstract_params(saved)) if place is not None else None
    params, extra = checkpoint.load_for_inference(out_dir, step, sharding=shardings, with_extra=True)
    # the model and tokenizer this checkpoint was trained with (older checkpoints: config.json, meta.json)
    section = (extra.get("config") or {}).get("model") or section
    tok_meta = (extra.get("meta") or {}).get("tokenizer") or tok_meta
    config = models.config_from(section, saved=True)
    kind = models.kind_of(config)
    tok = (
        tokenizers.Seq2SeqTokenizer.from_meta(tok_meta)
        if kind == "seq2seq"
        else tokenizers.from_meta(tok_meta)
    )
    return Run(kind, config, params, tok)


def resume_step(ckpt: checkpoint.Checkpointer, init_from: str = "auto") -> int | None:
    """The step to restore for `init_from`; None means start fresh (from scratch or pretrained weights).

    auto (the default): the latest checkpoint if out_dir has one, else None.
    resume: the latest checkpoint; an error when there is none.
    scratch: an error when out_dir already has checkpoints, so a new run never deletes or overwrites them.
    a pretrained name or path: the latest checkpoint if it was saved by a run with the same init_from
    (a preempted fine-tune continues), else as scratch.
    """
    latest = ckpt.latest_step()
    if init_from == "auto":
        return latest
    saved = None
    if init_from != "scratch" and latest is not None:
        saved = (ckpt.restore_extra(latest).get("config") or {}).get("init_from")
        if same_source(saved, init_from):
            return latest
    if init_from == "resume":
        if latest is None:
            raise checkpoint.CheckpointError(
                f"init_from=resume but {ckpt.out_dir} has no checkpoint; "
                "use init_from=scratch or point out_dir at a run with checkpoints"
            )
        return latest
    if latest is not None:
        was = f" (trained from init_from={saved})" if saved else ""
        raise checkpoint.CheckpointError(
            f"init_from={init_from} but {ckpt.out_dir} already has checkpoints up to step "
            f"{latest}{was}; use init_from=resume or a new out_dir"
        )
    return None


def recorded_init_from(out_dir) -> str | None:
    """The init_from a run in `out_dir` recorded in its config.json (None: no readable run there)."""
    try:
        value = json.loads((Path(out_dir) / "config.json").read_text()).get("init_from")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def same_source(a, b) -> bool:
    """Two init_from values naming the same weights: equal, or paths to one directory (out/base,
    ./out/base/, its absolute path, a link to it)."""
    if a is None or b is None:
        return False
    return str(a) == str(b) or (
        Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    )
