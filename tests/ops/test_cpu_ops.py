"""The C host backend (copy and KVSUM64 in one pass) equals the per-block reference, byte for byte,
and its checksums equal KVSUM64's torch definition; a corrupt byte fails verification."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier import codec
from kvtier.layout import build_layout
from kvtier.ops import ChunkSpan, cpu_library, cpu_ops, reference
from kvtier.ops.checksum import as_unsigned, payload_checksum

from test_ops import layouts, make_spans, spans

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason=f"cpu ops unavailable: {cpu_ops.build_error()}")


@pytest.fixture(autouse=True)
def _many_threads(monkeypatch):
    monkeypatch.setattr(cpu_ops, "BYTES_PER_THREAD", 64)  # tiny batches split over threads too


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gather_matches_reference_and_sums_its_blocks(data):
    layout = data.draw(layouts())
    chunks = data.draw(spans(layout))
    threads = data.draw(st.integers(1, 3))
    a, b = make_spans(layout, chunks, False), make_spans(layout, chunks, False)
    sums = torch.empty(len(a), dtype=torch.int64)
    if threads == 1:
        cpu_ops.gather(layout, a, checksums_out=sums)
    else:
        _gather_threads(layout, a, sums, threads)
    reference.gather(layout, b)
    for x, y, got in zip(a, b, as_unsigned(sums)):
        assert torch.equal(x.buffer, y.buffer)
        assert got == payload_checksum(y.buffer[codec.HEADER_BYTES :])  # other blocks are zero: they add nothing


def _gather_threads(layout, spans_, sums, threads):
    values = cpu_ops.run_copy(layout, spans_, gather=True, want_sums=True, threads=threads)
    sums.copy_(torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values]))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scatter_matches_reference_verifies_and_touches_only_its_blocks(data):
    layout = data.draw(layouts())
    chunks = data.draw(spans(layout))
    sources = make_spans(layout, chunks, True)
    expected_sums = [payload_checksum(s.buffer[codec.HEADER_BYTES :]) for s in sources]
    before = [r.blocks.clone() for r in layout.regions]
    reference.scatter(layout, sources)
    expected = [r.blocks.clone() for r in layout.regions]
    for region, old in zip(layout.regions, before):
        region.blocks.copy_(old)
    assert cpu_ops.scatter(layout, sources, expected_sums) == [True] * len(sources)
    for region, want in zip(layout.regions, expected):
        assert torch.equal(region.blocks, want)
    bad = data.draw(st.integers(0, len(sources) - 1))
    at = data.draw(st.integers(codec.HEADER_BYTES, sources[bad].buffer.numel() - 1))  # own block or the rest
    sources[bad].buffer[at] ^= 1 << data.draw(st.integers(0, 7))
    ok = cpu_ops.scatter(layout, sources, expected_sums)
    assert ok == [i != bad for i in range(len(sources))]


def test_full_chunk_round_trip_through_the_codec_and_a_corrupt_byte():
    alloc = torch.randn(16, 2, 4, 16, 32)  # 2 layers, 8 KiB blocks: the vectorized path with streaming stores
    layout = build_layout({f"l{i}": alloc[:, i] for i in range(2)}, 16, 16)
    buf = torch.zeros(codec.chunk_bytes(layout, 4), dtype=torch.uint8)
    sums = torch.empty(1, dtype=torch.int64)
    cpu_ops.gather(layout, [ChunkSpan(buf, 4, 0, torch.tensor([9, 2, 14, 5]))], checksums_out=sums)
    codec.write_header(buf, layout, 4, kvsum64=as_unsigned(sums)[0])
    header = codec.verify_chunk(buf, layout, 4)  # the host recomputes the same KVSUM64
    assert header.checksum == payload_checksum(buf[codec.HEADER_BYTES :]) == cpu_library.payload_checksum(buf[codec.HEADER_BYTES :])
    target = torch.zeros_like(alloc)
    other = build_layout({f"l{i}": target[:, i] for i in range(2)}, 16, 16)
    assert cpu_ops.scatter(other, [ChunkSpan(buf, 4, 1, torch.tensor([3, 4]))], [header.checksum]) == [True]
    assert torch.equal(target[3], alloc[2]) and torch.equal(target[4], alloc[14])
    buf[codec.HEADER_BYTES + 5] ^= 0x10  # in block 0, which this partial span does not write
    assert cpu_ops.scatter(other, [ChunkSpan(buf, 4, 1, torch.tensor([3, 4]))], [header.checksum]) == [False]
    with pytest.raises(codec.ChunkError, match="checksum mismatch"):
        codec.verify_chunk(buf, layout, 4)
