"""TLS on every server, mTLS from the gateway to the tokenizer and worker, and API keys on all three."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rpcserver.auth import OPEN_SERVICES
from rpcserver.healthcheck import check
from tests.integration.certs import CertificateAuthority
from tests.integration.stack import ROOT, make_stack, wait_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

API_KEY = "test-key-3f9a1c"
INTERNAL_KEY = "internal-key-81d2e"  # the tokenizer's and worker's, sent by the gateway
GATEWAY_SERVICE = "vllm_v0.gateway.v1.GatewayService"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory)
    rogue = CertificateAuthority(directory, "rogue CA")
    key_file = directory / "api-key"
    key_file.write_text(API_KEY + "\n")
    return SimpleNamespace(ca=ca, server=ca.issue("server", server=True), client=ca.issue("gateway", server=False),
                           rogue_client=rogue.issue("rogue", server=False), api_key_file=str(key_file))


def credentials(pki, client=None) -> grpc.ChannelCredentials:
    with open(pki.ca.path, "rb") as f:
        root = f.read()
    if client is None:
        return grpc.ssl_channel_credentials(root)
    cert, key = client.read()
    return grpc.ssl_channel_credentials(root, key, cert)


@pytest.fixture(scope="module")
def secure_stack(checkpoint, pki, tmp_path_factory):
    downstream_only = ["--tls-client-ca", pki.ca.path]  # the tokenizer and worker accept only certified clients
    stack = make_stack(
        str(checkpoint), str(tmp_path_factory.mktemp("secure-logs")),
        common_flags=["--tls-cert", pki.server.cert, "--tls-key", pki.server.key],
        tokenizer_flags=downstream_only, worker_flags=downstream_only,
        gateway_flags=["--downstream-tls-ca", pki.ca.path, "--downstream-tls-cert", pki.client.cert,
                       "--downstream-tls-key", pki.client.key, "--api-key-file", pki.api_key_file])
    for service in stack.services:
        service.start()
    try:
        wait_serving(stack.tokenizer.address, credentials=credentials(pki, pki.client))
        wait_serving(stack.worker.address, credentials=credentials(pki, pki.client))
        # SERVING only once the gateway has reached both over mTLS.
        wait_serving(stack.gateway.address, credentials=credentials(pki))
    except TimeoutError:
        stack.stop()
        raise AssertionError("secure stack did not start:\n" + "\n".join(s.log()[-3000:] for s in stack.services))
    yield stack
    stack.stop()


def call_any(channel: grpc.Channel, method, metadata) -> tuple[grpc.StatusCode, str]:
    """Call a method known only from reflection with an empty request; the status it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            next(iter(channel.stream_stream(path)(iter([b""]), metadata=metadata, timeout=5)))
        elif method.client_streaming:
            channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=5)
        elif method.server_streaming:
            next(iter(channel.unary_stream(path)(b"", metadata=metadata, timeout=5)))
        else:
            channel.unary_unary(path)(b"", metadata=metadata, timeout=5)
    except grpc.RpcError as e:
        return e.code(), e.details()
    except StopIteration:
        pass
    return grpc.StatusCode.OK, ""


