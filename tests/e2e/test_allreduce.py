"""The all-reduce baseline with real processes: a 2-rank CLI run writes the PS worker's metrics
schema and ends with one model, its gloo group and threads gone when the run returns, and K steps
equal single-process SGD on the concatenated batches."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, Proc, child_env, spawn
from psgrad.tasks import get_task
from psgrad.tasks.data import batches

pytestmark = pytest.mark.timeout(120)

STEP_KEYS = {
    "time", "rank", "step", "clock", "loss", "step_s", "compute_s", "delay_s", "exchange_s",
    "allreduce_s", "staleness", "accepted", "version", "lr",
}


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stop_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
        p.popen.wait()


# Rank 0 of the CLI test's job runs under this: one CLI rank, then the names of the threads still
# alive in its process (a fresh interpreter: no earlier import in the test process hides the problem).
# A thread that is ending when the run returns is given 10 s to be gone (polled): one that stays
# is held by a group still alive.
_THREADS_AFTER = """
import os, sys, time
from psgrad.cli.main import main
code = main(sys.argv[1:])
def names():
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            out.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # that thread ended meanwhile
            pass
    return sorted(out)
deadline = time.monotonic() + 10
while any("gloo" in n for n in names()) and time.monotonic() < deadline:
    time.sleep(0.05)
print("exit", code, "threads", ",".join(names()))
"""


@pytest.mark.slow
def test_two_ranks_via_cli_write_the_worker_schema_and_end_with_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps, world = 30, 2
    store = tmp_path / "store"
    common = ["--num-workers", str(world), "--store", str(store), "--task", "digits", "--steps", str(steps),
              "--batch-size", "16", "--momentum", "0.9", "--eval-every", "10", "--slowdown", "1.5"]
    # Rank 0 reports the threads left when its run returned: a gloo group still alive at interpreter
    # exit is torn down during finalization, which can abort the process after a successful run
    # (exit -6, "terminate called without an active exception").
    procs = [
        Proc([sys.executable, "-c", _THREADS_AFTER, "allreduce", "--rank", "0", *common, "--metrics-out",
              str(tmp_path / "w0.jsonl")], name="psgrad-allreduce", cwd=REPO, new_session=False, env=child_env()),
        *[spawn(["allreduce", "--rank", str(r), *common, "--metrics-out", str(tmp_path / f"w{r}.jsonl")])
          for r in range(1, world)],
    ]
    try:
        for p in procs:
            assert p.wait(90) == 0, p.output
    finally:
        _stop_all(procs)
    last = procs[0].lines[-1]
    assert last.startswith("exit 0 threads "), procs[0].output
    threads = last.split(" threads ", 1)[1].split(",")  # a thread name may hold spaces, never a comma
    assert not [n for n in threads if "gloo" in n], last
    finals = []
    for r, p in enumerate(procs):
        assert f"worker {r}/{world}: step {steps}/{steps} loss " in p.output
        assert f"worker {r}/{world}: final test_loss " in p.output
        recs = _records(tmp_path / f"w{r}.jsonl")
        start, body, final = recs[0], recs[1:-1], recs[-1]
        assert set(start) == {"time", "rank", "step", "event", "clock", "batch_size", "mode", "slowdown", "jitter_ms",
                              "straggler_model"}
        assert (start["event"], start["step"], start["clock"], start["mode"]) == ("start", 0, 0, "allreduce")
        assert (start["rank"], start["batch_size"], start["slowdown"], start["jitter_ms"]) == (r, 16, 1.5, 0.0)
        assert [rec["step"] for rec in body] == list(range(1, steps + 1))
        for k, rec in enumerate(body):
            evaluated = (k + 1) % 10 == 0
            assert set(rec) == STEP_KEYS | ({"test_loss", "test_accuracy"} if evaluated else set()), rec
            assert (rec["clock"], rec["version"], rec["staleness"], rec["accepted"]) == (k, [k], 0, True)
            assert rec["exchange_s"] == rec["allreduce_s"] >= 0.0
            assert rec["delay_s"] == pytest.approx(0.5 * rec["compute_s"])
            assert rec["step_s"] >= rec["compute_s"] + rec["delay_s"] + rec["exchange_s"] - 1e-3
        assert set(final) == {"time", "rank", "step", "event", "steps", "elapsed_s", "test_loss", "test_accuracy",
                              "max_rss_mb"}
        assert (final["event"], final["step"], final["steps"]) == ("final", steps, steps)
        finals.append(final)
    # every rank trains on its own data slice, yet both end with the same model
    losses = [[rec["loss"] for rec in _records(tmp_path / f"w{r}.jsonl")[1:-1]] for r in range(world)]
    assert losses[0] != losses[1]
    assert finals[0]["test_loss"] == finals[1]["test_loss"]
    assert finals[0]["test_accuracy"] == finals[1]["test_accuracy"]
    assert finals[0]["test_loss"] < 2.0  # it learned something (chance is ln 10 = 2.30)


# Run by each rank of the equivalence test: train with train_allreduce, save the final weights.
# Rank > 0 builds a perturbed model, so only rank 0's broadcast makes the ranks start equal.
_CHILD = """
import sys, torch
from psgrad.experiments.allreduce import train_allreduce
from psgrad.config import JobSpec, WorkerConfig
from psgrad.metrics.jsonl import MetricsSink
from psgrad.tasks import get_task
rank, world, steps, batch, lr, momentum, wd, store, out = sys.argv[1:]
rank, world = int(rank), int(world)
task = get_task("digits")
build, built = task.build_model, []
def build_model():
    model = build()
    if rank > 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    built.append(model)
    return model
task.build_model = build_model
config = WorkerConfig(servers=(), rank=rank, steps=int(steps), batch_size=int(batch), device="cpu", seed=3)
spec = JobSpec(mode="sync", num_workers=world, lr=float(lr), momentum=float(momentum), weight_decay=float(wd))
train_allreduce(config, spec, task, MetricsSink(None, rank), store, log=lambda line: None)
torch.save(torch.cat([p.detach().reshape(-1) for p in built[0].parameters()]), out)
"""


@pytest.mark.slow
def test_k_steps_equal_single_process_sgd_on_the_concatenated_batches(tmp_path: Path) -> None:
    world, steps, batch, lr, momentum, wd, seed = 2, 5, 16, 0.2, 0.9, 0.01, 3
    store = tmp_path / "store"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [  # (forked from the preloaded template)
        Proc([sys.executable, "-c", _CHILD, str(r), str(world), str(steps), str(batch), str(lr), str(momentum),
              str(wd), str(store), str(tmp_path / f"w{r}.pt")], name=f"rank{r}", cwd=REPO, new_session=False, env=env)
        for r in range(world)
    ]
    try:
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            p.stop(grace_s=0)
    for p, code in zip(procs, codes):
        assert code == 0, p.output
    got = [torch.load(tmp_path / f"w{r}.pt") for r in range(world)]
    assert torch.equal(got[0], got[1]), "the ranks' models diverged"

    task = get_task("digits", seed)
    torch.manual_seed(seed)
    ref = task.build_model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    streams = [batches(task.train_dataset(), batch, seed, rank=r, num_workers=world) for r in range(world)]
    for _ in range(steps):
        parts = [next(s) for s in streams]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        task.loss_fn(ref(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.manual_seed(seed)
    init = task.build_model()  # sanity: training moved the weights well beyond the tolerance
    assert (expected - torch.cat([p.detach().reshape(-1) for p in init.parameters()])).abs().max() > 1e-2
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-6)
