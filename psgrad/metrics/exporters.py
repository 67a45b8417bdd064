"""Where a worker's metrics records go besides JSONL: Prometheus (/metrics), TensorBoard, a terminal progress bar."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

# Per-step timings: from sub-millisecond exchanges to multi-second steps of a big model.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TIMINGS = {"step_s": "step", "compute_s": "compute", "exchange_s": "exchange", "wait_s": "wait"}


def evaluation(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's evaluation results (test_*/val_* numbers), by name."""
    for key, value in record.items():
        if key.startswith(("test_", "val_")) and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)


class PrometheusExporter:
    """A worker's /metrics: steps, step/compute/exchange/wait time histograms, loss, lr, clock,
    staleness of its pushes and its latest evaluation, labelled with its rank."""

    def __init__(self, rank: int, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import start_http_server

        r = self.registry = CollectorRegistry()
        labels = ["rank"]
        self._rank = str(rank)
        self.steps = Counter("psgrad_worker_steps", "training steps completed", labels, registry=r)
        self.seconds = Histogram("psgrad_worker_step_phase_seconds", "time per step in each phase: step (all of "
                                 "it), compute, exchange (push + pull), wait (blocked on the exchange)",
                                 ["rank", "phase"], registry=r, buckets=SECONDS_BUCKETS)
        self.loss = Gauge("psgrad_worker_loss", "training loss of the latest step", labels, registry=r)
        self.lr = Gauge("psgrad_worker_learning_rate", "learning rate in effect", labels, registry=r)
        self.clock = Gauge("psgrad_worker_clock", "the worker's clock (iterations pushed)", labels, registry=r)
        self.staleness = Histogram("psgrad_worker_push_staleness", "largest staleness a shard reported per push",
                                   labels, registry=r, buckets=STALENESS_BUCKETS)
        self.metric = Gauge("psgrad_worker_evaluation", "latest evaluation result, by metric", ["rank", "metric"],
                            registry=r)
        # This worker's series, looked up once (a labels() call per step costs more than the update).
        self._steps, self._loss = self.steps.labels(self._rank), self.loss.labels(self._rank)
        self._lr, self._clock = self.lr.labels(self._rank), self.clock.labels(self._rank)
        self._staleness = self.staleness.labels(self._rank)
        self._phases = [(key, self.seconds.labels(self._rank, phase)) for key, phase in _TIMINGS.items()]
        self._http, _ = start_http_server(port, addr=host, registry=r)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self._http.server_address[1]}/metrics"

    def record(self, record: dict[str, Any]) -> None:
        for key, value in evaluation(record):
            self.metric.labels(self._rank, key).set(value)
        if "loss" not in record:
            return
        self._steps.inc()
        self._loss.set(record["loss"])
        for key, series in self._phases:
            timing = record.get(key)
            if isinstance(timing, (int, float)):
                series.observe(timing)
        if isinstance(record.get("staleness"), int):
            self._staleness.observe(record["staleness"])
        if isinstance(record.get("lr"), (int, float)):
            self._lr.set(record["lr"])
        if isinstance(record.get("clock"), int):
            self._clock.set(record["clock"])

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class TensorBoardExporter:
    """Scalars for TensorBoard under DIR/workerR: loss, lr, staleness, step time and evaluations
    (eval/..., and the final evaluation as final/...), by step (needs the `tensorboard` package: pip install psgrad[tensorboard])."""

    def __init__(self, directory: str, rank: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"--tensorboard needs the tensorboard package ({exc}): pip install "
                              "'psgrad[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=f"{directory}/worker{rank}")

    def record(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        group = "final" if record.get("event") == "final" else "eval"  # the final model's, after the last step
        for key, value in evaluation(record):
            self.writer.add_scalar(f"{group}/{key}", value, step)
        for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("staleness", "train/staleness"),
                         ("step_s", "time/step_s"), ("compute_s", "time/compute_s"), ("wait_s", "time/wait_s")):
            scalar = record.get(key)
            if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
                self.writer.add_scalar(tag, scalar, step)

    def close(self) -> None:
        self.writer.close()


class ProgressExporter:
    """A progress bar (steps, steps/s, loss, the latest evaluation) on a terminal."""

    def __init__(self, total: int, who: str, stream: TextIO | None = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=who, unit="step", file=stream or sys.stderr, dynamic_ncols=True,
                        leave=True, mininterval=0.25)
        self._latest: dict[str, float] = {}

    def record(self, record: dict[str, Any]) -> None:
        self._latest.update(evaluation(record))
        if "loss" not in record:
            return
        shown = {"loss": f"{record['loss']:.4f}", **{k: f"{v:.4f}" for k, v in self._latest.items() if k != "test_loss"}}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
