"""--engine-cpus: CPU lists as Linux writes them, and a child pinned from its first instruction."""
import json
import os
import subprocess
import sys

import pytest

from services.model_worker.host.cpu_affinity import (check_available, current, format_cpu_list,
                                                     inherited_by_children, parse_cpu_list)


@pytest.mark.parametrize("text, cpus", [("3", {3}), ("0-3", {0, 1, 2, 3}), ("0,2,4-6", {0, 2, 4, 5, 6}),
                                        (" 1 , 5-5 ", {1, 5}), ("2,2,1-2", {1, 2})])
def test_cpu_lists_parse_as_linux_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "-1", "1-", "a", "1-b", "0x1", "1.5", "0,,2", "3-1", "1-2-3"])
def test_what_is_not_a_cpu_list_is_refused(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


@pytest.mark.parametrize("cpus", [{0}, {0, 1, 2, 5}, {1, 3, 5}, {7, 8, 9, 10}, set(range(64))])
def test_format_is_the_inverse_of_parse(cpus):
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list({0, 1, 2, 5}) == "0-2,5"


def test_cpus_outside_this_process_are_named():
    allowed = os.sched_getaffinity(0)
    check_available(frozenset(allowed))
    with pytest.raises(ValueError, match=f"CPU {max(allowed) + 1} is not available"):
        check_available(frozenset({max(allowed) + 1}))


def child_view() -> tuple[list[int], int]:
    """A child's CPUs and torch's thread count there, read before anything else runs in it."""
    code = ("import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))\n"
            "import torch; print(torch.get_num_threads())")
    lines = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}).stdout.split("\n")
    return json.loads(lines[0]), int(lines[1])


def test_a_child_started_inside_runs_on_those_cpus_only_and_sizes_torch_to_them():
    before = os.sched_getaffinity(0)
    one = frozenset({max(before)})
    with inherited_by_children(one):
        cpus, threads = child_view()
    assert cpus == sorted(one) and threads == 1
    assert os.sched_getaffinity(0) == before  # this thread's own set is back
    with inherited_by_children(None):
        cpus, _ = child_view()
    assert cpus == sorted(before)


def test_current_names_this_threads_cpus():
    assert parse_cpu_list(current()) == os.sched_getaffinity(0)


KEEP_OFF_CHILD = """
import json, os, sys, threading
from services.model_worker.host.cpu_affinity import keep_process_off
go = threading.Event()
early = threading.Thread(target=go.wait)
early.start()
rest = keep_process_off(frozenset({int(sys.argv[1])}))
late = threading.Thread(target=go.wait)
late.start()
seen = {}
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/status") as f:
        seen[task] = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
go.set()
left_alone = keep_process_off(frozenset(os.sched_getaffinity(0)))
print(json.dumps({"rest": sorted(rest), "threads": seen, "left_alone": left_alone}))
"""


def test_keep_process_off_moves_every_thread_and_the_ones_started_later():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs: one to keep the process off, one for it to run on")
    engine = max(allowed)
    # In a child, so this process keeps its CPUs: a thread started before the move, and one after.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = json.loads(subprocess.run([sys.executable, "-c", KEEP_OFF_CHILD, str(engine)], check=True,
                                    capture_output=True, text=True, cwd=root).stdout)
    rest = allowed - {engine}
    assert out["rest"] == sorted(rest)
    assert len(out["threads"]) == 3 and set(out["threads"].values()) == {format_cpu_list(rest)}, out["threads"]
    assert out["left_alone"] is None  # keeping off every CPU it has moves nothing


def test_others_prints_the_cpus_besides_a_list_for_scripts_and_refuses_bad_ones():
    allowed = os.sched_getaffinity(0)
    engine = max(allowed)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def others(text: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.model_worker.host.cpu_affinity", "--others", text],
                              capture_output=True, text=True, cwd=root)

    out = others(str(engine))
    assert out.returncode == 0 and out.stdout == format_cpu_list(allowed - {engine}) + "\n", out
    assert others(format_cpu_list(allowed)).stdout == "\n"  # the list takes every CPU: none is left
    refused = others(str(max(allowed) + 1))
    assert refused.returncode == 2 and f"CPU {max(allowed) + 1} is not available" in refused.stderr
    assert others("1-").returncode == 2
