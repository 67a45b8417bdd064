"""main(): the `psgrad` entry point; parses argv (for `launch --resume DIR`, the flags recorded in DIR too), runs the
command, and turns its errors into exit codes."""
from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence

from psgrad.cli import logs
from psgrad.cli.flags import apply_drift
from psgrad.cli.parser import build_parser, flags_named, one_line_usage
from psgrad.errors import ConfigError, PsgradError, TaskError, Terminated

EXIT_USAGE = 2


def resumed_launch(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.Namespace:
    """`launch --resume DIR`: the flags the job was launched with (recorded in DIR), then the ones
    given now, parsed; ns.resume still names DIR.

    Raises:
        ConfigError: DIR holds no launched job, flags that contradict resuming, or a shard of the
            job has no checkpoint to restore.
    """
    from pathlib import Path

    from psgrad.launch import jobdir

    directory = Path(ns.resume)
    argv = jobdir.resume_argv(directory, ns.raw_argv[1:])
    resumed = parser.parse_args(["launch", *argv])
    resumed.raw_argv = ["launch", *argv]
    resumed.resume = ns.resume
    jobdir.check_resumable(Path(resumed.checkpoint_dir), resumed.num_servers)
    where = jobdir.launched_in(directory)
    if ":" in str(getattr(resumed, "task", "")) and where is not None and where != Path.cwd():
        # A task of the user's was imported from the directory the job was launched in: it is
        # searched there again (this process, and its servers and workers through PYTHONPATH).
        import os

        sys.path.insert(0, str(where))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(where), *filter(None, [os.environ.get("PYTHONPATH")])])
        print(f"[launch] the task {resumed.task} is searched in {where} too, where the job was launched", flush=True)
    print(f"[launch] resuming the job in {directory}: psgrad launch {' '.join(argv)}", flush=True)
    return resumed


def entry() -> None:
    """The `psgrad` program (its console script, and `python -m psgrad`): main(), then exit.

    Before the interpreter exits, every object alive is moved out of the garbage collector's sight
    (gc.freeze): its finalization would otherwise run full collections over every object torch and
    the rest imported (~170,000), about a second of CPU per process (0.8-0.9 s of a server's exit
    on a 2-core VM: a server took 1.6 s from SIGTERM to its exit, 0.75 s frozen). Nothing of
    psgrad's waits for those collections: its files, checkpoints, shared-memory segments and
    threads are closed by the command itself, and the compiled kernels are collected at exit on
    their own (core/compiled.py). Only the program does this: main() called in a process of the
    caller's (a test, a notebook) leaves its collector alone."""
    code = main()
    gc.freeze()
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:  # (the output went to `head` or the like, which has read its fill: not an error)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nothing more to flush at exit)
        return 0


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.raw_argv = list(argv) if argv is not None else sys.argv[1:]
    func: Callable[[argparse.Namespace], int] = ns.func
    # A server's lines carry their time and level (`psgrad run` may be one); a worker's and the
    # launcher's console stay as they read.
    logs.configure(ns.log_level, ns.log_format, stamped=ns.command in ("server", "run"))
    logs.quiet_grpc(ns.log_level, ns.command)  # (before any command imports grpc)
    logs.one_line_warnings(ns.command)
    try:
        if ns.command == "launch" and ns.resume is not None:
            ns = resumed_launch(parser, ns)
        apply_drift(ns)
        return func(ns)
    except (ConfigError, TaskError) as exc:  # (the command's usage in one line: its full one runs to dozens)
        print(one_line_usage(ns.command), file=sys.stderr)
        print(f"psgrad {ns.command}: error: {flags_named(str(exc), parser, ns.command)}", file=sys.stderr)
        return EXIT_USAGE
    except PsgradError as exc:  # (a server's refusal names the job's fields too: JobMismatchError)
        print(f"psgrad {ns.command}: error: {flags_named(str(exc), parser, ns.command)}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"psgrad {ns.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"psgrad {ns.command}: interrupted", file=sys.stderr)
        return 130
