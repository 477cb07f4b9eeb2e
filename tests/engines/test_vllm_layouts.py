"""kvtier addresses every KV layout vLLM's CUDA attention backends give, byte for byte, on the CPU.

Each layer's KV tensor is built exactly as vLLM's GPU model runner builds it: for 0.26 and older,
``_reshape_kv_cache_tensors`` (one raw ``int8`` buffer per layer, viewed in the backend's
physical dim order, then permuted back to its logical shape); for 0.32, the installed release's
own ``compute_layout_strides`` and ``create_kv_cache_views`` over one backing buffer shared by
the layers (0.32's backends have no ``get_kv_cache_shape``: a ``KVCacheSpec`` and a
``KVCacheLayout`` decide the views). Covered: FlashAttention / FlashInfer / Triton of 0.26 (NHD
and HND), the older ``[2, num_blocks, ...]`` and ``[num_blocks, 2, ...]`` layouts, MLA's latent
cache, fp8 and uint8 KV, Triton's inline per-token-head scales, KV sharing, and all six 0.32
layouts. For each: random bytes in, every available backend's gather equals the reference's,
and a scatter into a zeroed twin writes exactly the chunk's blocks and nothing else.
"""

import math

import pytest
import torch

from kvtier import codec
from kvtier.layout import LayoutError, build_layout
from kvtier.ops import ChunkSpan, backend_names, gather, scatter

NB, BS, HEADS, HEAD = 24, 16, 2, 8
BACKENDS = [b for b in ("reference", "torch", "cpu") if b in backend_names()]
NHD, HND = "NHD", "HND"
FP8 = torch.float8_e4m3fn


def runner_kv(shape, stride_order, dtype):
    """``(raw, tensor)``: one layer as vLLM 0.26's ``gpu_model_runner._reshape_kv_cache_tensors``
    builds it from ``backend.get_kv_cache_shape`` and ``backend.get_kv_cache_stride_order``."""
    raw = torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.int8)  # num_blocks * page_bytes
    physical_shape = tuple(shape[i] for i in stride_order)
    inverse_order = [stride_order.index(i) for i in range(len(stride_order))]
    return raw, raw.view(dtype).view(physical_shape).permute(*inverse_order)


# vLLM 0.26 FlashAttention, FlashInfer and Triton attention (one shape): K and V packed in the content dim.
def fa_026(nb, order, heads=HEADS, head=HEAD):
    return (nb, heads, BS, 2 * head), {NHD: (0, 2, 1, 3), HND: (0, 1, 2, 3)}[order]


# vLLM 0.26 Triton attention with per-token-head fp8 scales: one float32 scale inline after each of K and V.
def triton_scales_026(nb, order):
    return (nb, HEADS, BS, 2 * (HEAD + 4)), {NHD: (0, 2, 1, 3), HND: (0, 1, 2, 3)}[order]


# Older vLLM FlashAttention: K and V as a leading dim, two regions per layer.
def fa_old(nb, order):
    return (2, nb, BS, HEADS, HEAD), {NHD: (0, 1, 2, 3, 4), HND: (0, 1, 3, 2, 4)}[order]


# Older vLLM FlashInfer and Triton attention: K and V behind the block dim, one region.
def flashinfer_old(nb, order):
    return (nb, 2, BS, HEADS, HEAD), {NHD: (0, 1, 2, 3, 4), HND: (0, 1, 3, 2, 4)}[order]


# vLLM MLA backends (FlashMLA, Triton MLA, CUTLASS MLA): kv_lora_rank 512 + rope 64 latent, no K/V split.
def mla(nb, order):
    return (nb, BS, 512 + 64), (0, 1, 2)


def vllm_026(make, order, dtype, layers=2):
    """``(raw buffers, kv_caches, block dim)``: one raw buffer per layer, as the GPU runner allocates."""
    raws, kv = [], {}
    for i in range(layers):
        shape, stride_order = make(NB, order)
        raw, kv[f"model.layers.{i}.self_attn.attn"] = runner_kv(shape, stride_order, dtype)
        raws.append(raw)
    return raws, kv, 1 if shape[0] == 2 else 0


