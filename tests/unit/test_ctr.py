"""Task ctr: examples made from (seed, index) alone, Zipf-skewed ids within each field's vocabulary,
the planted model's AUC, the AUC itself, the model in both forms, and its recipe's metric."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from psgrad.config import metric_reached
from psgrad.errors import TaskError, WorkerStateError
from psgrad.tasks import get_task, recipe_for
from psgrad.tasks import ctr
from psgrad.tasks.data import BatchSchedule

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGRAD_CTR_ROWS", "20000")
    monkeypatch.setenv("PSGRAD_CTR_DIM", "8")


def test_an_example_depends_on_its_index_alone(small: None) -> None:
    task = get_task("ctr", seed=3)
    data = task.train_set
    x, y = data.batch(torch.tensor([5, 17, 123456]))
    x2, y2 = data.batch(torch.tensor([123456, 9, 5]))
    assert torch.equal(x[0], x2[2]) and torch.equal(x[2], x2[0]) and y[0] == y2[2]
    one, label = data[17]
    assert torch.equal(one, x[1]) and label == y[1]
    other = get_task("ctr", seed=4).train_set.batch(torch.tensor([5]))[0]
    assert not torch.equal(other[0], x[0])  # another seed, other data
    # the worker's batches come through the dataset's own batch(): a schedule's batch is the same each time
    schedule = BatchSchedule(data, 64, seed=0, rank=1, num_workers=2)
    assert torch.equal(schedule.at(7)[0], schedule.at(7)[0]) and schedule.at(7)[0].shape == (64, ctr.FIELDS + ctr.DENSE)


def test_ids_are_in_their_fields_vocabulary_and_skewed_towards_small_ones(small: None) -> None:
    sizes = ctr.vocabularies(20000)
    assert sizes.sum() == 20000 and len(sizes) == ctr.FIELDS and sizes.min() >= 10
    assert all(a >= b for a, b in itertools.pairwise(sizes[1:]))
    x, y, logit = ctr.Generator(0, 20000).examples(1, np.arange(20000))
    ids = x[:, : ctr.FIELDS]
    assert (ids >= 0).all() and (ids < sizes).all() and (ids == np.floor(ids)).all()
    first = ids[:, 0]
    assert (first < 10).mean() > 0.5 and (first >= sizes[0] / 2).mean() < 0.01  # Zipf: the head holds most draws
    assert 0.15 < y.mean() < 0.5 and logit.std() > 1.0


def test_auc_counts_ties_as_half_like_the_pairwise_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        scores = torch.randint(0, 6, (60,), generator=gen).double()  # many ties
        labels = torch.randint(0, 2, (60,), generator=gen)
        pos, neg = scores[labels == 1], scores[labels == 0]
        pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
        assert ctr.auc(scores, labels) == pytest.approx(float(pairs.mean()))
    assert ctr.auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert ctr.auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1])) == 0.5  # one class only


def test_the_planted_model_is_the_best_and_an_untrained_model_is_chance(small: None) -> None:
    task = get_task("ctr")
    model = task.dense_model()
    metrics = task.evaluate(model, torch.device("cpu"))
    assert 0.85 < metrics["bayes_auc"] < 0.95
    assert abs(metrics["test_auc"] - 0.5) < 0.1 and metrics["test_auc"] < metrics["bayes_auc"]
    assert (metrics["embedding_rows"], metrics["embedding_bytes"]) == (20000, 20000 * 8 * 4)
    recipe = recipe_for("ctr")
    assert recipe.metric == "test_auc" and metric_reached(0.9, 0.85, "test_auc") and not metric_reached(0.8, 0.85, "test_auc")


def test_the_dense_model_learns_close_to_the_planted_models_auc(small: None) -> None:
    """Trained locally (the all-reduce baseline's model), it gets within 0.03 of bayes_auc."""
    torch.manual_seed(0)
    task = get_task("ctr")
    model = task.dense_model()
    opt = torch.optim.Adagrad(model.parameters(), lr=recipe_for("ctr").lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(600):
        x, y = task.train_set.batch(torch.randint(0, len(task.train_set), (256,), generator=gen))
        opt.zero_grad()
        task.loss_fn(model(x), y).backward()
        opt.step()
    metrics = task.evaluate(model, torch.device("cpu"))
    assert metrics["bayes_auc"] - metrics["test_auc"] < 0.03, metrics


def test_the_sparse_model_needs_a_job_and_the_size_comes_from_the_environment(small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = get_task("ctr").build_model()
    assert model.embedding.num_embeddings == 20000 and model.embedding.embedding_dim == 8
    with pytest.raises(WorkerStateError, match="not bound to a job"):
        model(get_task("ctr").test_x[:4])
    monkeypatch.setenv("PSGRAD_CTR_ROWS", "12")
    with pytest.raises(TaskError, match="PSGRAD_CTR_ROWS must be >= 260"):
        get_task("ctr")
    monkeypatch.setenv("PSGRAD_CTR_ROWS", "lots")
    with pytest.raises(TaskError, match="must be integers"):
        get_task("ctr")


def test_a_drifting_stream_is_read_in_time_order_and_moves_popularity_and_preferences(
    small: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PSGRAD_CTR_DRIFT", "2")
    task = get_task("ctr", seed=1)
    data = task.train_set
    assert data.in_time_order
    # workers read the stream in order, in disjoint consecutive batches, never shuffled nor repeated
    schedules = [BatchSchedule(data, 4, seed=0, rank=r, num_workers=2) for r in range(2)]
    got = [schedules[c % 2].indices_at(c // 2).tolist() for c in range(4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    gen = data.generator
    index = np.arange(20_000)
    early, _, _ = gen.examples(ctr._SALT_TEST, index, np.zeros(len(index)))
    late, _, late_logit = gen.examples(ctr._SALT_TEST, index, np.ones(len(index)))
    # popularity: field 0's most frequent id moved, and ids never seen early are common late
    top = lambda x: int(np.bincount(x[:, 0].astype(np.int64)).argmax())  # noqa: E731
    assert top(early) != top(late)
    new = ~np.isin(late[:, 0], early[:, 0])
    assert new.mean() > 0.3, new.mean()
    # preferences: the same example at another time has another planted logit
    _, _, again = gen.examples(ctr._SALT_TEST, index, np.full(len(index), 0.5))
    assert not np.allclose(again, late_logit)
    # the test set is the window before the newest example trained on, and says when it ends
    data.batch(torch.arange(600_000, 600_010))
    model = task.dense_model()
    metrics = task.evaluate(model, torch.device("cpu"))
    assert metrics["test_time"] == pytest.approx(600_010 / ctr.TRAIN_EXAMPLES)
    assert 0.5 < metrics["bayes_auc"] <= 1.0
    with_no_drift = ctr.Generator(1, 20_000, 0.0)
    assert not with_no_drift.drift and not ctr.ClickStream(with_no_drift).in_time_order


def test_drift_is_for_ctr_and_a_rate_at_least_0(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import cli_in_process

    monkeypatch.delenv("PSGRAD_CTR_DRIFT", raising=False)
    res = cli_in_process(["worker", "--servers", "127.0.0.1:1", "--task", "digits", "--drift", "1"], capsys)
    assert res.returncode == 2 and "--drift is for --task ctr" in res.stderr, res.stderr
    res = cli_in_process(["launch", "--task", "ctr", "--drift", "-1"], capsys)
    assert res.returncode == 2 and "--drift must be a number >= 0" in res.stderr, res.stderr
    monkeypatch.setenv("PSGRAD_CTR_DRIFT", "fast")
    with pytest.raises(TaskError, match="PSGRAD_CTR_DRIFT must be a number >= 0"):
        ctr.drift_rate()


def test_hashed_ids_come_as_raw_64_bit_ids_and_train_a_dynamic_table(small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import psgrad
    from psgrad.config import ClientConfig

    plain = get_task("ctr", seed=2).train_set.batch(torch.arange(256))[0]
    monkeypatch.setenv("PSGRAD_CTR_IDS", "hashed")
    task = get_task("ctr", seed=2)
    x, y = task.train_set.batch(torch.arange(256))
    assert x.dtype == torch.int64 and x.shape == plain.shape
    ids = x[:, :ctr.FIELDS]
    assert int(ids.abs().max()) > 2**53  # beyond what a float64 holds exactly
    assert torch.equal(x[:, ctr.FIELDS:].contiguous().view(torch.float64), plain[:, ctr.FIELDS:])  # the same features
    same = (plain[:, 0].unsqueeze(0) == plain[:, 0].unsqueeze(1)) == (ids[:, 0].unsqueeze(0) == ids[:, 0].unsqueeze(1))
    assert bool(same.all())  # one id, one hash (field 0)
    assert task.dense_model()(x).shape == (256,)  # the all-reduce baseline: the hashing trick
    model = task.build_model()
    assert model.embedding.dynamic
    servers = [psgrad.serve() for _ in range(2)]
    try:
        with psgrad.connect([s.address for s in servers], optimizer=psgrad.Adagrad(lr=0.05),
                            client=ClientConfig(shared_memory=False)) as ps:
            opt = ps.optimizer(model)
            for step in range(3):
                bx, by = task.train_set.batch(torch.arange(256 * step, 256 * (step + 1)))
                opt.zero_grad()
                task.loss_fn(model(bx), by).backward()
                opt.step()
            stored = [sum(t.rows_touched for t in s.shard.status().tables if t.kind == "sparse") for s in servers]
            assert min(stored) > 100, stored  # rows stored by hashed id, on both shards
    finally:
        for s in servers:
            s.stop()
    monkeypatch.setenv("PSGRAD_CTR_IDS", "raw")
    with pytest.raises(TaskError, match="PSGRAD_CTR_IDS must be 'dense' or 'hashed'"):
        get_task("ctr")


def test_the_tables_row_lifetime_comes_from_the_environment(small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    table = get_task("ctr").build_model().embedding
    assert (table.min_count, table.ttl, table.evict) == (0, 0, False)
    monkeypatch.setenv("PSGRAD_CTR_MIN_COUNT", "2")
    monkeypatch.setenv("PSGRAD_CTR_TTL", "5000")
    monkeypatch.setenv("PSGRAD_CTR_EVICT", "1")
    table = get_task("ctr").build_model().embedding
    assert (table.min_count, table.ttl, table.evict) == (2, 5000, True)
    monkeypatch.setenv("PSGRAD_CTR_EVICT", "yes")
    with pytest.raises(TaskError, match="PSGRAD_CTR_EVICT must be 0 or 1, got 'yes'"):
        get_task("ctr")
    monkeypatch.setenv("PSGRAD_CTR_EVICT", "0")
    monkeypatch.setenv("PSGRAD_CTR_TTL", "-3")
    with pytest.raises(TaskError, match="PSGRAD_CTR_TTL must be an integer >= 0"):
        get_task("ctr")


def test_table_flags_give_the_tables_an_optimizer_of_their_own(small: None) -> None:
    """`psgrad worker --optimizer adamw --table-optimizer adagrad --table-lr 0.05`: the task's table
    takes Adagrad at 0.05 in a param group of its own (its spec as the servers get it), the dense
    part AdamW; given for a task without psgrad embeddings, the flags are refused by name."""
    from psgrad.cli.flags import apply_recipe, client_config, job_spec, worker_config
    from psgrad.cli.parser import build_parser
    from psgrad.cli.train import table_groups
    from psgrad.core.optimizers.rows import check_row_settings
    from psgrad.core.sharding import TableSpec, param_specs
    from psgrad.errors import ConfigError
    from psgrad.worker.param_groups import with_groups

    argv = ["worker", "--servers", "127.0.0.1:1", "--task", "ctr", "--optimizer", "adamw", "--table-optimizer", "adagrad",
            "--table-lr", "0.05"]
    ns = build_parser().parse_args(argv)
    apply_recipe(ns)
    spec, config = job_spec(ns, 1, 1), worker_config(ns, ("127.0.0.1:1",), client_config(ns), 0, 1.0, None)
    assert (spec.optimizer, config.table_optimizer, config.table_lr) == ("adamw", "adagrad", 0.05)
    model = get_task("ctr").build_model()
    groups = table_groups(model, config, "ctr")
    assert groups is not None and groups[0]["params"] == [model.embedding]
    emb = model.embedding
    _, (table,) = with_groups(param_specs(model), model, groups, spec, [TableSpec("embedding", emb.num_embeddings, emb.embedding_dim)])
    assert (table.optimizer, table.lr_scale) == ("adagrad", pytest.approx(0.05 / spec.lr))
    check_row_settings(table.job_spec(spec), "embedding")  # (AdamW for the table alone is refused)
    plain = build_parser().parse_args(argv[:7])
    apply_recipe(plain)
    assert table_groups(model, worker_config(plain, (), client_config(plain), 0, 1.0, None), "ctr") is None
    with pytest.raises(ConfigError, match="task 'digits' has none"):
        table_groups(get_task("digits").build_model(), config, "digits")
