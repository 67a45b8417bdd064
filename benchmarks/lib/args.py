"""Arguments the benchmark scripts share: --preset (tiny for CI, full for the figures), flags that
override one value of a preset, and the psgrad server's stream window."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def add_preset(parser: argparse.ArgumentParser, presets: Iterable[str], what: str) -> None:
    """--preset NAME, one of presets (default: tiny); `what` says what a preset sets."""
    parser.add_argument("--preset", choices=sorted(presets), default="tiny", help=f"{what} (default: tiny)")


def overrides(args: argparse.Namespace, preset: Mapping[str, Any]) -> dict[str, Any]:
    """The preset's values, each replaced by the argument of the same name where one was given."""
    return {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in preset.items()}


def window_bytes_arg(text: str) -> int:
    """argparse type of the benchmarks' --stream-window-bytes: a window `psgrad server` accepts."""
    from psgrad.config import ServerConfig

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}") from None
    try:
        ServerConfig(stream_window_bytes=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def window_argv(window: int | None) -> list[str]:
    """The psgrad server arguments that set its stream window; none for its default (None)."""
    return [] if window is None else ["--stream-window-bytes", str(window)]


def names_arg(valid: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type of a comma-separated list of names, each one of `valid` (e.g. --configs)."""
    known = list(valid)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(known)}")
        return names

    return parse
