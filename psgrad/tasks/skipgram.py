"""Task "skipgram": word2vec's skip-gram with negative sampling (Mikolov et al., 2013), the classic
asynchronous parameter-server workload, on real text every machine with psgrad carries: the
identifiers of Python source code.

Corpus: the .py files of SOURCES (PSGRAD_SKIPGRAM_SOURCES, comma-separated; default
"stdlib,torch": the standard library of the running Python, and the installed torch package's
sources), files sorted by path, each read as its identifiers (names, attributes, keywords; the
regex below). The corpus is pinned by those versions: the same Python and torch give the same
corpus on every machine (with this project's pins, Python 3.11.7 and torch 2.13.0: 4,075 files,
7.47M tokens of the vocabulary). A file whose path (relative to its source) has CRC-32 ≡ 0 mod
HELD_OUT_MOD is held out. The vocabulary is every identifier seen at least MIN_COUNT times in the
training files (PSGRAD_SKIPGRAM_MIN_COUNT, default 3: 113,066 words there), numbered by falling
count; other tokens are dropped from the stream, as word2vec does. Building the corpus reads and
tokenizes the files once (about 13 s on a 2-vCPU machine); the result is kept in a cache file
(PSGRAD_CACHE_DIR, default ~/.cache/psgrad) keyed by the sources' file list and sizes.

Examples: example j is the training token at kept[j] (the positions that survive word2vec's
subsampling of frequent words, keep probability sqrt(t/f) + t/f with t = SUBSAMPLE) as the
center, one context word at an offset of 1..b on either side (b uniform in 1..WINDOW), and NEGATIVES
ids drawn from the unigram distribution to the power 3/4. Every draw is a function of (seed,
position), so the stream is the same on every worker and every run; x is [center, context,
negatives...] as int64, y is unused.

Model: two psgrad.Embedding tables of V rows of DIM values (PSGRAD_SKIPGRAM_DIM, default 64), the
words as centers and as contexts, on the servers; the logits are the dot products of the center's
row with the context's and the negatives' rows (times a learned scale, plus a learned bias: two
dense parameters, as a psgrad model needs at least one), and the loss is word2vec's:
-log σ(positive) - Σ log σ(-negative), averaged over the batch.

Evaluation: `test_loss`, the same loss on HELD_OUT_PAIRS pairs of the held-out files with fixed
negatives; `test_neighbours`, the share of PROBES (pairs of related identifiers: encode/decode,
read/write, min/max, ...) whose partner is among the NEAREST nearest words of the other by cosine,
among the NEIGHBOUR_POOL most frequent words; and the corpus's size (`corpus_tokens`) and
vocabulary (`vocabulary`).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import sys
import sysconfig
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from psgrad.core.rows import splitmix64
from psgrad.errors import TaskError
from psgrad.nn.embedding import Embedding
from psgrad.tasks.base import Task, register_task
from psgrad.tasks.files import skipgram_sources

DEFAULT_MIN_COUNT = 3
HELD_OUT_MOD = 50  # about 2 % of the files
DIM = 64
WINDOW = 5
NEGATIVES = 5
SUBSAMPLE = 1e-4
HELD_OUT_PAIRS = 20_000
NEIGHBOUR_POOL = 10_000
NEAREST = 10
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_SALT_KEEP, _SALT_CONTEXT, _SALT_NEGATIVE, _SALT_HELD_OUT = 1, 2, 3, 4
#: pairs of identifiers that play the same part in code: the test asks whether each one's partner
#: is among its nearest words (both ways)
PROBES = (("encode", "decode"), ("read", "write"), ("min", "max"), ("start", "stop"), ("True", "False"),
          ("keys", "values"), ("width", "height"), ("input", "output"), ("begin", "end"), ("left", "right"),
          ("open", "close"), ("src", "dst"), ("lower", "upper"), ("rows", "cols"), ("key", "value"),
          ("append", "extend"), ("float", "int"), ("load", "save"), ("head", "tail"), ("add", "remove"),
          ("forward", "backward"), ("lhs", "rhs"), ("first", "last"), ("send", "recv"), ("x", "y"),
          ("row", "col"), ("enter", "exit"), ("get", "set"), ("push", "pop"), ("train", "eval"))


def setting(name: str, default: int) -> int:
    """An integer setting of the task from the environment: PSGRAD_SKIPGRAM_DIM (the rows' width,
    default DIM), PSGRAD_SKIPGRAM_MIN_COUNT (the fewest sightings of a word in the vocabulary,
    default DEFAULT_MIN_COUNT). Every process of a job must see the same values.

    Raises:
        TaskError: not an integer >= 1.
    """
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) < 1:
        raise TaskError(f"task 'skipgram': {name} must be an integer >= 1, got {raw!r}")
    return int(raw)


def version_of(name: str, root: Path) -> str:
    """"Python 3.11.7", "torch 2.13.0+cpu", "json (Python 3.11.7)": what pins a source's files."""
    if name == "stdlib":
        return f"Python {platform.python_version()}"
    if root.parent == Path(sysconfig.get_paths()["stdlib"]):
        return f"{name} (Python {platform.python_version()})"
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} (no version)"


