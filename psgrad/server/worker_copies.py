"""Compressed pulls, the server's half: per worker, the copy of the weights that worker holds, and
the change since it, encoded with a push codec (see DeltaAsk in ps.proto).

A worker that pulls with `--compress-pull CODEC` does not receive the weights w but C(w - c), where
c is its copy: what the server last sent it, added up exactly as the worker adds it up. Both ends
then add the decoded change to c (the same float32 additions of the same decoded values, so the two
copies stay equal bit for bit). What C left out remains in w - c and is sent with the next pull:
error feedback kept on the server's side, per worker, as in DoubleSqueeze (Tang et al., 2019) but
against each worker's own copy (workers pull different versions at different times in async and
ssp). The copy's distance from the weights, e = w - c, then stays bounded: for a codec that keeps
a share delta of a vector's squared norm (top-k with ratio R: delta >= R; int8: nearly all of it),
||e|| <= q / (1 - q) * D with q = sqrt(1 - delta) and D the largest change of the weights between
two pulls of the worker (docs/guide/compression.md, "Compressed pulls"). The
worker may also ask for the exact weights now and then (DeltaAsk.resync_every, resync_error).

The copies live in this process only: a restarted server or a promoted standby holds none, and the
first pull of each worker after it is exact (the worker's `holds` names no copy here). So are
observe pulls, exports and fetch_state_dict, which never ask for a change.
"""
from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass

import torch

from psgrad.core.codecs import byte_view, get_codec
from psgrad.core.compression import Compression, parse_compression
from psgrad.core.gradient_codecs import RangeCodec
from psgrad.core.status import DeltaStatus
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.proto import ps_pb2 as pb


@dataclass
class DeltaPull:
    """What one pull of a worker with compressed pulls sends: the payload, its codec ("": the
    weights in the wire dtype, exact), the copy the worker holds once it applied it (`copy`, its
    next DeltaAsk.holds) and that copy's relative distance from the weights (`drift`)."""

    payload: memoryview
    compress: str
    copy: int
    drift: float
    held: torch.Tensor  # the worker's copy once applied (the server's: read it before that worker's next pull)


class _Copy:
    """One worker's copy of a shard's range: its values (float32), the token that names them, the
    version they were last exact at, and the codec that encodes the changes (its random draws and
    payload buffer; made at the first change, again if the worker asks for another codec)."""

    def __init__(self, values: torch.Tensor, token: int, synced: int) -> None:
        self.values = values
        self.token = token
        self.synced = synced
        self.codec: RangeCodec | None = None
        self.lock = threading.Lock()  # one pull of this worker at a time reads and moves the copy


def _token() -> int:
    """A fresh name for a copy: random, so a copy of another server (or of this one before a
    restart) is never mistaken for one held here; never 0 (a worker that holds none)."""
    return secrets.randbits(63) | 1


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


