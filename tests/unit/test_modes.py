"""psgrad.experiments.modes: the --modes grammar, its errors, and the flags and lrs each variant becomes."""
from __future__ import annotations

from pathlib import Path

import pytest

from psgrad.errors import ConfigError
from psgrad.experiments.compare import worker_argv
from psgrad.experiments.compare_config import CompareConfig
from psgrad.experiments.modes import ModeRun, parse_mode, parse_modes

pytestmark = pytest.mark.timeout(60)


def test_plain_modes_parse_as_before() -> None:
    assert parse_modes("sync,async,ssp:2,allreduce") == (
        ModeRun("sync", "sync"), ModeRun("async", "async"), ModeRun("ssp:2", "ssp", 2), ModeRun("allreduce", "allreduce"),
    )
    assert [m.slug for m in parse_modes("sync,ssp:2")] == ["sync", "ssp2"]  # run directories as before


def test_variants_become_job_settings() -> None:
    assert parse_mode("sync:backup=1") == ModeRun("sync:backup=1", "sync", backup_workers=1)
    assert parse_mode("async:slr") == ModeRun("async:slr", "async", staleness_lr=True)
    assert parse_mode("async:dc=0.04") == ModeRun("async:dc=0.04", "async", dc_asgd=0.04)
    assert parse_mode("ssp:2:dca=2") == ModeRun("ssp:2:dca=2", "ssp", 2, dc_asgd=2.0, dc_asgd_adaptive=True)
    assert parse_mode("ssp:auto") == ModeRun("ssp:auto", "ssp", staleness_max=8)  # the CLI's --staleness-max
    assert parse_mode("ssp:auto:max=5") == ModeRun("ssp:auto:max=5", "ssp", staleness_max=5)
    assert parse_mode("async:lr=0.02:slr") == ModeRun("async:lr=0.02:slr", "async", staleness_lr=True, lr=0.02)
    assert parse_mode("async:dc=0.04").slug == "async-dc0.04"


@pytest.mark.parametrize("bad,message", [
    ("bsp", "unknown mode 'bsp' in --modes entry 'bsp'"),
    ("ssp", "ssp needs its bound first"),
    ("ssp:x", "ssp needs its bound first"),
    ("sync:1", "'1' is not an option of sync; sync takes backup=B, tables=async, lr=LR"),
    ("sync:slr", "'slr' is not an option of sync"),
    ("async:backup=1", "'backup=1' is not an option of async"),
    ("async:dc", "'dc' is not an option of async"),
    ("async:slr=1", "'slr=1' is not an option of async"),
    ("async:dc=0", "dc= needs a finite number > 0, got '0'"),
    ("async:dc=x", "dc= needs a finite number > 0"),
    ("sync:backup=-1", "backup= needs an integer >= 0"),
    ("ssp:2:max=4", "max= bounds ssp:auto only"),
    ("ssp:auto:max=0", "max= needs an integer >= 1"),
    ("async:dc=0.1:dca=2", "dc= and dca= exclude each other"),
    ("async:slr:slr", "slr given twice"),
    ("allreduce:slr", "'slr' is not an option of allreduce"),
    ("", "unknown mode ''"),
])
def test_bad_variants_are_named(bad: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_mode(bad)


@pytest.mark.parametrize("bad, message", [
    ("async:dc=0.04:dca=2", "dc= and dca= exclude each other (dca=LAMBDA is adaptive DC-ASGD with its own lambda): "
                            "give one of them"),
    ("ssp:2:dca=2:dc=0.04", "dc= and dca= exclude each other (dca=LAMBDA is adaptive DC-ASGD with its own lambda): "
                            "give one of them"),
    ("async:dca=2:dca=3", "dca given twice; give it once"),
    ("async:dc=1:dc=2", "dc given twice; give it once"),
    ("async:slr:slr", "slr given twice; give it once"),
])
def test_dc_and_dca_together_are_not_said_to_be_given_twice(bad: str, message: str) -> None:
    """async:dc=0.04:dca=2 said "dca given twice", as if dc and dca were one key."""
    with pytest.raises(ConfigError) as info:
        parse_mode(bad)
    assert str(info.value) == f"mode {bad!r} in --modes: {message}"


@pytest.mark.parametrize("bad, codec", [("async:noef", "none"), ("sync:compress=int8:noef", "int8"),
                                        ("ssp:2:noef:compress=int8", "int8")])
def test_noef_without_a_biased_codec_is_refused(bad: str, codec: str) -> None:
    """async:noef (error feedback off in a job that compresses nothing) was taken without a word."""
    with pytest.raises(ConfigError) as info:
        parse_mode(bad)
    name = bad.partition(":")[0]
    assert str(info.value) == (f"mode {bad!r} in --modes: noef needs compress= a biased codec (topk:R, randomk:R or "
                               f"sign): with compress {codec} no push leaves anything out to feed back; e.g. "
                               f"{name}:compress=topk:0.01:noef")
    assert not parse_mode(f"{name}{':2' if name == 'ssp' else ''}:noef:compress=sign").error_feedback


def test_a_mode_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="lists a mode twice"):
        parse_modes("sync,sync")