def test_every_method_but_health_and_reflection_needs_the_api_key(secure_stack, pki):
    bad_keys = {"missing": None, "wrong": [("authorization", "Bearer not-the-key")],
                "no scheme": [("authorization", API_KEY)], "prefix": [("authorization", f"Bearer {API_KEY[:-1]}")]}
    protected = []
    with grpc.secure_channel(secure_stack.gateway.address, credentials(pki)) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)  # reflection itself needs no key
        services = list(database.get_services())
        assert {GATEWAY_SERVICE, *{"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}} <= set(
            services)
        pool = DescriptorPool(database)
        for service in services:
            for method in pool.FindServiceByName(service).methods:
                for label, metadata in bad_keys.items():
                    code, details = call_any(channel, method, metadata)
                    if service in OPEN_SERVICES:
                        # (Health.List answers UNIMPLEMENTED in grpcio-health-checking; still not a refusal.)
                        assert code != grpc.StatusCode.UNAUTHENTICATED, (method.full_name, label, details)
                    else:
                        assert code == grpc.StatusCode.UNAUTHENTICATED, (method.full_name, label, code, details)
                        assert "API key" in details or "authorization" in details
                if service not in OPEN_SERVICES:
                    protected.append(method.name)
        assert {"Generate", "GetInfo"} <= set(protected)

        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        key = [("authorization", f"Bearer {API_KEY}")]
        assert stub.GetInfo(gateway_pb2.GetInfoRequest(), metadata=key, timeout=5).max_context > 0
        replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt="Hello there", max_tokens=8, temperature=0,
                                                                 ignore_eos=True), metadata=key, timeout=30))
        assert "".join(r.text for r in replies)
        assert replies[-1].usage.completion_tokens == 8
        # The scheme is case-insensitive (RFC 6750), and a request with the key but bad fields gets
        # past auth to validation.
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(gateway_pb2.GenerateRequest(), metadata=[("authorization", f"bearer {API_KEY}")]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_command_line_client_with_tls_and_api_key(secure_stack, pki):
    command = [sys.executable, "-m", "gateway.client", "Hello", "--addr", secure_stack.gateway.address,
               "--tls-ca", pki.ca.path, "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    ok = subprocess.run([*command, "--api-key", API_KEY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "completion_tokens: 4" in ok.stdout + ok.stderr
    env = {k: v for k, v in os.environ.items() if k != "VLLM_V0_API_KEY"}
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr


@pytest.mark.parametrize("name", ["tokenizer", "worker"])
def test_downstream_services_require_a_client_certificate(secure_stack, pki, name):
    address = getattr(secure_stack, name).address

    def health(creds) -> grpc.StatusCode | int:
        with grpc.secure_channel(address, creds) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError as e:
                return e.code()

    assert health(credentials(pki)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert health(credentials(pki, pki.rogue_client)) == grpc.StatusCode.UNAVAILABLE  # signed by another CA
    assert health(credentials(pki, pki.client)) == health_pb2.HealthCheckResponse.SERVING
    # The container probe can present the certificate too.
    assert check(address, "", 5, pki.ca.path, pki.client.cert, pki.client.key) == "SERVING"


@pytest.mark.parametrize("name", ["tokenizer", "worker", "gateway"])
def test_plaintext_client_cannot_talk_to_a_tls_server(secure_stack, name):
    with grpc.insecure_channel(getattr(secure_stack, name).address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# --- API keys on the tokenizer and worker, for deployments without mTLS ------------------------


@pytest.fixture(scope="module")
def keyed_stack(checkpoint, tmp_path_factory):
    """Plaintext throughout: clients give the gateway its key; the gateway gives the others theirs."""
    directory = tmp_path_factory.mktemp("keyed")
    key_file = directory / "internal-key"
    key_file.write_text(INTERNAL_KEY + "\n")
    downstream = ["--api-key-file", str(key_file)]
    stack = make_stack(str(checkpoint), str(directory), tokenizer_flags=downstream, worker_flags=downstream,
                       gateway_flags=["--api-key", API_KEY, "--downstream-api-key-file", str(key_file)])
    stack.start()  # health needs no key; the gateway is SERVING only once its keyed GetInfo calls went through
    yield stack
    stack.stop()


@pytest.mark.parametrize("name", ["tokenizer", "worker"])
def test_a_keyed_downstream_service_refuses_calls_without_its_key(keyed_stack, name):
    with grpc.insecure_channel(getattr(keyed_stack, name).address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)  # reflection stays open, as on the gateway
        pool = DescriptorPool(database)
        protected = []
        for service in database.get_services():
            for method in pool.FindServiceByName(service).methods:
                for metadata in (None, [("authorization", f"Bearer {API_KEY}")]):  # none, or the gateway's
                    code, details = call_any(channel, method, metadata)
                    if service in OPEN_SERVICES:
                        assert code != grpc.StatusCode.UNAUTHENTICATED, (method.full_name, details)
                    else:
                        assert code == grpc.StatusCode.UNAUTHENTICATED, (method.full_name, code, details)
                if service not in OPEN_SERVICES:
                    protected.append(method.name)
        assert {"GetInfo"} < set(protected)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        key = [("authorization", f"Bearer {INTERNAL_KEY}")]
        if name == "tokenizer":
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            assert stub.GetInfo(tokenizer_pb2.GetInfoRequest(), metadata=key, timeout=5).vocab_size > 0
            assert stub.Encode(tokenizer_pb2.EncodeRequest(text="Hi"), metadata=key, timeout=5).token_ids
        else:
            stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
            assert stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=key, timeout=5).max_context > 0
            replies = list(stub.Generate(worker_pb2.GenerateRequest(
                request_id="direct", prompt_token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True), metadata=key,
                timeout=30))
            assert len(replies) == 3


def test_the_gateway_sends_the_downstream_key_end_to_end(keyed_stack):
    with grpc.insecure_channel(keyed_stack.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        key = [("authorization", f"Bearer {API_KEY}")]
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetInfo(gateway_pb2.GetInfoRequest(), metadata=key, timeout=5)
        assert info.max_context > 0 and [w.state for w in info.workers] == ["serving"]
        # Encode, the worker's GenerateMany and the tokenizer's DecodeBatches, all with the internal key.
        replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt="Hello there", max_tokens=8, temperature=0,
                                                                 ignore_eos=True), metadata=key, timeout=60))
    assert replies[-1].usage.completion_tokens == 8 and "".join(r.text for r in replies)
    assert "UNAUTHENTICATED" not in keyed_stack.gateway.log()
