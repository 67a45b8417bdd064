"""main(): the `psgrad` entry point; parses argv, runs the command, and turns its errors into exit codes."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from psgrad.cli import logs
from psgrad.cli.parser import build_parser
from psgrad.errors import ConfigError, PsgradError, TaskError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.raw_argv = list(argv) if argv is not None else sys.argv[1:]
    func: Callable[[argparse.Namespace], int] = ns.func
    logs.configure(ns.log_level, ns.log_format)
    try:
        return func(ns)
    except (ConfigError, TaskError) as exc:
        parser.print_usage(sys.stderr)
        print(f"psgrad {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PsgradError as exc:
        print(f"psgrad {ns.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"psgrad {ns.command}: interrupted", file=sys.stderr)
        return 130
