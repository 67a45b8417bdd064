"""psgrad.experiments.modes: the --modes grammar, its errors, and the flags and lrs each variant becomes."""
from __future__ import annotations

from pathlib import Path

import pytest

from psgrad.errors import ConfigError
from psgrad.experiments.compare import CompareConfig, worker_argv
from psgrad.experiments.modes import ModeRun, known_flags, missing_features, parse_mode, parse_modes

pytestmark = pytest.mark.timeout(60)


def test_plain_modes_parse_as_before() -> None:
    assert parse_modes("sync,async,ssp:2,allreduce") == (
        ModeRun("sync", "sync"), ModeRun("async", "async"), ModeRun("ssp:2", "ssp", 2), ModeRun("allreduce", "allreduce"),
    )
    assert [m.slug for m in parse_modes("sync,ssp:2")] == ["sync", "ssp2"]  # run directories as before


def test_variants_become_fields_and_flags() -> None:
    assert parse_mode("sync:backup=1") == ModeRun("sync:backup=1", "sync", backup_workers=1,
                                                  extra=("--backup-workers", "1"))
    assert parse_mode("async:slr") == ModeRun("async:slr", "async", staleness_lr=True)
    assert parse_mode("async:dc=0.04").extra == ("--dc-asgd", "0.04")
    assert parse_mode("ssp:2:dca=2").extra == ("--dc-asgd", "2.0", "--dc-asgd-adaptive")
    assert parse_mode("ssp:auto").extra == ("--staleness", "auto")
    assert parse_mode("ssp:auto:max=8").extra == ("--staleness", "auto", "--staleness-max", "8")
    assert parse_mode("async:lr=0.02:slr") == ModeRun("async:lr=0.02:slr", "async", staleness_lr=True, lr=0.02)
    assert parse_mode("async:dc=0.04").slug == "async-dc0.04"


@pytest.mark.parametrize("bad,message", [
    ("bsp", "unknown mode 'bsp' in --modes entry 'bsp'"),
    ("ssp", "ssp needs its bound first"),
    ("ssp:x", "ssp needs its bound first"),
    ("sync:1", "'1' is not an option of sync; sync takes backup=B, lr=LR"),
    ("sync:slr", "'slr' is not an option of sync"),
    ("async:backup=1", "'backup=1' is not an option of async"),
    ("async:dc", "'dc' is not an option of async"),
    ("async:slr=1", "'slr=1' is not an option of async"),
    ("async:dc=0", "dc= needs a finite number > 0, got '0'"),
    ("async:dc=x", "dc= needs a finite number > 0"),
    ("sync:backup=-1", "backup= needs an integer >= 0"),
    ("ssp:2:max=4", "max= bounds ssp:auto only"),
    ("async:dc=0.1:dca=2", "dc and dca exclude each other"),
    ("async:slr:slr", "slr given twice"),
    ("allreduce:slr", "'slr' is not an option of allreduce"),
    ("", "unknown mode ''"),
])
def test_bad_variants_are_named(bad: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_mode(bad)


def test_a_mode_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="lists a mode twice"):
        parse_modes("sync,sync")


def test_worker_argv_carries_each_variant(tmp_path: Path) -> None:
    modes = parse_modes("sync,sync:backup=1,async:slr,async:dc=0.04,ssp:auto:max=6,async:lr=0.01")
    cfg = CompareConfig(out_dir=tmp_path, modes=modes, num_workers=4, lr=0.1)
    argv = {m.label: worker_argv(cfg, m, seed=0, rank=1, run_dir=tmp_path, servers="127.0.0.1:1") for m in modes}
    assert "--backup-workers" not in argv["sync"]
    assert argv["sync:backup=1"][-2:] == ["--backup-workers", "1"]
    assert "--staleness-lr" in argv["async:slr"] and "--staleness-lr" not in argv["async:dc=0.04"]
    assert argv["async:dc=0.04"][-2:] == ["--dc-asgd", "0.04"]
    ssp = argv["ssp:auto:max=6"]
    assert ssp[ssp.index("--mode") + 1] == "ssp" and ssp[-4:] == ["--staleness", "auto", "--staleness-max", "6"]
    lr = {label: float(a[a.index("--lr") + 1]) for label, a in argv.items()}
    assert lr == {"sync": 0.1, "sync:backup=1": 0.1, "async:slr": 0.1, "async:dc=0.04": 0.1, "ssp:auto:max=6": 0.1,
                  "async:lr=0.01": 0.01}


def test_linear_scaling_multiplies_by_the_gradients_each_update_averages(tmp_path: Path) -> None:
    modes = parse_modes("sync,sync:backup=1,allreduce,async,ssp:2")
    cfg = CompareConfig(out_dir=tmp_path, modes=modes, num_workers=4, lr=0.05, sync_lr_scaling="linear")
    assert {m.label: cfg.mode_lr(m) for m in modes} == pytest.approx(
        {"sync": 0.2, "sync:backup=1": 0.15, "allreduce": 0.2, "async": 0.05, "ssp:2": 0.05})
    assert cfg.settings()["lrs"]["sync"] == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="4 backup workers need more than 4 workers"):
        CompareConfig(out_dir=tmp_path, modes=parse_modes("sync:backup=4"), num_workers=4)


def test_missing_features_are_found_in_the_cli() -> None:
    known = known_flags()
    assert {"--staleness-lr", "--slowdown", "--straggler-dist", "--lease-s"} <= known
    modes = parse_modes("sync,async:slr,async:dc=0.04")
    assert missing_features(modes, known={"--staleness-lr"}) == {"async:dc=0.04": ["--dc-asgd"]}
    assert missing_features(modes, known={"--dc-asgd"}) == {}
    assert missing_features(parse_modes("ssp:auto"), known={"--staleness"}) == {"ssp:auto": ["--staleness-max"]}
