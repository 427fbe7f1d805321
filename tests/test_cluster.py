"""flaxgpt.cluster.detect: each engine's variables, set as the engine sets them, give the coordinator,
the process count and this process's index; explicit settings win; a single process joins nothing.
(tests/train/test_multihost.py starts real 2-process jobs with some of these environments.)"""

import importlib.util
import io
import urllib.request

import ml_collections
import pytest

from flaxgpt import cluster


def settings(address="", n=0, pid=-1):
    d = ml_collections.ConfigDict()
    d.coordinator_address, d.num_processes, d.process_id = address, n, pid
    return d


SLURM = {  # srun -N2 --ntasks-per-node=4 on nodes gpu[017-018], task 5
    "SLURM_JOB_ID": "81234",
    "SLURM_JOB_NODELIST": "gpu[017-018]",
    "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NUM_NODES": "2",
}
OMPI = {  # Open MPI 4's mpirun -np 4, rank 3
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
}
SKYPILOT = {  # num_nodes: 3, node 2
    "SKYPILOT_NUM_NODES": "3",
    "SKYPILOT_NODE_RANK": "2",
    "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9\n10.0.0.4\n",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
}
JOBSET = {  # launch/gke/jobset-gpu.yaml's variables, for 2 replicated Jobs of 2 pods; job 1, pod 1
    "JOBSET_NAME": "flaxgpt",
    "REPLICATED_JOB_NAME": "gpu",
    "JOB_INDEX": "1",
    "REPLICATED_JOB_REPLICAS": "2",
    "JOB_COMPLETION_INDEX": "1",
    "PODS_PER_JOB": "2",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}


@pytest.fixture(autouse=True)
def no_libtpu(monkeypatch):
    """This machine is no TPU VM, whatever the tpu-aot extra installed (no metadata server query)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "libtpu" else find_spec(n))


def test_one_process_joins_nothing():
    assert cluster.detect(settings(), {}) is None
    assert cluster.detect(settings(), {"LANG": "C.UTF-8", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    # a job of one: srun -n1, mpirun -np 1, one SkyPilot node, a one-pod JobSet
    assert cluster.detect(settings(), {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert cluster.detect(settings(), {**OMPI, "OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert cluster.detect(settings(), {**SKYPILOT, "SKYPILOT_NUM_NODES": "1"}) is None
    one_pod = {**JOBSET, "REPLICATED_JOB_REPLICAS": "1", "PODS_PER_JOB": "1", "JOB_INDEX": "0"}
    assert cluster.detect(settings(), {**one_pod, "JOB_COMPLETION_INDEX": "0"}) is None
    # train.py in an sbatch script without srun: the batch shell is one process
    batch_shell = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert cluster.detect(settings(), batch_shell) is None


def test_jax_detects_slurm_and_open_mpi_itself():
    """flaxgpt reads the count and index; the coordinator (None here) is jax's to find."""
    assert cluster.detect(settings(), SLURM) == cluster.Join("slurm", None, 8, 5)
    assert cluster.detect(settings(), OMPI) == cluster.Join("ompi", None, 4, 3)
    # and jax agrees on the coordinator: the first node of the step, the launcher's IP
    from jax._src.clusters import OmpiCluster, SlurmCluster

    with pytest.MonkeyPatch.context() as m:
        for k, v in {**SLURM, **OMPI}.items():
            m.setenv(k, v)
        assert SlurmCluster.get_coordinator_address(None, "7000") == "gpu017:7000"
        assert OmpiCluster.get_coordinator_address(None, "7000") == "10.96.0.1:7000"


