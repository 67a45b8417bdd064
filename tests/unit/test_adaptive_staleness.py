"""`--staleness auto`: the adaptive SSP bound. The rule on its own, a deterministic discrete-event
run of SSP with the policy (fake time: a persistent straggler, then none), and the shard's wiring
(history, status, push replies) with a fake clock; plus the spec and flag validation."""
from __future__ import annotations

import heapq
import threading

import pytest
import torch

from psgrad.cli.flags import apply_recipe, job_spec
from psgrad.cli.parser import build_parser
from psgrad.config import JobSpec, ServerConfig
from psgrad.core import adaptive
from psgrad.core.adaptive import AdaptiveSSPPolicy
from psgrad.core.codecs import WireBuffer
from psgrad.core.consistency import ClockView, SSPPolicy
from psgrad.core.modes import AUTO_STALENESS_MAX
from psgrad.core.policies import policy_for
from psgrad.core.sharding import ParamSpec, fingerprint
from psgrad.errors import ConfigError
from psgrad.server.shard import Layout, Shard

pytestmark = pytest.mark.timeout(60)


def test_rule_raises_lowers_and_holds_within_bounds() -> None:
    p = AdaptiveSSPPolicy(staleness_max=3)
    assert p.staleness == 2 and p.adapts
    window = adaptive.WINDOW_PULLS * 2  # pulls per window with 2 live workers

    def run_window(waited_each: float, t0: float) -> bool:
        """One window of 1 s per pull; every pull waited waited_each seconds."""
        changed = False
        for i in range(window):
            changed |= p.observe_pull(waited_each, t0 + i + 1, live=2, version=0)
        return changed

    t = 0.0
    p.observe_pull(0.0, t, live=2, version=0)  # opens the first window at t
    assert run_window(1.0, t) and p.staleness == 3  # blocked: half the workers' time > 0.25
    t += window
    assert not run_window(1.0, t) and p.staleness == 3  # held at the max
    t += window
    assert not run_window(0.3, t) and p.staleness == 3  # 0.15: inside the hysteresis band
    t += window
    assert run_window(0.0, t) and p.staleness == 2
    t += window
    assert run_window(0.0, t) and p.staleness == 1
    t += window
    assert not run_window(0.0, t) and p.staleness == 1  # held at the min
    assert [s for _t, _v, s in p.trajectory] == [2, 3, 2, 1]


def _simulate(workers: int, s_max: int, step: "callable") -> tuple[list[tuple], AdaptiveSSPPolicy]:  # type: ignore[type-arg, valid-type]
    """SSP through the policy in simulated time: each worker pulls (clock c waits for the gate),
    computes step(rank, t) seconds, pushes; the bound adapts as pulls are granted. Returns the
    events ("pull", t, rank, clock, slowest, s) / ("apply", t, staleness, s_max_so_far)."""
    p = AdaptiveSSPPolicy(s_max)
    clocks = dict.fromkeys(range(workers), 0)
    version, events, highest = 0, [], p.staleness
    waiting: dict[int, float] = {r: 0.0 for r in range(workers)}  # rank -> when its pull was asked
    base: dict[int, int] = {}
    pushes: list[tuple[float, int]] = []  # (time, rank) heap
    t = 0.0
    while t < 400.0:
        for r in sorted(waiting):  # grant what the gate lets through, in rank order
            view = ClockView(version, dict(clocks))
            if not p.pull_ready(clocks[r], view):
                continue
            events.append(("pull", t, r, clocks[r], view.min_clock, p.staleness))
            p.observe_pull(t - waiting.pop(r), t, workers, version)
            highest = max(highest, p.staleness)
            base[r] = version
            heapq.heappush(pushes, (t + step(r, t), r))
        t, r = heapq.heappop(pushes)
        version += 1
        clocks[r] += 1
        events.append(("apply", t, version - 1 - base[r], highest))
        waiting[r] = t
    return events, p


def _check_invariants(events: list[tuple], workers: int, s_max: int) -> None:  # type: ignore[type-arg]
    for e in events:
        if e[0] == "pull":
            _, _t, _r, clock, slowest, s = e
            assert 1 <= s <= s_max
            assert clock - slowest <= s, f"a pull beyond the bound in effect: {e}"
        else:
            _, _t, staleness, highest = e
            assert staleness <= (workers - 1) * (2 * highest + 1), e


def test_bound_rises_under_a_persistent_straggler_and_falls_back_when_it_goes() -> None:
    workers, s_max = 3, 6
    events, p = _simulate(workers, s_max, lambda r, t: 4.0 if r == 0 and t < 150 else 1.0)
    _check_invariants(events, workers, s_max)
    bound = {round(t): s for t, _v, s in p.trajectory}
    during = [s for t, s in bound.items() if t < 150]
    after = [s for t, s in bound.items() if t >= 150]
    assert max(during) == s_max, p.trajectory  # a persistent straggler: it climbs to the max
    assert after and after[-1] == 1, p.trajectory  # no straggler: back down to the min
    ss = [s for t, _v, s in p.trajectory]
    assert all(abs(a - b) == 1 for a, b in zip(ss, ss[1:]))  # one step at a time


def test_no_straggler_keeps_the_bound_at_its_floor() -> None:
    events, p = _simulate(3, 8, lambda r, t: 1.0 + 0.1 * r)
    _check_invariants(events, 3, 8)
    assert p.staleness == 1 and max(s for _t, _v, s in p.trajectory) == 2


