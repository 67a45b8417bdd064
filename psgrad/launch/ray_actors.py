"""What `psgrad launch --backend ray` runs inside Ray actors: a shard server in the actor's own process,
a worker as a `psgrad worker` child of its actor; each keeps its output lines for the driver to collect."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from psgrad.config import ServerConfig
from psgrad.launch.supervisor import SupervisedProcess

# In a shard's checkpoint directory: the job and the port its server bound, so that a server actor
# Ray restarts binds the same port again (the workers' --servers still name it).
PORT_FILE = "ray-port.json"


def bind_host(node_ip: str, local_only: bool) -> str:
    """Where a server actor listens, which is also the address it advertises to the workers: the
    loopback address when the whole job runs on this machine (the driver started Ray itself), else
    the node's IP as Ray reports it, which the other nodes route to. This is the one place that
    decides; a server bound to a non-loopback address serves whoever can reach that port."""
    return "127.0.0.1" if local_only else node_ip


def where() -> dict[str, Any]:
    """This actor's node (Ray's id and IP) and process id."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


class Output:
    """Lines printed in an actor, for the driver to read from an index on. A restarted actor is a
    new process with new lines: a reader who names the process it read before starts again at 0."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def since(self, pid: int | None, index: int) -> tuple[int, int, list[str]]:
        """(this process's id, the index to read from next, the lines from `index` on)."""
        with self._lock:
            start = index if pid == os.getpid() else 0
            return os.getpid(), len(self._lines), self._lines[start:]


class _ToOutput(logging.Handler):
    def __init__(self, output: Output, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self._output = output
        if formatter is not None:
            self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._output.add(self.format(record))
        except Exception:  # a logging handler must not raise into the server
            self.handleError(record)


def _previous_port(directory: Path, job: str) -> int:
    """The port this job's server of the shard bound before it was restarted (0: this is its first start)."""
    try:
        record = json.loads((directory / PORT_FILE).read_text(encoding="utf-8"))
        return int(record["port"]) if record.get("job") == job else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _record_port(directory: Path, job: str, port: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{PORT_FILE}.tmp"
    tmp.write_text(json.dumps({"job": job, "port": port}) + "\n", encoding="utf-8")
    os.replace(tmp, directory / PORT_FILE)


class ServerActor:
    """One shard's server (what `psgrad server` runs: psgrad.server.runtime), serving from the actor's
    process until stop(). With a checkpoint directory, a server Ray restarts after a crash binds the
    port it had before and restores the shard's newest checkpoint, so the workers find it again."""

    def __init__(
        self, config: ServerConfig, job: str, local_only: bool, formatter: logging.Formatter | None = None,
        log_level: str = "info",
    ) -> None:
        from psgrad.server.runtime import start_server

        self.output = Output()
        log = logging.getLogger("psgrad")
        log.addHandler(_ToOutput(self.output, formatter))
        log.setLevel(log_level.upper())
        log.propagate = False
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (1 for none), as `psgrad server`'s --torch-threads 1.
        host = bind_host(str(where()["ip"]), local_only)
        directory = None if config.checkpoint_dir is None else Path(config.checkpoint_dir)
        port = config.port if directory is None else _previous_port(directory, job) or config.port
        self._server = start_server(dataclasses.replace(config, host=host, port=port, advertise_host=host))
        self.address = self._server.address
        if directory is not None:
            _record_port(directory, job, int(self.address.rpartition(":")[2]))
        self.output.add(f"psgrad server listening on {self.address}")
        self.metrics = self._server.metrics_url  # "" without a metrics port (its server logs it, too)

    def ready(self) -> dict[str, Any]:
        """Where it serves: address, metrics (its Prometheus endpoint, or ""), node, ip, pid."""
        return {"address": self.address, "metrics": self.metrics, **where()}

    def lines(self, pid: int | None, index: int) -> tuple[int, int, list[str]]:
        return self.output.since(pid, index)

    def stop(self) -> None:
        """Stop gracefully (a last checkpoint when the shard changed since the previous one)."""
        self._server.stop()


class WorkerActor:
    """One worker: `psgrad worker ARGV` as a child of the actor (so it sees the GPU Ray gave the actor,
    through CUDA_VISIBLE_DEVICES), its output kept for the driver; the child dies with the actor."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None) -> None:
        self.output = Output()
        self._argv, self._env = argv, env
        self._cwd = cwd if cwd is not None and os.path.isdir(cwd) else None  # the driver's, where it exists here
        self._proc: SupervisedProcess | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def ready(self) -> dict[str, Any]:
        return where()

    def run(self) -> int:
        """Train until the worker exits; returns its exit code."""
        with self._lock:
            if self._stopped:
                return 143
            self._proc = SupervisedProcess(
                [sys.executable, "-m", "psgrad", "worker", *self._argv], name="worker", env={**os.environ, **self._env},
                cwd=self._cwd, collect=False, on_line=self.output.add,
            )
        return self._proc.wait()

    def lines(self, pid: int | None, index: int) -> tuple[int, int, list[str]]:
        return self.output.since(pid, index)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the worker, SIGKILL after grace_s; reaped either way."""
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None:
            proc.stop(grace_s)
