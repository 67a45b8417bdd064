"""What the benchmark scripts share: child processes, reports, arguments and the ceilings they are
measured beside. The scripts (`python benchmarks/X.py`) have benchmarks/ on their path and import
it as `lib`:

- lib.children: benchmark children spoken to in JSON (Child, stop_all, paused, run_together; on
  the child's side CommandChild and command_loop), psgrad server and worker processes
  (psgrad_server, psgrad_process, psgrad_launch), and lib_argv, the command line of a child that
  runs a function of lib;
- lib.report: progress on stderr, the JSON document on stdout, machine info and the commit
  measured (code_version), summary statistics, timed pull/push rounds and their aggregate, target
  and figure rows, the alternating order of interleaved repetitions;
- lib.args: the --preset argument, overrides of a preset's values, the stream window argument;
- lib.procfs and lib.window: CPU time and memory from /proc, and a measured window of workers
  started together, with the skeleton of server_bench.py and scaling.py (Fleet: servers and the
  script's own worker processes, set up together and stopped at once; rotated rounds; the
  operations completed inside a window);
- lib.ceilings (loopback TCP, memory copy), lib.raw_grpc (bare gRPC streaming and unary calls, and
  a psgrad server that also serves them): what psgrad is measured against in the same run;
- lib.swarm: worker processes and servers shared by the transport comparisons and ray_ps.py;
- lib.netbed: network namespaces as hosts on one Linux machine;
- lib.dlrm_model and lib.torchrec_worker: dlrm.py's model, batches and training loop (torch and
  numpy only), and its TorchRec worker, which runs from TorchRec's own interpreter.

The first three are re-exported here (they import neither torch nor gRPC).
"""
from __future__ import annotations

from lib.args import add_preset, overrides, window_argv, window_bytes_arg
from lib.children import (
    BENCH,
    ONE_THREAD_ENV,
    PSGRAD_SERVER,
    RAW_SERVER,
    REPO,
    SETUP_TIMEOUT_S,
    BenchError,
    Child,
    CommandChild,
    command_loop,
    exit_now,
    lib_argv,
    paused,
    psgrad_launch,
    psgrad_process,
    psgrad_server,
    read_jsonl,
    run_together,
    start_server,
    stop_all,
)
from lib.report import (
    aggregate,
    code_version,
    figure,
    log,
    machine_info,
    median_gbps,
    percentile,
    pull_push_iterations,
    rep_order,
    run_by_run,
    summarize,
    target,
    write_doc,
    write_json,
)

__all__ = [
    "BENCH", "ONE_THREAD_ENV", "PSGRAD_SERVER", "RAW_SERVER", "REPO", "SETUP_TIMEOUT_S", "BenchError", "Child", "CommandChild", "add_preset", "aggregate", "code_version",
    "command_loop", "exit_now", "figure", "lib_argv", "log", "machine_info", "median_gbps", "overrides", "paused",
    "percentile", "psgrad_launch", "pull_push_iterations", "psgrad_process", "psgrad_server", "read_jsonl", "rep_order", "run_by_run", "run_together",
    "start_server", "stop_all", "summarize", "target", "window_argv", "window_bytes_arg", "write_doc", "write_json",
]