# ----------------------------------------------------------------------------- the shard's wiring
PARAMS = (ParamSpec("w", (4,), "float32"),)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_shard_adapts_its_bound_records_it_and_reports_it() -> None:
    spec = JobSpec(mode="ssp", num_workers=2, staleness_max=3, lr=0.1)
    layout = Layout(spec, PARAMS, 0, 0, 4, fingerprint(PARAMS, spec))
    clock = FakeClock()
    shard = Shard(ServerConfig(lease_s=1e6), now=clock)
    shard.initialize(0, layout, torch.zeros(4))
    shard.join(1, layout)
    assert shard.status().staleness_bound == 2

    def push(rank: int, c: int) -> int:
        g = torch.ones(4)
        buf, wire, writer = shard.push_target(rank, c, shard.version, 4, "float32", layout.fingerprint)
        writer.write(WireBuffer(4, "float32").encode(g))
        writer.finish()
        return shard.apply_push(rank, c, shard.version, buf, wire, wire.nbytes).bound

    def pull(rank: int, c: int) -> None:
        assert shard.pull_frames(rank, c, layout.fingerprint, timeout_s=0) is not None

    # Worker 0 runs ahead and waits at the gate for worker 1 (a straggler) every time: 10 s of
    # each 10 s window blocked for one of two workers.
    slow = 0
    pull(1, 0)
    for c in range(40):
        if c - slow > shard.status().staleness_bound:  # worker 0 parks; worker 1 pushes 10 s later
            got: list[object] = []
            t = threading.Thread(target=lambda: got.append(shard.pull_frames(0, c, layout.fingerprint, timeout_s=60)))
            t.start()
            assert shard.wait_until(lambda st: st.waiting == 1, timeout_s=30)
            clock.t += 10.0
            push(1, slow)
            slow += 1
            pull(1, slow)
            t.join(timeout=30)
            assert got and got[0] is not None
        else:
            clock.t += 1.0
            pull(0, c)
        push(0, c)
    history = list(shard.history)
    bounds = [e for e in history if e[0] == "bound"]
    assert bounds and bounds[-1][1] == 3 == shard.status().staleness_bound
    assert push(1, slow) == 3  # the push reply carries the bound in effect (the metrics record it)
    s = 2
    for e in history:  # every granted pull within the bound in effect when it was granted
        if e[0] == "bound":
            s = e[1]
        elif e[0] == "pull":
            _, _rank, c, slowest, _v = e
            assert c - slowest <= s, e


def test_fixed_staleness_is_the_plain_policy() -> None:
    assert type(policy_for(JobSpec(mode="ssp", staleness=3, num_workers=2))) is SSPPolicy
    assert isinstance(policy_for(JobSpec(mode="ssp", staleness_max=4, num_workers=2)), AdaptiveSSPPolicy)
    assert AdaptiveSSPPolicy(1).staleness == 1  # starts at min(2, max)


def _spec(*argv: str) -> JobSpec:
    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", *argv])
    apply_recipe(ns)
    return job_spec(ns, ns.num_workers, 1)


def test_staleness_auto_flag_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec("--mode", "ssp", "--staleness", "auto")
    assert (spec.staleness, spec.staleness_max) == (0, AUTO_STALENESS_MAX)
    assert _spec(*spec.to_argv()) == spec
    assert _spec("--mode", "ssp", "--staleness", "auto", "--staleness-max", "3").staleness_max == 3
    assert _spec("--mode", "ssp", "--staleness", "4").staleness_max == 0
    with pytest.raises(SystemExit) as info:
        _spec("--mode", "ssp", "--staleness", "soon")
    assert info.value.code == 2 and "expected an integer or 'auto', got 'soon'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="adapts only mode 'ssp'"):
        _spec("--mode", "sync", "--staleness", "auto")
    with pytest.raises(ConfigError, match="not both"):
        JobSpec(mode="ssp", staleness=2, staleness_max=4)


def test_compare_analysis_summarizes_the_bound_and_the_late_gradients() -> None:
    from psgrad.experiments.analysis import RunData, aggregate, run_metrics

    def step(rank: int, n: int, t: float, bound: int | None) -> dict:  # type: ignore[type-arg]
        rec = {"time": 100.0 + t, "rank": rank, "step": n, "clock": n - 1, "loss": 1.0, "staleness": 0,
               "accepted": True, "version": [n], "test_accuracy": 0.5, "test_loss": 1.0}
        return rec if bound is None else {**rec, "staleness_bound": bound}

    start = {"time": 100.0, "rank": 0, "step": 0, "event": "start", "clock": 0, "batch_size": 1}
    run = RunData("ssp:auto", 0, {0: [start, step(0, 1, 1, 2), step(0, 2, 2, 3), step(0, 3, 3, 3)]},
                  status={"shards": [{"late_dropped": 4}, {"late_dropped": 0}]})
    m = run_metrics(run, 0.9)
    assert m["staleness_bound_curve"] == [(1.0, 2), (2.0, 3), (3.0, 3)]
    assert (m["staleness_bound_mean"], m["staleness_bound_max"], m["late_dropped"]) == (8 / 3, 3, 4)
    fixed = run_metrics(RunData("ssp:2", 0, {0: [start, step(0, 1, 1, None)]}), 0.9)
    assert fixed["staleness_bound_curve"] == [] and fixed["staleness_bound_max"] is None
    assert fixed["late_dropped"] is None
    assert aggregate([m])["staleness_bound_max"]["mean"] == 3.0
