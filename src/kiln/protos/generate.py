"""Compile every .proto under src/kiln/protos/kiln/v1 into Python modules and .pyi stubs beside it.

Run `python -m kiln.protos.generate` (or this file) after editing a .proto; the generated files
are committed, and tests/unit/test_protos.py fails when they differ from a fresh generation.
Imports inside the generated code are rewritten to the package they live in (`kiln.protos.kiln.v1`),
because protoc emits `from kiln.v1 import x_pb2`, which is not an importable path here.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "kiln" / "v1"
PACKAGE = "kiln.protos.kiln.v1"


def _fix_imports(text: str) -> str:
    return re.sub(r"^from kiln\.v1 import", f"from {PACKAGE} import", text, flags=re.M)


def generate(out_root: Path) -> list[Path]:
    """Generate into `out_root` (laid out like PROTO_ROOT); returns the files written."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its message above")
    written = []
    for path in sorted((out_root / "kiln" / "v1").iterdir()):
        if path.suffix in (".py", ".pyi") and path.name != "__init__.py":
            path.write_text(_fix_imports(path.read_text()))
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = generate(args.out)
    print(f"generated {len(files)} files under {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def generate_to_temp() -> dict[str, str]:
    """Fresh generation in a temporary directory: {file name: text}. Used by tests."""
    with tempfile.TemporaryDirectory() as tmp:
        return {p.name: p.read_text() for p in generate(Path(tmp))}
