"""The cpu overlay's containers, run here as the kubelet would run them: their commands, arguments and
environment as rendered, with each pod's volumes on local folders, its ports on free local ones and the
Services' names on 127.0.0.1. A Generate call through them proves the manifests configure the real programs.

Where this machine lets the test make a mount namespace (as root), each process also runs as in its
container on a read-only root filesystem, with only its pod's volumes writable, so the manifests'
volumes are shown to hold everything the programs write.

One substitution: the worker pod's init container writes the RANDOM Qwen3-0.6B-shaped demo checkpoint
(1.2 GB, minutes on CPU); here the worker's `models` volume gets the suite's tiny checkpoint instead, at
the same path. The tokenizer pod's init container (tokenizer files only) runs as rendered.
"""
from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
import warnings

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from services.model_worker.kernels.build import cache_dir
from tests.integration.stack import ROOT, free_port, wait_serving
from tests.kube import container_env, containers, find, render
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc


class Pod:
    """One Deployment's pod on this machine: its volumes as folders, its container ports as free ports."""

    def __init__(self, objects: list[dict], name: str, root, volume_dirs: dict[str, str]):
        self.name = name
        self.deployment = find(objects, "Deployment", name)
        spec = self.deployment["spec"]["template"]["spec"]
        self.volumes = {}
        for volume in spec["volumes"]:
            path = volume_dirs.get(volume["name"]) or str(root / name / volume["name"])
            os.makedirs(path, exist_ok=True)
            self.volumes[volume["name"]] = path
        self.ports = {p["containerPort"]: free_port() for c in containers(self.deployment) for p in c["ports"]}
        self.processes: list[subprocess.Popen] = []

    def port(self, container: dict, name: str) -> int:
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
        return self.ports[port]


class Cluster:
    """Maps what the manifests name (mount paths, container ports, Service host:port) to this machine."""

    def __init__(self, objects: list[dict], pods: dict[str, Pod]):
        self.objects = objects
        self.pods = pods
        self.services: dict[str, str] = {}  # "worker:50053" -> "127.0.0.1:PORT"
        for service in [o for o in objects if o["kind"] == "Service"]:
            pod = pods[service["metadata"]["name"]]
            (container,) = containers(pod.deployment)
            for port in service["spec"]["ports"]:
                address = f"{service['metadata']['name']}:{port['port']}"
                self.services[address] = f"127.0.0.1:{pod.port(container, port['targetPort'])}"

    def local(self, pod: Pod, container: dict, value: str) -> str:
        for mount in container.get("volumeMounts", []):
            path = mount["mountPath"]
            if value == path or value.startswith(path + "/"):
                return pod.volumes[mount["name"]] + value[len(path):]
        for address, local in self.services.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(address)}$", local, value)
        return value

    def command(self, pod: Pod, container: dict) -> tuple[list[str], dict[str, str]]:
        command = container["command"]
        assert command[0] == "python"
        args = list(container.get("args", []))
        for i, arg in enumerate(args):
            if args[i - 1] == "--host" and i > 0:
                args[i] = "127.0.0.1"  # 0.0.0.0 in the pod, where only the pod's own address is behind it
            elif i > 0 and args[i - 1].endswith("-port") and int(arg) in pod.ports:
                args[i] = str(pod.ports[int(arg)])
            else:
                args[i] = self.local(pod, container, arg)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_V0_")}
        env.update({k: self.local(pod, container, v) for k, v in container_env(container, self.objects).items()})
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("resourceFieldRef")
            if ref:  # as the kubelet computes it: the resource rounded up to whole divisors
                amount = container["resources"][ref["resource"].split(".")[0]][ref["resource"].split(".")[1]]
                env[var["name"]] = str(math.ceil(float(amount) / float(ref["divisor"])))
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] == "/tmp":  # the programs find /tmp by default; this one through TMPDIR
                env["TMPDIR"] = pod.volumes[mount["name"]]
        env["PYTHONUNBUFFERED"] = "1"
        return [sys.executable, *command[1:], *args], env

    def start(self, pod: Pod, container: dict, log) -> subprocess.Popen:
        argv, env = self.command(pod, container)
        if READ_ONLY_ROOT:
            writable = [pod.volumes[m["name"]] for m in container.get("volumeMounts", [])
                        if not m.get("readOnly")]
            argv = read_only_root(argv, writable)
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        pod.processes.append(process)
        return process


def read_only_root(argv: list[str], writable: list[str]) -> list[str]:
    """argv in a mount namespace of its own where / is read-only but for the `writable` folders."""
    steps = [f"mount --bind {shlex.quote(d)} {shlex.quote(d)}" for d in writable]
    script = " && ".join([*steps, "mount -o remount,bind,ro /", "exec " + shlex.join(argv)])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def _can_make_read_only_root() -> bool:
    probe = read_only_root(["sh", "-c", "! touch /.vllm-v0-read-only-probe 2>/dev/null"], [])
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


READ_ONLY_ROOT = _can_make_read_only_root()


def probe_address(pod: Pod, container: dict, kind: str) -> tuple[str, str]:
    probe = container[kind]["grpc"]
    return f"127.0.0.1:{pod.ports[probe['port']]}", probe.get("service", "")


