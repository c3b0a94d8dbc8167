"""The project's version, which every service and the client report with --version."""

VERSION = "0.1.0"


def add_version_flag(parser, prog: str) -> None:
    parser.add_argument("--version", action="version", version=f"{prog} (vllm-v0) {VERSION}")
