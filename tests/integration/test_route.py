"""The gradient's route, module by module: which psgrad modules a pushed gradient passes through, from
PSOptimizer.step() to the update the shard applies, on the gRPC path and on the same-host path, for a
dense gradient and for an embedding table's row gradient. A concept check that the route stays short
(a change that adds hops fails here, naming them), and the figures docs/design/decisions.md ("The
gradient's route") gives.

The route is read off the call stacks, one worker and one shard in this process, in a steady-state
step of async SGD: on the worker, every stack on which the push hands its gradient to the wire
(frames for gRPC, the shared segment for the same host; a row gradient: taken from its module, put
in the push's header); on the server, every stack that reaches the optimizer's update (staged while
the push arrives, or applied once it is whole; a row gradient: through the sparse-table path)."""
from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from psgrad.config import ClientConfig, ServerConfig
from psgrad.server import kernels
from psgrad.server.runtime import start_server

pytestmark = pytest.mark.timeout(120)

# The worker's calls that ship a push (gRPC frames, the combined Step call, a same-host segment).
PUSH_CALLS = {"push", "push_frames", "_gated", "step"}
# Where a worker's stack touches the gradient (gathered into the flat buffer, handed to the wire:
# in frames written to the server's TCP socket, or into the same-host segment), and a server's
# (received into a buffer, staged, applied), on the way of a push. (On one host the Step call over
# the local socket carries no gradient, which lies in the segment: not counted there.)
WORKER_SINKS = ("psgrad.worker.flat", "psgrad.wire.frames", "psgrad.wire.shm", "psgrad.wire.published",
                "psgrad.wire.local_socket")
SOCKET = "psgrad.wire.local_socket"
SERVER_SINKS = ("psgrad.core.optimizers", "psgrad.server.transfers", "psgrad.server.buffers", "psgrad.server.tables")
# A row gradient's (an embedding table's): taken from its module, split over the shards and written
# into the push's header (wire.frames' PushHead, called by the shard client's transport), and sent
# with the Step request over the server's local or TCP socket (wire.local_socket); on the server,
# the stacks through the sparse-table path (checked, rows made, applied).
ROW_WORKER_SINKS = ("psgrad.nn.embedding", "psgrad.core.rows", "psgrad.wire.rows", "psgrad.wire.frames",
                    "psgrad.wire.local_socket")
ROW_SERVER_SINKS = (*SERVER_SINKS, "psgrad.server.rows_path", "psgrad.server.row_index", "psgrad.core.rows")
ROW_PATH = "psgrad.server.rows_path"
# The modules and packages a gradient may cross (gRPC path, same-host path; a dense gradient, a row
# gradient): the route today (docs/design/decisions.md, "The gradient's route"). A server
# takes a Step call in frames over its TCP socket, through the modules of the same-host socket's
# (server.local_calls, wire.local_socket), where gRPC took it to the handler itself.
# The gRPC path's dense route counts the socket its frames are written to (wire.local_socket) since
# 2026-12-03; before, the test left it out, and read 13.
LIMITS = {(False, "dense"): (14, 6), (True, "dense"): (13, 6), (False, "rows"): (17, 6), (True, "rows"): (17, 6)}


def _carries_payload(frame: FrameType) -> bool:
    """Whether a call into wire.frames handles a dense gradient's bytes: its data frames, or a Step
    request carrying it inline (the module also writes a push's header, where row gradients travel)."""
    name = frame.f_code.co_name
    return name == "data_frames" or (name in ("step_request", "step_request_pieces")
                                     and frame.f_locals.get("payload") is not None)