def source_files(name: str, root: Path) -> list[tuple[str, Path]]:
    """(name/path relative to the source, path) of its .py files, sorted; the standard library's
    without the packages installed into it (site-packages, dist-packages)."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if name == "stdlib" and ("site-packages" in path.parts or "dist-packages" in path.parts):
            continue
        out.append((f"{name}/{rel}", path))
    return sorted(out)


def held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


class Corpus:
    """The tokens of the training and held-out files as word ids, and the vocabulary."""

    def __init__(self, words: list[bytes], counts: np.ndarray, train: np.ndarray, test: np.ndarray,
                 described: str) -> None:
        self.words, self.counts, self.train, self.test, self.described = words, counts, train, test, described
        self.index = {w: i for i, w in enumerate(words)}

    @classmethod
    def build(cls, roots: list[tuple[str, Path]], least: int) -> Corpus:
        """Read every file (or the cache of an earlier build of the same files)."""
        names = [name for name, _ in roots]
        files = [f for name, root in roots for f in source_files(name, root)]
        if not files:
            raise TaskError(f"task 'skipgram': no .py files under {', '.join(names)}")
        key = hashlib.sha256(repr((least, [(rel, p.stat().st_size) for rel, p in files])).encode()).hexdigest()[:16]
        described = " + ".join(version_of(n, r) for n, r in roots)
        cache = Path(os.environ.get("PSGRAD_CACHE_DIR") or Path.home() / ".cache" / "psgrad") / f"skipgram-{key}.npz"
        try:
            with np.load(cache) as z:
                words = bytes(z["words"]).split(b"\n")
                return cls(words, z["counts"], z["train"], z["test"], described)
        except (OSError, KeyError, ValueError):
            pass
        print(f"task 'skipgram': reading the corpus ({described}: {len(files):,} files) once; cached in {cache}",
              file=sys.stderr, flush=True)
        train_tokens: list[list[bytes]] = []
        test_tokens: list[list[bytes]] = []
        counts: Counter[bytes] = Counter()
        for rel, path in files:
            tokens = _WORD.findall(path.read_bytes())
            if held_out(rel):
                test_tokens.append(tokens)
            else:
                train_tokens.append(tokens)
                counts.update(tokens)
        vocab = sorted((w for w, c in counts.items() if c >= least), key=lambda w: (-counts[w], w))
        if len(vocab) < 2:
            raise TaskError(f"task 'skipgram': {described} has fewer than 2 words seen {least} times")
        index = {w: i for i, w in enumerate(vocab)}

        def ids(parts: list[list[bytes]]) -> np.ndarray:
            flat = [index.get(w, -1) for tokens in parts for w in tokens]
            arr = np.asarray(flat, dtype=np.int32)
            return arr[arr >= 0]

        train, test = ids(train_tokens), ids(test_tokens)
        word_counts = np.asarray([counts[w] for w in vocab], dtype=np.int64)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, words=np.frombuffer(b"\n".join(vocab), dtype=np.uint8), counts=word_counts, train=train,
                     test=test)
            os.replace(tmp, cache)
        except OSError as exc:  # (a read-only home: build it again next time)
            print(f"task 'skipgram': could not cache the corpus in {cache}: {exc}", file=sys.stderr, flush=True)
        return cls(vocab, word_counts, train, test, described)


def uniforms(seed: int, salt: int, index: np.ndarray, k: int) -> np.ndarray:
    """[len(index), k] uniforms in (0, 1), a function of (seed, salt, index, column) only."""
    base = np.asarray(index, dtype=np.uint64)[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)[None, :]
    mixed = splitmix64(base ^ splitmix64(np.full(1, seed * 1_000_003 + salt, dtype=np.uint64))[0])
    return ((mixed >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


class PairStream(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Skip-gram examples of a token array: example j centered on tokens[kept[j]] (see the module doc)."""

    def __init__(self, tokens: np.ndarray, counts: np.ndarray, seed: int, salt: int = 0) -> None:
        self.tokens, self.seed, self.salt = tokens, seed, salt
        freq = counts / counts.sum()
        keep = np.minimum(1.0, np.sqrt(SUBSAMPLE / freq) + SUBSAMPLE / freq)
        positions = np.arange(len(tokens))
        self.kept = positions[uniforms(seed, _SALT_KEEP + salt, positions, 1)[:, 0] < keep[tokens]]
        noise = counts.astype(np.float64) ** 0.75
        self.noise_cdf = np.cumsum(noise / noise.sum())

    def __len__(self) -> int:
        return len(self.kept)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        j = index.numpy().astype(np.int64)
        at = self.kept[j]
        u = uniforms(self.seed, _SALT_CONTEXT + self.salt, j, 2)
        reach = 1 + (u[:, 0] * WINDOW).astype(np.int64)  # b in 1..WINDOW
        step = 1 + (u[:, 1] * 2 * reach).astype(np.int64)  # 1..2b
        offset = np.where(step <= reach, -step, step - reach)
        context = np.clip(at + offset, 0, len(self.tokens) - 1)
        context = np.where(context == at, np.clip(at + 1, 0, len(self.tokens) - 1), context)
        negatives = np.searchsorted(self.noise_cdf, uniforms(self.seed, _SALT_NEGATIVE + self.salt, j, NEGATIVES))
        negatives = np.minimum(negatives, len(self.noise_cdf) - 1)
        x = np.concatenate([self.tokens[at, None], self.tokens[context, None], negatives], axis=1).astype(np.int64)
        return torch.from_numpy(x), torch.zeros(len(j))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]


