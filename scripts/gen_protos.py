"""Generate the Python gRPC stubs under vllm_v0/ from protos/."""
import pathlib
import sys

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(out_dir: pathlib.Path = ROOT) -> None:
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    # Make every generated folder a regular package so `import vllm_v0.x.v1` works everywhere.
    for proto in protos:
        pkg = out_dir / pathlib.Path(proto).parent
        while pkg != out_dir:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
