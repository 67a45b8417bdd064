"""A shard server's outside view: Prometheus metrics, the gRPC health service and reflection.

Counters and gauges are read from the shard's status when Prometheus scrapes (`ShardCollector`),
so they cost the request path nothing and always equal what `psgrad status` reports. What the
status cannot say (how long each RPC took, why calls were refused, how long pulls waited at the
gate) is recorded as it happens, by a server interceptor and the shard's gate hook.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import start_http_server

from psgrad.core.build import build_labels
from psgrad.core.status import LIVE, ShardStatus
from psgrad.wire.protocol import ERROR_METADATA_KEY, SERVICE_NAME

# RPC latency: from sub-millisecond unary calls to multi-second 100 MB streams and waits at the gate.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def staleness_buckets(hist: dict[int, int]) -> tuple[list[tuple[str, float]], int, int]:
    """Prometheus cumulative buckets, sum and count of a staleness -> updates histogram."""
    total = sum(hist.values())
    buckets = [(str(b), float(sum(n for s, n in hist.items() if s <= b))) for b in STALENESS_BUCKETS]
    buckets.append(("+Inf", float(total)))
    return buckets, sum(s * n for s, n in hist.items()), total


class ShardCollector:
    """The shard's counters and gauges, read from one status snapshot per scrape."""

    def __init__(self, status: Callable[[], ShardStatus]) -> None:
        self._status = status

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only (the shard's index is known once initialized)

    def collect(self) -> Iterator[Any]:
        s = self._status()
        labels = ["shard"]
        shard = [str(s.index) if s.initialized else ""]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(shard, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(shard, value)
            return g

        yield gauge("psgrad_shard_initialized", "1 once the shard serves a job (initialized or restored)", float(s.initialized))
        yield gauge("psgrad_shard_version", "updates applied to the shard's weights", s.version)
        yield gauge("psgrad_shard_parameters", "parameters the shard holds", s.numel)
        yield counter("psgrad_pushes_applied", "gradients applied (or buffered, in sync mode)", s.pushes_applied)
        yield counter("psgrad_pushes_duplicate", "retried pushes recognised and not applied twice", s.pushes_duplicate)
        yield counter("psgrad_pushes_rejected", "pushes not applied: refused (psgrad_rpc_refused_total says why) or, "
                      "under --nonfinite skip, acknowledged unapplied", s.pushes_rejected)
        yield counter("psgrad_pulls", "weight pulls served", s.pulls)
        yield counter("psgrad_push_bytes", "payload bytes of pushes received: gradients as they travel (compressed "
                      "with --compress) and row gradients", s.bytes_in)
        yield counter("psgrad_pull_bytes", "payload bytes of pulls served: weights and rows", s.bytes_out)
        yield counter("psgrad_received_bytes", "psgrad_push_bytes_total's former name", s.bytes_in)
        yield counter("psgrad_sent_bytes", "psgrad_pull_bytes_total's former name", s.bytes_out)
        yield counter("psgrad_evictions", "workers evicted after their lease expired", s.evictions)
        yield counter("psgrad_updates_lost", "updates lost to a restart from a checkpoint", s.updates_lost)
        yield counter("psgrad_rolled_back_iterations", "sync iterations undone by roll-backs", s.rolled_back)
        yield gauge("psgrad_job_lr", "the job's learning rate: the chief's latest (async/ssp followers use it)", s.job_lr)
        yield gauge("psgrad_dc_asgd_copy_bytes", "DC-ASGD (--dc-asgd; else 0): memory of the copies of the weights "
                    "each worker pulled (and the compensation's scratch)", s.delay.nbytes)
        yield counter("psgrad_dc_asgd_compensated", "DC-ASGD: pushes compensated against their worker's copy",
                      s.delay.compensated)
        yield counter("psgrad_dc_asgd_uncompensated", "DC-ASGD: pushes applied as they came (no copy of the "
                      "weights they were computed on)", s.delay.uncompensated)
        yield counter("psgrad_pulls_compressed", "compressed pulls (--compress-pull): pulls sent as the compressed "
                      "change since the worker's copy", s.delta.compressed)
        yield counter("psgrad_pulls_exact_resync", "compressed pulls (--compress-pull): pulls sent exact instead "
                      "(first pulls, copies not held here, periodic or error resyncs)", s.delta.exact)
        yield gauge("psgrad_pull_copy_bytes", "compressed pulls (--compress-pull): memory of the copies of what "
                    "each such worker holds", s.delta.nbytes)
        yield gauge("psgrad_pull_drift", "compressed pulls (--compress-pull): the latest pull's distance of the "
                    "worker's copy from the weights, ||w - copy|| / ||w||", s.delta.drift)
        yield gauge("psgrad_published_ring_bytes", "same-host published versions: shared memory the ring of "
                    "slots holds in /dev/shm (0 until a worker asks for one)", s.published.nbytes)
        yield counter("psgrad_published_pulls", "same-host pulls served from a published version (zero-copy)",
                      s.published.leases)
        yield counter("psgrad_pushes_plain", "with --compress: pushes that came uncompressed (from workers on the "
                      "server's host, without --compress-same-host)", s.pushes_plain)
        yield counter("psgrad_late_dropped", "sync with backup workers: gradients dropped as late", s.late_dropped)
        yield counter("psgrad_pushes_skipped", "steps other shards applied that their workers dropped (zero_grad after "
                      "the step raised): acknowledged here, never applied", s.pushes_skipped)
        yield gauge("psgrad_staleness_bound", "ssp with --staleness auto: the bound in effect (0: a fixed bound)",
                    s.staleness_bound)
        live = sum(1 for w in s.workers if w.state == LIVE)
        yield gauge("psgrad_live_workers", "workers holding a lease", live)
        yield gauge("psgrad_sync_pending_gradients", "sync: gradients buffered for the current iteration", s.pending)
        yield gauge("psgrad_pulls_waiting", "pulls parked at the mode's gate right now", s.waiting)
        streams = s.transfers
        yield gauge("psgrad_client_streams_open", "client streams (pushes, init, replica records) open now",
                    streams.streams_open)
        yield counter("psgrad_client_streams_cancelled", "client streams and pulls cancelled: a frame late for "
                      "--stream-read-timeout-s, or a whole push or pull past its deadline (--transfer-allowance-s, "
                      "--min-transfer-rate-mb-s)", streams.streams_cancelled)
        yield counter("psgrad_client_streams_refused", "client streams refused for now (ServerBusyError): over "
                      "--max-streams-per-peer, or 3/4 of --threads open", streams.streams_refused)
        yield gauge("psgrad_read_bytes", "bytes the replies to reads of rows hold now (built, or being sent): what "
                    "--max-read-mb bounds", streams.read_bytes)
        yield gauge("psgrad_read_bytes_peak", "the most bytes the replies to reads of rows held at once since the "
                    "server started", streams.read_bytes_peak)
        yield gauge("psgrad_reads_waiting", "reads of rows waiting for their turn under --max-read-mb now",
                    streams.reads_waiting)
        yield counter("psgrad_reads_queued", "reads of rows that waited for their turn under --max-read-mb",
                      streams.reads_queued)
        yield counter("psgrad_reads_expired", "reads of rows that waited for their turn until their deadline "
                      "(ServerBusyError, which workers retry)", streams.reads_expired)
        yield counter("psgrad_reads_refused", "reads of rows refused as larger than all of --max-read-mb",
                      streams.reads_refused)
        if s.workers:
            lag = GaugeMetricFamily("psgrad_shard_worker_clock", "each worker's clock as the shard sees it",
                                    labels=["shard", "rank", "state"])
            for w in s.workers:
                lag.add_metric([*shard, str(w.rank), w.state], w.clock)
            yield lag
        if s.tables:
            families = [GaugeMetricFamily(name, doc, labels=["shard", "table", "kind"]) for name, doc in (
                ("psgrad_table_parameters", "parameters each table of the shard holds"),
                ("psgrad_table_bytes", "bytes of each table's fp32 master weights"),
                ("psgrad_table_optimizer_state_bytes", "bytes of each table's optimizer state"),
            )]
            for t in s.tables:
                for family, value in zip(families, (t.numel, t.nbytes, t.state_bytes)):
                    family.add_metric([*shard, t.name, t.kind], value)
            yield from families
        sparse = [t for t in s.tables if t.kind == "sparse"]
        if sparse:
            families = [GaugeMetricFamily(name, doc, labels=["shard", "table"]) for name, doc in (
                ("psgrad_table_rows", "rows of each sparse table placed on the shard (0: a dynamic table)"),
                ("psgrad_table_rows_touched", "rows of each sparse table stored now (stored at their first update)"),
                ("psgrad_table_updates", "updates applied to each sparse table (its version)"),
                ("psgrad_table_staleness_max", "the most table updates between a pull of rows and their push"),
                ("psgrad_table_staleness_mean", "the mean table updates between a pull of rows and their push"),
            )]
            for t in sparse:
                values: tuple[float, ...] = (t.rows, t.rows_touched, t.updates, t.staleness_max, t.staleness_mean)
                for family, figure in zip(families, values):
                    family.add_metric([*shard, t.name], figure)
            yield from families
            lifetime = [CounterMetricFamily(name, doc, labels=["shard", "table"]) for name, doc in (
                ("psgrad_table_rows_admitted", "rows of each sparse table stored by an update"),
                ("psgrad_table_rows_expired", "rows dropped by their table's ttl (untouched that many updates)"),
                ("psgrad_table_rows_evicted", "rows dropped at the memory budget (least recently updated first)"),
                ("psgrad_table_updates_dropped", "row updates not applied: their ids not seen in min_count updates yet"),
            )]
            for t in sparse:
                for counts, n in zip(lifetime, (t.admitted, t.expired, t.evicted, t.dropped)):
                    counts.add_metric([*shard, t.name], n)
            yield from lifetime
        buckets, total, count = staleness_buckets(s.staleness)
        h = HistogramMetricFamily("psgrad_staleness", "staleness of applied gradients (versions behind)", labels=labels)
        h.add_metric(shard, buckets, total)
        yield h
        ckpt = s.checkpoint
        if ckpt.age_s >= 0:
            yield gauge("psgrad_checkpoint_age_seconds", "seconds since the newest checkpoint was written", ckpt.age_s)
        if ckpt.enabled:
            yield counter("psgrad_checkpoint_failures", "checkpoint writes that failed (a full disk, ...; each "
                          "retried at the next interval)", ckpt.failures)
            yield gauge("psgrad_checkpoint_failing", "1 while the latest checkpoint write failed (psgrad status shows "
                        "why)", float(ckpt.failing))


class BuildInfo:
    """`psgrad_build_info{version,python,grpcio,torch} 1`: which build a server runs."""

    def __init__(self) -> None:
        self._labels = build_labels()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily("psgrad_build_info", "the psgrad build serving (always 1), by version",
                                 labels=list(self._labels))
        info.add_metric(list(self._labels.values()), 1.0)
        yield info


class RpcMetrics(grpc.ServerInterceptor):
    """Times every call of the parameter service and counts refusals by method and reason, labelled
    with the shard's index (`shard`: "" until the server holds a shard)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram("psgrad_rpc_duration_seconds", "time a server spent in each call, by method",
                                 ["shard", "method"], registry=registry, buckets=LATENCY_BUCKETS)
        self.refused = Counter("psgrad_rpc_refused", "calls that ended with an error status, by method and reason "
                               "(the psgrad error class, or the gRPC status code)", ["shard", "method", "reason"],
                               registry=registry)
        self.shard: Callable[[], str] = lambda: ""  # the shard's index, as a label (Observability.watch sets it)
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, that handler timed)
        self._latency: dict[tuple[str, str], Any] = {}  # (shard, method) -> its histogram

    def _done(self, method: str, start: float, context: grpc.ServicerContext) -> None:
        took = time.perf_counter() - start
        shard = self.shard()
        latency = self._latency.get((shard, method))
        if latency is None:
            latency = self._latency[(shard, method)] = self.latency.labels(shard, method)
        latency.observe(took)
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            reason = next((str(v) for k, v in (context.trailing_metadata() or ())
                           if k == ERROR_METADATA_KEY), code.name)
            self.refused.labels(shard, method, reason).inc()

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        prefix = f"/{SERVICE_NAME}/"
        if handler is None or not details.method.startswith(prefix):
            return handler
        known = self._wrapped.get(details.method)
        if known is not None and known[0] is handler:  # called for every call: wrap each method once
            return known[1]
        timed = self._timed(details.method[len(prefix):], handler)
        self._wrapped[details.method] = (handler, timed)
        return timed

    def _timed(self, method: str, handler: Any) -> Any:
        done = self._done
        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream

            def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                try:
                    yield from behavior(request, context)
                finally:
                    done(method, start, context)

            wrapped, kind = streaming, ("unary_stream" if handler.unary_stream else "stream_stream")
        else:
            behavior = handler.unary_unary or handler.stream_unary

            def single(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    return behavior(request, context)
                finally:
                    done(method, start, context)

            wrapped, kind = single, ("unary_unary" if handler.unary_unary else "stream_unary")
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            wrapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class Observability:
    """One server's metrics registry, HTTP endpoint and health service."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry)
        self.gate_wait = Histogram("psgrad_gate_wait_seconds", "time pulls waited at the mode's gate for other "
                                   "workers", ["shard"], registry=self.registry, buckets=LATENCY_BUCKETS)
        # The process's CPU seconds, memory, open and allowed descriptors (process_*, Linux), and the build.
        ProcessCollector(registry=self.registry)
        self.registry.register(BuildInfo())
        self.health = health.HealthServicer()
        self._http: Any = None
        self.metrics_address = ""

    def watch(self, status: Callable[[], ShardStatus], shard: Callable[[], str] = lambda: "") -> None:
        """Read the shard's counters from `status` at each scrape; `shard`: its index as a label
        ("" until it holds one), for the metrics recorded as calls happen."""
        self.registry.register(ShardCollector(status))
        self.rpc.shard = shard

    def observe_gate_wait(self, seconds: float) -> None:
        """A pull parked at the gate went on after `seconds`."""
        self.gate_wait.labels(self.rpc.shard()).observe(seconds)

    def add_services(self, server: grpc.Server) -> None:
        """The standard health service (NOT_SERVING until the shard serves a job) and reflection."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.set_serving(False)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)  # ps.proto is in the default descriptor pool

    def set_serving(self, serving: bool) -> None:
        value = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, value)

    def serve_http(self, host: str, port: int) -> str:
        """Serve /metrics on host:port (0: a free port); returns the URL."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http.server_address[1]
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.metrics_address = f"http://{shown}:{bound}/metrics"
        return self.metrics_address

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
