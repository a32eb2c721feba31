"""The KubeRay manifests (deployments/kuberay/) say what exists: they parse; the RayService's
Serve config loads as a clawray config that passes its own check and names an importable app;
the training job's config is the app's; the secret, the volume and the metrics port are wired
the same way everywhere they appear; the image is built by the setup CI runs. (No Kubernetes
cluster or Docker daemon on the development machine: docs/deploy.md.)"""

from __future__ import annotations

import pkgutil
import re
import shlex
from pathlib import Path

import pytest
import yaml

from clawray.config import load_config
from tests.support.common import REPO

KUBE = REPO / "deployments" / "kuberay"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


@pytest.fixture
def service() -> dict:
    (svc,) = docs("rayservice-cpu.yaml")
    assert (svc["apiVersion"], svc["kind"]) == ("ray.io/v1", "RayService")
    return svc


def pods(svc: dict) -> list[dict]:
    cluster = svc["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]


def test_every_manifest_parses():
    for path in sorted(KUBE.glob("*.yaml")):
        assert docs(path.name), path


def test_the_services_app_is_a_clawray_config_that_passes_its_check(service, tmp_path,
                                                                     monkeypatch):
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    assert pkgutil.resolve_name(app["import_path"].replace(":", ".", 1)) is not None
    path = tmp_path / "serve.yaml"
    path.write_text(service["spec"]["serveConfigV2"])
    monkeypatch.setenv("CLAWRAY_API_KEYS", "sk-test")  # the secret, as the pods get it
    cfg = load_config(str(path), app["name"]).check()
    assert (cfg.serving_cfg.host, cfg.serving_cfg.port) == ("0.0.0.0", 8000)
    # the training job reads the same settings (it finds the app's parts by them)
    assert yaml.safe_load((KUBE / "train-cpu.yaml").read_text()) == app["args"]


def test_the_training_job_runs_the_trainer_on_the_apps_cluster(service):
    (job,) = docs("rayjob-train.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert set(job["spec"]["clusterSelector"]) == {"ray.io/cluster"}  # an existing cluster
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "clawray.train"]
    config = Path(argv[argv.index("--config") + 1]).relative_to("/opt/clawray")
    assert (REPO / config).is_file()
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["name"]
    assert argv[argv.index("--app") + 1] == app


def test_the_secret_the_volume_and_the_metrics_port_are_wired_alike(service):
    (secret,) = docs("secret.yaml")
    (claim,) = docs("pvc.yaml")
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    for group in pods(service):
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
        assert env["CLAWRAY_API_KEYS"] == {"name": secret["metadata"]["name"],
                                           "key": next(iter(secret["stringData"]))}
        (volume,) = spec["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (mount,) = container["volumeMounts"]
        for path in (args["buffer"]["path"], args["serving"]["records_path"],
                     args["training"]["checkpoint_dir"]):
            assert path.startswith(mount["mountPath"] + "/"), path
        port = group["rayStartParams"]["metrics-export-port"]
        assert group["template"]["metadata"]["annotations"]["prometheus.io/port"] == port
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod mounts it


def test_the_image_is_built_by_the_setup_ci_runs():
    dockerfile = (KUBE / "Dockerfile").read_text()
    assert re.search(r"^RUN (CLAWRAY_CUDA=\S+ )?make setup\b", dockerfile, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^setup:\n\tbash scripts/setup\.sh$", makefile, re.M)
    assert re.search(r"^test: setup$", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_make_test_leaves_the_own_cluster_harnesses_to_make_test_long():
    """CI's suite shares one Ray cluster; the tests that start their own run by test-long."""
    makefile = (REPO / "Makefile").read_text()
    test = re.search(r"^test: setup\n\t(.*)$", makefile, re.M).group(1)
    long = re.search(r"^test-long: setup\n\t(.*)$", makefile, re.M).group(1)
    assert '-m "not own_cluster"' in test and "-m own_cluster" in long
    pyproject = (REPO / "pyproject.toml").read_text()
    # declared, and --strict-markers makes a misspelt mark an error
    assert '"own_cluster: ' in pyproject and "--strict-markers" in pyproject
    marked = [f for f in (REPO / "tests" / "cpu").rglob("test_*.py")
              if "pytest.mark.own_cluster" in f.read_text()]
    assert {f.name for f in marked} == {"test_two_hosts_on_cpu.py", "test_multinode_on_cpu.py",
                                        "test_bench_smoke_on_cpu.py"}, marked


def _nodes_of(svc: dict) -> list[dict]:
    """The Ray nodes a RayService's groups start (``ray start`` params -> ``ray.nodes()``
    entries), each group at its ``replicas``."""
    nodes = []
    cluster = svc["spec"]["rayClusterConfig"]
    for i, group in enumerate([cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]):
        p = group["rayStartParams"]
        labels = dict(kv.split("=", 1) for kv in p.get("labels", "").split(",") if kv)
        for k in range(group.get("replicas", 1)):
            nodes.append({"NodeManagerAddress": f"10.0.{i}.{k}", "Alive": True,
                          "Labels": labels, "Resources": {"CPU": float(p["num-cpus"]),
                                                          "GPU": float(p.get("num-gpus", 0))}})
    return nodes


def test_the_gpu_service_places_each_part_on_its_own_group(tmp_path, monkeypatch):
    """The GPU RayService (not run: no GPU, no cluster): its app passes clawray's check with
    the model folder present; every part it places (ingress and buffer on the head, a vLLM
    replica of tensor_parallel_size GPUs per serving node, both learner ranks on the train
    node) fits the nodes its groups start, by the same check the app and trainer run at start;
    with one serving node too few, the policy's placement is refused."""
    from clawray.placement import PlacementError, check_placement

    (svc,) = docs("rayservice-gpu.yaml")
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    args = app["args"]
    assert yaml.safe_load((KUBE / "train-gpu.yaml").read_text()) == args
    (job,) = docs("rayjob-train-gpu.yaml")
    assert "deployments/kuberay/train-gpu.yaml" in job["spec"]["entrypoint"]
    (models,) = docs("pvc-models.yaml")
    model = tmp_path / "model"
    model.mkdir()
    args["model"]["path"] = str(model)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve_config))
    monkeypatch.setenv("CLAWRAY_API_KEYS", "sk-test")
    cfg = load_config(str(path), app["name"]).check()
    assert cfg.inference_cfg.tensor_parallel_size == cfg.serving_cfg.replica_num_gpus == 2
    nodes = _nodes_of(svc)
    check_placement(cfg, nodes)
    serving = [n for n in nodes if n["Labels"].get("clawray-host") == "serving"]
    with pytest.raises(PlacementError, match="placement.policy"):
        check_placement(cfg, [n for n in nodes if n is not serving[-1]])
    for group in pods(svc):  # the models volume, read-only, on every pod
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert claims["models"] == models["metadata"]["name"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["models"]["readOnly"] and \
            yaml.safe_load((KUBE / "train-gpu.yaml").read_text())["model"]["path"].startswith(
                mounts["models"]["mountPath"] + "/")
    dockerfile = (KUBE / "Dockerfile").read_text()
    assert "CLAWRAY_CUDA=$CLAWRAY_CUDA make setup" in dockerfile
    assert 'CLAWRAY_CUDA:-0}" = 1' in (REPO / "scripts" / "setup.sh").read_text()
