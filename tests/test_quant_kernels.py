"""The quantized grouped GEMMs (layers/quant_gemm.py: W4A16 int4 and block-scaled FP8, for
routed experts and dense layers) against plain-torch references, run by Triton's interpreter
on CPU; the torch dequantization against compressed-tensors' own unpacking."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import blockspec.layers.quant_gemm as qg  # noqa: E402
from blockspec.layers.fused_moe import BLOCK_M  # noqa: E402
from blockspec.layers.moe import select_experts  # noqa: E402
from blockspec.layers.quant_dequant import (  # noqa: E402
    QuantWeight,
    dequantize,
    dequantize_int4,
    unpack_int4,
)
from blockspec.layers.quant_gemm import Tiles, fused_experts_quant, quant_linear  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)


def int4(shape: tuple[int, ...], k: int, group: int, g: torch.Generator,
         scale_dtype: torch.dtype = torch.float32) -> QuantWeight:
    packed = torch.randint(-(1 << 31), (1 << 31) - 1, (*shape, k // 8), dtype=torch.int32,
                           generator=g)
    scale = (torch.rand(*shape, k // group, generator=g) * 0.02 + 0.01).to(scale_dtype)
    return QuantWeight("int4", packed, scale, (1, group), k)


def fp8(shape: tuple[int, ...], k: int, block: tuple[int, int], g: torch.Generator
        ) -> QuantWeight:
    w = (torch.randn(*shape, k, generator=g) * 40).to(torch.float8_e4m3fn)
    rows = -(-shape[-1] // block[0])
    scale = torch.rand(*shape[:-1], rows, -(-k // block[1]), generator=g) * 0.01 + 0.001
    return QuantWeight("fp8", w, scale, block, k)


def ref_fp8(w: QuantWeight) -> torch.Tensor:
    """Element by element: w[n, k] * scale[n // bn, k // bk]."""
    n = torch.arange(w.n)[:, None] // w.group[0]
    k = torch.arange(w.k)[None, :] // w.group[1]
    return w.data.float() * w.scale[..., n, k]


def ref_int4(w: QuantWeight) -> torch.Tensor:
    """Exact in fp32 (the kernel rounds once, to the activations' dtype)."""
    return unpack_int4(w.data, w.k).float() * w.scale.float().repeat_interleave(w.group[1], -1)


def test_int4_unpacking_is_compressed_tensors_order():
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_to_int32(q, 4)
    assert torch.equal(unpack_int4(packed, 64), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([6, 64])), unpack_int4(packed, 64))
    scale = torch.rand(6, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(dequantize_int4(packed, scale, 32, 64),
                               q.to(torch.bfloat16) * scale.repeat_interleave(32, 1), rtol=0,
                               atol=0)


def test_fp8_dequantization_covers_partial_edge_blocks():
    g = torch.Generator().manual_seed(1)
    w = fp8((40,), 70, (16, 32), g)  # 40 = 2.5 row blocks, 70 = 2.2 column blocks
    torch.testing.assert_close(dequantize(w), ref_fp8(w), rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 5, BLOCK_M + 1, 70])
@pytest.mark.parametrize("fmt", ["int4", "int4_channel", "int4_bf16_scale", "fp8", "fp8_edge"])
def test_quant_linear_matches_dequantized_matmul(fmt, m):
    g = torch.Generator().manual_seed(m)
    w = {"int4": lambda: int4((72,), 96, 32, g),
         "int4_channel": lambda: int4((72,), 96, 96, g),
         "int4_bf16_scale": lambda: int4((72,), 96, 32, g, torch.bfloat16),
         "fp8": lambda: fp8((64,), 128, (32, 64), g),
         "fp8_edge": lambda: fp8((40,), 70, (16, 32), g)}[fmt]()
    x = torch.randn(m, w.k, generator=g)
    dense = ref_fp8(w) if w.fmt == "fp8" else ref_int4(w)
    torch.testing.assert_close(quant_linear(x, w), x @ dense.T, **TOL)


@pytest.mark.parametrize("m", [3, 130, 300])
def test_fp8_dense_tiles_by_rows(m):
    """Each of FP8_DENSE_TILES' row ranges (decode: K 256 a step over 128-column scale groups;
    128-row tiles; 256 weight rows a tile) against the dequantized matmul, N and M past one
    tile with ragged edges."""
    from blockspec.layers.quant_gemm import FP8_DENSE_TILES, dense_tiles

    assert dense_tiles(m, "fp8") in [(bm, t) for _, bm, t in FP8_DENSE_TILES]
    assert dense_tiles(m, "int4")[1].dequant == "magic16"  # int4 keeps the grouped GEMM's
    g = torch.Generator().manual_seed(m)
    w = fp8((272,), 512, (128, 128), g)
    x = torch.randn(m, w.k, generator=g)
    torch.testing.assert_close(quant_linear(x, w), x @ ref_fp8(w).T, **TOL)


def test_k_tiles_hold_whole_scale_groups_or_lie_in_one():
    from blockspec.layers.quant_gemm import _k_tile

    assert _k_tile(128, 32) == (128, True)  # four groups per tile, scales broadcast
    assert _k_tile(64, 128) == (64, False)  # half a group per tile: one scale per row
    assert _k_tile(128, 96) == (32, False)  # a third of a group
    with pytest.raises(NotImplementedError, match="groups of 40"):
        _k_tile(128, 40)


