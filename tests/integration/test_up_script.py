"""scripts/up.sh beside a running stack: it fails at once, leaves that stack's logs alone, and trusts only
ports that its own live processes serve (scripts/up_stack.py)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from scripts import up_stack
from tests.integration.stack import ROOT, Service, free_port, wait_serving

OLD_LOG = "the running stack's log\n"


@pytest.fixture()
def listening():
    """A server already on a port, as the running stack's gateway is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture()
def bystander():
    """A live process that is not the one serving anything: a service that failed to bind, still exiting."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture()
def checkout(tmp_path):
    """scripts/up.sh and its helper in a folder of their own, with a running stack's .run/ logs."""
    (tmp_path / "scripts").mkdir()
    for name in ("up.sh", "up_stack.py", "__init__.py"):
        shutil.copy2(pathlib.Path(ROOT) / "scripts" / name, tmp_path / "scripts" / name)
    (tmp_path / ".run").mkdir()
    for name in ("tokenizer", "worker", "gateway"):
        (tmp_path / ".run" / f"{name}.log").write_text(OLD_LOG)
    return tmp_path


def run_up(checkout: pathlib.Path, ports: dict[str, int]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **{name: str(port) for name, port in ports.items()}}
    return subprocess.run(["bash", str(checkout / "scripts" / "up.sh")], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def free_ports() -> dict[str, int]:
    return {name: free_port() for name in ("VLLM_V0_TOKENIZER_PORT", "VLLM_V0_WORKER_PORT", "VLLM_V0_GATEWAY_PORT",
                                           "VLLM_V0_HTTP_PORT")}


def logs_untouched(checkout: pathlib.Path) -> bool:
    return all(log.read_text() == OLD_LOG for log in (checkout / ".run").glob("*.log"))


def test_a_second_up_from_the_same_checkout_says_so_and_leaves_the_logs(checkout, bystander):
    (checkout / ".run" / "up.pid").write_text(f"{bystander.pid}\n")  # the first up.sh, still running
    result = run_up(checkout, free_ports())
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"scripts/up.sh is already running from this checkout (pid {bystander.pid})" in result.stderr
    assert "Installing" not in result.stdout
    assert logs_untouched(checkout)
    assert (checkout / ".run" / "up.pid").read_text() == f"{bystander.pid}\n"  # still the first run's


def test_up_with_a_port_taken_fails_before_installing_and_leaves_the_logs(checkout, listening):
    result = run_up(checkout, {**free_ports(), "VLLM_V0_GATEWAY_PORT": listening})
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"port {listening} (VLLM_V0_GATEWAY_PORT) is already in use" in result.stderr
    assert "Installing" not in result.stdout
    assert logs_untouched(checkout)
    assert not (checkout / ".run" / "up.pid").exists()  # this run's claim, given back on the way out


def test_a_stale_claim_is_taken_over(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    pid_file = tmp_path / "up.pid"
    pid_file.write_text(f"{gone.pid}\n")
    assert up_stack.claim(str(pid_file), os.getpid()) is None
    assert pid_file.read_text() == f"{os.getpid()}\n"


def test_an_exited_child_not_yet_reaped_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie
    assert not up_stack.is_alive(child.pid)
    child.wait()
    assert up_stack.is_alive(os.getpid())


def test_a_port_is_served_only_by_the_process_listening_on_it(listening, bystander):
    assert up_stack.serves(os.getpid(), listening) is True
    assert up_stack.serves(bystander.pid, listening) is False


def test_healthy_ports_of_another_server_are_not_taken_for_this_runs_services(listening, bystander):
    """The bug: the old stack answered every health check while the new services failed to bind."""
    started = [up_stack.Started("gateway", bystander.pid, [listening])]
    problem = up_stack.wait_until_serving(started, is_healthy=lambda port: True, sleep=lambda s: None)
    assert problem == (f"port {listening} answers, but not from the gateway this run started (pid {bystander.pid}):"
                       " another server holds it")


def test_a_service_that_exits_while_starting_fails_the_wait(bystander):
    bystander.kill()
    bystander.wait()
    started = [up_stack.Started("worker", bystander.pid, [free_port()])]
    problem = up_stack.wait_until_serving(started, is_healthy=lambda port: False, sleep=lambda s: None)
    assert problem == f"the worker (pid {bystander.pid}) exited"


def test_the_wait_ends_once_its_own_processes_serve(listening):
    polls = []

    def is_healthy(port):
        polls.append(port)
        return len(polls) > 2

    started = [up_stack.Started("tokenizer", os.getpid(), [listening])]
    assert up_stack.wait_until_serving(started, is_healthy, sleep=lambda s: None) is None
    assert polls == [listening] * 3


@pytest.mark.parametrize("with_template", [True, False], ids=["chat_template", "no_template"])
def test_up_asks_the_tokenizer_whether_to_send_chat(demo_tokenizer_dir, tmp_path, with_template):
    model = tmp_path / "model"
    shutil.copytree(demo_tokenizer_dir, model)
    if not with_template:
        config = json.loads((model / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Service("tokenizer", ["services.tokenizer", "--model", str(model)], free_port(),
                        str(tmp_path / "tokenizer.log"))
    tokenizer.start()
    try:
        wait_serving(tokenizer.address, timeout=60)
        assert up_stack.main(["chat", str(tokenizer.port)]) == (0 if with_template else 1)
    finally:
        tokenizer.stop()
    up = (pathlib.Path(ROOT) / "scripts" / "up.sh").read_text()
    assert 'scripts.up_stack chat "$TOKENIZER_PORT"; then chat=(--chat)' in up
