"""Where a worker's metrics records go besides JSONL: Prometheus (/metrics), TensorBoard, a terminal progress bar."""
from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from psgrad.core.build import build_labels

# Per-step timings: from sub-millisecond exchanges to multi-second steps of a big model.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TIMINGS = {"step_s": "step", "compute_s": "compute", "exchange_s": "exchange", "wait_s": "wait"}


def evaluation(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's evaluation results (test_*/val_* numbers), by name."""
    for key, value in record.items():
        if key.startswith(("test_", "val_")) and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)


class _Histogram:
    """Counts per bucket and a sum, updated without a lock (the training thread is the only writer;
    a scrape copies the counts in one step)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket with value <= bound
        self.total += value

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        counts, total = list(self.counts), self.total
        cumulative = list(itertools.accumulate(counts))
        return [*((str(b), float(n)) for b, n in zip(self.bounds, cumulative)), ("+Inf", float(cumulative[-1]))], total


class PrometheusExporter:
    """A worker's /metrics: steps, step/compute/exchange/wait time histograms, loss, lr, clock,
    staleness of its pushes and its latest evaluation, labelled with its rank.

    A step's record only updates plain numbers; the metric families are built when Prometheus
    scrapes (prometheus_client's own metrics take a lock per update: several times the cost)."""

    def __init__(self, rank: int, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector
        from prometheus_client.exposition import start_http_server

        self.rank = str(rank)
        self.steps = 0
        self.gauges: dict[str, float] = {}  # loss, lr, clock of the latest step
        self.evaluations: dict[str, float] = {}
        self.phases = {phase: _Histogram(SECONDS_BUCKETS) for phase in _TIMINGS.values()}
        self.staleness = _Histogram(STALENESS_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)  # a collector: collect() below
        # The process's CPU seconds, memory, open and allowed descriptors (process_*, Linux).
        ProcessCollector(registry=self.registry)
        self._build = build_labels()
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self._http.server_address[1]}/metrics"

    def record(self, record: dict[str, Any]) -> None:
        for key, value in evaluation(record):
            self.evaluations[key] = value
        if "loss" not in record:
            return
        self.steps += 1
        self.gauges["loss"] = record["loss"]
        for key, phase in _TIMINGS.items():
            timing = record.get(key)
            if isinstance(timing, (int, float)):
                self.phases[phase].observe(timing)
        for key in ("lr", "clock"):
            if isinstance(record.get(key), (int, float)):
                self.gauges[key] = record[key]
        if isinstance(record.get("staleness"), int):
            self.staleness.observe(record["staleness"])

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        rank = [self.rank]
        info = GaugeMetricFamily("psgrad_build_info", "the psgrad build running (always 1), by version",
                                 labels=list(self._build))
        info.add_metric(list(self._build.values()), 1.0)
        yield info
        steps = CounterMetricFamily("psgrad_worker_steps", "training steps completed", labels=["rank"])
        steps.add_metric(rank, self.steps)
        yield steps
        seconds = HistogramMetricFamily("psgrad_worker_step_phase_seconds", "time per step in each phase: step "
                                        "(all of it), compute, exchange (push + pull), wait (blocked on the "
                                        "exchange)", labels=["rank", "phase"])
        for phase, hist in self.phases.items():
            seconds.add_metric([self.rank, phase], *hist.buckets())
        yield seconds
        gauges = dict(self.gauges)
        for key, name, doc in (("loss", "psgrad_worker_loss", "training loss of the latest step"),
                               ("lr", "psgrad_worker_learning_rate", "learning rate in effect"),
                               ("clock", "psgrad_worker_clock", "the worker's clock (iterations pushed)")):
            gauge = GaugeMetricFamily(name, doc, labels=["rank"])
            if key in gauges:
                gauge.add_metric(rank, gauges[key])
            yield gauge
        staleness = HistogramMetricFamily("psgrad_worker_push_staleness", "largest staleness a shard reported per "
                                          "push", labels=["rank"])
        staleness.add_metric(rank, *self.staleness.buckets())
        yield staleness
        evaluations = GaugeMetricFamily("psgrad_worker_evaluation", "latest evaluation result, by metric",
                                        labels=["rank", "metric"])
        for key, value in dict(self.evaluations).items():
            evaluations.add_metric([self.rank, key], value)
        yield evaluations

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
