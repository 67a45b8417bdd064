"""Task "ctr": a synthetic click-through-rate workload whose embedding table is too big to replicate,
for psgrad's sparse tables (psgrad.Embedding: rows on the servers, pulled and pushed by id).

Data: 26 categorical fields and 13 dense features per example. Field f has a vocabulary of V_f ids
(the sizes fall geometrically from field to field and sum to PSGRAD_CTR_ROWS, default 32M: 4.1 GB of rows at dim 32); its
ids follow a Zipf-like law (a continuous power law with exponent ZIPF_S on [1, V_f + 1), floored),
so small ids are hot: the servers place row r on shard r mod S, which spreads them. Every example
is a function of (seed, its index) alone — counter-based draws (splitmix64), made a batch at a
time — so a worker holds no training data: the training set is 1M indices, the test set 50k
examples made once.

Labels come from a planted model, so the best test AUC is known: logit = bias + the sum over fields
of an effect of the example's id (nonzero for the HOT_IDS most frequent ids of each field, N(0,
EFFECT_STD^2) drawn from (field, id)) + a linear function of the dense features + one pairwise
product of them; the label is a Bernoulli draw of sigmoid(logit). `bayes_auc` is that logit's AUC
on the test set: no model can do better in expectation.

Model: DLRM-style. One psgrad.Embedding of all fields' rows (field f's ids offset by the earlier
vocabularies: one table, so a forward makes one pull per shard), a bottom MLP of the dense features,
the pairwise dot products of the 27 vectors, and a top MLP. The dense variant (`Task.dense_model`,
what the all-reduce baseline trains) has a torch.nn.Embedding of the same size instead.

The input x of an example is one float64 row: its 26 ids (exact in float64), then its 13 features;
with PSGRAD_CTR_IDS=hashed, one int64 row: the 26 ids hashed with their field to raw 64-bit ids (as
a recommender's logs carry them; the model's table is then dynamic, any int64 id), then the
features' float64 bits.
PSGRAD_CTR_MIN_COUNT, PSGRAD_CTR_TTL and PSGRAD_CTR_EVICT set the table's row lifetime (psgrad.Embedding's
min_count=, ttl=, evict=; default off).
PSGRAD_CTR_ROWS (total rows) and PSGRAD_CTR_DIM (embedding width, default 32) size the table: a
task is built from its seed alone, so its size comes from the environment (every worker of a job
must see the same values; the servers refuse a job whose table differs).

Drift (PSGRAD_CTR_DRIFT=RATE, default 0: none). The clicks become a stream whose example i happens
at time t = i / 1M, read in time order (never shuffled, never repeated: BatchSchedule). Popularity
moves: field f's id of Zipf rank k at time t is (k + floor(RATE * t * SHIFT_IDS)) mod V_f, so the
hot ids change and ids never seen before keep arriving. Preferences move: every id has a planted
effect, EFFECT_STD * (a cos(theta) + b sin(theta)) with a, b ~ N(0, 1) drawn from (field, id) and
theta = RATE * t * pi / 2. The test set is the most recent window: RECENT_EXAMPLES examples spread
over the last RECENT_WINDOW of time before the newest example the worker trained on, drawn afresh
at each evaluation (and `bayes_auc` on that window).
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from psgrad.core.rows import splitmix64
from psgrad.errors import TaskError
from psgrad.nn.embedding import Embedding, SparseEmbedding
from psgrad.tasks.base import Task, register_task

FIELDS, DENSE = 26, 13
DEFAULT_ROWS, DEFAULT_DIM = 32_000_000, 32
MIN_ROWS = 10 * FIELDS
ZIPF_S = 1.5
HOT_IDS = 20  # ids with a planted effect, per field
EFFECT_STD = 0.6
DENSE_STD = 0.25
BIAS = -1.0
TRAIN_EXAMPLES, TEST_EXAMPLES = 1_000_000, 50_000
EVAL_BATCH = 2048  # examples per forward when evaluating (its activations are the worker's peak memory)
INIT_STD = 0.01  # the embedding rows' initial N(0, std^2)
_SALT_DATA, _SALT_TEST, _SALT_PLANTED = 1, 2, 3
_SALT_EFFECT_A, _SALT_EFFECT_B = 4, 5
SHIFT_IDS = 2000  # drift: how far (in Zipf ranks) the hot ids move per unit of time at RATE 1
RECENT_EXAMPLES, RECENT_WINDOW = 10_000, 0.02  # drift: the test window (examples, and its span in time)
_COLUMNS = FIELDS + 2 * DENSE + 1  # uniforms per example: ids, features (Box-Muller pairs), label


def table_size() -> tuple[int, int]:
    """(rows, dim) from PSGRAD_CTR_ROWS and PSGRAD_CTR_DIM.

    Raises:
        TaskError: not integers, or too small (at least 10 rows per field, dim >= 1).
    """
    try:
        rows = int(os.environ.get("PSGRAD_CTR_ROWS", DEFAULT_ROWS))
        dim = int(os.environ.get("PSGRAD_CTR_DIM", DEFAULT_DIM))
    except ValueError as exc:
        raise TaskError(f"task 'ctr': PSGRAD_CTR_ROWS and PSGRAD_CTR_DIM must be integers ({exc})") from None
    if rows < MIN_ROWS or dim < 1:
        raise TaskError(f"task 'ctr': PSGRAD_CTR_ROWS must be >= {MIN_ROWS} and PSGRAD_CTR_DIM >= 1, got {rows}, {dim}")
    return rows, dim


def drift_rate() -> float:
    """PSGRAD_CTR_DRIFT: how fast the stream drifts (0: a fixed distribution, the default).

    Raises:
        TaskError: not a number >= 0.
    """
    raw = os.environ.get("PSGRAD_CTR_DRIFT", "0")
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not rate >= 0 or rate == float("inf"):
        raise TaskError(f"task 'ctr': PSGRAD_CTR_DRIFT must be a number >= 0 (0: no drift), got {raw!r}")
    return rate


def row_lifetime() -> tuple[int, int, bool]:
    """The table's row lifetime, (min_count, ttl, evict) of psgrad.Embedding, from PSGRAD_CTR_MIN_COUNT,
    PSGRAD_CTR_TTL (integers >= 0, default 0: off) and PSGRAD_CTR_EVICT (0 or 1, default 0).

    Raises:
        TaskError: another value.
    """
    values = []
    for name in ("PSGRAD_CTR_MIN_COUNT", "PSGRAD_CTR_TTL", "PSGRAD_CTR_EVICT"):
        raw = os.environ.get(name, "0")
        flag = name == "PSGRAD_CTR_EVICT"
        if not raw.isdigit() or (flag and raw not in ("0", "1")):
            raise TaskError(f"task 'ctr': {name} must be {'0 or 1' if flag else 'an integer >= 0 (0: off)'}, got {raw!r}")
        values.append(int(raw))
    return values[0], values[1], values[2] == 1


def hashed_ids() -> bool:
    """PSGRAD_CTR_IDS: "hashed" feeds the model raw 64-bit hashed ids (a dynamic table), "dense" (the
    default) each field's ids offset into one table of PSGRAD_CTR_ROWS rows.

    Raises:
        TaskError: another value.
    """
    kind = os.environ.get("PSGRAD_CTR_IDS", "dense")
    if kind not in ("dense", "hashed"):
        raise TaskError(f"task 'ctr': PSGRAD_CTR_IDS must be 'dense' or 'hashed', got {kind!r}")
    return kind == "hashed"


def encode_hashed(x: np.ndarray) -> torch.Tensor:
    """Examples as a recommender's logs carry them: [n, 39] int64, each field's id hashed with its
    field to a 64-bit id (splitmix64 of field << 56 | id; never int64's two smallest, which a dynamic
    table reserves), then the 13 features' float64 bits (the model views them back)."""
    ids = x[:, :FIELDS].astype(np.uint64) | (np.arange(FIELDS, dtype=np.uint64) << np.uint64(56))
    hashed = splitmix64(ids).view(np.int64)
    hashed[hashed <= np.iinfo(np.int64).min + 1] += 2
    features = np.ascontiguousarray(x[:, FIELDS:]).view(np.int64)
    return torch.from_numpy(np.concatenate([hashed, features], axis=1))


