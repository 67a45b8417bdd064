"""Regenerate psgrad/proto/ from protos/ with grpcio-tools (pinned in pyproject's test extra)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ["psgrad/proto/ps.proto"]


def generate(out_dir: Path) -> None:
    """Write ps_pb2.py and ps_pb2.pyi under out_dir/psgrad/proto/. No ps_pb2_grpc.py: both ends
    call the service through generic handlers with raw-bytes (de)serializers (psgrad/wire/protocol.py
    names the service), so generated stubs would be imported by nothing."""
    from grpc_tools import protoc  # imported lazily: only needed by developers

    (out_dir / "psgrad" / "proto").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(PROTO_ROOT / name) for name in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT.parent,
        help="directory that receives psgrad/proto/*.py (default: the repository root)",
    )
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
