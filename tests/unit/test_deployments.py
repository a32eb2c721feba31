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
    assert re.search(r"^RUN make setup\b", dockerfile, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^setup:\n\tbash scripts/setup\.sh$", makefile, re.M)
    assert re.search(r"^test: setup$", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