def test_worker_argv_carries_each_variant(tmp_path: Path) -> None:
    modes = parse_modes("sync,sync:backup=1,async:slr,async:dc=0.04,ssp:2:dca=2,ssp:auto:max=6,async:lr=0.01")
    cfg = CompareConfig(out_dir=tmp_path, modes=modes, num_workers=4, lr=0.1)
    argv = {m.label: worker_argv(cfg, m, seed=0, rank=1, run_dir=tmp_path, servers="127.0.0.1:1") for m in modes}

    def value(label: str, flag: str) -> str | None:
        a = argv[label]
        return a[a.index(flag) + 1] if flag in a else None

    assert value("sync", "--backup-workers") is None and value("sync:backup=1", "--backup-workers") == "1"
    assert "--staleness-lr" in argv["async:slr"] and "--staleness-lr" not in argv["async:dc=0.04"]
    assert value("async:dc=0.04", "--dc-asgd") == "0.04" and "--dc-asgd-adaptive" not in argv["async:dc=0.04"]
    assert value("ssp:2:dca=2", "--dc-asgd") == "2.0" and "--dc-asgd-adaptive" in argv["ssp:2:dca=2"]
    assert (value("ssp:auto:max=6", "--mode"), value("ssp:auto:max=6", "--staleness"),
            value("ssp:auto:max=6", "--staleness-max")) == ("ssp", "auto", "6")
    lr = {label: float(value(label, "--lr") or "nan") for label in argv}
    assert lr == {"sync": 0.1, "sync:backup=1": 0.1, "async:slr": 0.1, "async:dc=0.04": 0.1, "ssp:2:dca=2": 0.1,
                  "ssp:auto:max=6": 0.1, "async:lr=0.01": 0.01}


def test_worker_argv_of_a_compressed_variant_compresses_to_same_host_shards_too(tmp_path: Path) -> None:
    modes = parse_modes("async,async:compress=topk:0.01,sync:compress=sign:noef")
    cfg = CompareConfig(out_dir=tmp_path, modes=modes, num_workers=2, lr=0.1)
    argv = {m.label: worker_argv(cfg, m, seed=0, rank=1, run_dir=tmp_path, servers="127.0.0.1:1") for m in modes}
    assert "--compress" not in argv["async"] and "--compress-same-host" not in argv["async"]
    topk = argv["async:compress=topk:0.01"]
    assert topk[topk.index("--compress") + 1] == "topk:0.01" and "--compress-same-host" in topk
    assert "--no-error-feedback" not in topk and "--no-error-feedback" in argv["sync:compress=sign:noef"]


def test_linear_scaling_multiplies_by_the_gradients_each_update_averages(tmp_path: Path) -> None:
    modes = parse_modes("sync,sync:backup=1,allreduce,async,ssp:2")
    cfg = CompareConfig(out_dir=tmp_path, modes=modes, num_workers=4, lr=0.05, sync_lr_scaling="linear")
    assert {m.label: cfg.mode_lr(m) for m in modes} == pytest.approx(
        {"sync": 0.2, "sync:backup=1": 0.15, "allreduce": 0.2, "async": 0.05, "ssp:2": 0.05})
    assert cfg.settings()["lrs"]["sync"] == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="backup_workers must be < num_workers"):
        CompareConfig(out_dir=tmp_path, modes=parse_modes("sync:backup=4"), num_workers=4)
