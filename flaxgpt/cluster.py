"""Joining a multi-process job: which engine started this process, where process 0 listens, how many
processes there are and which one this is, decided from the environment before JAX starts a backend.

    from flaxgpt import cluster
    cluster.join(config.distributed)   # the trainer's first act (train.py, GRPO); None on one process
    cluster.join()                       # a command without a recipe (flaxgpt eval, serve.py): the engine's

`detect(distributed, env)` is the decision, a pure function of the recipe's `distributed` section and
the environment; `join` calls jax.distributed.initialize with it. In order, the first that applies:

  settings   --config.distributed.coordinator_address (and num_processes / process_id): always win;
             a field left unset is filled by the engine found below.
  slurm      srun's task variables (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
             SLURM_LOCALID): jax's own detection (its SlurmCluster) finds the
             coordinator, the first node of the step, on a port derived from the job id.
  ompi       mpirun's OMPI_COMM_WORLD_SIZE / _RANK: jax's own detection reads the coordinator's IP from
             Open MPI 4's OMPI_MCA_orte_hnp_uri; Open MPI 5 has no such variable, so there
             JAX_COORDINATOR_ADDRESS (which jax reads) must name it, and the rank's GPU is its
             OMPI_COMM_WORLD_LOCAL_RANK (jax's detection would have given it).
  tpu        a Cloud TPU VM of a multi-host slice (GKE's TPU_WORKER_HOSTNAMES, or the GCE metadata
             server): jax's own detection (its GkeTpuCluster and GceTpuCluster); before SkyPilot,
             which counts a slice's hosts as its nodes.
  skypilot   SKYPILOT_NUM_NODES > 1: the first of SKYPILOT_NODE_IPS (one per line) is the coordinator,
             SKYPILOT_NODE_RANK the process (jax has no SkyPilot detection).
  jobset     a GKE JobSet's GPU pods (launch/gke/jobset-gpu.yaml sets the variables, see JOBSET_ENV):
             the coordinator is pod 0 of job 0 through the JobSet's headless service,
             `<jobset>-<replicatedJob>-0-0.<subdomain>`; jax's k8s detection would need the
             `kubernetes` package and a service account allowed to list pods.

Nothing found, or a job of one process: None, and no initialize call (a single process runs exactly as
without this module). JAX_COORDINATOR_PORT (jax's own variable) moves the port for every engine.

May import: nothing of flaxgpt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

# The port process 0 listens on where the engine does not give one (SkyPilot, JobSet): every process
# must agree on it without talking first, so it is fixed; JAX_COORDINATOR_PORT moves it.
PORT = 8476

# What launch/gke/jobset-gpu.yaml sets in each GPU pod (the downward API reads JobSet's labels;
# JOB_COMPLETION_INDEX is Kubernetes' own for Indexed Jobs; a pod cannot read its Job's parallelism,
# so the YAML writes PODS_PER_JOB next to it).
JOBSET_ENV = {
    "JOBSET_NAME": "label jobset.sigs.k8s.io/jobset-name",
    "REPLICATED_JOB_NAME": "label jobset.sigs.k8s.io/replicatedjob-name",
    "JOB_INDEX": "label jobset.sigs.k8s.io/job-index (which of the replicated Jobs)",
    "REPLICATED_JOB_REPLICAS": "annotation jobset.sigs.k8s.io/replicatedjob-replicas",
    "JOB_COMPLETION_INDEX": "set by Kubernetes: the pod's index in its Indexed Job",
    "PODS_PER_JOB": "the Job's parallelism (= completions), written by the YAML",
}

TPU_WORKERS_URL = (
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A recipe's `distributed` section as configs/default.py leaves it: nothing set, the engine decides.
    Commands without a recipe (flaxgpt eval, serve.py) join with these."""

    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1


UNSET = Settings()


