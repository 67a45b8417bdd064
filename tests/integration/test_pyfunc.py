"""Task "pyfunc", the sparse task on real text: functions of twelve standard-library packages, their
words hashed to 64-bit ids, classified by package with a dynamic table (psgrad.EmbeddingBag(None, ...))
trained against two real in-process servers; its split keeps every file on one side."""
from __future__ import annotations

import pytest
import torch

import psgrad
from psgrad.config import ClientConfig
from psgrad.tasks import get_task
from psgrad.tasks.files import STDLIB_PACKAGES, stdlib_packages
from psgrad.tasks.pyfunc import WIDTH, FunctionClassifier, features, package_files, split, word_id

pytestmark = pytest.mark.timeout(240)


def test_ids_are_stable_64_bit_hashes_and_the_split_keeps_files_apart() -> None:
    assert word_id(b"self") == word_id(b"self") and word_id(b"self") != word_id(b"cls")
    ids = features(b"def get(self, key):\n    return self._data[key]")
    words = [b"def", b"get", b"self", b"key", b"return", b"self", b"_data", b"key"]
    assert ids == [word_id(w) for w in words] + [word_id(a + b" " + b) for a, b in zip(words, words[1:])]
    assert 0 not in ids and len(features(b"x " * 200)) == WIDTH  # never the padding; at most MAX_WORDS words
    (train_x, train_y), (test_x, test_y) = split(package_files(stdlib_packages()))
    assert train_x.shape[1] == WIDTH and len(train_x) == len(train_y) and len(test_x) == len(test_y)
    seen = {tuple(r) for r in train_x.tolist()}
    assert sum(tuple(r) in seen for r in test_x.tolist()) < 0.05 * len(test_x)  # (boilerplate repeats: 2.6 %)
    assert set(train_y.tolist()) == set(test_y.tolist()) == set(range(len(STDLIB_PACKAGES)))


def test_pyfunc_trains_with_a_dynamic_table_against_real_servers(make_servers) -> None:  # type: ignore[no-untyped-def]
    task = get_task("pyfunc")
    assert task.train_x is not None and task.train_y is not None and task.test_x is not None
    servers = make_servers(2)
    torch.manual_seed(0)
    model = task.build_model()
    before = task.evaluate(model.__class__(dense=True), torch.device("cpu"))["test_accuracy"]  # (untrained)
    client = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, reconnect_timeout_s=0, shared_memory=False)
    with psgrad.connect([s.address for s in servers], optimizer=psgrad.Adagrad(lr=0.1), client=client) as ps:
        opt = ps.optimizer(model)
        g = torch.Generator().manual_seed(0)
        for _ in range(150):
            pick = torch.randint(0, len(task.train_x), (64,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(task.train_x[pick]), task.train_y[pick]).backward()
            opt.step()
        after = task.evaluate(model, torch.device("cpu"))["test_accuracy"]
        stored = sum(t.rows_touched for s in servers for t in s.shard.status().tables if t.kind == "sparse")
    print(f"pyfunc: test accuracy {before:.3f} untrained, {after:.3f} after 150 steps; {stored:,} rows stored")
    assert after > 0.45 and after > before + 0.2
    assert stored > 10_000  # one per distinct id updated: 64-bit hashes, no collisions
    dense = FunctionClassifier(dense=True)
    assert dense(task.test_x[:4]).shape == (4, len(STDLIB_PACKAGES))  # the all-reduce baseline's hashing trick