def test_open_mpi_5_needs_the_coordinator_named():
    env = {k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS"):
        cluster.detect(settings(), env)
    env["JAX_COORDINATOR_ADDRESS"] = "10.1.0.5:1234"  # jax reads it itself
    how = cluster.detect(settings(), env)
    # the rank's GPU is its local rank, as jax's OmpiCluster gives it under Open MPI 4 (without it
    # every rank opened all of its node's GPUs); jax.distributed.initialize makes it the visible one
    assert how == cluster.Join("ompi", None, 4, 3, (1,))
    assert how.initialize_kwargs()["local_device_ids"] == [1]
    assert "local_device_ids" not in cluster.detect(settings(), OMPI).initialize_kwargs()  # jax's own
    # jax reads these two unchecked where it finds the coordinator itself: one line each
    for var, value in (("JAX_COORDINATOR_ADDRESS", "localhost"), ("JAX_COORDINATOR_PORT", "abc")):
        for engine in (env, SLURM):
            with pytest.raises(ValueError, match=f"{var}"):
                cluster.detect(settings(), {**engine, var: value})


def test_a_tpu_slice_under_skypilot_is_joined_by_jax():
    """SkyPilot runs a slice's hosts as its nodes (SKYPILOT_NUM_NODES=4 on a v5e-16): the tpu rule goes
    first, so jax numbers the hosts as the slice does."""
    tpu = {
        **SKYPILOT,
        "SKYPILOT_NUM_NODES": "4",
        "SKYPILOT_NODE_IPS": "a\nb\nc\nd",
        "TPU_WORKER_HOSTNAMES": "w-0,w-1",
    }
    assert cluster.detect(settings(), tpu) == cluster.Join("tpu")


def test_skypilot_first_node_is_the_coordinator():
    assert cluster.detect(settings(), SKYPILOT) == cluster.Join("skypilot", "10.0.0.7:8476", 3, 2)
    moved = {**SKYPILOT, "JAX_COORDINATOR_PORT": "9000"}
    assert cluster.detect(settings(), moved).coordinator == "10.0.0.7:9000"
    with pytest.raises(ValueError, match="lists 2 addresses for SKYPILOT_NUM_NODES=3"):
        cluster.detect(settings(), {**SKYPILOT, "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9"})


def test_jobset_pod_0_of_job_0_through_the_headless_service():
    want = cluster.Join("jobset", "flaxgpt-gpu-0-0.flaxgpt:8476", 4, 3)
    assert cluster.detect(settings(), JOBSET) == want
    first = {**JOBSET, "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "0"}
    assert cluster.detect(settings(), first).process_id == 0
    sub = cluster.detect(settings(), {**JOBSET, "JOBSET_SUBDOMAIN": "net"})
    assert sub.coordinator == "flaxgpt-gpu-0-0.net:8476"
    with pytest.raises(ValueError, match="without PODS_PER_JOB"):
        cluster.detect(settings(), {k: v for k, v in JOBSET.items() if k != "PODS_PER_JOB"})
    # a JobSet of TPU pods: GKE lists the workers and jax's own TPU detection joins them
    tpu = {**JOBSET, "TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3", "TPU_WORKER_ID": "1"}
    assert cluster.detect(settings(), tpu) == cluster.Join("tpu")
    how = cluster.detect(settings(), JOBSET).initialize_kwargs()
    assert how["cluster_detection_method"] == "deactivate"  # jax would look for the kubernetes package


def test_explicit_settings_win_field_by_field():
    explicit = settings("10.9.9.9:1234", 2, 1)
    assert cluster.detect(explicit, {}) == cluster.Join("settings", "10.9.9.9:1234", 2, 1)
    assert cluster.detect(explicit, SKYPILOT) == cluster.Join("settings", "10.9.9.9:1234", 2, 1)
    assert cluster.detect(settings("10.9.9.9:1234"), SLURM) == cluster.Join("settings", "10.9.9.9:1234", 8, 5)
    assert cluster.detect(settings(pid=0), SKYPILOT) == cluster.Join("skypilot", "10.0.0.7:8476", 3, 0)
    assert "cluster_detection_method" not in cluster.detect(explicit, {}).initialize_kwargs()
    with pytest.raises(ValueError, match="set coordinator_address, num_processes and process_id together"):
        cluster.detect(settings("10.9.9.9:1234"), {})
    with pytest.raises(ValueError, match="SLURM_PROCID='x' in the environment is not an integer"):
        cluster.detect(settings(), {**SLURM, "SLURM_PROCID": "x"})
    # an address without a port (jax's own check: an IndexError deep in initialize), or a port not a number
    with pytest.raises(
        ValueError, match=r"coordinator_address 'localhost' is not HOST:PORT with a port number"
    ):
        cluster.detect(settings("localhost", 2, 0), {})
    with pytest.raises(ValueError, match=r"the coordinator '10\.0\.0\.7:abc' is not HOST:PORT"):
        cluster.detect(settings(), {**SKYPILOT, "JAX_COORDINATOR_PORT": "abc"})
    with pytest.raises(ValueError, match=r"the coordinator 'head' is not HOST:PORT"):
        cluster.detect(settings(), {**SKYPILOT, "JAX_COORDINATOR_ADDRESS": "head"})
    assert cluster.detect(settings("[::1]:8476", 2, 0), {}).coordinator == "[::1]:8476"


def test_tpu_pods_gke_variable_or_the_metadata_server(monkeypatch):
    """A Cloud TPU VM of a multi-host slice: GKE's variable, or (a `gcloud` TPU VM) the metadata server."""
    assert not cluster.on_tpu_pod({})  # no libtpu: not a TPU VM, nothing asked
    assert cluster.on_tpu_pod({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1,t1k-w-2,t1k-w-3"})
    assert not cluster.on_tpu_pod({"TPU_WORKER_HOSTNAMES": "t1k-w-0"})

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object() if n == "libtpu" else find_spec(n))
    asked = []

    def metadata(request, timeout):
        asked.append((request.full_url, request.get_header("Metadata-flavor")))
        return io.BytesIO(endpoints)

    monkeypatch.setattr(urllib.request, "urlopen", metadata)
    endpoints = b"10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5"
    assert cluster.on_tpu_pod({}) and cluster.detect(settings(), {}) == cluster.Join("tpu")
    assert asked[0] == (cluster.TPU_WORKERS_URL, "Google")
    endpoints = b"10.130.0.2"  # a single-host TPU VM
    assert not cluster.on_tpu_pod({}) and cluster.detect(settings(), {}) is None
