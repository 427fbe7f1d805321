"""Train a GPT.

    flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python train.py --config configs/shakespeare_char_cpu.py          # a few minutes on a laptop CPU
    python train.py --config configs/shakespeare_char.py              # one GPU / TPU
    python train.py --config configs/gpt2_124m.py                     # TPU VM or GPU node
    python train.py --config configs/shakespeare_char_cpu.py --config.max_iters=500 --config.out_dir=out/x

Without --config, train.py uses configs/shakespeare_char_cpu.py (the quickstart's recipe) and says so.
Every option is in configs/default.py (the model's fields in flaxgpt/models/gpt_config.py, the typed
data, mesh, lora, dpo and grpo sections' in flaxgpt/train/sections.py); override
any with --config.section.key=value (a misplaced key gets its right section: did you mean ...?).
Progress: `step N/total`, tokens/s and the time left each log_interval steps; a closing summary with
the checkpoint and the command that samples from it. --verbose keeps absl's and orbax's log lines.
Bad input (an unknown key, a wrong type, a nonsense value, a broken recipe file, missing data, a full
disk, ...) is a one-line error and exit code 1; the whole config is checked before anything is written.
Checkpoints go to out_dir/checkpoints; running the same command again resumes (init_from=auto).
SIGTERM (a preemption) or Ctrl-C saves the finished step and exits 0; a NaN loss is an error naming
the last good checkpoint.
"""

import errno
import os
import sys

from absl import app, flags
from ml_collections import config_flags

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs/shakespeare_char_cpu.py")


KEYS_HINT = (
    "every key is in configs/default.py, the model's in flaxgpt/models/gpt_config.py, the data, mesh, "
    "lora, dpo and grpo sections' in flaxgpt/train/sections.py"
)
flags.DEFINE_bool("verbose", False, "keep absl's and orbax's log lines (INFO and warnings)")


def one_line(e: BaseException) -> str:
    """ml_collections' messages carry quotes and newlines ("Did you mean ..."): flatten them."""
    msg = str(e)
    if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":  # repr-quoted by KeyError
        msg = msg[1:-1]
    msg = " ".join(msg.replace("\\n", "\n").replace("\\'", "'").split())
    if isinstance(e, AttributeError | KeyError):
        return f"unknown config key {msg} ({KEYS_HINT})"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on device writing {e.filename or 'a file'}; free disk space and run again"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return msg


def split_recipe(argv) -> tuple[str | None, list[str]]:
    """The --config file named on the command line (`--config=F` or `--config F`; None when there is
    none) and the other arguments (`--config.key=value` overrides among them)."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(("--config=", "-config=")):
            path = arg.split("=", 1)[1]
        elif arg in ("--config", "-config") and i + 1 < len(argv):
            path, i = argv[i + 1], i + 1
        else:
            rest.append(arg)
        i += 1
    return path, rest


def short_help() -> str:
    """train.py --help: the docstring and the three kinds of option; the options themselves are in
    configs/default.py and docs/training.md (--helpfull: absl's, with the whole recipe)."""
    return (
        "usage: python train.py [--config FILE] [--config.KEY=VALUE ...] [--verbose]\n\n"
        f"{__doc__.strip()}\n\n"
        "options:\n"
        "  --config FILE           a recipe (configs/*.py); default configs/shakespeare_char_cpu.py\n"
        "  --config.KEY=VALUE      override one setting, e.g. --config.optim.learning_rate=3e-4;\n"
        "                          every key with its default and why: configs/default.py, docs/training.md\n"
        f"  --verbose               {flags.FLAGS['verbose'].help}\n"
        "  --helpfull              absl's help, the whole recipe's values included\n"
    )


def fail():
    """The run stopped with a one-line error, already printed (errors.run_cli): exit 1 right away.

    The trainer has closed its files, checkpointer and lock on the way out; what is left are orbax's
    background threads and finalizers, which can report the failure the line already names again
    while Python shuts down (after a full disk: `ImportError: sys.meta_path is None`). Ending the
    process here keeps the one line the last thing on screen.
    """
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def parse_flags(argv):
    """Runs the recipe file once (one-line errors for a broken one), then applies the overrides to
    its config, locked: a misspelt --config.lerning_rate is an error naming the key it means."""
    from flaxgpt.train.config_check import (
        ConfigError,
        load_recipe,
        override_type_error,
        overrides,
        unknown_override,
    )

    path, rest = split_recipe(argv)
    if {"--help", "-help", "-h"} & set(rest):  # absl's would print the whole recipe as a default
        print(short_help(), end="")
        sys.exit(0)
    if path is None and not {"--help", "-help", "--helpfull", "-h"} & set(rest):
        print(f"no --config: using {os.path.relpath(DEFAULT_RECIPE)} (the quickstart's recipe)", flush=True)
    try:
        recipe = load_recipe(path or DEFAULT_RECIPE)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    message = unknown_override(recipe, rest)
    if message:  # before ml_collections, whose message knows one section only
        sys.exit(f"error: {message} ({KEYS_HINT})")
    message = override_type_error(recipe, rest)
    if message:  # ml_collections' own is int()'s ("invalid literal for int() with base 10")
        sys.exit(f"error: {message}")
    try:  # the override flags are defined from `rest` here: a misspelt key fails already
        config_flags.DEFINE_config_dict(
            "config", recipe, "the recipe's config (--config FILE)", lock_config=True, sys_argv=rest
        )
        parsed = flags.FLAGS(rest)
    except (flags.Error, AttributeError, KeyError, ValueError, TypeError, OSError) as e:
        sys.exit(f"error: {one_line(e)}")
    if overrides(rest).get("tensorboard", "").lower() in ("true", "1"):  # asked for: it must be there
        from flaxgpt import extras

        extras.require("tensorboard", "--config.tensorboard=True")
    return parsed


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; options look like --config.key=value")
    from flaxgpt import errors, extras, runtime

    config = flags.FLAGS.config
    from flaxgpt.train.config_check import ignored_model_override

    message = ignored_model_override(config, sys.argv[1:])
    if message:  # before anything loads: the weights would replace the override without a word
        sys.exit(f"error: {message}")
    extras.require_hf(config.init_from, "--config.init_from")  # pretrained weights: before anything loads
    if config.get("dpo") and config.dpo.get("reference"):
        extras.require_hf(config.dpo.reference, "--config.dpo.reference")
    # orbax logs every save at INFO (and some warnings) through absl; --verbose or --verbosity keeps its say
    verbose = flags.FLAGS.verbose or flags.FLAGS["verbosity"].present
    runtime.setup(verbosity=None if verbose else "error")
    from flaxgpt.train.trainer import train

    try:  # OSError: a full disk, a missing file
        if errors.run_cli(
            lambda _: train(config), errors=(ValueError, OSError, FloatingPointError), describe=one_line
        ):
            fail()
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops, like SIGTERM)
        sys.exit("error: interrupted before the run could save; run the same command to resume")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
