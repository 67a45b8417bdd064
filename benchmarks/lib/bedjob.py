"""One training job on the test bed (lib/netbed.py): psgrad shard servers on hosts 0 and 1 and
workers on hosts 2 and 3, or all-reduce ranks (gloo) on hosts 2 and 3; the workers' metrics go into
a run directory, which psgrad.experiments.analysis reads like a `psgrad compare` run's."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lib.netbed import NetBed

from psgrad.launch.supervisor import SupervisedProcess

PSGRAD = [sys.executable, "-m", "psgrad"]
SERVER_HOSTS = (0, 1)
WORKER_HOSTS = (2, 3)


def train_on_bed(
    bed: NetBed, run_dir: Path, name: str, common: Sequence[str], env: Mapping[str, str] | None = None,
    allreduce: bool = False, worker_argv: Sequence[str] = (), server_argv: Sequence[str] = (),
    timeout_s: float = 3600.0, rank_argv: Mapping[int, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Train one job: `psgrad worker COMMON WORKER_ARGV --servers ...` (or `psgrad allreduce COMMON
    --store ...`) as ranks 0 and 1 (rank r with rank_argv[r] added: a straggler's --slowdown), each
    writing run_dir/workerRANK.jsonl. Returns the servers' `psgrad status --json` read after the
    workers finished (empty for all-reduce). Servers and workers are forks of the hosts' templates
    (bed.templates: started by the first job on a bed, kept for the next), started together.

    Raises:
        SystemExit: a worker failed (its output's tail in the message).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
    run_dir.mkdir(parents=True)
    procs: list[SupervisedProcess] = []
    status: dict[str, Any] = {}
    try:
        servers = []
        templates = dict(zip(WORKER_HOSTS if allreduce else SERVER_HOSTS + WORKER_HOSTS,
                             bed.templates(WORKER_HOSTS if allreduce else SERVER_HOSTS + WORKER_HOSTS)))
        if allreduce:
            argv = [*PSGRAD, "allreduce", *common, "--store", str(run_dir / "allreduce.store")]
        else:
            for host in SERVER_HOSTS:
                addr = bed.hosts[host].addr
                procs.append(SupervisedProcess([*PSGRAD, "server", "--host", addr, "--port", "0", "--insecure",
                                                "--lease-s", "60", *server_argv],
                                               name=f"server{host}", env=env, new_session=False, template=templates[host]))
            servers = [p.wait_for_line("listening on", timeout_s=120).rsplit(" ", 1)[1] for p in procs]
            argv = [*PSGRAD, "worker", *common, *worker_argv, "--servers", ",".join(servers)]
        workers = []
        for rank, host in enumerate(WORKER_HOSTS):
            w = SupervisedProcess([*argv, *(rank_argv or {}).get(rank, ()), "--num-workers", str(len(WORKER_HOSTS)),
                                   "--rank", str(rank), "--metrics-out", str(run_dir / f"worker{rank}.jsonl")],
                                  name=f"{name}-worker{rank}", env=env, new_session=False, template=templates[host])
            procs.append(w)
            workers.append(w)
        for w in workers:
            if w.wait(timeout_s) != 0:
                raise SystemExit(f"{name}: {w.name} failed: {w.output[-3000:]}")
        if servers:
            done = bed.run(WORKER_HOSTS[0], [*PSGRAD, "status", "--servers", ",".join(servers), "--json"])
            if done.returncode == 0:
                status = json.loads(done.stdout)
                (run_dir / "status.json").write_text(done.stdout)
    finally:
        for p in reversed(procs):
            p.stop(10)
    return status