class SkipGram(nn.Module):
    """[n, 2 + NEGATIVES] ids -> [n, 1 + NEGATIVES] logits: the center's row against the context's and
    the negatives' rows (the `words` table for centers, `contexts` for the rest)."""

    def __init__(self, vocabulary: int, dim: int = DIM, dense: bool = False) -> None:
        super().__init__()
        if dense:  # word2vec's initialization: small centers, zero contexts
            words, contexts = nn.Embedding(vocabulary, dim), nn.Embedding(vocabulary, dim)
            nn.init.normal_(words.weight, std=0.5 / dim)
            nn.init.zeros_(contexts.weight)
            self.words: nn.Module = words
            self.contexts: nn.Module = contexts
        else:
            self.words, self.contexts = Embedding(vocabulary, dim, std=0.5 / dim), Embedding(vocabulary, dim, std=0.0)

        # a scale and a bias of the logits: word2vec has no dense weights, psgrad's step needs some
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        center = self.words(x[:, 0])
        others = self.contexts(x[:, 1:])
        return self.scale * torch.einsum("nd,nkd->nk", center, others) + self.bias


def negative_sampling_loss(logits: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    """word2vec's loss: -log σ(the context's logit) - Σ log σ(-a negative's logit), the batch's mean."""
    return -(F.logsigmoid(logits[:, 0]) + F.logsigmoid(-logits[:, 1:]).sum(dim=1)).mean()


def neighbour_share(model: SkipGram, corpus: Corpus) -> float:
    """The share of PROBES (each pair both ways, words in the pool only) whose partner is among
    the NEAREST nearest of the pool's words by cosine of their `words` rows."""
    pool = min(NEIGHBOUR_POOL, len(corpus.words))
    pairs = [(corpus.index[a], corpus.index[b]) for a, b in ((a.encode(), b.encode()) for a, b in PROBES)
             if corpus.index.get(a, pool) < pool and corpus.index.get(b, pool) < pool]
    if not pairs:
        return 0.0
    rows = F.normalize(model.words(torch.arange(pool)).float(), dim=1)
    hits = 0
    for a, b in pairs:
        for q, partner in ((a, b), (b, a)):
            sims = rows @ rows[q]
            sims[q] = -2.0
            hits += int(partner in torch.topk(sims, min(NEAREST, pool - 1)).indices.tolist())
    return hits / (2 * len(pairs))


@register_task("skipgram")  # its recipe: psgrad/tasks/registry.py
def skipgram_task(seed: int = 0) -> Task:
    """word2vec on the identifiers of the standard library and torch (see the module doc)."""
    corpus = Corpus.build(skipgram_sources(), setting("PSGRAD_SKIPGRAM_MIN_COUNT", DEFAULT_MIN_COUNT))
    if len(corpus.train) < 2 * WINDOW or len(corpus.test) < 2 * WINDOW:
        raise TaskError(f"task 'skipgram': {corpus.described} gives too few tokens to train and test on "
                        f"({len(corpus.train):,} and {len(corpus.test):,})")
    stream = PairStream(corpus.train, corpus.counts, seed)
    held = PairStream(corpus.test, corpus.counts, seed=0, salt=_SALT_HELD_OUT)  # the same pairs for every seed
    picked = torch.from_numpy(np.linspace(0, len(held) - 1, min(HELD_OUT_PAIRS, len(held))).astype(np.int64))
    test_x, test_y = held.batch(picked)
    vocabulary, width = len(corpus.words), setting("PSGRAD_SKIPGRAM_DIM", DIM)

    @torch.no_grad()
    def evaluate_on(model: nn.Module, device: torch.device, xs: torch.Tensor, ys: torch.Tensor) -> dict[str, float]:
        was_training = model.training
        model.eval()
        chunks = xs.split(4096)
        loss = sum(float(negative_sampling_loss(model(x.to(device)), ys)) * len(x) for x in chunks) / len(xs)
        share = neighbour_share(model, corpus) if isinstance(model, SkipGram) else 0.0
        model.train(was_training)
        return {"test_loss": loss, "test_neighbours": share, "corpus_tokens": float(len(corpus.train) + len(corpus.test)),
                "vocabulary": float(vocabulary)}

    return Task(
        name="skipgram",
        build_model=lambda: SkipGram(vocabulary, width),
        train_set=stream,
        test_x=test_x,
        test_y=test_y,
        loss_fn=negative_sampling_loss,
        evaluator=evaluate_on,
        dense_model=lambda: SkipGram(vocabulary, width, dense=True),
    )
