"""The launch files of launch/ read as their engines read them:

- launch/slurm/train.sbatch: `bash -n`, then run as sbatch would run it, with `srun` replaced by
  tests/launch/srun (SLURM_NTASKS local copies, each with srun's task variables): 2 processes train
  2 steps and join through jax's own Slurm detection.
- launch/gke/jobset-*.yaml: the JobSet envelope (apiVersion jobset.x-k8s.io/v1alpha2, kind,
  replicatedJobs, network, failurePolicy, successPolicy) against JOBSET_SCHEMA below, which is OURS,
  written from the fields of JobSet's Go types (api/jobset/v1alpha2/jobset_types.go), not its CRD;
  each replicated Job's template against Kubernetes' own batch/v1 Job schema (kubernetes-validate).
- launch/skypilot/*.yaml: SkyPilot's own task loader (tests/launch/test_skypilot.py).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate  # the dev extra: Kubernetes' own schemas, offline
import ml_collections
import pytest
import yaml

from flaxgpt import cluster
from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
sys.path.insert(0, str(ROOT))

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
JOBSET_SCHEMA = {  # ours, from the JobSet v1alpha2 Go types' json tags and kubebuilder enums
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": NAME}},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": NAME,
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {"type": "object", "required": ["spec"]},  # batch/v1 JobTemplateSpec
                            "dependsOn": {"type": "array", "maxItems": 5},
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "required": ["operator"],
                    "properties": {
                        "operator": {"enum": ["All", "Any"]},
                        "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                        "rules": {"type": "array"},
                    },
                },
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            },
        },
    },
}
KUBERNETES_VERSION = "1.32"  # GKE's regular channel, 2026
JOBSETS = sorted((LAUNCH / "gke").glob("jobset-*.yaml"))


def test_the_sbatch_script_parses():
    subprocess.run(["bash", "-n", str(LAUNCH / "slurm" / "train.sbatch")], check=True)
    text = (LAUNCH / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --requeue" in text and re.search(r"^srun .*train\.py", text, re.M)


@pytest.mark.slow  # two jax processes
def test_the_sbatch_script_trains_two_processes_with_a_local_srun(tmp_path):
    """sbatch's variables for a 2-task job on this machine, srun replaced by tests/launch/srun."""
    from flaxgpt.data import prepare
    from flaxgpt.runs.checkpoint import Checkpointer
    from tests.train.test_multihost import TEXT, free_port, metrics_losses

    prepare.prepare_text(TEXT, tmp_path / "data", "char", 0.1, "generated")
    path = f"{Path(__file__).parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if not re.match(r"SLURM_|XLA_FLAGS|JAX_NUM_CPU", k)}
    env.update(
        PATH=path,
        PYTHON=sys.executable,
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
        XLA_FLAGS=xla_flags(1),
        JAX_COORDINATOR_PORT=str(free_port()),  # jax's own variable: a free port, not the job id's
        SLURM_JOB_ID="4243",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        RECIPE="configs/shakespeare_char_cpu.py",
        OUT_DIR=str(tmp_path / "run"),
        DATA_DIR=str(tmp_path / "data"),
    )
    tiny = ["--config.model.n_layer=1", "--config.model.n_embd=32", "--config.model.block_size=16"]
    tiny += ["--config.batch_size=8", "--config.max_iters=2", "--config.eval_iters=1"]
    tiny += ["--config.log_interval=1"]
    tiny += ["--config.tensorboard=False", "--config.plot=False"]
    proc = subprocess.run(
        ["bash", str(LAUNCH / "slurm" / "train.sbatch"), *tiny],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "job 4243: 2 tasks on localhost" in out
    assert sorted(metrics_losses(tmp_path / "run")) == [1, 2]  # one line a step: process 0 alone wrote
    assert Checkpointer(tmp_path / "run").latest_step() == 2
    assert out.count("compiled the train step") == 1  # process 0 alone prints
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["max_iters"] == 2 and config["model"]["n_layer"] == 1


@pytest.mark.parametrize("path", JOBSETS, ids=lambda p: p.name)
def test_jobsets_envelope_and_their_jobs_kubernetes_schema(path):
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    jsonschema.validate(doc, JOBSET_SCHEMA)
    for rj in doc["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, **rj["template"]}
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
        assert rj["template"]["spec"]["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX


def test_a_broken_jobset_is_refused():
    """The checks above can fail: a misspelt field, a wrong kind, a Job field of the wrong type."""
    (doc,) = list(yaml.safe_load_all((LAUNCH / "gke" / "jobset-gpu.yaml").read_text()))
    for broken in ({"replicatedJob": []}, {"failurePolicy": {"maxRestart": 3}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**doc, "spec": {**doc["spec"], **broken}}, JOBSET_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "kind": "Job"}, JOBSET_SCHEMA)
    template = doc["spec"]["replicatedJobs"][0]["template"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **template}
    job["spec"] = {**job["spec"], "parallelism": "two"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def pod_env(path: Path, job_index: int, pod_index: int) -> dict:
    """The environment of pod `pod_index` of job `job_index`: the YAML's values, its downward-API
    fields resolved from the labels and annotations JobSet puts on the pod, and Kubernetes'
    JOB_COMPLETION_INDEX."""
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    rj = doc["spec"]["replicatedJobs"][0]
    meta = {
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']": doc["metadata"]["name"],
        "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']": rj["name"],
        "metadata.labels['jobset.sigs.k8s.io/job-index']": str(job_index),
        "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']": str(rj.get("replicas", 1)),
    }
    env = {"JOB_COMPLETION_INDEX": str(pod_index)}
    for var in rj["template"]["spec"]["template"]["spec"]["containers"][0].get("env", []):
        env[var["name"]] = var["value"] if "value" in var else meta[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_the_gpu_jobset_sets_what_flaxgpt_cluster_reads():
    path = LAUNCH / "gke" / "jobset-gpu.yaml"
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert set(cluster.JOBSET_ENV) <= set(pod_env(path, 0, 0))
    assert pod_env(path, 0, 0)["PODS_PER_JOB"] == str(job["parallelism"]) == str(job["completions"])
    d = ml_collections.ConfigDict({"coordinator_address": "", "num_processes": 0, "process_id": -1})
    joins = [cluster.detect(d, pod_env(path, 0, k)) for k in range(job["parallelism"])]
    coordinator = f"flaxgpt-gpu-{doc['spec']['replicatedJobs'][0]['name']}-0-0.flaxgpt-gpu:{cluster.PORT}"
    assert joins == [cluster.Join("jobset", coordinator, 2, k) for k in range(2)]
    assert doc["spec"]["network"]["enableDNSHostnames"] is True