def _normal(seed: int, salt: int, field: int, ids: np.ndarray) -> np.ndarray:
    """N(0, 1) draws, one per (field, id), a function of (seed, salt, field, id) only."""
    u = _uniforms(seed, salt * 64 + field, ids, 2)
    return np.sqrt(-2.0 * np.log(u[:, 0])) * np.cos(2.0 * np.pi * u[:, 1])


def vocabularies(total: int) -> np.ndarray:
    """The 26 fields' vocabulary sizes: falling geometrically (ratio 0.8), at least 10 each, summing to total."""
    weights = 0.8 ** np.arange(FIELDS)
    sizes = np.maximum(10, np.floor(weights / weights.sum() * total)).astype(np.int64)
    sizes[0] += total - sizes.sum()
    return sizes


def _uniforms(seed: int, salt: int, index: np.ndarray, columns: int) -> np.ndarray:
    """[len(index), columns] uniforms in (0, 1), a function of (seed, salt, index, column) only."""
    with np.errstate(over="ignore"):
        key = splitmix64(np.array([seed * 0x9E3779B1 + salt], dtype=np.uint64))[0]
        counter = index.astype(np.uint64)[:, None] * np.uint64(columns) + np.arange(columns, dtype=np.uint64)
        bits = splitmix64(counter ^ key)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


