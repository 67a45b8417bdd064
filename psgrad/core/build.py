"""Which build runs: psgrad's version (the installed distribution's), Python's, grpcio's and torch's,
as the build-info metric of servers and workers labels them; pure (package metadata only)."""
from __future__ import annotations

import importlib.metadata
import platform


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # (psgrad run from a checkout never installed)
        return "unknown"


def build_labels() -> dict[str, str]:
    """{version, python, grpcio, torch}: the labels of psgrad_build_info."""
    return {"version": _version("psgrad"), "python": platform.python_version(), "grpcio": _version("grpcio"),
            "torch": _version("torch")}
