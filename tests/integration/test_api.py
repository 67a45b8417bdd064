"""The Python API (psgrad.connect / Session.optimizer / PSOptimizer.step) against real gRPC servers:
sync equals single-process training, overlap's one-step delay is exact, mixed precision keeps
float32 masters, and misuse fails with a message that names the problem."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.config import ClientConfig, ServerConfig
from psgrad.errors import ConfigError, ServerUnavailableError, WorkerStateError
from psgrad.server.runtime import RunningServer, start_server
from psgrad.tasks import get_task

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _addresses(running: list[RunningServer]) -> list[str]:
    return [s.address for s in running]


def _masters(running: list[RunningServer]) -> torch.Tensor:
    weights = [s.shard.weights_copy() for s in running]
    assert all(w is not None for w in weights)
    return torch.cat(weights)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "optimizer, reference",
    [
        (psgrad.SGD(lr=0.2, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)),
        (psgrad.Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
        (psgrad.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
        (psgrad.Adagrad(lr=0.05, lr_decay=0.01), lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01)),
        (psgrad.RMSprop(lr=0.003, momentum=0.5, centered=True),
         lambda ps: torch.optim.RMSprop(ps, lr=0.003, momentum=0.5, centered=True)),
        (psgrad.Adadelta(), lambda ps: torch.optim.Adadelta(ps)),
    ],
    ids=["sgd-momentum", "adam", "sgd-nesterov", "adagrad", "rmsprop", "adadelta"],
)
def test_the_users_loop_in_sync_mode_equals_single_process_training(make_servers, optimizer, reference) -> None:  # type: ignore[no-untyped-def]
    """Two workers, each its own half of every batch, train exactly like one process on the whole batch."""
    task = get_task("digits")
    workers, steps, batch = 2, 5, 16
    running = make_servers(2)
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, len(task.train_x), (batch,), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = _model()
    finals: dict[int, torch.Tensor] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect(_addresses(running), rank=rank, num_workers=workers, mode="sync",
                            optimizer=optimizer, client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for k in range(steps):
                idx = batches[rank][k]
                opt.zero_grad()
                nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
                stats = opt.step()
                assert stats.staleness == 0 and stats.accepted and stats.clock == k
        finals[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    run_in_threads(workers, worker)
    ref = _model()
    opt = reference(ref.parameters())
    for k in range(steps):
        idx = torch.cat([batches[r][k] for r in range(workers)])
        opt.zero_grad()
        nn.functional.cross_entropy(ref(task.train_x[idx]), task.train_y[idx]).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(_masters(running), expected, rtol=1e-5, atol=1e-6)
    for rank in range(workers):  # the last step's pull brought the final weights into each model
        torch.testing.assert_close(finals[rank], expected, rtol=1e-5, atol=1e-6)
    for s in running:
        assert [(r, state) for r, _, state, *_ in s.shard.status().workers] == [(0, "left"), (1, "left")]


def _delayed_sgd(model: nn.Module, steps: int, lr: float, x: torch.Tensor, y: torch.Tensor, delay: int) -> torch.Tensor:
    """Single-process SGD where step k's gradient is computed on the weights of step k - delay."""
    params = list(model.parameters())
    history = [torch.cat([p.detach().reshape(-1) for p in params])]
    for k in range(steps):
        old = history[max(0, k - delay)]
        probe = copy.deepcopy(model)
        torch.nn.utils.vector_to_parameters(old, probe.parameters())
        probe.zero_grad()
        nn.functional.cross_entropy(probe(x[k]), y[k]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in probe.parameters()])
        history.append(history[-1] - lr * g)
    return history[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_one_async_worker_overlap_computes_on_weights_one_step_old(make_servers, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    task = get_task("digits")
    steps, lr = 8, 0.3
    gen = torch.Generator().manual_seed(2)
    idx = [torch.randint(0, len(task.train_x), (16,), generator=gen) for _ in range(steps)]
    xs, ys = [task.train_x[i] for i in idx], [task.train_y[i] for i in idx]
    running = make_servers(2)
    model = _model()
    staleness = []
    with psgrad.connect(_addresses(running), optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
        opt = ps.optimizer(model, overlap=overlap)
        for k in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[k]), ys[k]).backward()
            stats = opt.step()
            if stats.staleness is not None:
                staleness.append(stats.staleness)
        last = opt.synchronize()
        if last is not None:
            staleness.append(last.staleness)
    expected = _delayed_sgd(_model(), steps, lr, torch.stack(xs), torch.stack(ys), delay=1 if overlap else 0)
    torch.testing.assert_close(_masters(running), expected, rtol=1e-5, atol=1e-6)
    # Server-reported staleness: every push saw only its own previous update in between (overlap)
    assert staleness == ([0] + [1] * (steps - 1) if overlap else [0] * steps)


@pytest.mark.timeout(60)
def test_a_bfloat16_model_trains_against_float32_master_weights(make_servers) -> None:  # type: ignore[no-untyped-def]
    task = get_task("digits")
    running = make_servers(1)
    model = _model().to(torch.bfloat16)
    with psgrad.connect(_addresses(running), optimizer=psgrad.SGD(lr=0.05), wire_dtype="bfloat16", client=CLIENT) as ps:
        opt = ps.optimizer(model)
        first = last = None
        for k in range(30):
            x, y = task.train_x[k * 16 : (k + 1) * 16], task.train_y[k * 16 : (k + 1) * 16]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            opt.step()
            first = loss.item() if first is None else first
            last = loss.item()
        opt.refresh()
    masters = _masters(running)
    assert masters.dtype == torch.float32
    assert not torch.equal(masters, masters.to(torch.bfloat16).float()), "masters should keep float32 precision"
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert got.dtype == torch.bfloat16 and torch.equal(got, masters.to(torch.bfloat16))
    assert last is not None and first is not None and last < first


@pytest.mark.timeout(60)
def test_session_misuse_is_refused_by_name(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1)
    with pytest.raises(ConfigError, match="malformed server address"):
        psgrad.connect(["localhost"])
    with pytest.raises(ConfigError, match="rank"):
        psgrad.connect(_addresses(running), rank=2, num_workers=2)
    with pytest.raises(ConfigError, match="mode"):
        psgrad.connect(_addresses(running), mode="bsp")
    with pytest.raises(ConfigError, match="overlap needs mode async or ssp"):
        psgrad.connect(_addresses(running), mode="sync", client=CLIENT).optimizer(_model(), overlap=True)
    ps = psgrad.connect(_addresses(running), client=CLIENT)
    opt = ps.optimizer(_model())
    with pytest.raises(WorkerStateError, match="one model per job"):
        ps.optimizer(_model())
    ps.close()
    ps.close()  # idempotent
    with pytest.raises(WorkerStateError, match="left the job"):
        opt.step()
    with pytest.raises(WorkerStateError, match="closed"):
        ps.optimizer(_model())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("given, what", [("list", "a list of parameters"), ("generator", "a generator")])
def test_parameters_instead_of_the_model_are_refused_saying_what_to_pass(given: str, what: str) -> None:
    """ps.optimizer([params]) (torch.optim's first argument) raised AttributeError; nothing is sent."""
    model = _model()
    params = list(model.parameters()) if given == "list" else model.parameters()
    ps = psgrad.connect("127.0.0.1:1", client=CLIENT)
    with pytest.raises(TypeError, match=f"^ps.optimizer\\(model\\) takes the model, an nn.Module, got {what}: .* pass the "
                                        "module itself \\(ps.optimizer\\(model\\)\\); per-parameter settings go in "
                                        "param_groups="):
        ps.optimizer(params)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_an_unreachable_server_fails_within_the_connect_timeout() -> None:
    dead = start_server(ServerConfig(port=0))
    address = dead.address
    dead.stop(0)
    fast = ClientConfig(connect_timeout_s=1.0, rpc_timeout_s=2.0, reconnect_timeout_s=0)
    with pytest.raises(ServerUnavailableError, match=address.rsplit(":", 1)[1]):
        psgrad.connect([address], client=fast).optimizer(_model())


@pytest.mark.timeout(60)
def test_an_error_inside_the_with_block_is_not_hidden_and_the_worker_leaves(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1)
    with pytest.raises(RuntimeError, match="user bug"):
        with psgrad.connect(_addresses(running), client=CLIENT) as ps:
            ps.optimizer(_model())
            raise RuntimeError("user bug")
    assert [state for _, _, state, *_ in running[0].shard.status().workers] == ["left"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "device, overlap",
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.cuda),
     pytest.param("cuda", True, marks=pytest.mark.cuda)],
)
def test_the_model_on_each_device_ends_with_the_servers_weights(make_servers, device: str, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    """The CPU run covers the same code path as the CUDA one (which adds pinned staging copies)."""
    task = get_task("digits")
    running = make_servers(2)
    model = _model().to(device)
    with psgrad.connect(_addresses(running), optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model, overlap=overlap)
        for k in range(6):
            x, y = task.train_x[k * 8 : (k + 1) * 8].to(device), task.train_y[k * 8 : (k + 1) * 8].to(device)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            stats = opt.step()
            assert stats.d2h_s >= 0 and stats.h2d_s >= 0
        opt.synchronize()
        got = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        assert torch.equal(got, _masters(running))
        assert all(p.device.type == device for p in model.parameters())


def test_serve_starts_shards_in_this_process_and_refuses_an_unknown_setting() -> None:
    """psgrad.serve(): the Python way to start a job's servers (no second terminal)."""
    with pytest.raises(ConfigError, match="psgrad.serve\\(\\) has no setting lease; valid: .*lease_s"):
        psgrad.serve(lease=3)
    with psgrad.serve(lease_s=5.0) as a, psgrad.serve() as b:
        with psgrad.connect([a.address, b.address], client=CLIENT) as ps:
            model = _model()
            opt = ps.optimizer(model)
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
        assert a.shard.version == b.shard.version == 1 and a.shard.core.config.lease_s == 5.0
    assert a.stopped.is_set() and b.stopped.is_set()


@pytest.mark.parametrize(
    "optimizer, reference",
    [
        (psgrad.SGD(lr=0.2, momentum=0.9, weight_decay=0.05), lambda g: torch.optim.SGD(g, lr=0.2, momentum=0.9, weight_decay=0.05)),
        (psgrad.Adam(lr=0.01, weight_decay=0.1, decoupled=True), lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1)),
    ],
    ids=["sgd", "adamw"],
)
def test_parameter_groups_equal_torchs(make_servers, optimizer, reference) -> None:  # type: ignore[no-untyped-def]
    """No weight decay on biases, half the lr on the first layer: two sync workers on two shards (the
    groups' segments cut across the shard boundary) train exactly like torch's optimizer with the
    same param groups on the whole batch; the groups reach the server, a checkpoint and a restore."""
    task = get_task("digits")
    workers, steps, batch = 2, 4, 16
    running = make_servers(2)
    gen = torch.Generator().manual_seed(2)
    batches = [[torch.randint(0, len(task.train_x), (batch,), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = _model()

    def groups(model: nn.Module, lr: float) -> list[dict[str, object]]:
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        first = [model[0].weight]  # type: ignore[index]
        rest = [p for n, p in model.named_parameters() if not n.endswith("bias") and n != "0.weight"]
        return [{"params": biases, "weight_decay": 0.0}, {"params": first, "lr": lr / 2}, {"params": rest}]

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect(_addresses(running), rank=rank, num_workers=workers, mode="sync",
                            optimizer=optimizer, client=CLIENT) as ps:
            opt = ps.optimizer(model, param_groups=groups(model, optimizer.lr))
            for k in range(steps):
                idx = batches[rank][k]
                opt.zero_grad()
                nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
                opt.step()

    run_in_threads(workers, worker)
    ref = _model()
    opt = reference(groups(ref, optimizer.lr))
    for k in range(steps):
        idx = torch.cat([batches[r][k] for r in range(workers)])
        opt.zero_grad()
        nn.functional.cross_entropy(ref(task.train_x[idx]), task.train_y[idx]).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(_masters(running), expected, rtol=1e-5, atol=1e-6)
    # The settings are the job's: a snapshot keeps them, and a shard restored from it is the same.
    from psgrad.server import checkpoint

    snap = running[0].shard.snapshot()
    back = checkpoint.decode(*checkpoint.encode(snap))
    assert back.layout == snap.layout and {p.lr_scale for p in back.layout.params} == {1.0, 0.5}
    assert {p.weight_decay for p in back.layout.params} == {None, 0.0}


def test_parameter_groups_are_checked_by_name(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1)
    model = _model()
    cases = [
        ([{"params": [model[0].weight], "momentum": 0.9}], "may set only 'lr' and 'weight_decay'"),
        ([{"params": [torch.zeros(3, requires_grad=True)]}], "not a trainable parameter of the model"),
        ([{"params": [model[0].weight]}, {"params": [model[0].weight]}], "parameter '0.weight' is in two of param_groups"),
        ([{"params": [model[0].bias], "lr": -1}], "param_groups\\[0\\]\\['lr'\\] must be a finite number >= 0"),
        ([{"lr": 0.1}], "must be a dict with 'params'"),
    ]
    for groups, message in cases:
        with psgrad.connect(_addresses(running), client=CLIENT) as ps:
            with pytest.raises(ConfigError, match=message):
                ps.optimizer(model, param_groups=groups)


def _sgd_twin_step(twin: nn.Module, grads: list[torch.Tensor], lr: float,
                   only: list[tuple[int, int] | None] | None = None) -> None:
    """One sync iteration of the job's SGD on torch's twin: the mean of the workers' flat gradients
    (`grads`; the flat space is the model's parameters in order, back to back), element by element
    over the workers whose gradient the element's shard applied (`only[r]`: the flat range worker
    r's counts on, None: all of it)."""
    flat = torch.nn.utils.parameters_to_vector(twin.parameters()).detach()
    total, count = torch.zeros_like(flat), torch.zeros_like(flat)
    for r, g in enumerate(grads):
        mask = torch.ones_like(flat)
        if only is not None and only[r] is not None:
            lo, hi = only[r]  # type: ignore[misc]
            mask.zero_()[lo:hi] = 1.0
        total += g * mask
        count += mask
    step = torch.where(count > 0, total / count.clamp(min=1.0), torch.zeros_like(total))
    torch.nn.utils.vector_to_parameters(flat - lr * step, twin.parameters())


def _flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def _skip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped on" in r.getMessage()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_one_shard_refused_and_the_user_dropped_spends_its_clock_and_the_next_batch_counts_everywhere(
        start_servers, caplog, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Two server processes, one worker. Step 2's gradient holds a NaN in shard 0's range only:
    shard 0 refuses it, shard 1 applies it, and step() raises. The user skips the batch the torch
    way (zero_grad(), then the next batch). Step 2's clock is spent: the next step tells shard 0 it
    is skipped (counted there, logged), then pushes clock 3, which both shards apply. The job's
    weights equal torch's twin that applied step 2's gradient on shard 1's range only and every
    other batch in full. Before, the next batch went as clock 2 again: shard 1 acknowledged it as a
    duplicate of step 2 and dropped it, silently."""
    from psgrad.client.status_client import shard_status
    from psgrad.errors import NonFiniteGradientError

    caplog.set_level("WARNING", logger="psgrad")
    addresses = start_servers(2)
    lr, steps, bad = 0.1, 6, 2
    gen = torch.Generator().manual_seed(11)
    data = [(torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(steps)]
    model = _model()
    twin, probe = copy.deepcopy(model), copy.deepcopy(model)
    with psgrad.connect(addresses, mode=mode, optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        (start0, end0), (start1, end1) = opt.plan.ranges
        assert start0 == 0 < end0 == start1 < end1  # model[0].weight[0, 0] is the first element: shard 0's
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            probe.load_state_dict(model.state_dict())
            grad = _flat_grad(probe, x, y)  # (this batch's gradient on the weights the model holds)
            if k == bad:
                model[0].weight.grad[0, 0] = float("nan")
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
                _sgd_twin_step(twin, [grad], lr, [(start1, end1)])
                continue  # (the loop's zero_grad() drops the step)
            assert opt.step().accepted
            _sgd_twin_step(twin, [grad], lr)
        clock = opt.clock
        status = shard_status(addresses, 10)
        final = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    torch.testing.assert_close(final, torch.nn.utils.parameters_to_vector(twin.parameters()).detach(),
                               rtol=1e-5, atol=1e-6)
    assert clock == steps  # the dropped step spent its clock
    assert [s.pushes_duplicate for s in status] == [0, 0]
    assert [s.pushes_skipped for s in status] == [1, 0]
    assert [s.version for s in status] == ([steps, steps] if mode == "sync" else [steps - 1, steps])
    assert _skip_warnings(caplog) == [
        f"worker rank 0: the step at clock {bad} was applied on shard(s) [1] and skipped on [0] (refused or unanswered "
        "there, then dropped instead of taken again): its gradient counts on [1] only"]


@pytest.mark.timeout(120)
def test_in_sync_a_worker_that_drops_a_step_one_shard_refused_does_not_hold_the_other_worker(
        start_servers, caplog) -> None:  # type: ignore[no-untyped-def]
    """Sync, two workers, two server processes. Worker 0's step 2 holds a NaN in shard 0's range:
    shard 0 refuses it (shard 1 buffers it for the iteration) and the step raises; worker 0 drops
    it (zero_grad) and goes on. Its next step tells shard 0 the step is skipped, so shard 0's
    iteration 2 completes with worker 1's gradient alone (worker 1's pull there waited for it),
    and both workers end at the same clock, the job's weights equal to torch's twin: iteration 2's
    mean over both workers on shard 1's range, worker 1's gradient alone on shard 0's. Before,
    worker 0's next batch went as clock 2: shard 1 dropped it as a duplicate."""
    from psgrad.client.status_client import shard_status
    from psgrad.errors import NonFiniteGradientError

    caplog.set_level("WARNING", logger="psgrad")
    addresses = start_servers(2)
    lr, steps, bad = 0.1, 5, 2
    gen = torch.Generator().manual_seed(12)
    data = [[(torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(steps)]
            for _ in range(2)]
    base = _model()
    twin = copy.deepcopy(base)
    finals: dict[int, torch.Tensor] = {}
    clocks: dict[int, int] = {}
    ranges: list[tuple[int, int]] = []
    status: list = []

    def worker(rank: int) -> None:
        model = copy.deepcopy(base)
        with psgrad.connect(addresses, rank=rank, num_workers=2, mode="sync", optimizer=psgrad.SGD(lr=lr),
                            client=CLIENT) as ps:
            opt = ps.optimizer(model)
            if rank == 0:
                ranges.extend(opt.plan.ranges)
            for k, (x, y) in enumerate(data[rank]):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                if rank == 0 and k == bad:
                    model[0].weight.grad[0, 0] = float("nan")
                    with pytest.raises(NonFiniteGradientError):
                        opt.step()
                    continue
                assert opt.step().accepted
            clocks[rank] = opt.clock
            finals[rank] = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            if rank == 0:
                status.extend(shard_status(addresses, 10))

    run_in_threads(2, worker, timeout_s=90)
    (start0, end0), (start1, end1) = ranges
    assert start0 == 0 < end0 == start1 < end1
    for k in range(steps):
        grads = [_flat_grad(twin, *data[r][k]) for r in range(2)]
        _sgd_twin_step(twin, grads, lr, [(start1, end1), None] if k == bad else None)
    expected = torch.nn.utils.parameters_to_vector(twin.parameters()).detach()
    for rank in range(2):  # (each pulled the last iteration's weights)
        torch.testing.assert_close(finals[rank], expected, rtol=1e-5, atol=1e-6)
    assert clocks == {0: steps, 1: steps}
    assert [s.pushes_duplicate for s in status] == [0, 0]
    assert [s.pushes_skipped for s in status] == [1, 0]
    assert len(_skip_warnings(caplog)) == 1


@pytest.mark.timeout(120)
def test_with_overlap_a_step_one_shard_refused_is_skipped_there_by_the_next_step(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Async with overlap, two server processes. Step 2's background exchange is refused by shard 0
    (a NaN in its range) and applied by shard 1; the failure reaches step 3's call, which raises
    before it pushes. The loop goes on: step 4 sends the skip of clock 2 to shard 0, then pushes
    clock 3, which both shards apply, and the job goes on to the end. Before, every later push was
    refused by shard 0 as a clock jump (its next clock stayed 2)."""
    from psgrad.client.status_client import shard_status
    from psgrad.errors import NonFiniteGradientError

    addresses = start_servers(2)
    model = _model()
    gen = torch.Generator().manual_seed(13)
    raised = []
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model, overlap=True)
        for k in range(7):
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 64, generator=gen)),
                                        torch.randint(0, 10, (8,), generator=gen)).backward()
            if k == 2:
                model[0].weight.grad[0, 0] = float("nan")
            try:
                opt.step()
            except NonFiniteGradientError:
                raised.append(k)
        opt.synchronize()
        clock = opt.clock
        status = shard_status(addresses, 10)
    assert raised == [3] and clock == 6  # (step 3's call raised before it pushed: 6 clocks for 7 calls)
    assert [(s.pushes_skipped, s.pushes_applied, s.pushes_duplicate) for s in status] == [(1, 5, 0), (0, 6, 0)]
