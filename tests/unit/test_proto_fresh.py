"""The checked-in generated code must equal what protos/generate.py produces from protos/."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import REPO

GENERATED = ["ps_pb2.py", "ps_pb2.pyi"]


def test_no_grpc_stubs_are_generated_or_checked_in(tmp_path: Path) -> None:
    """Nothing imports generated service stubs: the wire module names the methods."""
    assert not (Path(REPO) / "psgrad" / "proto" / "ps_pb2_grpc.py").exists()


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the code")
    spec = importlib.util.spec_from_file_location("psgrad_generate", os.path.join(REPO, "protos", "generate.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "psgrad" / "proto" / name).read_text()
        checked_in = (Path(REPO) / "psgrad" / "proto" / name).read_text()
        assert fresh == checked_in, f"psgrad/proto/{name} is stale: run `python protos/generate.py`"


def test_runtime_floors_match_generated_code() -> None:
    """pyproject's grpcio/protobuf floors must be the versions the generated code demands."""
    text = (Path(REPO) / "pyproject.toml").read_text()
    pb2 = (Path(REPO) / "psgrad" / "proto" / "ps_pb2.py").read_text()
    gencode = pb2.split("# Protobuf Python Version: ", 1)[1].split()[0]
    tools = text.split('"grpcio-tools==', 1)[1].split('"', 1)[0]
    assert f'"protobuf>={gencode}"' in text
    assert f'"grpcio>={tools}"' in text  # the generator's grpcio, as its generated code would demand
