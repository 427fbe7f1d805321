"""Writes tests/launch/skypilot_schema.json: SkyPilot's own JSON schemas for a task YAML, its
`resources` and a storage entry of `file_mounts` (sky.utils.schemas, the ones sky.Task.from_yaml
validates with), as the installed skypilot gives them.

The `skypilot` package pulls ~460 MB of dependencies and takes minutes to install, too much for CI, so
tests/launch/test_skypilot.py validates against this file instead. Regenerate it when SkyPilot changes:

    python -m venv sky-venv && sky-venv/bin/pip install skypilot   # a scratch venv
    sky-venv/bin/python tests/launch/make_skypilot_schema.py
"""

import json
from pathlib import Path

import sky
from sky.utils import schemas

if __name__ == "__main__":
    out = {
        "skypilot": sky.__version__,
        "task": schemas.get_task_schema(),
        "resources": schemas.get_resources_schema(),
        "storage": schemas.get_storage_schema(),
    }
    path = Path(__file__).with_name("skypilot_schema.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} (skypilot {sky.__version__})")
