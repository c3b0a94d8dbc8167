"""Every benchmark still imports against the tree: they are not run in CI, so a module they use
can move under them unnoticed (bench_attention once pointed at a name the worker had moved)."""

import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
# The llama.cpp driver runs inside the peer's own venv, where llama_cpp is installed.
PEER_ONLY = {"peer_llama_driver"}
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__" and p.stem not in PEER_ONLY)


def test_the_list_covers_the_benchmarks():
    assert "bench_attention" in MODULES and "bench_peers" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports(name):
    importlib.import_module(f"bench.{name}")