class Generator:
    """Examples and their planted logits, as functions of (seed, index)."""

    def __init__(self, seed: int, total_rows: int, drift: float = 0.0) -> None:
        self.seed, self.drift = seed, drift
        self.sizes = vocabularies(total_rows)
        planted = np.random.default_rng([seed, _SALT_PLANTED])
        hot = np.minimum(self.sizes, HOT_IDS)
        self.effects = [planted.normal(0.0, EFFECT_STD, int(h)) for h in hot]  # field f: its hot ids' effects
        self.dense_w = planted.normal(0.0, DENSE_STD, DENSE)
        self.pair_w = 0.5

    def _ids(self, u: np.ndarray) -> np.ndarray:
        """Zipf-like ids per field from uniforms [n, 26] (inverse CDF of a power law on [1, V + 1))."""
        v = self.sizes.astype(np.float64)
        a = 1.0 - ZIPF_S
        x = ((v + 1.0) ** a - 1.0) * u + 1.0
        ids = np.floor(x ** (1.0 / a)) - 1.0
        return np.clip(ids, 0, v - 1)

    def examples(self, salt: int, index: np.ndarray, times: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x [n, 39] float64: ids then features, labels [n] float32, planted logits [n]); with
        drift, each example at its time (default: its index / TRAIN_EXAMPLES, the stream's)."""
        u = _uniforms(self.seed, salt, index, _COLUMNS)
        ids = self._ids(u[:, :FIELDS])
        u1, u2 = u[:, FIELDS:FIELDS + DENSE], u[:, FIELDS + DENSE:FIELDS + 2 * DENSE]
        dense = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        logit = np.full(len(index), BIAS) + dense @ self.dense_w + self.pair_w * dense[:, 0] * dense[:, 1]
        if self.drift:
            t = index.astype(np.float64) / TRAIN_EXAMPLES if times is None else times
            shift = np.floor(self.drift * t * SHIFT_IDS)
            theta = self.drift * t * np.pi / 2
            for f in range(FIELDS):
                ids[:, f] = np.mod(ids[:, f] + shift, self.sizes[f])
                col = ids[:, f].astype(np.int64)
                a, b = _normal(self.seed, _SALT_EFFECT_A, f, col), _normal(self.seed, _SALT_EFFECT_B, f, col)
                logit += EFFECT_STD * (a * np.cos(theta) + b * np.sin(theta))
            labels = (u[:, -1] < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
            return np.concatenate([ids, dense], axis=1), labels, logit
        for f, effects in enumerate(self.effects):
            col = ids[:, f].astype(np.int64)
            hot = col < len(effects)
            logit[hot] += effects[col[hot]]
        labels = (u[:, -1] < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return np.concatenate([ids, dense], axis=1), labels, logit


class ClickStream(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The training examples: `length` indices, each example made when asked for (`batch` makes
    a batch at once; BatchSchedule uses it)."""

    def __init__(self, generator: Generator, length: int = TRAIN_EXAMPLES, hashed: bool = False) -> None:
        self.generator, self.length, self.hashed = generator, length, hashed
        #: with drift: a stream in time order (BatchSchedule reads it so), and its newest example here
        self.in_time_order = generator.drift > 0
        self.latest = -1

    def __len__(self) -> int:
        return self.length

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, _ = self.generator.examples(_SALT_DATA, index.numpy())
        if index.numel():
            self.latest = max(self.latest, int(index.max()))
        return (encode_hashed(x) if self.hashed else torch.from_numpy(x)), torch.from_numpy(y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The area under the ROC curve: the probability that a positive scores above a negative, ties
    counted half (ranks averaged over ties). 0.5 when one class is absent."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if unique.numel() < scores.numel():
        first = torch.cumsum(counts, 0) - counts + 1
        mean_rank = first + (counts - 1) / 2.0
        ranks[order] = mean_rank[inverse].double()
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


class DLRM(nn.Module):
    """Embeddings of the 26 fields (one table), a bottom MLP of the 13 features, their pairwise dot
    products, a top MLP; sparse=False: the table is a local torch.nn.Embedding (dense gradients)."""

    offsets: torch.Tensor
    pairs: torch.Tensor

    def __init__(self, sizes: np.ndarray, dim: int, sparse: bool = True, init_std: float = INIT_STD,
                 hashed: bool = False, lifetime: tuple[int, int, bool] = (0, 0, False)) -> None:
        super().__init__()
        total = int(sizes.sum())
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
        self.register_buffer("offsets", offsets, persistent=False)
        self.hashed, self.total = hashed, total  # hashed: x holds 64-bit ids and the features' float64 bits
        if sparse:
            self.embedding: nn.Module = Embedding(None if hashed else total, dim, std=init_std, min_count=lifetime[0],
                                                  ttl=lifetime[1], evict=lifetime[2])
        else:  # (hashed: the hashing trick, ids mod the table's rows)
            self.embedding = nn.Embedding(total, dim)
            nn.init.normal_(self.embedding.weight, 0.0, init_std)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        pairs = (FIELDS + 1) * FIELDS // 2
        self.register_buffer("pairs", torch.triu_indices(FIELDS + 1, FIELDS + 1, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(pairs + dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hashed:
            ids = x[:, :FIELDS]
            if isinstance(self.embedding, nn.Embedding):
                ids = torch.remainder(ids, self.total)
            d = self.bottom(x[:, FIELDS:].contiguous().view(torch.float64).float())
        else:
            ids = x[:, :FIELDS].long() + self.offsets
            d = self.bottom(x[:, FIELDS:].float())
        z = torch.cat([d.unsqueeze(1), self.embedding(ids)], dim=1)  # [B, 27, dim]
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([d, inter], dim=1)).squeeze(1)


def embedding_rows(model: nn.Module) -> tuple[int, int]:
    """(rows, bytes) of the model's embedding tables: psgrad's (on the servers) and torch's (local)."""
    rows = nbytes = 0
    for m in model.modules():
        if isinstance(m, SparseEmbedding):
            rows, nbytes = rows + m.num_embeddings, nbytes + m.nbytes
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            rows, nbytes = rows + m.num_embeddings, nbytes + m.weight.numel() * m.weight.element_size()
    return rows, nbytes


def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y.float())


@register_task("ctr")  # its recipe: psgrad/tasks/registry.py
def ctr_task(seed: int = 0) -> Task:
    """The synthetic click-through workload (see the module doc); its size from the environment."""
    total, dim = table_size()
    generator = Generator(seed, total, drift_rate())
    hashed, lifetime = hashed_ids(), row_lifetime()
    stream = ClickStream(generator, hashed=hashed)
    as_input = encode_hashed if hashed else torch.from_numpy
    parts = [generator.examples(_SALT_TEST, np.arange(lo, min(lo + EVAL_BATCH, TEST_EXAMPLES)))
             for lo in range(0, TEST_EXAMPLES, EVAL_BATCH)]  # (in pieces: the temporaries stay small)
    test_x = as_input(np.concatenate([p[0] for p in parts]))
    test_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    bayes = auc(torch.from_numpy(np.concatenate([p[2] for p in parts])), test_y)

    def recent_window() -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Drift: the test window before the newest example this worker trained on (x, y, its
        bayes AUC, the time it ends at)."""
        now = (stream.latest + 1) / TRAIN_EXAMPLES
        index = np.arange(RECENT_EXAMPLES)
        times = now - RECENT_WINDOW * (1.0 - index / RECENT_EXAMPLES)
        x, y, logit = generator.examples(_SALT_TEST, index, times)
        labels = torch.from_numpy(y)
        return as_input(x), labels, auc(torch.from_numpy(logit), labels), now

    @torch.no_grad()
    def evaluate_on(model: nn.Module, device: torch.device, xs: torch.Tensor, ys: torch.Tensor,
                    batch: int = EVAL_BATCH) -> dict[str, float]:
        best, extra = bayes, {}
        if generator.drift:  # the most recent window, not the fixed test set
            xs, ys, best, now = recent_window()
            extra = {"test_time": now}
        was_training = model.training
        model.eval()
        with torch.no_grad():  # (read-only reads of the rows: an evaluation's forwards take no gradient)
            logits = torch.cat([model(xs[lo:lo + batch].to(device)).float().cpu() for lo in range(0, len(xs), batch)])
        model.train(was_training)
        rows, nbytes = embedding_rows(model)
        return {"test_loss": float(bce(logits, ys)), "test_accuracy": float(((logits > 0) == (ys > 0.5)).float().mean()),
                "test_auc": auc(logits, ys), "bayes_auc": best, "embedding_rows": rows, "embedding_bytes": nbytes,
                **extra}

    return Task(
        name="ctr",
        build_model=lambda: DLRM(generator.sizes, dim, hashed=hashed, lifetime=lifetime),
        train_set=stream,
        test_x=test_x,
        test_y=test_y,
        loss_fn=bce,
        quick_eval=10_000,
        evaluator=evaluate_on,
        dense_model=lambda: DLRM(generator.sizes, dim, sparse=False, hashed=hashed),
    )
