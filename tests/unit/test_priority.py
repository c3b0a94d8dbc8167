"""--nice: the tokenizer and gateway lower every thread of their own, and only in the range nice(1) lowers by."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from gateway.main import parse_args as gateway_args
from services.tokenizer.main import parse_args as tokenizer_args

SERVICES = {"gateway": gateway_args, "tokenizer": tokenizer_args}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# In a child process, so the test run keeps its own priority: a thread started before the call and one started
# after it, then each thread's nice value as the kernel reports it (field 19 of /proc/self/task/TID/stat).
PROBE = textwrap.dedent("""
    import json, os, sys, threading
    from rpcserver.priority import lower_priority

    def nice_of(tid):
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])

    release = threading.Event()
    before = threading.Thread(target=release.wait)
    before.start()
    lower_priority(int(sys.argv[1]))
    after = threading.Thread(target=release.wait)
    after.start()
    threads = sorted(map(nice_of, os.listdir("/proc/self/task")))
    print(json.dumps({"main": nice_of(threading.get_native_id()), "before": nice_of(before.native_id),
                      "after": nice_of(after.native_id), "threads": threads}))
    release.set()
""")


def probe(increment: int, start_nice: int = 0) -> dict:
    preexec = (lambda: os.nice(start_nice)) if start_nice else None
    out = subprocess.run([sys.executable, "-c", PROBE, str(increment)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True, preexec_fn=preexec).stdout
    return json.loads(out)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads each thread's nice value from /proc")
def test_every_thread_is_lowered_those_before_the_call_and_those_after_it():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    result = probe(7)
    expected = min(19, base + 7)
    assert result["main"] == result["before"] == result["after"] == expected
    assert set(result["threads"]) == {expected}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads each thread's nice value from /proc")
def test_it_lowers_from_where_the_process_already_is_and_stops_at_19():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 12:
        pytest.skip(f"this run is already at nice {base}")
    assert probe(3, start_nice=2)["main"] == base + 5
    assert probe(19, start_nice=5)["threads"] == [19, 19, 19]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads each thread's nice value from /proc")
def test_zero_leaves_the_priority_alone():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(probe(0)["threads"]) == {base}


@pytest.mark.parametrize("name", SERVICES)
def test_the_flag_is_0_by_default_read_from_the_environment_and_within_0_to_19(name, monkeypatch, capsys):
    parse = SERVICES[name]
    assert parse([]).nice == 0
    assert parse(["--nice", "19"]).nice == 19
    monkeypatch.setenv("VLLM_V0_NICE", "10")
    assert parse([]).nice == 10
    for bad in ("-1", "20"):
        with pytest.raises(SystemExit) as exit_:
            parse(["--nice", bad])
        assert exit_.value.code == 2
        assert f"--nice must be in [0, 19], got {bad}" in capsys.readouterr().err


def test_the_gateway_benchmark_lowers_the_services_as_up_sh_does():
    from bench.bench_gateway import UP_SH_NICE

    up = open(os.path.join(ROOT, "scripts", "up.sh")).read()
    assert f'yield_to_engine=(--nice "${{VLLM_V0_NICE:-{UP_SH_NICE}}}")' in up
