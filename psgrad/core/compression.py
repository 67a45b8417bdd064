"""Gradient compression settings: the codecs a pushed gradient may travel in (top-k and random-k values
with their indices, 1-bit signs with a scale per chunk, 8-bit stochastic quantization), the names
users give them (`--compress topk:0.01`) and their payload sizes. No torch (the CLI reads these);
the codecs themselves are in core/gradient_codecs.py.

A codec turns n float32 values into a payload whose size depends only on n (and the values' wire
dtype), so a receiver knows it from the push header, as for the plain wire dtypes. The payload
layouts (little-endian throughout):

- ``topk:R`` / ``randomk:R``: k = ceil(R * n) int32 indices, then k values in the job's wire dtype;
  the receiver adds each value at its index into zeros (an index may repeat with value 0: padding).
- ``sign``: one float32 scale per chunk of CHUNK values (the mean absolute value there), then n
  bits (bit i set: value i is >= 0), least significant bit first; value i is +-scale.
- ``int8``: one float32 scale per chunk (the largest absolute value there), then n int8 values q
  with value = q * scale / 127, q rounded stochastically so that its expectation is the value
  (QSGD-style: unbiased).

Top-k, random-k and sign are biased: what they drop is lost unless the worker keeps it and adds it
to its next gradient (error feedback, on by default for them: `Compressor`). int8 is unbiased and
never keeps a residual.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from psgrad.errors import ConfigError

# Values per scale of `sign` and `int8`: 4 bytes of scale per 1,024 values (0.4% of int8's payload,
# 3% of sign's), and a scale that follows the gradient's magnitude within a layer.
CHUNK = 1024
NONE = "none"
_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # a sparse codec's values travel in the wire dtype
GRAMMAR = "none, topk:RATIO, randomk:RATIO (0 < RATIO <= 1), sign or int8"


@dataclass(frozen=True)
class Compression:
    """One codec and its setting (`ratio`: the fraction of values top-k and random-k send)."""

    name: str
    ratio: float = 0.0

    @property
    def label(self) -> str:
        """The name users write: 'topk:0.01', 'sign'."""
        return f"{self.name}:{self.ratio!r}" if self.sparse else self.name

    @property
    def sparse(self) -> bool:
        """Sends some values with their indices (top-k, random-k)."""
        return self.name in ("topk", "randomk")

    @property
    def biased(self) -> bool:
        """The decoded gradient's expectation is not the gradient: error feedback makes up for it."""
        return self.name != "int8"

    def kept(self, numel: int) -> int:
        """Values a sparse codec sends of numel: ceil(ratio * numel), at least 1 (0 for none)."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def payload_bytes(self, numel: int, wire_dtype: str = "float32") -> int:
        """Bytes of an encoded gradient of numel values."""
        if self.sparse:
            return self.kept(numel) * (4 + _VALUE_BYTES[wire_dtype])
        scales = 4 * -(-numel // CHUNK)
        return scales + (-(-numel // 8) if self.name == "sign" else numel)


def check_text(value: object, name: str) -> None:
    """A compression setting (`name`: compress, compress_pull) is a string of GRAMMAR.

    Raises:
        TypeError: it is not a string (compress=0.01, which meant 'topk:0.01'), named with the grammar.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {GRAMMAR} (e.g. {name}='topk:0.01'), got {value!r} "
                        f"({type(value).__name__})")


BIASED = "topk:RATIO, randomk:RATIO or sign"  # the codecs error feedback acts on


def feeds_back(text: str) -> bool:
    """Whether error feedback acts on the pushes of a compression setting: a biased codec's (it
    keeps what a push leaves out). Without compression, or with int8 (unbiased, nothing kept),
    turning it off would change nothing (JobSpec then keeps it on: one job, one fingerprint), so
    the user-facing settings (psgrad.connect, the CLI's flags, --modes) refuse that by name.

    Raises:
        ConfigError: not a compression setting (see parse_compression).
    """
    codec = parse_compression(text)
    return codec is not None and codec.biased


def parse_compression(text: str) -> Compression | None:
    """'topk:0.01' -> Compression('topk', 0.01); 'none' -> None.

    Raises:
        ConfigError: not a codec, or a ratio outside (0, 1] (the message gives the grammar).
    """
    name, sep, arg = text.strip().partition(":")
    if name == NONE and not sep:
        return None
    if name in ("sign", "int8") and not sep:
        return Compression(name)
    if name in ("topk", "randomk"):
        try:
            ratio = float(arg)
        except ValueError:
            ratio = math.nan
        if math.isfinite(ratio) and 0 < ratio <= 1:
            return Compression(name, ratio)
        raise ConfigError(f"compression {text!r}: {name} needs a ratio 0 < RATIO <= 1, e.g. {name}:0.01")
    raise ConfigError(f"unknown compression {text!r}; valid: {GRAMMAR}")


def normalize(text: str) -> str:
    """The canonical spelling of a compression setting ('topk:1e-2' -> 'topk:0.01', 'none')."""
    c = parse_compression(text)
    return NONE if c is None else c.label
