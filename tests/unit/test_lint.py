"""Pyflakes' checks (ruff's F rules) over every Python file of the repository.

An undefined name in a test that only runs on a GPU is never executed on CPU CI; only a static check
catches it there. Files are found through git, so moved and new files are linted without a list here.
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# protoc writes these; test_protos checks they are exactly its output, so they are not edited by hand.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")


def python_files() -> list[str]:
    """Tracked and new (not ignored) .py files that exist in the work tree, relative to ROOT."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    return sorted({path for path in listed
                   if not path.endswith(GENERATED_SUFFIXES) and (ROOT / path).is_file()})


def pyflakes_findings(files: list[str], cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    # --isolated: only the F rules, whatever a developer's own ruff configuration says.
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F",
                           "--output-format", "concise", *files], cwd=cwd, capture_output=True, text=True)


def test_every_python_file_passes_pyflakes():
    files = python_files()
    # GPU-only tests and the scripts are linted too, not just what CPU CI imports.
    assert {"tests/unit/test_step_syncs.py", "scripts/gen_protos.py", "tests/unit/test_lint.py"} <= set(files)
    result = pyflakes_findings(files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_undefined_name_fails_the_check(tmp_path):
    (tmp_path / "gpu_only.py").write_text("def test_on_gpu():\n    return len(kinds)\n")
    result = pyflakes_findings(["gpu_only.py"], cwd=tmp_path)
    assert result.returncode == 1
    assert "F821" in result.stdout and "kinds" in result.stdout


def test_generated_stubs_are_left_out_and_nothing_else():
    files = python_files()
    assert not [f for f in files if f.endswith(GENERATED_SUFFIXES)]
    assert not [f for f in files if f.startswith(".venv/")]
    assert "vllm_v0/__init__.py" in files
