"""Train a GPT.

    python -m flaxgpt.prepare --dataset shakespeare_char --out_dir data/shakespeare_char
    python train.py --config configs/shakespeare_char_cpu.py          # a few minutes on a laptop CPU
    python train.py --config configs/shakespeare_char.py              # one GPU / TPU
    python train.py --config configs/gpt2_124m.py                     # TPU VM or GPU node
    python train.py --config configs/shakespeare_char_cpu.py --config.max_iters=500 --config.out_dir=out/x

Every option is in configs/default.py; override any with --config.section.key=value.
"""

import sys

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/shakespeare_char_cpu.py", "a recipe file from configs/", lock_config=True
)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; options look like --config.key=value")
    from flaxgpt.trainer import train

    try:
        train(_CONFIG.value)
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main)
