"""The torch backend equals the per-block reference, byte for byte, on random layouts and block sets."""

import torch
from hypothesis import given, settings, strategies as st

from kvtier import codec
from kvtier.layout import build_layout
from kvtier.ops import ChunkSpan, gather, scatter

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


@st.composite
def layouts(draw):
    num_blocks = draw(st.integers(4, 24))
    layers = draw(st.integers(1, 3))
    split = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    inner = (draw(st.integers(1, 3)), draw(st.sampled_from([16, 32])), draw(st.integers(1, 8)))
    pad = draw(st.integers(0, 2))  # extra blocks' worth of padding between a layer's blocks
    shape = (2, num_blocks, *inner) if split else (num_blocks, *inner)
    alloc = torch.randint(0, 100, (num_blocks, layers + pad, *shape[1:]) if not split else (2, num_blocks, layers + pad, *inner)).to(dtype)
    if split:
        kv = {f"l{i}": alloc[:, :, i] for i in range(layers)}
    else:
        kv = {f"l{i}": alloc[:, i] for i in range(layers)}
    return build_layout(kv, inner[1], num_blocks)


@st.composite
def spans(draw, layout):
    n = draw(st.integers(1, 4))
    chunks = []
    free = list(range(layout.num_blocks))
    for _ in range(draw(st.integers(1, 3))):
        first = draw(st.integers(0, n - 1))
        k = draw(st.integers(1, n - first))
        if len(free) < k:
            break
        ids = draw(st.permutations(free))[:k]
        free = [b for b in free if b not in ids]
        chunks.append((n, first, ids))
    return chunks


def make_spans(layout, chunks, fill):
    out = []
    for n, first, ids in chunks:
        buf = torch.randint(0, 256, (codec.chunk_bytes(layout, n),), dtype=torch.uint8) if fill else torch.zeros(codec.chunk_bytes(layout, n), dtype=torch.uint8)
        out.append(ChunkSpan(buf, n, first, torch.tensor(ids, dtype=torch.int64)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gather_matches_reference(data):
    layout = data.draw(layouts())
    chunks = data.draw(spans(layout))
    a, b = make_spans(layout, chunks, False), make_spans(layout, chunks, False)
    gather(layout, a, "torch")
    gather(layout, b, "reference")
    for x, y in zip(a, b):
        assert torch.equal(x.buffer, y.buffer)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scatter_matches_reference_and_touches_only_its_blocks(data):
    layout = data.draw(layouts())
    chunks = data.draw(spans(layout))
    sources = make_spans(layout, chunks, True)
    before = [r.blocks.clone() for r in layout.regions]
    scatter(layout, sources, "reference")
    expected = [r.blocks.clone() for r in layout.regions]
    for region, old in zip(layout.regions, before):
        region.blocks.copy_(old)
    scatter(layout, sources, "torch")
    touched = {b for _, _, ids in chunks for b in ids}
    for region, want, old in zip(layout.regions, expected, before):
        assert torch.equal(region.blocks, want)
        untouched = [b for b in range(layout.num_blocks) if b not in touched]
        assert torch.equal(region.blocks[untouched], old[untouched])


def test_gather_then_scatter_round_trips_a_partial_span():
    alloc = torch.randn(8, 2, 2, 16, 4)
    layout = build_layout({f"l{i}": alloc[:, i] for i in range(2)}, 16, 8)
    buf = torch.zeros(codec.chunk_bytes(layout, 4), dtype=torch.uint8)
    gather(layout, [ChunkSpan(buf, 4, 0, torch.tensor([6, 1, 3, 0]))])
    target = torch.zeros_like(alloc)
    other = build_layout({f"l{i}": target[:, i] for i in range(2)}, 16, 8)
    scatter(other, [ChunkSpan(buf, 4, 2, torch.tensor([5, 7]))])
    assert torch.equal(target[5], alloc[3]) and torch.equal(target[7], alloc[0])
    assert target[[0, 1, 2, 3, 4, 6]].abs().sum() == 0
