import pytest
import torch

from kvtier.layout import LayoutError, build_layout


def cpu_kv(num_blocks=6, layers=2, heads=2, block=32, head=8):
    """vLLM-CPU style: one allocation, each layer a view ``[num_blocks, heads, block, 2*head]``."""
    alloc = torch.randn(num_blocks, layers, heads, block, 2 * head)
    return alloc, {f"layer.{i}": alloc[:, i] for i in range(layers)}


def test_cpu_layer_views_alias_the_engine_memory():
    alloc, kv = cpu_kv()
    layout = build_layout(kv, 32, 6)
    assert len(layout.regions) == 2
    region = layout.regions[1]
    assert region.block_bytes == 2 * 32 * 16 * 4
    assert region.block_stride == 2 * region.block_bytes  # layers interleave per block
    region.blocks[3].fill_(0)
    assert alloc[3, 1].abs().sum() == 0 and alloc[3, 0].abs().sum() > 0


def test_flash_layout_splits_k_and_v_into_two_regions():
    kv = {"l0": torch.zeros(2, 5, 16, 2, 8, dtype=torch.bfloat16)}
    layout = build_layout(kv, 16, 5)
    assert [r.name for r in layout.regions] == ["l0.k", "l0.v"]
    layout.regions[1].blocks[4].fill_(1)
    assert kv["l0"][1, 4].view(torch.int16).ne(0).all() and kv["l0"][0].view(torch.int16).eq(0).all()


def test_fingerprint_changes_with_dtype_block_size_and_rank():
    _, kv = cpu_kv()
    base = build_layout(kv, 32, 6).fingerprint
    half = {k: v.half() for k, v in kv.items()}
    assert build_layout(half, 32, 6).fingerprint != base
    assert build_layout(kv, 64, 6).fingerprint != base
    assert build_layout(kv, 32, 6, tp_rank=1, tp_size=2).fingerprint != base
    assert build_layout(kv, 32, 6).fingerprint == base


@pytest.mark.parametrize(
    "kv, match",
    [
        ({"l0": torch.zeros(7, 4, 4)}, "has no block dim: expected \\[num_blocks=6"),
        ({"l0": torch.zeros(1, 4, 4).expand(6, 4, 4)}, "shape \\(6, 4, 4\\), strides \\(0, 4, 1\\).* overlapping blocks"),
        ({}, "no KV tensors"),
    ],
)
def test_unsupported_layouts_are_refused_with_one_sentence(kv, match):
    with pytest.raises(LayoutError, match=match):
        build_layout(kv, 16, 6)


def test_an_outer_dim_splits_blocks_into_regions():
    """A dim laid out outside the block dim (here 4 parts, as K/V are 2 in flash attention) gives
    one region per index; each still holds whole blocks."""
    alloc = torch.arange(4 * 6 * 4, dtype=torch.float32).view(4, 6, 4)
    layout = build_layout({"l0": alloc.transpose(0, 1)}, 16, 6)
    assert [r.name for r in layout.regions] == ["l0.0", "l0.1", "l0.2", "l0.3"]
    assert layout.regions[2].blocks[5].view(torch.float32).tolist() == alloc[2, 5].tolist()
