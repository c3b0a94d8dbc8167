"""deploy/kubernetes/: every overlay renders, validates against the Kubernetes 1.31 API, and wires the services."""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from types import SimpleNamespace
import shutil
import subprocess

import pytest
import yaml
from grpc_health.v1 import health_pb2

from tests.kube import (DEPLOY, OVERLAYS, PROGRAMS, ROOT, config_maps, container_env, containers, find, parse_flags, pod_spec,
                        program, render, render_dir)

DEPLOYMENTS = ("tokenizer", "worker", "gateway")
# The module each Deployment's main container runs.
MODULES = {"tokenizer": "services.tokenizer", "worker": "services.model_worker", "gateway": "gateway"}


def all_containers(deployment: dict) -> list[dict]:
    return containers(deployment, init=True) + containers(deployment)


def main_container(objects: list[dict], name: str) -> dict:
    (container,) = containers(find(objects, "Deployment", name))
    return container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_three_services_and_their_guards(overlay):
    objects = render(overlay)
    kinds = sorted({(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "ConfigMap"})
    assert kinds == sorted([
        ("Namespace", "vllm-v0"), ("Deployment", "tokenizer"), ("Deployment", "worker"), ("Deployment", "gateway"),
        ("Service", "tokenizer"), ("Service", "worker"), ("Service", "gateway"),
        ("HorizontalPodAutoscaler", "worker"), ("PodDisruptionBudget", "worker"),
        ("NetworkPolicy", "default-deny-ingress"), ("NetworkPolicy", "gateway-from-clients"),
        ("NetworkPolicy", "worker-from-gateway"), ("NetworkPolicy", "tokenizer-from-gateway"),
        ("NetworkPolicy", "metrics-from-prometheus")])
    # The flags' ConfigMaps, and not the local-config one that names the images.
    assert sorted(n.rsplit("-", 1)[0] for n in config_maps(objects)) == [
        "gateway-flags", "model", "tokenizer-flags", "worker-flags"]
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"vllm-v0"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_1_31_schemas_strictly(overlay):
    import kubernetes_validate

    for obj in render(overlay):  # built-in kinds only: no custom resource needs a CRD first
        assert kubernetes_validate.validate(obj, "1.31", strict=True) == "1.31", obj["kind"]


def test_strict_validation_refuses_a_misspelt_field():
    """The check above can fail: an unknown field (a typo'd probe) is an error, not ignored."""
    import kubernetes_validate

    deployment = find(render("cpu"), "Deployment", "worker")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50053}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, "1.31", strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_container_parses_with_its_own_programs_parser(overlay, monkeypatch):
    objects = render(overlay)
    for name in DEPLOYMENTS:
        deployment = find(objects, "Deployment", name)
        assert program(containers(deployment)[0]) == MODULES[name]
        for container in all_containers(deployment):
            parse_flags(container, objects, monkeypatch)  # exits (SystemExit) on a flag it does not know


# Read by the worker's kernel builder, not a flag.
NON_FLAG_VARIABLES = {"VLLM_V0_CACHE"}


def flag_variables(module: str, monkeypatch) -> set[str]:
    """The VLLM_V0_* variables a program's flags read, as its --help lists them."""
    import contextlib
    import importlib
    import io

    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(PROGRAMS[module]).parse_args(["--help"])
    return set(re.findall(r"\[env (VLLM_V0_\w+)\]", out.getvalue()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_a_container_gets_is_one_its_program_reads(overlay, monkeypatch):
    """A misspelt variable in a ConfigMap would be ignored without a word: none is."""
    objects = render(overlay)
    for name in DEPLOYMENTS:
        for container in all_containers(find(objects, "Deployment", name)):
            given = {v for v in container_env(container, objects) if v.startswith("VLLM_V0_")} - NON_FLAG_VARIABLES
            known = flag_variables(program(container), monkeypatch)
            assert given <= known, (name, container["name"], given - known)
    assert {"VLLM_V0_WORKER_ADDR", "VLLM_V0_TOKENIZER_ADDR"} <= flag_variables("gateway", monkeypatch)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_finds_the_workers_through_the_headless_service(overlay, monkeypatch):
    objects = render(overlay)
    gateway = parse_flags(main_container(objects, "gateway"), objects, monkeypatch)
    (target,) = gateway.worker_addr
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", target)
    assert match, target
    service = find(objects, "Service", match.group(1))
    assert service["spec"]["clusterIP"] == "None"  # DNS names every pod, not one virtual IP
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(match.group(2))]
    worker = find(objects, "Deployment", "worker")
    assert selects(service["spec"]["selector"], worker)
    assert named_port(main_container(objects, "worker"), port["targetPort"]) == int(match.group(2))
    worker_args = parse_flags(main_container(objects, "worker"), objects, monkeypatch)
    assert worker_args.port == int(match.group(2)) and worker_args.host == "0.0.0.0"

    (tokenizer_addr,) = gateway.tokenizer_addr
    host, port_number = tokenizer_addr.split(":")
    service = find(objects, "Service", host)
    assert "clusterIP" not in service["spec"]  # one virtual IP in front of the tokenizer replicas
    assert selects(service["spec"]["selector"], find(objects, "Deployment", "tokenizer"))
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port_number)]
    tokenizer = parse_flags(main_container(objects, "tokenizer"), objects, monkeypatch)
    assert named_port(main_container(objects, "tokenizer"), port["targetPort"]) == tokenizer.port == int(port_number)


