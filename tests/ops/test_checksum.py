"""KVSUM64, the checksum the CUDA copy kernels compute while copying, checked on the CPU."""

import pytest
import torch

from kvtier import codec
from kvtier.layout import build_layout
from kvtier.ops.checksum import payload_checksum, word_weight


def test_matches_its_definition_on_a_small_payload():
    payload = torch.randint(0, 256, (64,), dtype=torch.uint8)
    words = payload.view(torch.int32).tolist()
    expected = sum((w & 0xFFFFFFFF) * word_weight(i) for i, w in enumerate(words)) % (1 << 64)
    assert payload_checksum(payload) == expected


@pytest.mark.parametrize("bit", [0, 7, 8 * 1000 + 3, 8 * 4095 + 7])
def test_every_single_bit_flip_changes_it(bit):
    payload = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    flipped = payload.clone()
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert payload_checksum(flipped) != payload_checksum(payload)


def test_swapped_blocks_change_it():
    payload = torch.randint(0, 256, (8, 512), dtype=torch.uint8)
    swapped = payload[[1, 0, 2, 3, 4, 5, 6, 7]]
    assert payload_checksum(swapped.flatten()) != payload_checksum(payload.flatten())


def test_codec_carries_a_kernel_checksum_and_verifies_it_on_the_host():
    layout = build_layout({"l0": torch.randn(4, 2, 16, 8)}, 16, 4)
    buf = torch.randint(0, 256, (codec.chunk_bytes(layout, 2),), dtype=torch.uint8)
    codec.write_header(buf, layout, 2, kvsum64=payload_checksum(buf[codec.HEADER_BYTES :]))
    assert codec.verify_chunk(buf, layout, 2).checksum_kind == codec.chunk.CHECKSUM_KVSUM64
    buf[-1] ^= 1
    assert codec.verify_chunk(buf, layout, 2, payload=False).tokens == 2 * layout.block_size  # header-only check passes
    with pytest.raises(codec.ChunkError, match="checksum"):
        codec.verify_chunk(buf, layout, 2)
