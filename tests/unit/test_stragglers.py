"""psgrad.core.stragglers and the worker's DelayInjector: seeded, deterministic heavy tails and a rotating slow node."""
from __future__ import annotations

import statistics

import pytest

from psgrad.config import WorkerConfig
from psgrad.core.stragglers import MAX_MULTIPLIER, StragglerModel, parse_dist, parse_rotation
from psgrad.errors import ConfigError
from psgrad.worker.loop import DelayInjector

pytestmark = pytest.mark.timeout(60)


def test_parse_dist_and_rotation() -> None:
    assert parse_dist("lognormal:0.5") == ("lognormal", 0.5)
    assert parse_dist("pareto:1.5") == ("pareto", 1.5)
    assert parse_dist("none") == ("none", 0.0)
    for bad in ("lognormal", "lognormal:0", "pareto:-1", "pareto:inf", "gamma:2", "none:1", "lognormal:x"):
        with pytest.raises(ConfigError, match="lognormal:SIGMA or pareto:ALPHA"):
            parse_dist(bad)
    assert parse_rotation("50:2") == (50, 2)
    for bad in ("50", "0:1", "a:1", "5:-1"):
        with pytest.raises(ConfigError, match="STEPS:FIRST_RANK"):
            parse_rotation(bad)
    with pytest.raises(ConfigError, match="one of none, lognormal, pareto"):
        StragglerModel(dist="gamma", shape=1.0)


@pytest.mark.parametrize("dist,shape", [("lognormal", 1.0), ("pareto", 1.5)])
def test_draws_are_seeded_at_least_one_and_heavy_tailed(dist: str, shape: float) -> None:
    model = StragglerModel(dist=dist, shape=shape)
    draws = [model.multiplier(seed=3, rank=1, step=s) for s in range(4000)]
    assert draws == [model.multiplier(seed=3, rank=1, step=s) for s in range(4000)]  # deterministic
    assert draws != [model.multiplier(seed=4, rank=1, step=s) for s in range(4000)]  # the seed matters
    assert draws != [model.multiplier(seed=3, rank=2, step=s) for s in range(4000)]  # so does the rank
    assert all(1.0 <= d <= MAX_MULTIPLIER for d in draws)
    # A heavy tail: the largest of 4000 draws is far beyond the median (a normal's max would be ~3.5 sd).
    median = statistics.median(draws)
    assert max(draws) > 8 * median
    if dist == "lognormal":
        assert 0.45 < sum(d == 1.0 for d in draws) / len(draws) < 0.55  # half the steps are not slowed
    else:  # Pareto(1.5): P(m > x) = x^-1.5
        assert 0.03 < sum(d > 8 for d in draws) / len(draws) < 0.06


def test_no_distribution_means_no_draw() -> None:
    assert StragglerModel().multiplier(0, 0, 5) == 1.0


def test_the_slow_node_rotates_every_steps() -> None:
    model = StragglerModel(rotate_steps=10, rotate_first=2)
    slow = [[model.slowdown_at(4.0, step, rank, 3) for rank in range(3)] for step in (0, 9, 10, 20, 30)]
    assert slow == [[1, 1, 4], [1, 1, 4], [4, 1, 1], [1, 4, 1], [1, 1, 4]]
    assert StragglerModel().slowdown_at(4.0, 99, 1, 3) == 4.0  # no rotation: always this worker's


def test_delay_injector_applies_the_model_once_per_step() -> None:
    model = StragglerModel(dist="pareto", shape=2.0, rotate_steps=5, rotate_first=0)
    config = WorkerConfig((), rank=1, slowdown=3.0, step_time_ms=10.0, seed=7, straggler_model=model)
    inj = DelayInjector(config, num_workers=2)
    for step in range(20):
        fixed = 3.0 if (step // 5) % 2 == 1 else 1.0
        expected = 0.010 * fixed * model.multiplier(7, 1, step) - 0.002
        assert inj.delay_s(0.002, step) == pytest.approx(max(0.0, expected))
    argv = config.to_argv()
    assert argv[argv.index("--straggler-dist") + 1] == "pareto:2.0"
    assert argv[argv.index("--slow-node-rotate") + 1] == "5:0"