def experts_ref(x, weights, ids, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_k weight * down_e(silu(gate_e x) * up_e x), token by token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("t", [1, 6, 37])
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quant_experts_match_the_reference(fmt, t):
    g = torch.Generator().manual_seed(t)
    e, h, i = 8, 64, 32
    if fmt == "int4":
        gate_up, down = int4((e, 2 * i), h, 32, g), int4((e, h), i, 32, g)
    else:
        gate_up, down = fp8((e, 2 * i), h, (16, 32), g), fp8((e, h), i, (16, 32), g)
    dense = [ref_fp8(w) if fmt == "fp8" else ref_int4(w) for w in (gate_up, down)]
    x = torch.randn(t, h, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g), None, 2, 1, 1, True, 2.5)
    if t == 37:  # more slots than a tile for one expert, none for most
        ids = torch.stack([torch.full((t,), 5), torch.full((t,), 2)], dim=1)
    torch.testing.assert_close(fused_experts_quant(x, weights, ids, gate_up, down),
                               experts_ref(x, weights, ids, *dense), **TOL)


DEQUANTS = [d for d in qg.DEQUANTS if d != "convert"]
# NOTE: Triton's interpreter stores bf16 as uint16: it has no bf16 arithmetic or bf16 tl.dot and
# it truncates fp32 -> bf16. Here bf16 tiles run only through fp32 ("convert", "magic") and are
# compared with each other; the GPU check run (benchmarks/quant_gpu_checks.py, check_dequants)
# compares every dequantization in bf16 there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _int4_tile_kernel(w_ptr, s_ptr, out_ptr, k, DEQUANT: tl.constexpr, MAGIC: tl.constexpr,
                      VALUE_DTYPE: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The kernel's dequantized int4 tiles of a [BLOCK_N, k] weight, as tl.dot takes them."""
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < BLOCK_N
    for k0 in range(0, k, BLOCK_K):
        w = qg._weight_tile(w_ptr + cols * (k // 8), k0, k, col_ok, 0, DEQUANT, MAGIC,
                            VALUE_DTYPE, BLOCK_N, BLOCK_K)
        w = qg._scaled(w, s_ptr + cols * (k // GROUP_K), k0, k, col_ok, GROUP_K, BLOCK_N,
                       BLOCK_K, SPLIT)
        kk = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + cols[:, None] * k + kk[None, :], w.to(out_ptr.dtype.element_ty))


def int4_tiles(w: QuantWeight, act: torch.dtype, dequant: str, block_k: int) -> torch.Tensor:
    block_k, split = qg._k_tile(block_k, w.group[1])
    out = torch.empty(w.n, w.k, dtype=act)
    _int4_tile_kernel[(1,)](w.data, w.scale, out, w.k, GROUP_K=w.group[1], BLOCK_N=w.n,
                            BLOCK_K=block_k, SPLIT=split, **qg._dequant(w, act, dequant))
    return out


@pytest.mark.parametrize("group, block_k", [(32, 128), (64, 128), (128, 128), (128, 64),
                                            (96, 128)])
@pytest.mark.parametrize("act, scale", [(torch.bfloat16, torch.bfloat16),
                                        (torch.float16, torch.float16),
                                        (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("dequant", DEQUANTS)
def test_int4_tiles_are_quant_dequant_weights(dequant, act, scale, group, block_k):
    """Each dequantization's tile == "convert"'s == the exact product rounded once to the
    activations' dtype, which is quant_dequant's dense weight where the scales share that dtype;
    tiles of whole groups (32, 64), of one (128), and inside one (128 in 64-column tiles, 96
    in 32)."""
    w = int4((32,), 384, group, torch.Generator().manual_seed(group + block_k), scale)
    bf16_interpreted = INTERPRETED and act == torch.bfloat16
    if bf16_interpreted and qg._dequant(w, act, dequant)["VALUE_DTYPE"] == tl.bfloat16:
        pytest.skip("the interpreter has no bf16 arithmetic (see INTERPRETED)")
    out = int4_tiles(w, act, dequant, block_k)
    assert torch.equal(out, int4_tiles(w, act, "convert", block_k))
    if not bf16_interpreted:
        assert torch.equal(out, ref_int4(w).to(act))
    if scale == act and not bf16_interpreted:
        assert torch.equal(out, dequantize(w))


@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("act, scale", [(torch.float32, torch.float32),
                                        (torch.float16, torch.float16),
                                        (torch.float16, torch.bfloat16)])
def test_int4_dequants_match_convert_in_gemms(act, scale, dequant):
    """Routed experts and dense layers: each dequantization's GEMM == "convert"'s bit for bit
    (the same tiles into the same dot), at group 32 and 64, and 128 with a tile inside it."""
    g = torch.Generator().manual_seed(7)
    e, h, i, t = 4, 128, 64, 5
    gate_up, down = int4((e, 2 * i), h, 32, g, scale), int4((e, h), i, 64, g, scale)
    x = torch.randn(t, h, generator=g).to(act)
    weights, ids = select_experts(torch.randn(t, e, generator=g), None, 2, 1, 1, True, 2.5)
    old, new = Tiles(32, 64, 4), Tiles(32, 64, 4, dequant)
    out = fused_experts_quant(x, weights.to(act), ids, gate_up, down, tiles=new)
    assert torch.equal(out, fused_experts_quant(x, weights.to(act), ids, gate_up, down,
                                                tiles=old))
    dense, xd = int4((48,), 256, 128, g, scale), torch.randn(t, 256, generator=g).to(act)
    assert torch.equal(quant_linear(xd, dense, new), quant_linear(xd, dense, old))
    torch.testing.assert_close(out.float(), experts_ref(
        x.float(), weights, ids, ref_int4(gate_up), ref_int4(down)), atol=2e-2, rtol=2e-2)