def vllm_032(layout_name, spec_kwargs, layers=3):
    """``(raw buffers, kv_caches, block dim)`` from the installed vLLM 0.32's own functions: the
    ``KVCacheTensor`` as ``core.kv_cache_utils.get_kv_cache_config_from_groups`` places one group's
    layers, then the per-layer views ``worker.utils.allocate_kv_cache`` makes of one int8 buffer."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    spec_kwargs = dict(spec_kwargs)
    cls = kvi.MLAAttentionSpec if spec_kwargs.pop("mla", False) else kvi.FullAttentionSpec
    spec = cls(block_size=BS, **spec_kwargs)
    layout = kvi.KVCacheLayout[layout_name]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    bytes_per_block = layers * spec.page_size_bytes
    fixed = (None, bytes_per_block if layout.is_block_outermost else None, None, None, None)
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(spec, NB, layers, layout, fixed_strides=fixed)
    tensor = kvi.KVCacheTensor(size=NB * bytes_per_block, layers=names, layer_stride=layer_stride,
                               block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return [raw], dict(zip(names, kvi.create_kv_cache_views(raw, spec, NB, layout, tensor))), 0


def bits(t):
    """``t`` as integers of its width, so bf16 NaNs and fp8 compare exactly."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def chunk_spans(layout, ids):
    """A full chunk of 4 shuffled blocks, a partial span (2 blocks from block 1 of 4), a full chunk of 3."""
    plan = [(4, 0, ids[:4]), (4, 1, ids[4:6]), (3, 0, ids[6:9])]
    return [ChunkSpan(torch.zeros(codec.chunk_bytes(layout, n), dtype=torch.uint8), n, first, b) for n, first, b in plan]


def check_round_trip(make, regions_per_layer):
    g = torch.Generator().manual_seed(0)
    raws, src, dim = make()
    for raw in raws:
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))
    layout = build_layout(src, BS, NB)
    layers = list({t.data_ptr(): t for t in src.values()}.values())  # KV sharing: one tensor, two names
    assert len(layout.regions) == regions_per_layer * len(layers)
    assert sum(r.block_bytes for r in layout.regions) * NB == sum(t.numel() * t.element_size() for t in layers)
    ids, dst_ids = torch.randperm(NB, generator=g)[:9], torch.randperm(NB, generator=g)[:9]
    want = chunk_spans(layout, ids)
    gather(layout, want, "reference")
    expected_raws, expected, _ = make()  # the source's blocks ids[i] at dst_ids[i], zero elsewhere
    for s, d in zip(ids.tolist(), dst_ids.tolist()):
        for name in src:
            bits(expected[name]).select(dim, d).copy_(bits(src[name]).select(dim, s))
    for backend in BACKENDS:
        got = chunk_spans(layout, ids)
        gather(layout, got, backend)
        assert all(torch.equal(a.buffer, b.buffer) for a, b in zip(got, want)), f"{backend} gather differs from reference"
        dst_raws, dst, _ = make()
        dst_layout = build_layout(dst, BS, NB)
        loads = [ChunkSpan(c.buffer, c.num_blocks, c.first, d) for c, d in zip(got, dst_ids.split([4, 2, 3]))]
        scatter(dst_layout, loads, backend)  # the same chunks, loaded into other blocks in one batch
        assert all(torch.equal(a, b) for a, b in zip(dst_raws, expected_raws)), f"{backend} scatter differs"
        untouched = torch.tensor([b for b in range(NB) if b not in dst_ids.tolist()])
        assert not any(bits(t).index_select(dim, untouched).any() for t in dst.values()), f"{backend} wrote other blocks"


CASES_026 = [
    pytest.param(fa_026, NHD, torch.bfloat16, 1, id="fa-0.26-NHD"),
    pytest.param(fa_026, HND, torch.bfloat16, 1, id="fa-0.26-HND"),
    pytest.param(fa_026, NHD, FP8, 1, id="fa-0.26-NHD-fp8"),
    pytest.param(fa_026, NHD, torch.uint8, 1, id="fa-0.26-NHD-uint8"),
    pytest.param(triton_scales_026, NHD, FP8, 1, id="triton-0.26-NHD-fp8-scales"),
    pytest.param(fa_old, NHD, torch.bfloat16, 2, id="fa-old-NHD"),
    pytest.param(fa_old, HND, torch.bfloat16, 2, id="fa-old-HND"),
    pytest.param(fa_old, NHD, FP8, 2, id="fa-old-NHD-fp8"),
    pytest.param(fa_old, HND, torch.uint8, 2, id="fa-old-HND-uint8"),
    pytest.param(flashinfer_old, NHD, torch.float16, 1, id="flashinfer-old-NHD"),
    pytest.param(flashinfer_old, HND, torch.float16, 1, id="flashinfer-old-HND"),
    pytest.param(mla, None, torch.bfloat16, 1, id="mla-0.26"),
]


@pytest.mark.parametrize("make, order, dtype, regions_per_layer", CASES_026)
def test_vllm_026_and_older_layouts_round_trip(make, order, dtype, regions_per_layer):
    layers = 3 if order == HND else 2  # one raw buffer per layer, as the GPU runner allocates by default
    check_round_trip(lambda: vllm_026(make, order, dtype, layers), regions_per_layer)


def test_runner_helper_gives_vllm_026_strides():
    """23770 blocks of 8 heads x 16 tokens x 128 dims in bf16, NHD: what 0.26 hands a connector."""
    _, t = runner_kv(*fa_026(4, NHD, heads=8, head=128), torch.bfloat16)
    assert t.shape == (4, 8, 16, 256) and t.stride() == (32768, 256, 2048, 1)