@dataclasses.dataclass(frozen=True)
class Join:
    """How this process joins its job. A None field is left to jax's cluster detection."""

    engine: str  # settings | slurm | ompi | skypilot | jobset | tpu
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # the GPUs this process drives; None: jax's or all

    def initialize_kwargs(self) -> dict:
        kwargs = dict(
            coordinator_address=self.coordinator,
            num_processes=self.num_processes,
            process_id=self.process_id,
        )
        if self.local_device_ids is not None:
            kwargs["local_device_ids"] = list(self.local_device_ids)
        if self.engine in ("skypilot", "jobset"):  # all known: jax's detection would only misfire
            # (on Kubernetes it warns that the `kubernetes` package is missing, or asks the API server)
            kwargs["cluster_detection_method"] = "deactivate"
        return kwargs


def join(distributed=UNSET, env: Mapping[str, str] | None = None) -> Join | None:
    """Joins the job this process is part of (jax.distributed.initialize), once; returns how, or None
    for a single process. Must run before anything starts a JAX backend."""
    if jax.distributed.is_initialized():  # a second train() in the same process (tests, tools)
        return None
    how = detect(distributed, os.environ if env is None else env)
    if how is not None:
        jax.distributed.initialize(**how.initialize_kwargs())
    return how


def detect(distributed, env: Mapping[str, str]) -> Join | None:
    """The Join for `distributed` (the recipe's section: coordinator_address, num_processes,
    process_id) in environment `env`, or None for a single process."""
    found = _engine(env)
    address = distributed.coordinator_address or None
    n = distributed.num_processes or None
    pid = None if distributed.process_id < 0 else distributed.process_id
    if address is None and n is None and pid is None:
        if found is not None and found.coordinator is not None:
            check_address(found.coordinator, "the coordinator")
        elif found is not None:
            _check_jax_variables(env)
        return found
    # explicit settings win field by field; the engine (if any) fills the rest
    base = found or Join("settings")
    how = Join(
        "settings" if address else base.engine,
        address or base.coordinator,
        n if n is not None else base.num_processes,
        pid if pid is not None else base.process_id,
    )
    if found is None and (how.coordinator is None or how.num_processes is None or how.process_id is None):
        raise ValueError(
            "distributed: set coordinator_address, num_processes and process_id together (got "
            f"{distributed.coordinator_address!r}, {distributed.num_processes}, {distributed.process_id}) "
            "or none of them under Slurm, Open MPI, SkyPilot, a GKE JobSet or a TPU pod, which are found"
        )
    if how.num_processes == 1 and how.coordinator is None:
        return None
    if how.coordinator is not None:
        check_address(how.coordinator, "coordinator_address" if address else "the coordinator")
    else:
        _check_jax_variables(env)
    return how