class WorkerCopies:
    """The copies of every worker that pulls compressed from one shard, and their counts. A copy
    is kept per rank (at most num_workers of them): a worker that left and joined again, or was
    evicted, has its next pull exact and reuses its rank's memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[int, _Copy] = {}
        self._compressed = self._exact = self._resyncs = 0
        self._drift = self._drift_max = 0.0

    def serve(
        self, rank: int, ask: pb.DeltaAsk, weights: torch.Tensor, version: int, wire_dtype: str, plain: int,
    ) -> DeltaPull:
        """The payload of a pull of `weights` (float32, the shard's range at `version`, a private
        snapshot) for worker `rank`, who asked with `ask`. `plain`: the range's model buffers
        (its tail), which travel as plain changes (see RangeCodec).

        Raises:
            InvalidRequestError: the ask names no codec this server knows.
        """
        compression = check_ask(ask, rank)
        with self._lock:
            copy = self._copies.get(rank)
            if copy is None or copy.values.numel() != weights.numel():
                copy = self._copies[rank] = _Copy(torch.empty_like(weights), 0, version)
        with copy.lock:
            why = self._exact_because(copy, compression, ask, version, wire_dtype)
            if why is None:
                out = self._change(copy, compression, weights, ask, wire_dtype, plain)
                if out is not None:
                    self._count(out, resync=False)
                    return out
                why = "error"
            out = self._exact_payload(copy, weights, version, wire_dtype)
            self._count(out, resync=why in ("periodic", "error"))
            return out

    def _exact_because(
        self, copy: _Copy, compression: Compression, ask: pb.DeltaAsk, version: int, wire_dtype: str,
    ) -> str | None:
        """Why this pull must be exact (None: it may send a change): the worker holds no copy of
        this server's ("copy"), the copy was last exact resync_every versions ago ("periodic"), or
        the codec's payload would be no smaller than the weights ("size": topk:0.6, say)."""
        if not ask.holds or ask.holds != copy.token:
            return "copy"
        if ask.resync_every and version - copy.synced >= ask.resync_every:
            return "periodic"
        numel = copy.values.numel()
        if compression.payload_bytes(numel, wire_dtype) >= numel * get_codec(wire_dtype).element_size:
            return "size"
        return None

    def _change(
        self, copy: _Copy, compression: Compression, weights: torch.Tensor, ask: pb.DeltaAsk, wire_dtype: str,
        plain: int,
    ) -> DeltaPull | None:
        """The encoded change since the copy, with the copy moved by it; None when the copy would
        end further than ask.resync_error from the weights (the caller then sends them exact, which
        overwrites the copy)."""
        if copy.codec is None or copy.codec.prefix.compression != compression:
            copy.codec = RangeCodec(compression, weights.numel(), wire_dtype, seed=copy.token, plain=plain)
        payload = copy.codec.encode(weights - copy.values)
        # The copy moves exactly as the worker's will: the same decode added to the same values.
        copy.codec.decode(payload, copy.values, add=True)
        total = _norm(weights)
        drift = _norm(weights - copy.values) / total if total else 0.0
        if ask.resync_error and drift > ask.resync_error:
            return None
        copy.token = _token()
        return DeltaPull(memoryview(bytes(payload)), compression.label, copy.token, drift, copy.values)

    def _exact_payload(self, copy: _Copy, weights: torch.Tensor, version: int, wire_dtype: str) -> DeltaPull:
        """The weights themselves in the wire dtype; the copy becomes what the worker reads of them."""
        dtype = get_codec(wire_dtype).dtype
        sent = weights if weights.dtype == dtype else weights.to(dtype)
        copy.values.copy_(sent)
        copy.token, copy.synced = _token(), version
        return DeltaPull(byte_view(sent), "", copy.token, 0.0, copy.values)  # (weights: this pull's own snapshot)

    def _count(self, out: DeltaPull, resync: bool) -> None:
        with self._lock:
            if out.compress:
                self._compressed += 1
            else:
                self._exact += 1
                self._resyncs += resync
            self._drift = out.drift
            self._drift_max = max(self._drift_max, out.drift)

    def status(self) -> DeltaStatus:
        with self._lock:
            copies = list(self._copies.values())
            return DeltaStatus(
                copies=len(copies), nbytes=sum(c.values.numel() * 4 + (c.codec.nbytes if c.codec else 0) for c in copies),
                compressed=self._compressed, exact=self._exact, resyncs=self._resyncs, drift=self._drift,
                drift_max=self._drift_max,
            )


def check_ask(ask: pb.DeltaAsk, rank: int) -> Compression:
    """The codec a DeltaAsk names, checked before the pull waits at the gate.

    Raises:
        InvalidRequestError: it names none, or not a codec, or a negative resync error.
    """
    try:
        compression = parse_compression(ask.codec)
    except ConfigError as exc:  # a worker sent a name this server does not know
        raise InvalidRequestError(f"compressed pull of worker rank {rank}: {exc}") from None
    if compression is None:
        raise InvalidRequestError(f"compressed pull of worker rank {rank} names no codec ({ask.codec!r})")
    if not math.isfinite(ask.resync_error) or ask.resync_error < 0:
        raise InvalidRequestError(f"compressed pull of worker rank {rank}: resync_error must be a finite number "
                                  f">= 0 (0: off), got {ask.resync_error!r}")
    return compression