@pytest.mark.parametrize("make, regions", [(fa_026, 1), (fa_old, 2)], ids=["fa-0.26", "fa-old"])
def test_kv_sharing_layers_give_one_region(make, regions):
    def shared():
        raws, kv, dim = vllm_026(make, NHD, torch.bfloat16)
        kv["model.layers.2.self_attn.attn"] = kv["model.layers.0.self_attn.attn"]  # vLLM's cross-layer KV sharing
        return raws, kv, dim

    check_round_trip(shared, regions)


BF16 = dict(num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
CASES_032 = [
    pytest.param("LBNHC", BF16, 1, id="fa-0.32-LBNHC"),  # FA / FlashInfer / Triton default (NHD)
    pytest.param("LBHNC", BF16, 1, id="fa-0.32-LBHNC"),  # HND
    pytest.param("LHBNC", BF16, HEADS, id="fa-0.32-LHBNC"),  # head outside the block: one region per head
    pytest.param("BLNHC", BF16, 1, id="fa-0.32-BLNHC"),  # block-outermost: layers interleave per block
    pytest.param("BLHNC", BF16, 1, id="fa-0.32-BLHNC"),
    # a layer's block is one range per head, other layers' heads between them: one region per head
    pytest.param("BHLNC", BF16, HEADS, id="fa-0.32-BHLNC"),
    pytest.param("LBNHC", dict(BF16, dtype=FP8), 1, id="fa-0.32-LBNHC-fp8"),
    # TritonAttentionBackend.customize_spec, fp8 per-token-head: (K + V) data + two float32 scales
    pytest.param("LBNHC", dict(BF16, dtype=FP8, state_content_bytes=2 * HEAD + 2 * 4), 1, id="triton-0.32-LBNHC-fp8-scales"),
    pytest.param("LBHNC", dict(BF16, page_size_padded=HEADS * BS * 4 * HEAD + 256), 1, id="fa-0.32-LBHNC-padded-page"),
    pytest.param("LBNHC", dict(mla=True, num_kv_heads=1, head_size=576, dtype=torch.bfloat16), 1, id="mla-0.32"),
]


@pytest.mark.parametrize("layout_name, spec, regions_per_layer", CASES_032)
def test_vllm_032_layouts_from_its_own_functions_round_trip(layout_name, spec, regions_per_layer):
    check_round_trip(lambda: vllm_032(layout_name, spec), regions_per_layer)


def refusal(kv):
    with pytest.raises(LayoutError) as info:
        build_layout(kv, BS, 6)
    message = str(info.value)
    assert message.endswith(".") and ". " not in message, message  # one sentence
    return message


@pytest.mark.parametrize("tensor", [
    pytest.param(torch.zeros(6, 128, 2)[..., :1], id="block-in-128-pieces"),  # a gap after every element
    pytest.param(torch.zeros(64).as_strided((2, 6, 4), (2, 8, 1)), id="k-and-v-share-bytes"),
    pytest.param(torch.zeros(1, 4, 4).expand(6, 4, 4), id="blocks-overlap"),
])
def test_unaddressable_layouts_are_refused_naming_name_shape_and_strides(tensor):
    message = refusal({"model.layers.0.self_attn.attn": tensor})
    for fact in ("model.layers.0.self_attn.attn", str(tuple(tensor.shape)), str(tensor.stride())):
        assert fact in message, message


@pytest.mark.parametrize("tensor", [
    pytest.param(torch.zeros(5, 4, 4), id="no-num-blocks-dim"),
    pytest.param(torch.zeros(6, 3, 4).transpose(0, 1), id="blocks-behind-a-non-kv-dim"),
])
def test_tensors_without_a_block_dim_are_refused_naming_name_and_shape(tensor):
    message = refusal({"model.layers.0.self_attn.attn": tensor})
    for fact in ("model.layers.0.self_attn.attn", str(tuple(tensor.shape)), str(tensor.stride())):
        assert fact in message, message


@pytest.mark.parametrize("tensor, regions", [
    pytest.param(runner_kv(*fa_026(6, NHD), torch.bfloat16)[1][..., :HEAD], BS * HEADS, id="half-of-each-token"),
    pytest.param(torch.zeros(64).as_strided((2, 6, 4), (12, 8, 1)), 2, id="k-and-v-blocks-interleave"),
])
def test_blocks_with_gaps_or_interleaved_split_into_regions_that_share_no_byte(tensor, regions):
    """Still addressable: each dense piece of a block is a region (K0 . K1 V0 K2 V1 ... for the second)."""
    layout = build_layout({"l0": tensor}, BS, 6)
    assert len(layout.regions) == regions
    starts = sorted((r.blocks.data_ptr() + b * r.block_stride, r.block_bytes)
                    for r in layout.regions for b in range(r.num_blocks))
    assert all(a + n <= b for (a, n), (b, _) in zip(starts, starts[1:]))  # no byte in two blocks
