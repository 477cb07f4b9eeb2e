import pytest
import torch

from kvtier import codec
from kvtier.codec import checksums  # noqa: F401 - codec.checksums below
from kvtier.layout import build_layout


@pytest.fixture
def layout():
    alloc = torch.randn(8, 3, 2, 16, 8)
    return build_layout({f"l{i}": alloc[:, i] for i in range(3)}, 16, 8)


def sealed(layout, n=4):
    buf = torch.randint(0, 256, (codec.chunk_bytes(layout, n),), dtype=torch.uint8)
    codec.write_header(buf, layout, n)
    return buf


def test_region_major_offsets(layout):
    per = [r.block_bytes for r in layout.regions]
    assert codec.region_offsets(layout, 4) == [64, 64 + 4 * per[0], 64 + 4 * (per[0] + per[1])]
    assert codec.chunk_bytes(layout, 4) == 64 + 4 * sum(per)


def test_sealed_chunk_verifies(layout):
    header = codec.verify_chunk(sealed(layout), layout, 4)
    assert header.tokens == 4 * layout.block_size and header.fingerprint == layout.fingerprint


@pytest.mark.parametrize("where", [0, 5, 20, 64, 100, -1])
def test_any_flipped_byte_is_detected(layout, where):
    buf = sealed(layout)
    buf[where] ^= 0x10
    with pytest.raises(codec.ChunkError):
        codec.verify_chunk(buf, layout, 4)


def test_wrong_layout_block_count_and_truncation_are_detected(layout):
    buf = sealed(layout)
    other = build_layout({"l0": torch.zeros(8, 2, 16, 8)}, 16, 8)
    with pytest.raises(codec.ChunkError, match="another KV layout"):
        codec.verify_chunk(buf, other, 4)
    with pytest.raises(codec.ChunkError, match="expected 2"):
        codec.verify_chunk(buf, layout, 2)
    with pytest.raises(codec.ChunkError, match="truncated"):
        codec.verify_chunk(buf[:-1], layout, 4)
    with pytest.raises(codec.ChunkError, match="magic"):
        codec.verify_chunk(torch.zeros(128, dtype=torch.uint8), layout, 4)


@pytest.mark.parametrize("kind", sorted(codec.checksums.NAMES))
def test_every_checksum_kind_verifies_and_catches_a_flipped_payload_bit(layout, kind):
    buf = torch.randint(0, 256, (codec.chunk_bytes(layout, 4),), dtype=torch.uint8)
    codec.write_header(buf, layout, 4, kind=kind)
    header = codec.verify_chunk(buf, layout, 4)
    assert header.checksum_kind == kind and header.checksum != 0
    buf[codec.HEADER_BYTES + 777] ^= 0x04
    with pytest.raises(codec.ChunkError, match=f"{codec.checksums.NAMES[kind]} checksum mismatch"):
        codec.verify_chunk(buf, layout, 4)


def test_xxh3_keeps_all_128_bits(layout):
    buf = sealed(layout)
    header = codec.verify_chunk(buf, layout, 4)
    assert header.checksum_kind == codec.chunk.CHECKSUM_XXH3_128 and header.checksum >> 64
    buf[48] ^= 0x01  # low byte of the high half
    with pytest.raises(codec.ChunkError, match="checksum mismatch"):
        codec.verify_chunk(buf, layout, 4)


def old_format_chunk(layout, n=4):
    """A chunk as format version 1 wrote it: 64-bit BLAKE3 in a 48-byte header, intact otherwise."""
    import struct

    import blake3

    buf = torch.randint(0, 256, (codec.chunk_bytes(layout, n),), dtype=torch.uint8)
    payload = buf[codec.HEADER_BYTES :]
    digest = int.from_bytes(blake3.blake3(memoryview(payload.numpy())).digest(8), "little")
    packed = struct.Struct("<4sHH16sIIQQ").pack(b"KVTC", 1, 1, layout.fingerprint, n, 0, payload.numel(), digest)
    buf[: codec.HEADER_BYTES].zero_()
    buf[: len(packed)] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    return buf


def test_a_chunk_of_the_previous_format_version_is_refused(layout):
    assert codec.FORMAT_VERSION == 3
    with pytest.raises(codec.ChunkError, match="format version 1"):
        codec.verify_chunk(old_format_chunk(layout), layout, 4)


@pytest.mark.parametrize("tokens", [16, 64])
def test_retoken_cuts_or_pads_each_region_and_seals_anew(tokens):
    nhd = build_layout({"l0": torch.randn(2, 8, 32, 2, 4)}, 32, 8)  # token-contiguous: K and V regions
    src = sealed(nhd, 1)  # 32 tokens
    dst = torch.full((codec.HEADER_BYTES + tokens * sum(nhd.token_bytes),), 7, dtype=torch.uint8)
    codec.retoken(src, dst, nhd.token_bytes, tokens)
    header = codec.read_header(dst)
    assert header.tokens == tokens and header.fingerprint == nhd.fingerprint
    width, kept = nhd.token_bytes[0], min(tokens, 32) * nhd.token_bytes[0]
    for r in range(2):
        got = dst[codec.HEADER_BYTES + r * tokens * width:][: tokens * width]
        assert torch.equal(got[:kept], src[codec.HEADER_BYTES + r * 32 * width:][:kept])
        assert not got[kept:].any()
    if tokens % 32 == 0:
        codec.verify_chunk(dst, nhd, tokens // 32)


def test_retoken_refuses_a_corrupt_chunk():
    nhd = build_layout({"l0": torch.randn(2, 8, 32, 2, 4)}, 32, 8)
    src = sealed(nhd, 1)
    src[-1] ^= 1
    with pytest.raises(codec.ChunkError, match="checksum mismatch"):
        codec.retoken(src, torch.empty(4096, dtype=torch.uint8), nhd.token_bytes, 16)