def selects(selector: dict, deployment: dict) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def named_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_selectors_match(overlay, monkeypatch):
    objects = render(overlay)
    deployments = [find(objects, "Deployment", name) for name in DEPLOYMENTS]
    for deployment in deployments:
        assert deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
        (container,) = containers(deployment)
        args = parse_flags(container, objects, monkeypatch)
        assert named_port(container, "grpc") == args.port
        assert named_port(container, "metrics") == args.metrics_port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(args.metrics_port)
        if deployment["metadata"]["name"] == "gateway":
            assert named_port(container, "http") == args.http_port
        # Native gRPC probes on the server's own port: readiness asks the whole server (""), liveness
        # the name that stays SERVING while the server answers.
        probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert {p["port"] for p in probes.values()} == {args.port}
        assert probes["readinessProbe"].get("service", "") == ""
        assert probes["livenessProbe"]["service"] == "liveness"
    # Every Service selects exactly one Deployment, on ports its containers have.
    for service in [o for o in objects if o["kind"] == "Service"]:
        (target,) = [d for d in deployments if selects(service["spec"]["selector"], d)]
        for port in service["spec"]["ports"]:
            named_port(containers(target)[0], port["targetPort"])
    gateway = find(objects, "Service", "gateway")
    assert {p["name"]: p["port"] for p in gateway["spec"]["ports"]} == {"grpc": 50051, "http": 8000}


