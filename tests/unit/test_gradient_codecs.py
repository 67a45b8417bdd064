"""Gradient codecs (core/compression.py, core/gradient_codecs.py): names, payload sizes, what each
decodes to, error feedback, bad payloads; and how the job spec, the fingerprint and compare's
--modes take them."""
from __future__ import annotations

import math

import pytest
import torch

from psgrad.config import JobSpec
from psgrad.core.compression import CHUNK, Compression, parse_compression
from psgrad.core.gradient_codecs import Codec, Compressor, _top_k
from psgrad.core.layout import explain_push_header
from psgrad.core.sharding import ParamSpec, fingerprint
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.experiments.modes import parse_modes
from psgrad.wire import serde

NAMES = ["topk:0.05", "randomk:0.05", "sign", "int8"]
SIZES = [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 5000]


def _codec(name: str, numel: int, wire: str = "float32", seed: int = 0) -> Codec:
    c = parse_compression(name)
    assert c is not None
    return Codec(c, numel, wire, seed)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text,expected", [
    ("none", None), ("sign", Compression("sign")), ("int8", Compression("int8")),
    ("topk:0.01", Compression("topk", 0.01)), (" randomk:1 ", Compression("randomk", 1.0)),
])
def test_names_parse(text: str, expected: Compression | None) -> None:
    assert parse_compression(text) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text,says", [
    ("topk", "topk needs a ratio"), ("topk:0", "0 < RATIO <= 1"), ("randomk:1.5", "0 < RATIO <= 1"),
    ("topk:nan", "0 < RATIO <= 1"), ("zip", "unknown compression 'zip'"), ("sign:2", "unknown compression"),
    ("none:1", "unknown compression"),
])
def test_bad_names_are_refused_naming_the_problem(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_compression(text)


@pytest.mark.timeout(30)
def test_a_compression_setting_that_is_not_a_string_is_refused_naming_it() -> None:
    """psgrad.connect(compress=0.01) raised AttributeError ('float' object has no attribute 'strip')."""
    import psgrad
    from psgrad.config import ClientConfig

    grammar = "one of none, topk:RATIO, randomk:RATIO (0 < RATIO <= 1), sign or int8"
    with pytest.raises(TypeError) as info:
        psgrad.connect("127.0.0.1:1", compress=0.01)  # type: ignore[arg-type]  # (nothing is sent: refused before)
    assert str(info.value) == f"compress must be a string, {grammar} (e.g. compress='topk:0.01'), got 0.01 (float)"
    with pytest.raises(TypeError, match=r"^compress must be a string, .* got None \(NoneType\)$"):
        JobSpec(compress=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^compress_pull must be a string, .* got 1 \(int\)$"):
        ClientConfig(compress_pull=1)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_compression_settings_with_nothing_to_act_on_are_refused_by_connect() -> None:
    """psgrad.connect(error_feedback=False) without a biased codec, and compress_same_host without a
    codec, were taken without a word (JobSpec keeps error feedback on: one job)."""
    import psgrad
    from psgrad.config import ClientConfig

    with pytest.raises(ConfigError, match=r"^error_feedback=False needs compress= a biased codec \(topk:RATIO, "
                                          r"randomk:RATIO or sign\): with compress='none' .* leave error_feedback out"):
        psgrad.connect("127.0.0.1:1", error_feedback=False)
    with pytest.raises(ConfigError, match="error_feedback=False needs .* with compress='int8'"):
        psgrad.connect("127.0.0.1:1", compress="int8", error_feedback=False)
    with pytest.raises(ConfigError, match=r"^ClientConfig\(compress_same_host=True\) needs compress= .* leave "
                                          "compress_same_host out"):
        psgrad.connect("127.0.0.1:1", client=ClientConfig(compress_same_host=True))
    assert not psgrad.connect("127.0.0.1:1", compress="sign", error_feedback=False).spec.error_feedback
    psgrad.connect("127.0.0.1:1", client=ClientConfig(compress_same_host=True, compress_pull="int8"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("numel", SIZES)
def test_payload_size_is_what_the_header_implies(name: str, numel: int) -> None:
    for wire in ("float32", "bfloat16"):
        codec = _codec(name, numel, wire)
        payload = codec.encode(torch.randn(numel))
        assert len(payload) == codec.nbytes == parse_compression(name).payload_bytes(numel, wire)  # type: ignore[union-attr]


@pytest.mark.timeout(30)
def test_payload_ratios() -> None:
    n = 1 << 20
    assert Compression("topk", 0.01).payload_bytes(n) / (4 * n) == pytest.approx(0.02, rel=1e-3)
    assert Compression("sign").payload_bytes(n) / (4 * n) == pytest.approx(1 / 32 + 1 / CHUNK, rel=1e-6)
    assert Compression("int8").payload_bytes(n) / (4 * n) == pytest.approx(1 / 4 + 1 / CHUNK, rel=1e-6)
    assert Compression("topk", 0.01).payload_bytes(n, "bfloat16") / (4 * n) == pytest.approx(0.015, rel=1e-3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", SIZES)
def test_topk_sends_the_largest_values_exactly(numel: int) -> None:
    g = torch.randn(numel)
    codec = _codec("topk:0.05", numel)
    out = torch.empty(numel)
    codec.decode(codec.encode(g), out)
    k = max(1, math.ceil(0.05 * numel))
    kept = out != 0
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], g[kept])
    if k < numel:
        assert float(g[~kept].abs().max()) <= float(g[kept].abs().min())


@pytest.mark.timeout(60)
def test_fast_top_k_selects_the_same_set_as_a_full_selection() -> None:
    gen = torch.Generator().manual_seed(3)
    for n, k in [(3_000_000, 30_000), (3_000_000, 7)]:
        # a layer of large values among small ones, so a strided sample is not the whole picture
        a = torch.cat([torch.randn(n // 10, generator=gen) * 100, torch.randn(n - n // 10, generator=gen)]).abs()
        assert set(_top_k(a, k).tolist()) == set(torch.topk(a, k).indices.tolist())


@pytest.mark.timeout(30)
def test_randomk_sends_k_values_exactly_at_random_places() -> None:
    n = 10_000
    g = torch.randn(n)
    a, b = _codec("randomk:0.01", n, seed=1), _codec("randomk:0.01", n, seed=1)
    out = torch.empty(n)
    a.decode(a.encode(g), out)
    kept = out != 0
    assert 90 <= int(kept.sum()) <= 100  # 100 draws, repeats sent once
    assert torch.equal(out[kept], g[kept])
    first = bytes(b.encode(g))
    assert bytes(b.encode(g)) != first  # a fresh draw each push
    assert bytes(_codec("randomk:0.01", n, seed=1).encode(g)) == first  # ... from the codec's seed


@pytest.mark.timeout(30)
def test_sign_decodes_to_a_scaled_sign_per_chunk() -> None:
    n = 2 * CHUNK + 5
    g = torch.randn(n)
    g[:CHUNK] *= 10  # another scale in the first chunk
    out = torch.empty(n)
    codec = _codec("sign", n)
    codec.decode(codec.encode(g), out)
    for a, b in [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, n)]:
        scale = float(g[a:b].abs().mean())
        expected = torch.where(g[a:b] >= 0, scale, -scale)
        assert torch.allclose(out[a:b], expected, rtol=1e-6)


@pytest.mark.timeout(60)
def test_int8_is_unbiased_and_close() -> None:
    n = 3000
    g = torch.randn(n)
    codec = _codec("int8", n, seed=2)
    out, total = torch.empty(n), torch.zeros(n)
    for _ in range(400):
        codec.decode(codec.encode(g), out)
        step = float(g[:CHUNK].abs().max()) / 127
        assert float((out - g)[:CHUNK].abs().max()) <= step * 1.0001  # one quantization step at most
        total += out
    assert float((total / 400 - g).abs().max()) < 0.01  # its mean is the gradient (step ~0.03)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["topk:0.05", "randomk:0.05", "sign"])
def test_error_feedback_loses_nothing(name: str) -> None:
    """What the pushes carried plus the residual is every gradient given (up to float rounding)."""
    n = 4000
    compressor = Compressor(parse_compression(name), n, error_feedback=True)  # type: ignore[arg-type]
    decoder = _codec(name, n)
    sent, given, out = torch.zeros(n), torch.zeros(n), torch.empty(n)
    for i in range(30):
        g = torch.randn(n, generator=torch.Generator().manual_seed(i))
        given += g
        decoder.decode(compressor.encode(g), out)
        sent += out
    assert compressor.residual is not None
    assert torch.allclose(sent + compressor.residual, given, atol=1e-4)


@pytest.mark.timeout(30)
def test_no_error_feedback_and_int8_keep_no_residual() -> None:
    assert Compressor(Compression("topk", 0.1), 100, error_feedback=False).residual is None
    assert Compressor(Compression("int8"), 100, error_feedback=True).residual is None


@pytest.mark.timeout(30)
def test_a_non_finite_gradient_does_not_poison_later_pushes() -> None:
    n = 2000
    compressor = Compressor(Compression("sign"), n)
    decoder = _codec("sign", n)
    bad = torch.randn(n)
    bad[5] = math.nan
    out = torch.empty(n)
    decoder.decode(compressor.encode(bad), out)
    assert not torch.isfinite(out).all()  # the shard sees it (and refuses or skips it)
    decoder.decode(compressor.encode(torch.randn(n)), out)
    assert torch.isfinite(out).all() and compressor.resets == 1


@pytest.mark.timeout(30)
def test_bad_payloads_are_refused() -> None:
    codec = _codec("topk:0.5", 10)
    payload = bytearray(codec.encode(torch.randn(10)))
    out = torch.empty(10)
    with pytest.raises(InvalidRequestError, match="is 40 bytes, got 39"):
        codec.decode(memoryview(payload)[:-1], out)
    payload[0:4] = (10).to_bytes(4, "little")  # index 10 of 10
    with pytest.raises(InvalidRequestError, match=r"index outside \[0, 10\)"):
        codec.decode(memoryview(payload), out)
    payload[0:4] = (-1).to_bytes(4, "little", signed=True)
    with pytest.raises(InvalidRequestError, match="index outside"):
        codec.decode(memoryview(payload), out)


@pytest.mark.timeout(30)
def test_job_spec_normalizes_and_round_trips() -> None:
    spec = JobSpec(compress="topk:1e-2", error_feedback=False)
    assert spec.compress == "topk:0.01" and spec.compression == Compression("topk", 0.01)
    assert serde.job_spec_from_proto(serde.job_spec_to_proto(spec)) == spec
    assert spec.to_argv()[-3:] == ["--compress", "topk:0.01", "--no-error-feedback"]
    assert JobSpec(compress="int8", error_feedback=False).error_feedback  # int8 keeps no residual: one job
    assert JobSpec(error_feedback=False) == JobSpec()
    assert serde.job_spec_from_proto(serde.job_spec_to_proto(JobSpec())) == JobSpec()
    with pytest.raises(ConfigError, match="unknown compression"):
        JobSpec(compress="gzip")


@pytest.mark.timeout(30)
def test_fingerprint_of_an_uncompressed_job_is_unchanged_and_compression_changes_it() -> None:
    import hashlib
    import json

    params = [ParamSpec("w", (3,), "float32")]
    spec = JobSpec()
    old = {"params": [["w", [3], "float32"]], "spec": {k: v for k, v in spec.as_dict().items()
                                                       if k not in ("compress", "error_feedback")}}
    assert fingerprint(params, spec) == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:32]
    prints = {fingerprint(params, JobSpec(compress=c, error_feedback=ef))
              for c in ("none", "sign", "topk:0.01") for ef in (True, False)}
    assert len(prints) == 5  # none with or without error feedback is one job


@pytest.mark.timeout(30)
def test_a_push_in_another_codec_is_refused_naming_both() -> None:
    from psgrad.core.layout import Layout

    layout = Layout(JobSpec(compress="topk:0.01"), (), 0, 0, 10, "f")
    assert explain_push_header(layout, 1, 10, "float32", 0, 0, None, "topk:0.01") is None
    assert explain_push_header(layout, 1, 10, "float32", 0, 0, None, "") is None  # plain: a same-host shard's
    problem = explain_push_header(layout, 1, 10, "float32", 0, 0, None, "sign")
    assert problem is not None and "'sign'" in problem and "'topk:0.01'" in problem
    plain = Layout(JobSpec(), (), 0, 0, 10, "f")
    assert "plain gradients" in (explain_push_header(plain, 1, 10, "float32", 0, 0, None, "int8") or "")


@pytest.mark.timeout(30)
def test_compare_variants() -> None:
    a, b, c = parse_modes("async:compress=topk:0.01,sync:compress=sign:noef,ssp:2:lr=0.1:compress=int8")
    assert (a.mode, a.compress, a.error_feedback) == ("async", "topk:0.01", True)
    assert (b.mode, b.compress, b.error_feedback) == ("sync", "sign", False)
    assert (c.staleness, c.lr, c.compress) == (2, 0.1, "int8")
    assert a.slug == "async-compresstopk-0.01"
    with pytest.raises(ConfigError, match="topk needs a ratio"):
        parse_modes("async:compress=topk")
    with pytest.raises(ConfigError, match="not an option of allreduce"):
        parse_modes("allreduce:compress=sign")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", NAMES)
def test_a_range_codec_sends_its_tail_plain(name: str) -> None:
    from psgrad.core.gradient_codecs import RangeCodec

    c = parse_compression(name)
    assert c is not None
    g = torch.randn(2000)
    odd = RangeCodec(c, 2001, plain=48)  # a prefix payload ending at any byte (sign: 8 + 245 bytes)
    out, g1 = torch.empty(2001), torch.cat([g, g[:1]])
    odd.decode(odd.encode(g1), out)
    assert torch.equal(out[1953:], g1[1953:])
    for wire in ("float32", "bfloat16"):
        codec = RangeCodec(c, 2000, wire, plain=48)
        payload = codec.encode(g)
        assert len(payload) == codec.nbytes == c.payload_bytes(1952, wire) + 48 * (4 if wire == "float32" else 2)
        out = torch.empty(2000)
        codec.decode(payload, out)
        assert torch.equal(out[1952:], g[1952:].to(get_dtype(wire)).float())
        prefix = torch.empty(1952)
        _codec(name, 1952, wire).decode(payload[: codec.prefix.nbytes], prefix)
        assert torch.equal(out[:1952], prefix)
    compressor = Compressor(c, 2000, plain=48)
    assert compressor.residual is None or compressor.residual.numel() == 1952


def get_dtype(wire: str) -> torch.dtype:
    return torch.float32 if wire == "float32" else torch.bfloat16