def _check_jax_variables(env) -> None:
    """Where jax finds the coordinator itself (Slurm, Open MPI, TPU) it reads JAX_COORDINATOR_ADDRESS
    and JAX_COORDINATOR_PORT unchecked: an address without a port is an IndexError inside
    jax.distributed.initialize, a port that is not a number a segmentation fault."""
    if env.get("JAX_COORDINATOR_ADDRESS"):
        check_address(env["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS")
    port = env.get("JAX_COORDINATOR_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"JAX_COORDINATOR_PORT={port!r} in the environment is not a port number (1-65535)")


def check_address(address: str, what: str) -> None:
    """HOST:PORT with a port number: jax's own check is an IndexError deep in distributed.initialize."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{what} {address!r} is not HOST:PORT with a port number (e.g. 10.0.0.1:{PORT}); "
            "set --config.distributed.coordinator_address, JAX_COORDINATOR_ADDRESS or JAX_COORDINATOR_PORT so"
        )


def _engine(env: Mapping[str, str]) -> Join | None:
    """The first engine `env` shows, with what it says (None where jax finds it itself)."""
    # tpu before skypilot: SkyPilot counts a slice's hosts as nodes, and jax numbers them as the slice does
    for rule in (_slurm, _ompi, _tpu, _skypilot, _jobset):
        how = rule(env)
        if how is not None:
            return how if how.num_processes is None or how.num_processes > 1 else None
    return None


def _slurm(env) -> Join | None:
    # jax's SlurmCluster needs all five; without SLURM_STEP_NODELIST this is the batch script's own
    # shell (train.py run without srun): one process, whatever SLURM_NTASKS says
    names = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if not all(k in env for k in names):
        return None
    return Join("slurm", None, _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"))


def _ompi(env) -> Join | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    n = _int(env, "OMPI_COMM_WORLD_SIZE")
    if n > 1 and "OMPI_MCA_orte_hnp_uri" not in env and "JAX_COORDINATOR_ADDRESS" not in env:
        raise ValueError(
            f"Open MPI started {n} processes but does not say where process 0 is (Open MPI 5 sets no "
            "OMPI_MCA_orte_hnp_uri): pass -x JAX_COORDINATOR_ADDRESS=HOST:PORT to mpirun"
        )
    local = None
    if "OMPI_MCA_orte_hnp_uri" not in env and "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        # jax's OmpiCluster (which gives each rank its GPU) needs Open MPI 4's variable; under Open MPI 5
        # every rank would open all of its node's GPUs: rank k of a node drives GPU k, as under Slurm
        local = (_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),)
    return Join("ompi", None, n, _int(env, "OMPI_COMM_WORLD_RANK"), local)


def _skypilot(env) -> Join | None:
    if "SKYPILOT_NUM_NODES" not in env or _int(env, "SKYPILOT_NUM_NODES") < 2:
        return None
    ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
    n = _int(env, "SKYPILOT_NUM_NODES")
    if len(ips) != n:
        raise ValueError(f"SKYPILOT_NODE_IPS lists {len(ips)} addresses for SKYPILOT_NUM_NODES={n}")
    return Join("skypilot", _address(env, ips[0]), n, _int(env, "SKYPILOT_NODE_RANK"))


def _jobset(env) -> Join | None:
    if "JOBSET_NAME" not in env or "JOB_COMPLETION_INDEX" not in env or "TPU_WORKER_HOSTNAMES" in env:
        return None  # TPU pods of a JobSet: GKE sets TPU_WORKER_HOSTNAMES and jax finds them
    missing = [k for k in ("REPLICATED_JOB_NAME", "PODS_PER_JOB") if k not in env]
    if missing:
        raise ValueError(
            f"a JobSet pod without {', '.join(missing)}: set them as launch/gke/jobset-gpu.yaml does"
        )
    per_job = _int(env, "PODS_PER_JOB")
    n = per_job * _int(env, "REPLICATED_JOB_REPLICAS", 1)
    pid = _int(env, "JOB_INDEX", 0) * per_job + _int(env, "JOB_COMPLETION_INDEX")
    # JobSet names pod k of job j `<jobset>-<replicatedJob>-<j>-<k>` under a headless service whose
    # name (the subdomain) defaults to the JobSet's
    subdomain = env.get("JOBSET_SUBDOMAIN") or env["JOBSET_NAME"]
    host = f"{env['JOBSET_NAME']}-{env['REPLICATED_JOB_NAME']}-0-0.{subdomain}"
    return Join("jobset", _address(env, host), n, pid)


def _tpu(env) -> Join | None:
    return Join("tpu") if on_tpu_pod(env) else None


def on_tpu_pod(env: Mapping[str, str]) -> bool:
    """A Cloud TPU VM of a multi-host slice, found without starting a JAX backend (initialize() must
    come first). GKE lists the peers in TPU_WORKER_HOSTNAMES; a TPU VM made with `gcloud compute
    tpus tpu-vm create` has no such variable: its metadata server lists them (where jax looks too)."""
    import importlib.util
    import urllib.request

    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if hosts:
        return len(hosts) > 1
    if importlib.util.find_spec("libtpu") is None:  # jax[tpu] is not installed: not a TPU VM
        return False
    request = urllib.request.Request(TPU_WORKERS_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return len([w for w in response.read().decode().split(",") if w]) > 1
    except OSError:  # no metadata server: not on Google Cloud
        return False


def _address(env, host: str) -> str:
    """host:port for an engine jax does not know; JAX_COORDINATOR_ADDRESS (jax's variable) wins."""
    return env.get("JAX_COORDINATOR_ADDRESS") or f"{host}:{env.get('JAX_COORDINATOR_PORT', PORT)}"


def _int(env, name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} in the environment is not an integer") from None
