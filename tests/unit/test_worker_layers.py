"""The model worker's and the gateway's folders import one way, from the front down; no module of the project
imports itself back or takes a standard-library module's name."""
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "services" / "model_worker"
PACKAGE = "services.model_worker"

# Lowest first: a module may import its own folder and any folder below it, never one above.
# model/layers/ sits below the rest of model/ (the model file is built of its layers).
FLOORS = ["kernels", "host", "config", "distributed", "model/layers", "model", "executor", "engine", "core",
          "server", "main"]
SAME_FLOOR = {"kernels": "host", "host": "kernels"}  # two independent leaves, neither imports the other
GATEWAY = ROOT / "gateway"
GATEWAY_PACKAGE = "gateway"
# The gateway, lowest first: the text pipeline, the fleet of workers, the generation core over both,
# then its two fronts (gRPC and HTTP, side by side), then main.py, which wires them.
GATEWAY_FLOORS = ["text", "fleet", "core", "grpc_api", "http_api", "main"]
GATEWAY_SAME_FLOOR = {"grpc_api": "http_api", "http_api": "grpc_api"}
GATEWAY_TOP_LEVEL = ["__init__.py", "__main__.py", "client.py", "main.py"]  # client.py: the command-line client
PROJECT = ("services", "gateway", "rpcserver", "checkpoint", "demo")  # the packages the services run


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_of(module: str, package: str = PACKAGE, floors: list[str] = FLOORS) -> str:
    """The floors entry a module of `package` belongs to (its top-level modules are the top)."""
    rest = module.removeprefix(package).lstrip(".").replace(".", "/")
    if "/" not in rest:
        return "main"
    return max((f for f in floors if rest == f or rest.startswith(f + "/")), key=len)


def imports(path: pathlib.Path, at_run_time: bool, packages: tuple[str, ...] = (PACKAGE,)) -> set[str]:
    """Modules of `packages` that `path` imports; at_run_time leaves out `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if at_run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(packages):
                for alias in node.names:  # `from package import module` names a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists() else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(packages))
    return found


def modules_under(root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in root.rglob("*.py")}


def check_folders(root: pathlib.Path, top_level: list[str]) -> None:
    assert sorted(p.name for p in root.glob("*.py")) == top_level
    for folder in (p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "\n" not in doc.strip(), f"{init} needs a one-line docstring saying the folder's job"


def upward_imports(root: pathlib.Path, package: str, floors: list[str], same_floor: dict[str, str]) -> list[str]:
    upward = []
    for module, path in modules_under(root).items():
        mine = folder_of(module, package, floors)
        for target in imports(path, at_run_time=False, packages=(package,)):
            theirs = folder_of(target, package, floors)
            if theirs != mine and same_floor.get(mine) != theirs and floors.index(theirs) > floors.index(mine):
                upward.append(f"{module} ({mine}) imports {target} ({theirs})")
    return upward


def test_every_worker_module_is_in_a_folder_with_a_floor():
    check_folders(WORKER, ["__init__.py", "__main__.py", "main.py"])


def test_every_gateway_module_is_in_a_folder_with_a_floor():
    check_folders(GATEWAY, GATEWAY_TOP_LEVEL)
    for module in modules_under(GATEWAY):  # a new folder must be given a floor
        if module.count(".") > 1:
            assert module.split(".")[1] in GATEWAY_FLOORS, module


def test_no_import_goes_up_a_floor():
    upward = upward_imports(WORKER, PACKAGE, FLOORS, SAME_FLOOR)
    assert not upward, "\n".join(upward)


def test_no_gateway_import_goes_up_a_floor():
    upward = upward_imports(GATEWAY, GATEWAY_PACKAGE, GATEWAY_FLOORS, GATEWAY_SAME_FLOOR)
    assert not upward, "\n".join(upward)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PROJECT for p in (ROOT / package).rglob("*.py")}


def test_no_import_circle():
    # Imports under `if TYPE_CHECKING:` count too: a circle kept only for annotations still ties the two
    # modules into one idea, and the first annotation evaluated at run time (a dataclass field, a
    # typing.get_type_hints call) turns it into an ImportError.
    graph = {module: imports(path, at_run_time=False, packages=PROJECT) for module, path in project_modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]) if target in path else target)
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def stdlib_namesakes(modules) -> list[str]:
    """The modules among `modules` whose own name is a standard-library module's."""
    return sorted(m for m in modules
                  if m.rpartition(".")[2] in sys.stdlib_module_names and not m.rpartition(".")[2].startswith("__"))


def test_no_module_is_named_after_a_standard_library_module():
    # A module named like the standard library's shadows it wherever its folder comes first on sys.path (a
    # file of that folder run as a script): the standard library's own `import select`, in subprocess and
    # selectors, then loads the project's module. Readers and tools confuse the two names too.
    namesakes = stdlib_namesakes(project_modules())
    assert not namesakes, namesakes


def test_the_namesake_check_sees_one():
    assert stdlib_namesakes(["services.model_worker.model.layers.quant.select", "gateway.fleet.router",
                             "services.model_worker.__main__"]) == ["services.model_worker.model.layers.quant.select"]


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    """The two checks above would fail on the shapes they look for (the engine -> ranks -> ipc -> engine circle)."""
    assert folder_of("services.model_worker.model.layers.linear") == "model/layers"
    assert folder_of("services.model_worker.model.qwen3") == "model"
    assert FLOORS.index(folder_of("services.model_worker.core.protocol")) > FLOORS.index("distributed")
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom services.model_worker.core import protocol\n"
                      "if TYPE_CHECKING:\n    from services.model_worker.engine.llm_engine import LLMEngine\n")
    assert imports(source, at_run_time=True) == {"services.model_worker.core.protocol"}
    assert imports(source, at_run_time=False) == {"services.model_worker.core.protocol",
                                                  "services.model_worker.engine.llm_engine"}