def test_startup_probes_allow_for_model_loading():
    objects = render("gpu")
    for name, minimum in (("worker", 1800), ("tokenizer", 600)):
        probe = main_container(objects, name)["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= minimum, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_drain_fits_in_the_termination_grace_period(overlay, monkeypatch):
    objects = render(overlay)
    for name in DEPLOYMENTS:
        deployment = find(objects, "Deployment", name)
        container = main_container(objects, name)
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        args = parse_flags(container, objects, monkeypatch)
        # The worker's engine core gets up to 10 s to exit after the streams have drained.
        engine_exit = 10 if name == "worker" else 0
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] > pre_stop + args.grace_period + engine_exit
    # The worker sleeps past CoreDNS's 5 s TTL plus the gateway's next lookup before SIGTERM.
    gateway = parse_flags(main_container(objects, "gateway"), objects, monkeypatch)
    assert main_container(objects, "worker")["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5 + gateway.health_interval


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_images_non_root_user_read_only_and_unprivileged(overlay):
    objects = render(overlay)
    uid, gid = dockerfile_user()
    for name in DEPLOYMENTS:
        spec = pod_spec(find(objects, "Deployment", name))
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        # No Service variables (TOKENIZER_PORT=tcp://...) that a VLLM_V0_* flag could ever read.
        assert spec["enableServiceLinks"] is False
        assert spec["automountServiceAccountToken"] is False
        for container in containers(find(objects, "Deployment", name), init=True) + spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"] == {"drop": ["ALL"]}
            # Whatever the programs write goes to a mounted volume.
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            assert "/tmp" in mounts
            env = container_env(container, objects)
            for var in ("HF_HOME", "VLLM_V0_CACHE", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "CUDA_CACHE_PATH"):
                if var in env:
                    assert any(env[var] == m or env[var].startswith(m + "/") for m in mounts), (name, var)
            writes = container.get("args", [])
            if "--out" in writes:
                out = writes[writes.index("--out") + 1]
                assert any(out.startswith(m + "/") for m in mounts), out


def dockerfile_user() -> tuple[int, int]:
    users = set()
    for name in ("tokenizer", "worker", "gateway"):
        dockerfile = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
        (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
        assert f"--uid {user[0]} --gid {user[1]} app" in dockerfile, name
        users.add(tuple(int(x) for x in user))
    (user,) = users
    return user


def test_the_api_key_comes_from_a_secret_mounted_as_a_file(monkeypatch):
    objects = render("cpu")
    for name in DEPLOYMENTS:
        container = main_container(objects, name)
        spec = pod_spec(find(objects, "Deployment", name))
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-key"]
        assert volume["secret"]["secretName"] == "vllm-v0-api-key"
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-key"]
        assert mount["readOnly"] is True
        args = parse_flags(container, objects, monkeypatch)
        assert args.api_key is None and args.api_key_file == mount["mountPath"] + "/api-key"
        # Readable by the pod's group (fsGroup), not by others.
        assert volume["secret"]["defaultMode"] == 0o440


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tokenizer_and_worker_read_the_same_checkpoint(overlay, monkeypatch):
    objects = render(overlay)
    tokenizer = parse_flags(main_container(objects, "tokenizer"), objects, monkeypatch)
    worker = parse_flags(main_container(objects, "worker"), objects, monkeypatch)
    assert tokenizer.model == worker.model
    if overlay == "cpu":  # each pod's init container writes the demo checkpoint where its service reads it
        for name in ("tokenizer", "worker"):
            (init,) = containers(find(objects, "Deployment", name), init=True)
            args = parse_flags(init, objects, monkeypatch)
            assert str(args.out) == worker.model == "/models/demo"
            assert args.preset == "qwen3-0.6b"
            assert args.tokenizer_only == (name == "tokenizer")
        assert worker.device == "cpu"
    else:
        assert worker.device == "cuda"


@pytest.mark.parametrize("overlay", ("gpu", "gpu-tp"))
def test_a_gpu_worker_asks_for_one_gpu_per_rank(overlay, monkeypatch):
    objects = render(overlay)
    container = main_container(objects, "worker")
    args = parse_flags(container, objects, monkeypatch)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel_size
    assert args.tensor_parallel_size == (2 if overlay == "gpu-tp" else 1)
    spec = pod_spec(find(objects, "Deployment", "worker"))
    assert spec["nodeSelector"] and spec["tolerations"]
    if args.tensor_parallel_size > 1:  # NCCL's shared memory between the ranks
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_cpu_worker_sizes_its_threads_to_its_cpus():
    container = main_container(render("cpu"), "worker")
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed: whole cores under a static CPU manager
    (threads,) = [v for v in container["env"] if v["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"] == {"containerName": "worker", "resource": "requests.cpu",
                                                         "divisor": "1"}


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())["rules"]["custom"]
    return rule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_autoscale_and_are_disrupted_one_at_a_time(overlay):
    objects = render(overlay)
    worker = find(objects, "Deployment", "worker")
    assert "replicas" not in worker["spec"]  # the HPA's: a re-apply must not reset them
    hpa = find(objects, "HorizontalPodAutoscaler", "worker")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"}
    (metric,) = hpa["metrics"]
    if overlay == "cpu":
        assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        assert main_container(objects, "worker")["resources"]["requests"]["cpu"]  # utilization needs a request
    else:
        # The metric the prometheus-adapter rule serves, per worker pod.
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == adapter_rule()["name"]["as"]
    pdb = find(objects, "PodDisruptionBudget", "worker")["spec"]
    assert pdb["maxUnavailable"] == 1 and selects(pdb["selector"]["matchLabels"], worker)


def test_the_adapter_rule_adds_the_workers_running_and_waiting_gauges():
    """The series the rule reads are the worker's own gauges (by the names its collector exports)."""
    from services.model_worker.server.metrics import EngineCollector

    class Stats:
        info = None  # no speculative decoding: its series are not exported
        restarts = 0
        resume = SimpleNamespace(resumed=Counter(), abandoned=Counter())  # no stream carried on
        stats = dict(waiting=3, running=5, kv_blocks_used=0, kv_blocks_free=1, prefix_queries=0, prefix_hits=0,
                     prefix_cache_hit_rate=0.0, preemptions=0)

    exported = {family.name: family.samples[0].value for family in EngineCollector(Stats()).collect()}
    rule = adapter_rule()
    summed = re.findall(r"(vllm_v0_\w+)\{<<\.LabelMatchers>>\}", rule["metricsQuery"])
    assert sorted(summed) == ["vllm_v0_worker_running_sequences", "vllm_v0_worker_waiting_requests"]
    assert sum(exported[name] for name in summed) == 8
    assert rule["seriesQuery"].split("{")[0] in summed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_reaches_the_tokenizer_and_the_workers(overlay):
    objects = render(overlay)
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    gateway = find(objects, "Deployment", "gateway")
    for name in ("worker", "tokenizer"):
        deployment = find(objects, "Deployment", name)
        allowed = [p for p in policies.values() if p.get("ingress") and selects(p["podSelector"]["matchLabels"],
                                                                                 deployment)]
        grpc_rules = [rule for p in allowed for rule in p["ingress"] if {"port": "grpc"} in rule["ports"]]
        (rule,) = grpc_rules
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"} and selects(peer["podSelector"]["matchLabels"], gateway)
        # Anything else that reaches these pods reaches only the metrics port.
        other_ports = {port["port"] for p in allowed for r in p["ingress"] if r is not rule for port in r["ports"]}
        assert other_ports == {"metrics"}
        named_port(main_container(objects, name), "grpc")


def compose_images() -> dict[str, str]:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return {name: services[name]["image"] for name in DEPLOYMENTS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_ones_compose_builds(overlay):
    objects = render(overlay)
    for name, image in compose_images().items():
        deployment = find(objects, "Deployment", name)
        assert containers(deployment)[0]["image"] == image + ":latest"
        for init in containers(deployment, init=True):  # the demo writer, as in compose
            assert init["image"] == compose_images()["worker"] + ":latest"


def test_one_tag_and_one_repository_name_all_the_images(tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(DEPLOY, tree)
    for overlay in OVERLAYS:
        kustomization = tree / "overlays" / overlay / "kustomization.yaml"
        text = kustomization.read_text()
        assert text.count("repository=vllm-v0, tag=latest") == 1
        kustomization.write_text(text.replace("repository=vllm-v0, tag=latest",
                                              "repository=registry.example.com:5000/team/vllm-v0, tag=0.3.1"))
        objects = render_dir(tree / "overlays" / overlay)
        images = [c["image"] for o in objects if o["kind"] == "Deployment" for c in all_containers(o)]
        assert len(images) == (5 if overlay == "cpu" else 3)
        for name in DEPLOYMENTS:
            deployment = find(objects, "Deployment", name)
            expected = compose_images()[name].replace("vllm-v0/", "registry.example.com:5000/team/vllm-v0/", 1)
            assert containers(deployment)[0]["image"] == expected + ":0.3.1"


def test_the_system_kubectl_renders_the_same_as_the_pinned_one():
    """Users apply with their own kubectl: where this machine has another version, it must agree."""
    system = shutil.which("kubectl", path="/usr/local/bin:/usr/bin:/bin")
    if system is None:
        pytest.skip("no kubectl on the system PATH to compare with the pinned one")
    version = subprocess.run([system, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    for overlay in OVERLAYS:
        assert render_dir(DEPLOY / "overlays" / overlay, binary=system) == render(overlay), (overlay, version)


# --- the health name the liveness probes ask for ------------------------------------------


def test_liveness_is_serving_while_readiness_is_not():
    from rpcserver.config import ServerConfig
    from rpcserver.server import LIVENESS, GrpcServer
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    async def statuses(server: GrpcServer) -> tuple[str, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            replies = [await stub.Check(health_pb2.HealthCheckRequest(service=s)) for s in ("", LIVENESS)]
        return tuple(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in replies)

    async def main():
        server = GrpcServer(ServerConfig("127.0.0.1", 0, 1.0, 1 << 20, None, None, None, "INFO"), ["x.Y"])
        await server.start()
        try:
            loading = await statuses(server)
            await server.set_serving(True)
            serving = await statuses(server)
            server.draining = True
            await server.set_serving(False)
            draining = await statuses(server)
        finally:
            await server.close()
        return loading, serving, draining

    assert asyncio.run(main()) == (("NOT_SERVING", "SERVING"), ("SERVING", "SERVING"), ("NOT_SERVING", "SERVING"))