def check(address: str, service: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.fixture()
def cluster(checkpoint, tmp_path):
    objects = render("cpu")
    key = secrets.token_hex(16)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "api-key").write_text(key + "\n")  # as the Secret's key projects into the volume
    pods = {name: Pod(objects, name, tmp_path, {"api-key": str(tmp_path / "secret")})
            for name in ("tokenizer", "worker", "gateway")}
    shutil.copytree(checkpoint, os.path.join(pods["worker"].volumes["models"], "demo"), copy_function=os.link)
    cluster = Cluster(objects, pods)
    seed_kernel_cache(cluster, pods["worker"])
    try:
        yield cluster, key, tmp_path
    finally:
        for pod in pods.values():
            for process in pod.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def seed_kernel_cache(cluster: Cluster, pod: Pod) -> None:
    """Put the C kernels this machine has built into the worker pod's kernel cache (its VLLM_V0_CACHE, on the
    pod's cache volume), as a cache volume kept from an earlier start holds them: built afresh in the pod,
    paged_attention.c alone takes about 45 s of a 2-CPU machine."""
    (worker,) = containers(pod.deployment)
    kernels = pathlib.Path(cluster.local(pod, worker, container_env(worker, cluster.objects)["VLLM_V0_CACHE"]),
                           "kernels")
    kernels.mkdir(mode=0o700, parents=True, exist_ok=True)
    built = cache_dir()
    for library in built.glob("*.so") if built.is_dir() else ():
        try:
            os.link(library, kernels / library.name)
        except OSError:  # another filesystem
            shutil.copy2(library, kernels / library.name)


def log_tail(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def test_the_rendered_containers_serve_a_generate_call(cluster):
    local, key, tmp_path = cluster
    if not READ_ONLY_ROOT:
        warnings.warn("no mount namespace here (unshare needs root): the services run on a writable root "
                      "filesystem, so this run does not show that the volumes hold all they write")
    pods = local.pods
    logs = {name: open(tmp_path / f"{name}.log", "ab") for name in pods}
    try:
        worker = containers(pods["worker"].deployment)[0]
        tokenizer = containers(pods["tokenizer"].deployment)[0]
        gateway = containers(pods["gateway"].deployment)[0]
        # The pods start independently, as in a cluster; the tokenizer's container, as the kubelet would
        # start it, once its init container has written its files and exited 0.
        local.start(pods["worker"], worker, logs["worker"])
        local.start(pods["gateway"], gateway, logs["gateway"])
        (init,) = containers(pods["tokenizer"].deployment, init=True)
        assert local.start(pods["tokenizer"], init, logs["tokenizer"]).wait(timeout=180) == 0, \
            log_tail(tmp_path, "tokenizer")
        assert not os.path.exists(os.path.join(pods["tokenizer"].volumes["models"], "demo", "model.safetensors"))
        local.start(pods["tokenizer"], tokenizer, logs["tokenizer"])

        # Ready through each readiness probe's own port and health name, alive through the liveness one's.
        for name, container in (("tokenizer", tokenizer), ("worker", worker), ("gateway", gateway)):
            address, service = probe_address(pods[name], container, "readinessProbe")
            try:
                wait_serving(address, timeout=120)
            except TimeoutError:
                pytest.fail(f"{name} not ready:\n{log_tail(tmp_path, name)}")
            assert check(address, service) == "SERVING"
            assert check(*probe_address(pods[name], container, "livenessProbe")) == "SERVING"

        address, _ = probe_address(pods["gateway"], gateway, "readinessProbe")
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=8, ignore_eos=True,
                                                  temperature=0)
            with pytest.raises(grpc.RpcError) as refused:  # the key from the Secret guards the gateway
                list(stub.Generate(request, timeout=60))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = (("authorization", f"Bearer {key}"),)
            replies = list(stub.Generate(request, timeout=60, metadata=metadata))
            info = stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=10, metadata=metadata)
        ids = [i for reply in replies for i in reply.token_ids]
        assert len(ids) == 8 and replies[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        tokenizer_files = os.path.join(pods["tokenizer"].volumes["models"], "demo", "tokenizer.json")
        assert "".join(reply.text for reply in replies) == Tokenizer.from_file(tokenizer_files).decode(ids)
        # The worker was found through the dns:/// name the gateway's ConfigMap gives.
        worker_grpc = pods["worker"].port(worker, "grpc")
        assert [(w.address, w.state) for w in info.workers] == [(f"127.0.0.1:{worker_grpc}", "serving")]

        # The series the prometheus-adapter rule reads, on the port the pod annotations name.
        metrics_port = pods["worker"].ports[int(pods["worker"].deployment["spec"]["template"]["metadata"][
            "annotations"]["prometheus.io/port"])]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        for series in ("vllm_v0_worker_running_sequences", "vllm_v0_worker_waiting_requests"):
            assert re.search(rf"^{series} \d", text, re.M), series

        # SIGTERM, as after a preStop hook: each drains and exits cleanly, well within its grace period.
        for name in ("gateway", "tokenizer", "worker"):
            for process in pods[name].processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
        for name in ("gateway", "tokenizer", "worker"):
            grace = pods[name].deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert pods[name].processes[-1].wait(timeout=grace) == 0, log_tail(tmp_path, name)
    finally:
        for log in logs.values():
            with contextlib.suppress(OSError):
                log.close()
