"""Pure tests of psgrad.core.codecs: wire dtypes, byte views, hand-built protobuf data frames, payload writers."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from psgrad.core import codecs
from psgrad.core.codecs import WireBuffer, byte_view, joined, torch_dtype
from psgrad.wire.frames import (
    FrameParser,
    PayloadWriter,
    bytes_field_prefix,
    data_frames,
    frame_payload,
    trailing_bytes_field,
    write_frames,
)
from psgrad.config import DEFAULT_CHUNK_BYTES
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb

pytestmark = pytest.mark.timeout(60)

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _source(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float32)


def _send(src: torch.Tensor, wire_dtype: str, chunk_bytes: int) -> list[bytes]:
    """Sender side: encode into the wire dtype and cut into data frames."""
    wire = WireBuffer(src.numel(), wire_dtype)
    payload = wire.encode(src)
    assert len(payload) == wire.nbytes
    return list(data_frames(payload, chunk_bytes))


def _receive(frames: list[bytes], numel: int, wire_dtype: str) -> torch.Tensor:
    """Receiver side: parse frames, write them into a preallocated buffer, convert to float32."""
    dest = torch.full((numel,), float("nan"), dtype=torch.float32)
    wire = WireBuffer(numel, wire_dtype)
    writer = PayloadWriter(wire.receive_view(dest), "test payload")
    for frame in frames:
        piece = frame_payload(frame)
        assert piece is not None, "data_frames produced a frame frame_payload cannot parse"
        writer.write(piece)
    writer.finish()
    wire.finish_receive(dest)
    return dest


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("wire_dtype", list(WIRE_DTYPES))
@pytest.mark.parametrize(
    "numel, chunk_bytes",
    [
        (0, DEFAULT_CHUNK_BYTES),
        (1, DEFAULT_CHUNK_BYTES),
        (1, 1),
        (7, 3),  # chunk not a multiple of the element size
        (7, 5),
        (1000, 999),
        (1_000_003, DEFAULT_CHUNK_BYTES),  # payload not a multiple of the chunk
        (1_000_003, 65_537),
    ],
)
def test_round_trip(wire_dtype: str, numel: int, chunk_bytes: int) -> None:
    src = _source(numel, seed=numel)
    original = src.clone()
    frames = _send(src, wire_dtype, chunk_bytes)

    elem = torch.empty(0, dtype=WIRE_DTYPES[wire_dtype]).element_size()
    nbytes = numel * elem
    expected_frames = -(-nbytes // chunk_bytes)  # ceil
    assert len(frames) == expected_frames
    assert sum(len(frame_payload(f)) for f in frames) == nbytes  # type: ignore[arg-type]
    assert all(len(frame_payload(f)) <= chunk_bytes for f in frames)  # type: ignore[arg-type]

    got = _receive(frames, numel, wire_dtype)
    expected = original.to(WIRE_DTYPES[wire_dtype]).to(torch.float32)
    assert torch.equal(got, expected)
    if wire_dtype == "float32":
        assert torch.equal(got, original)
    assert torch.equal(src, original), "encoding must not modify the source tensor"



@pytest.mark.parametrize("wire_dtype", list(WIRE_DTYPES))
def test_a_payload_received_whole_may_be_empty(wire_dtype: str) -> None:
    """load() of no bytes into no elements (a shard without dense elements) is a no-op on every
    wire, where torch.frombuffer refuses an empty buffer; and bytes of one element still load."""
    wire = WireBuffer(0, wire_dtype)
    dest = torch.empty(0)
    wire.load(dest, memoryview(b""))
    assert dest.numel() == 0
    one, value = WireBuffer(1, wire_dtype), torch.tensor([1.5])
    out = torch.zeros(1)
    one.load(out, byte_view(value.to(WIRE_DTYPES[wire_dtype])))
    assert torch.equal(out, value)

def test_round_trip_with_write_frames_and_noncanonical_frame() -> None:
    src = _source(1001, seed=3)
    frames = _send(src, "float32", 1000)
    # Replace one canonical frame by an equivalent protobuf encoding with an extra (unknown) field.
    unknown_field = bytes(((15 << 3) | 0, 1))  # field 15, varint, value 1
    frames[1] = frames[1] + unknown_field
    assert frame_payload(frames[1]) is None
    dest = torch.empty(1001)
    writer = PayloadWriter(byte_view(dest), "push")
    write_frames(iter(frames), writer, FrameParser(pb.PushFrame, "push"))
    assert torch.equal(dest, src)


def test_write_frames_refuses_header_in_the_middle() -> None:
    src = _source(10)
    frames = _send(src, "float32", 16)
    frames.insert(1, pb.PushFrame(header=pb.PushHeader(rank=1)).SerializeToString())
    writer = PayloadWriter(byte_view(torch.empty(10)), "push")
    with pytest.raises(InvalidRequestError, match="header"):
        write_frames(iter(frames), writer, FrameParser(pb.PushFrame, "push"))


def test_write_frames_checks_total_size() -> None:
    frames = _send(_source(10), "float32", 16)
    writer = PayloadWriter(byte_view(torch.empty(11)), "push")
    with pytest.raises(InvalidRequestError, match="40 of 44"):
        write_frames(iter(frames), writer, FrameParser(pb.PushFrame, "push"))


# ----------------------------------------------------------------------------- frame format vs protobuf
@pytest.mark.parametrize(
    "size, varint_len",
    [(0, 1), (1, 1), (127, 1), (128, 2), (16_383, 2), (16_384, 3), (100_000, 3), (2_097_151, 3)],
)
def test_hand_built_frame_is_protobuf(size: int, varint_len: int) -> None:
    payload = bytes((i * 7 + 3) % 256 for i in range(size))
    if size == 0:
        # data_frames yields nothing for an empty payload; build the one-frame case by hand via protobuf.
        assert list(data_frames(memoryview(payload))) == []
        frame = pb.PushFrame(data=b"").SerializeToString()
    else:
        frames = list(data_frames(memoryview(payload), chunk_bytes=size))
        assert len(frames) == 1
        frame = frames[0]
    assert len(frame) == 1 + varint_len + size
    # Byte-identical to what protobuf itself produces, and parsed identically by protobuf.
    assert frame == pb.PushFrame(data=payload).SerializeToString()
    msg = pb.PushFrame.FromString(frame)
    assert msg.WhichOneof("kind") == "data"
    assert msg.data == payload
    assert pb.PullFrame.FromString(frame).data == payload
    assert pb.InitFrame.FromString(frame).data == payload
    # ... and by the hand parser.
    view = frame_payload(frame)
    assert view is not None
    assert bytes(view) == payload


def test_frame_payload_is_a_view_not_a_copy() -> None:
    frame = next(data_frames(memoryview(b"abcdef"), 6))
    view = frame_payload(frame)
    assert view is not None
    assert view.obj is frame


def test_frame_payload_refuses_header_frame() -> None:
    header = pb.PushFrame(header=pb.PushHeader(rank=3, clock=4, numel=10, dtype="float32"))
    assert frame_payload(header.SerializeToString()) is None
    assert frame_payload(pb.PullFrame(header=pb.PullHeader(version=1, numel=2)).SerializeToString()) is None


@pytest.mark.parametrize("size", [1, 5, 200, 20_000])
def test_frame_payload_refuses_truncated_or_padded_frames(size: int) -> None:
    frame = pb.PushFrame(data=b"\x01" * size).SerializeToString()
    assert frame_payload(frame) is not None
    assert frame_payload(frame[:-1]) is None  # payload cut short
    assert frame_payload(frame + b"\x00") is None  # trailing garbage
    assert frame_payload(frame[:1]) is None  # tag only
    assert frame_payload(frame[:2]) is None  # tag and (part of) the length, no payload


def test_frame_payload_edge_inputs() -> None:
    assert frame_payload(b"") is None
    assert frame_payload(b"\x12") is None
    assert frame_payload(b"\x12" + b"\xff" * 12) is None  # varint never terminates
    assert frame_payload(b"\x0a\x00") is None  # field 1 (header), empty
    # A non-minimal varint length is still a valid protobuf encoding.
    frame = b"\x12\x83\x00abc"
    assert pb.PushFrame.FromString(frame).data == b"abc"
    view = frame_payload(frame)
    assert view is not None and bytes(view) == b"abc"


def test_frame_parser_handles_noncanonical_frames() -> None:
    parse = FrameParser(pb.PushFrame, "push")
    # Two data fields: protobuf's last-one-wins rule applies.
    twice = pb.PushFrame(data=b"xx").SerializeToString() + pb.PushFrame(data=b"abc").SerializeToString()
    assert frame_payload(twice) is None
    assert bytes(parse(twice)) == b"abc"
    # A header then a data field in the same frame: the oneof ends up holding data.
    header_then_data = (
        pb.PushFrame(header=pb.PushHeader(rank=1)).SerializeToString()
        + pb.PushFrame(data=b"hello").SerializeToString()
    )
    assert frame_payload(header_then_data) is None
    assert bytes(parse(header_then_data)) == b"hello"


def test_frame_parser_refuses_header_frame() -> None:
    parse = FrameParser(pb.PushFrame, "push from worker rank 2")
    with pytest.raises(InvalidRequestError) as info:
        parse(pb.PushFrame(header=pb.PushHeader(rank=2)).SerializeToString())
    assert "push from worker rank 2" in str(info.value)
    assert "header" in str(info.value)
    with pytest.raises(InvalidRequestError):
        parse(b"")  # no field set at all


def test_data_frames_refuses_bad_chunk_size() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match=str(bad)):
            list(data_frames(memoryview(b"abc"), bad))


# ----------------------------------------------------------------------------- PayloadWriter
def test_payload_writer_too_many_bytes() -> None:
    dest = bytearray(8)
    writer = PayloadWriter(memoryview(dest), "push from worker rank 5")
    writer.write(memoryview(b"\x01" * 6))
    with pytest.raises(InvalidRequestError) as info:
        writer.write(memoryview(b"\x02" * 4))
    msg = str(info.value)
    assert "push from worker rank 5" in msg
    assert "8" in msg
    assert dest == bytearray(b"\x01" * 6 + b"\x00\x00"), "the overflowing piece must not be written"


def test_payload_writer_too_many_bytes_names_arrived_size() -> None:
    writer = PayloadWriter(memoryview(bytearray(8)), "push")
    writer.write(memoryview(b"\x01" * 6))
    with pytest.raises(InvalidRequestError) as info:
        writer.write(memoryview(b"\x02" * 4))
    assert "10" in str(info.value)


def test_payload_writer_too_few_bytes() -> None:
    writer = PayloadWriter(memoryview(bytearray(12)), "init")
    writer.write(memoryview(b"\x01" * 5))
    with pytest.raises(InvalidRequestError) as info:
        writer.finish()
    msg = str(info.value)
    assert "init" in msg and "5" in msg and "12" in msg


def test_payload_writer_no_bytes_at_all() -> None:
    writer = PayloadWriter(memoryview(bytearray(4)), "pull")
    with pytest.raises(InvalidRequestError, match="0 of 4"):
        writer.finish()


def test_payload_writer_exact_size_in_pieces() -> None:
    dest = bytearray(10)
    writer = PayloadWriter(memoryview(dest), "x")
    for piece in (b"ab", b"", b"cdefg", b"hij"):
        writer.write(memoryview(piece))
    writer.finish()
    assert bytes(dest) == b"abcdefghij"


# ----------------------------------------------------------------------------- WireBuffer and byte_view
def test_float32_encode_aliases_source() -> None:
    src = torch.arange(6, dtype=torch.float32)
    view = WireBuffer(6, "float32").encode(src)
    src[2] = 42.0  # a change to the source is visible through the view: no copy was made
    assert torch.frombuffer(bytearray(view), dtype=torch.float32)[2].item() == 42.0
    view[0:4] = torch.tensor([7.5], dtype=torch.float32).numpy().tobytes()  # and vice versa
    assert src[0].item() == 7.5


def test_float32_receive_writes_straight_into_dest() -> None:
    dest = torch.zeros(3)
    wire = WireBuffer(3, "float32")
    view = wire.receive_view(dest)
    view[:] = torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    assert dest.tolist() == [1.0, 2.0, 3.0]  # before finish_receive: no staging buffer in between
    wire.finish_receive(dest)
    assert dest.tolist() == [1.0, 2.0, 3.0]


def _special_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    specials = torch.tensor(
        [
            0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3.4e38, 65504.0,
            65520.0, 1e5, 6e-8, 1.00390625, 1.01171875, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
        ],
        dtype=torch.float32,
    )
    # Random bit patterns exercise every rounding case (ties included) of the mantissa.
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    randoms = bits.view(torch.float32)
    randoms = randoms[torch.isfinite(randoms)]
    return torch.cat([specials, randoms, torch.randn(1000, generator=g) * 1e3])


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_narrow_encode_rounds_like_torch(wire_dtype: str) -> None:
    src = _special_values()
    wire = WireBuffer(src.numel(), wire_dtype)
    assert wire.nbytes == src.numel() * 2
    got = bytes(wire.encode(src))
    want = src.to(WIRE_DTYPES[wire_dtype]).view(torch.int16).numpy().tobytes()
    assert got == want
    # The narrow wire is a staging copy, not an alias of the source.
    view = wire.encode(src)
    src.fill_(0.0)
    assert bytes(view) == want


def test_bf16_rounding_is_round_to_nearest_even() -> None:
    # 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0).
    # 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to even (1 + 2^-6).
    src = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], dtype=torch.float32)
    frames = _send(src, "bfloat16", 1 << 20)
    got = _receive(frames, 3, "bfloat16")
    assert got.tolist() == [1.0, 1.0 + 2**-6, 1.0 + 2**-7]


def test_nan_survives_every_wire_dtype() -> None:
    src = torch.tensor([float("nan"), 1.0, float("inf")])
    for wire_dtype in WIRE_DTYPES:
        got = _receive(_send(src, wire_dtype, 4), 3, wire_dtype)
        assert torch.isnan(got[0]) and got[1].item() == 1.0 and got[2].item() == float("inf")


def test_wire_buffer_nbytes() -> None:
    assert WireBuffer(5, "float32").nbytes == 20
    assert WireBuffer(5, "bfloat16").nbytes == 10
    assert WireBuffer(5, "float16").nbytes == 10
    assert WireBuffer(0, "float16").nbytes == 0


def test_unknown_wire_dtype() -> None:
    with pytest.raises(InvalidRequestError) as info:
        torch_dtype("int8")
    msg = str(info.value)
    assert "'int8'" in msg
    for name in WIRE_DTYPES:
        assert name in msg
    with pytest.raises(InvalidRequestError):
        WireBuffer(3, "float64")
    assert torch_dtype("bfloat16") is torch.bfloat16


def test_byte_view_aliases_and_is_writable() -> None:
    t = torch.zeros(2, 3)
    view = byte_view(t)
    assert len(view) == 24 and view.format == "B" and not view.readonly
    view[4:8] = torch.tensor([2.5]).numpy().tobytes()
    assert t[0, 1].item() == 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5)], ids=["0-d", "1-d", "2-d"])
def test_byte_view_is_every_dtypes_bytes_in_order(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # numpy's own view where numpy has the dtype, a uint8 view where it does not (bfloat16)
    t = (torch.arange(max(1, torch.Size(shape).numel())).reshape(shape) * 3 % 7).to(dtype)
    view = byte_view(t)
    assert view.format == "B" and view.ndim == 1 and not view.readonly
    assert bytes(view) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    view[0] ^= 1  # aliases the tensor
    assert t.reshape(-1).view(torch.uint8)[0].item() == bytes(view)[0]


def test_byte_view_of_offset_slice() -> None:
    base = torch.arange(10, dtype=torch.float32)
    part = base[3:6]  # contiguous, nonzero storage offset
    assert bytes(byte_view(part)) == torch.tensor([3.0, 4.0, 5.0]).numpy().tobytes()


def test_byte_view_of_empty_tensor() -> None:
    assert len(byte_view(torch.empty(0))) == 0
    assert len(byte_view(torch.empty(0, 5))) == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 4).t(),
        lambda: torch.zeros(10)[::2],
        lambda: torch.zeros(3, 4)[:, 1],
    ],
    ids=["transposed", "strided", "column"],
)
def test_byte_view_refuses_noncontiguous(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    assert not t.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(t)


def test_codec_registry_matches_the_cli_names() -> None:
    from psgrad.config import WIRE_DTYPES
    from psgrad.core.codecs import CODECS, get_codec

    assert list(CODECS) == list(WIRE_DTYPES)
    assert [name for name in CODECS if get_codec(name).exact] == ["float32"]
    assert {get_codec(n).element_size for n in ("bfloat16", "float16")} == {2}
    with pytest.raises(InvalidRequestError, match="valid: float32, bfloat16, float16"):
        get_codec("int8")


@pytest.mark.parametrize("nrows", [0, 1, 300, 4096])
def test_a_rows_reply_built_by_hand_splits_into_its_head_and_rows(nrows: int) -> None:
    rows = bytes(range(256)) * nrows
    head = pb.RowsReply(version=2**40 + 3).SerializeToString()
    reply = b"".join((head, bytes_field_prefix(2, len(rows)), rows))
    assert pb.RowsReply.FromString(reply).rows == rows  # what protobuf reads, too
    split = trailing_bytes_field(reply, 2)
    assert split is not None
    assert bytes(split[0]) == head and pb.RowsReply.FromString(bytes(split[0])).version == 2**40 + 3
    assert split[1] == rows and split[1].obj is reply  # a view, no copy


def test_trailing_bytes_field_leaves_other_layouts_to_protobuf() -> None:
    rows = b"\x01" * 100
    first = b"".join((bytes_field_prefix(2, len(rows)), rows, pb.RowsReply(version=7).SerializeToString()))
    assert trailing_bytes_field(first, 2) is None  # not last: a later field follows it
    assert trailing_bytes_field(pb.RowsReply(version=7).SerializeToString(), 2) is None  # no such field
    whole = pb.RowsReply(version=7, rows=rows).SerializeToString()
    assert trailing_bytes_field(whole[:-1], 2) is None  # truncated
    assert trailing_bytes_field(b"\xff" * 12, 2) is None  # not a message
    split = trailing_bytes_field(whole, 2)  # protobuf's own encoding puts it last too
    assert split is not None and split[1] == rows


def test_joined_views_tensors_that_lie_one_after_another_and_copies_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from psgrad.core import codecs
    from psgrad.core.codecs import joined

    whole = torch.arange(24, dtype=torch.float32).view(12, 2)
    parts = list(whole.split([3, 0, 5, 4]))
    small = joined(parts)  # below JOIN_VIEW_MIN_BYTES: copied without looking (a copy costs less)
    assert torch.equal(small, whole) and small.data_ptr() != whole.data_ptr()
    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 0)
    out = joined(parts)
    assert torch.equal(out, whole) and out.data_ptr() == whole.data_ptr()  # a view: no copy
    apart = [whole[:3], whole[5:]]  # a gap between them
    out = joined(apart)
    assert torch.equal(out, torch.cat(apart)) and out.data_ptr() != whole.data_ptr()
    reordered = [whole[6:], whole[:6]]
    assert torch.equal(joined(reordered), torch.cat(reordered))
    other = [whole[:2], torch.arange(4, 8, dtype=torch.float32).view(2, 2)]  # another storage
    assert torch.equal(joined(other), torch.cat(other))
    ids = torch.arange(10)
    assert torch.equal(joined(list(ids.split([4, 6]))), ids) and joined([ids]) is ids


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("sizes", [[300, 0, 41, 7], [0, 5, 0], [2000], [1, 1, 1, 1, 1, 1, 1, 1]])
def test_joined_parts_split_in_order_from_one_tensor_are_a_view_of_it(sizes: list[int],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 0)
    whole = torch.randn(sum(sizes) + 3, 32)[2:-1]  # (a view itself: its parts' base is the tensor it views)
    parts = list(whole.split(sizes))
    got = joined(parts)
    assert torch.equal(got, torch.cat(parts)) and got.shape == (sum(sizes), 32)
    assert _shares(got, whole) and got.data_ptr() == whole.data_ptr()  # (no copy)
    ids = torch.arange(sum(sizes) + 3)[2:-1]  # (1-D parts: a lookup's inverses, split from one tensor)
    got = joined(list(ids.split(sizes)))
    assert torch.equal(got, ids) and got.shape == ids.shape and got.data_ptr() == ids.data_ptr()


def test_joined_copies_parts_out_of_order_of_other_widths_or_tensors_and_small_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 0)
    whole = torch.randn(30, 8)
    a, b, c = whole.split([10, 10, 10])
    ids = torch.arange(30)
    cases = [[b, a], [a, c], [a, torch.randn(5, 8)], [a, b.double()], [a.t(), b.t()],
             [whole[:, :4], whole[:, 4:]], [torch.zeros(3, 0), torch.zeros(2, 0)],
             [ids[10:], ids[:10]], [ids[:5], ids[6:]], [ids[:5], ids[5:].int()], [ids[::2], ids[1::2]]]
    for parts in cases:
        got = joined(parts)
        assert torch.equal(got, torch.cat(parts)), parts
        assert got.data_ptr() != whole.data_ptr() or not got.numel()
    # (3-D rows split from one tensor: the general way finds their view)
    cube = torch.randn(6, 2, 3)
    got = joined(list(cube.split([2, 4])))
    assert torch.equal(got, cube) and _shares(got, cube)
    # (below the size a look is worth: a copy, the same values)
    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 1 << 30)
    got = joined([a, b])
    assert torch.equal(got, whole[:20]) and not _shares(got, whole)


def test_row_gradients_autograd_accumulates_from_one_block_are_joined_as_a_view_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward that returns its inputs' gradients as parts of one block (the pooled bags' does)
    leaves each leaf a detached part (no _base): joined still finds them one after another and
    views the block, where it copied them; parts that lie one after another in memory but in
    storages of their own (numpy slices) are not viewed past the first one's storage."""
    from psgrad.core.codecs import consecutive_rows

    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 0)

    class Parts(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *weights: torch.Tensor) -> torch.Tensor:
            ctx.sizes = [int(w.shape[0]) for w in weights]
            return torch.zeros(2)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
            block = torch.arange(sum(ctx.sizes) * 4, dtype=torch.float32).view(-1, 4)
            return tuple(block.split_with_sizes(ctx.sizes))

    leaves = [torch.zeros(n, 4, requires_grad=True) for n in (3, 0, 5, 2)]
    Parts.apply(*leaves).sum().backward()
    grads = [leaf.grad for leaf in leaves]
    assert all(g is not None and g._base is None for g in grads)
    got = joined(grads)  # type: ignore[arg-type]
    assert torch.equal(got, torch.cat(grads)) and got.data_ptr() == grads[0].data_ptr()  # type: ignore[union-attr, arg-type]
    block = np.arange(40, dtype=np.float32).reshape(10, 4)
    apart = [torch.from_numpy(block[:5]), torch.from_numpy(block[5:])]  # (adjacent, each its own storage)
    assert consecutive_rows(apart) is None
    assert torch.equal(joined(apart), torch.from_numpy(block))