class Route:
    """A profiler recording the psgrad module chains of the stacks that carry a gradient."""

    def __init__(self, rows: bool = False, shared_memory: bool = False) -> None:
        self.worker_sinks = ROW_WORKER_SINKS if rows else tuple(m for m in WORKER_SINKS
                                                                if not (shared_memory and m == SOCKET))
        self.server_sinks = ROW_SERVER_SINKS if rows else SERVER_SINKS
        self.rows = rows
        self.on = False
        self.chains: set[tuple[str, ...]] = set()
        self.main = threading.get_ident()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        worker = threading.get_ident() == self.main
        if not module.startswith(self.worker_sinks if worker else self.server_sinks):
            return
        if worker and not self.rows and module == "psgrad.wire.frames" and not _carries_payload(frame):
            return  # a push's header (PushHead), which a dense gradient does not travel in
        chain, names, f = [], set(), frame  # type: tuple[list[str], set[str], FrameType | None]
        while f is not None:
            m = f.f_globals.get("__name__", "")
            if m.startswith("psgrad.") and not m.startswith("psgrad.proto"):
                names.add(f.f_code.co_qualname)
                if not chain or chain[-1] != m:
                    chain.append(m)
            f = f.f_back
        if worker and any(n.rsplit(".", 1)[-1] in PUSH_CALLS or n.startswith("FlatModel.") for n in names):
            self.chains.add(tuple(reversed(chain)))
        elif not worker and any("push" in n.lower() for n in names) and (not self.rows or ROW_PATH in chain):
            self.chains.add(tuple(reversed(chain)))

    @property
    def modules(self) -> list[str]:
        return sorted({m for chain in self.chains for m in chain})


class _WithTable(nn.Module):
    """A dense head over two embedding tables' pooled rows (of one width: a shard stores them
    together): its push carries row gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = psgrad.EmbeddingBag(1000, 256, mode="sum")
        self.more = psgrad.EmbeddingBag(500, 256, mode="sum")
        self.head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bags(ids) + self.more(ids % 500))


def _route(shared_memory: bool, rows: bool = False) -> Route:
    route = Route(rows, shared_memory)
    threading.setprofile(route)  # (the server's handler threads start after this)
    server = start_server(ServerConfig(port=0, threads=4, lease_s=10.0))
    try:
        torch.manual_seed(0)
        model = _WithTable() if rows else nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        ps = psgrad.connect([server.address], mode="async", client=ClientConfig(shared_memory=shared_memory))
        x = torch.randint(0, 1000, (8, 3)) if rows else torch.randn(8, 256)
        with ps:
            opt = ps.optimizer(model)
            for step in range(4):
                route.on = step == 3  # a steady-state step
                sys.setprofile(route if route.on else None)
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                sys.setprofile(None)
            assert server.shard.wait_until(lambda s: s.pushes_applied >= 4, 30.0)
            route.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        server.stop(0)
    return route


@pytest.mark.parametrize("gradient", ["dense", "rows"])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "same-host"])
def test_the_gradients_route_stays_short(shared_memory: bool, gradient: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if gradient == "rows":
        # The route of a shard whose row kernels are compiled (after its first large push): the
        # same in every process. Until then (and in a process of small calls only) torch's ops
        # apply the row rule, which adds one module, core.optimizers.sgd (the dense rule the row
        # rule applies to its rows); which of the two a test saw depended on whether an earlier
        # test in its process had compiled them.
        monkeypatch.delenv(kernels.ENV, raising=False)
        assert kernels.rows(wait=True) is not None, "the row kernels must compile and agree with torch's ops"
    route = _route(shared_memory, gradient == "rows")
    modules = route.modules
    packages = {m.split(".")[1] for m in modules}
    print(f"\n{len(modules)} modules in {len(packages)} packages:", " ".join(m[len("psgrad."):] for m in modules))
    for chain in sorted(route.chains):
        print("   ", " > ".join(m[len("psgrad."):] for m in chain))
    assert "psgrad.api" in modules and any(m.startswith("psgrad.core.optimizers") for m in modules), route.chains
    assert any(m.startswith("psgrad.server.pushes") for m in modules), route.chains
    if gradient == "rows":
        assert {"psgrad.nn.embedding", "psgrad.server.rows_path", "psgrad.core.optimizers.rows"} <= set(modules), modules
    most, most_packages = LIMITS[shared_memory, gradient]
    assert len(modules) <= most and len(packages) <= most_packages, modules
