"""Task "skipgram", word2vec with negative sampling on Python identifiers: its corpus (held-out files
apart, vocabulary by count, a cache that gives back the same arrays), its examples (deterministic,
the context within the window, negatives from the vocabulary), its loss and neighbour check, and a
short async training against two real in-process servers on a small corpus (five packages of the
standard library) whose held-out loss falls."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import psgrad
from psgrad.config import ClientConfig
from psgrad.errors import TaskError
from psgrad.tasks import get_task
from psgrad.tasks.files import skipgram_sources
from psgrad.tasks.skipgram import (NEGATIVES, PROBES, WINDOW, Corpus, PairStream, SkipGram, held_out,
                                   negative_sampling_loss, neighbour_share)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PSGRAD_SKIPGRAM_SOURCES", "asyncio,email,json,logging,unittest")
    monkeypatch.setenv("PSGRAD_SKIPGRAM_MIN_COUNT", "2")
    monkeypatch.setenv("PSGRAD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_corpus_keeps_held_out_files_apart_and_is_cached_as_built(small: Path) -> None:
    corpus = Corpus.build(skipgram_sources(), 2)
    assert list(small.glob("skipgram-*.npz")), "no cache file"
    again = Corpus.build(skipgram_sources(), 2)  # from the cache
    assert again.words == corpus.words and np.array_equal(again.train, corpus.train)
    assert np.array_equal(again.test, corpus.test) and np.array_equal(again.counts, corpus.counts)
    assert len(corpus.test) > 0 and len(corpus.train) > 10 * len(corpus.test)
    assert (np.diff(corpus.counts) <= 0).all() and corpus.counts[-1] >= 2  # by falling count, all seen twice
    assert corpus.words[:3] == [b"self", b"the", b"if"] or b"self" in corpus.words[:5]
    assert held_out("json/decoder.py") is held_out("json/decoder.py")
    assert corpus.described.startswith("asyncio (Python 3.") and corpus.described.count(" + ") == 4


def test_examples_are_deterministic_in_the_window_and_from_the_vocabulary(small: Path) -> None:
    corpus = Corpus.build(skipgram_sources(), 2)
    stream = PairStream(corpus.train, corpus.counts, seed=0)
    assert 0 < len(stream) < len(corpus.train)  # frequent words subsampled
    index = torch.arange(0, len(stream), max(1, len(stream) // 3000))
    x, y = stream.batch(index)
    again, _ = PairStream(corpus.train, corpus.counts, seed=0).batch(index)
    other, _ = PairStream(corpus.train, corpus.counts, seed=1).batch(index)
    assert torch.equal(x, again) and not torch.equal(x, other)
    assert x.shape == (len(index), 2 + NEGATIVES) and y.shape == (len(index),)
    assert int(x.min()) >= 0 and int(x.max()) < len(corpus.words)
    centers = stream.kept[index.numpy()]
    assert (x[:, 0].numpy() == corpus.train[centers]).all()
    # the context is a token within WINDOW of the center: find it there
    near = [set(corpus.train[max(0, c - WINDOW):c + WINDOW + 1].tolist()) for c in centers]
    assert all(int(ctx) in s for ctx, s in zip(x[:, 1], near))
    # negatives follow counts^0.75: the most frequent word is drawn far more often than the median one
    drawn = np.bincount(x[:, 2:].flatten().numpy(), minlength=len(corpus.words))
    assert drawn[0] > 20 * max(1, drawn[len(corpus.words) // 2])
    assert stream[5][0].tolist() == stream.batch(torch.tensor([5]))[0][0].tolist()


def test_the_loss_is_word2vecs_and_the_neighbour_check_finds_planted_partners(small: Path) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0]])
    sig = torch.sigmoid
    want = -((torch.log(sig(torch.tensor(2.0))) + torch.log(sig(torch.tensor(1.0))) + torch.log(sig(torch.tensor(-0.5))))
             + (3 * math.log(0.5))) / 2
    assert torch.allclose(negative_sampling_loss(logits, torch.zeros(2)), want)
    corpus = Corpus.build(skipgram_sources(), 2)
    model = SkipGram(len(corpus.words), dim=8, dense=True)
    pool = [(corpus.index.get(a.encode()), corpus.index.get(b.encode())) for a, b in PROBES]
    pairs = [(a, b) for a, b in pool if a is not None and b is not None and max(a, b) < 10_000]
    assert pairs, "no probe pair in the small corpus"
    with torch.no_grad():
        for k, (a, b) in enumerate(pairs):  # each pair alone in a direction of its own
            model.words.weight[a] = 0.0
            model.words.weight[b] = 0.0
            model.words.weight[a, k % 8] = 100.0 + k
            model.words.weight[b, k % 8] = 100.0 + k
    share = neighbour_share(model, corpus)
    assert share > 0.5, share
    assert neighbour_share(SkipGram(len(corpus.words), dim=8, dense=True), corpus) < share


def test_bad_sources_and_counts_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGRAD_SKIPGRAM_SOURCES", "stdlib,no_such_package_here")
    with pytest.raises(TaskError, match="'no_such_package_here' is neither 'stdlib' nor an installed package"):
        skipgram_sources()
    monkeypatch.setenv("PSGRAD_SKIPGRAM_SOURCES", "json")
    monkeypatch.setenv("PSGRAD_SKIPGRAM_MIN_COUNT", "0")
    with pytest.raises(TaskError, match="PSGRAD_SKIPGRAM_MIN_COUNT must be an integer >= 1"):
        get_task("skipgram")


def test_skipgram_trains_async_against_two_real_servers(small: Path, make_servers) -> None:  # type: ignore[no-untyped-def]
    task = get_task("skipgram")
    assert task.evaluator is not None and task.test_x is not None and task.test_y is not None
    servers = make_servers(2)
    torch.manual_seed(0)
    model = task.build_model()
    client = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, reconnect_timeout_s=0, shared_memory=False)
    stream = task.train_set
    assert isinstance(stream, PairStream)
    with psgrad.connect([s.address for s in servers], mode="async", optimizer=psgrad.Adagrad(lr=0.2),
                        client=client) as ps:
        opt = ps.optimizer(model)
        before = task.evaluator(model, torch.device("cpu"), task.test_x, task.test_y)
        g = torch.Generator().manual_seed(0)
        for _ in range(150):
            x, y = stream.batch(torch.randint(0, len(stream), (256,), generator=g))
            opt.zero_grad()
            task.loss_fn(model(x), y).backward()
            opt.step()
        after = task.evaluator(model, torch.device("cpu"), task.test_x, task.test_y)
        stored = sum(t.rows_touched for s in servers for t in s.shard.status().tables if t.kind == "sparse")
    print(f"skipgram (five stdlib packages): held-out loss {before['test_loss']:.3f} -> {after['test_loss']:.3f}, "
          f"neighbours {after['test_neighbours']:.3f}, vocabulary {after['vocabulary']:.0f}, {stored:,} rows stored")
    assert before["test_loss"] == pytest.approx(6 * math.log(2), abs=0.01)  # zero context rows: every logit 0
    assert after["test_loss"] < before["test_loss"] - 0.5
    assert after["vocabulary"] == before["vocabulary"] > 1000 and after["corpus_tokens"] > 100_000
    assert 0 < stored <= 2 * after["vocabulary"]
