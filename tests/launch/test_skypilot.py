"""launch/skypilot/*.yaml against SkyPilot's own JSON schemas, the ones sky.Task.from_yaml validates a
task, its `resources` and each storage entry of `file_mounts` with (Draft 7 plus SkyPilot's
case_insensitive_enum keyword). The schemas are skypilot_schema.json, written from the installed
package by make_skypilot_schema.py: the `skypilot` package itself (~460 MB of dependencies, minutes to
install) is too heavy for CI. Checked by hand with skypilot 0.14.1's sky.Task.from_yaml_config too."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

HERE = Path(__file__).resolve().parent
LAUNCH = HERE.parents[1] / "launch" / "skypilot"
SCHEMAS = json.loads((HERE / "skypilot_schema.json").read_text())


def case_insensitive_enum(validator, enums, instance, schema):
    """SkyPilot's one keyword beyond Draft 7: an enum that ignores case (`infra: GCP`)."""
    if instance.lower() not in [e.lower() for e in enums]:
        yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")


Validator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"case_insensitive_enum": case_insensitive_enum}
)


def check(config: dict) -> None:
    """What sky.Task.from_yaml_config checks against its schemas, in its order; None values dropped
    as SkyPilot drops them (an empty YAML field)."""
    Validator(SCHEMAS["task"]).validate({k: v for k, v in config.items() if v is not None})
    Validator(SCHEMAS["resources"]).validate(config.get("resources") or {})
    for mount in (config.get("file_mounts") or {}).values():
        if isinstance(mount, dict):
            Validator(SCHEMAS["storage"]).validate(mount)


def load(name: str) -> dict:
    return yaml.safe_load((LAUNCH / name).read_text())


@pytest.mark.parametrize("name", ["gpu.yaml", "tpu.yaml"])
def test_the_skypilot_tasks_are_valid(name):
    config = load(name)
    check(config)
    # what makes them multi-node, spot and resumable from the bucket
    assert config["resources"]["use_spot"] and config["resources"]["job_recovery"]["strategy"] == "FAILOVER"
    assert config["file_mounts"]["/bucket"]["source"].startswith("gs://")
    assert '--config.out_dir="/bucket/runs/$RUN"' in config["run"]
    # the images' python3 is 3.10, below flaxgpt's requires-python: setup makes a 3.12 environment
    # (with the uv SkyPilot installs) and run uses it; `pip install -e .` under 3.10 failed the job
    assert "uv venv --seed --python 3.12 ~/flaxgpt-env" in config["setup"]
    assert "~/flaxgpt-env/bin/pip install" in config["setup"] and "\npip install" not in config["setup"]
    run = [line.strip() for line in config["run"].splitlines()]
    assert "~/flaxgpt-env/bin/python train.py" in config["run"] and not any(
        x.startswith("python") for x in run
    )


def test_gpu_nodes_and_tpu_slice():
    gpu, tpu = load("gpu.yaml"), load("tpu.yaml")
    assert gpu["num_nodes"] == 2 and gpu["resources"]["accelerators"] == "H100:8"
    assert "num_nodes" not in tpu and tpu["resources"]["accelerators"] == "tpu-v5e-16"  # one node, 4 hosts


def test_a_broken_task_is_refused():
    """The schemas can fail: a misspelt field, a value of the wrong type, an unknown storage mode."""
    for path, value in [
        (("num_node",), 2),
        (("resources", "use_spot"), "sometimes"),
        (("resources", "job_recovery", "strategy"), 3),
        (("file_mounts", "/bucket", "mode"), "MOUNT_SOMETIMES"),
    ]:
        config = load("gpu.yaml")
        target = config
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            check(config)
