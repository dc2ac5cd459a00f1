"""The decode-step experts (layers/moe_decode.py: two GEMV kernels, no sorting) against the torch
reference, for bf16-layout, int4 and fp8 weights, run by Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import blockspec.layers.fused_moe as fm  # noqa: E402
from blockspec.layers.moe import count_experts, experts_reference  # noqa: E402
from blockspec.layers.moe_decode import GemvTiles, decode_experts  # noqa: E402
from blockspec.layers.quant_dequant import dequantize  # noqa: E402
from tests.test_quant_kernels import experts_ref, fp8, int4  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)
# small tiles: several programs along N and several iterations along K, partial last ones
SMALL = {"gate_up": GemvTiles(8, 32, 2), "down": GemvTiles(4, 16, 1)}


def dense_case(t: int, k: int, e: int = 8, h: int = 72, i: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(e, h, i, generator=g) / i**0.5
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("t,k", [(1, 1), (1, 6), (2, 3), (3, 2)])
@pytest.mark.parametrize("tiles", [None, SMALL])
def test_decode_experts_match_the_reference(t, k, tiles):
    x, w, ids, gate_up, down = dense_case(t, k, seed=t * 10 + k)
    torch.testing.assert_close(decode_experts(x, w, ids, gate_up, down, tiles=tiles),
                               experts_reference(x, w, ids, gate_up, down), **TOL)


def test_residual_is_added_and_distinct_experts_counted():
    x, w, ids, gate_up, down = dense_case(3, 2, seed=7)
    ids = torch.tensor([[4, 1], [1, 4], [6, 4]])  # experts shared across tokens: 3 distinct
    res = torch.randn_like(x)
    stats = torch.zeros(2, dtype=torch.int64)
    out = decode_experts(x, w, ids, gate_up, down, stats=stats, residual=res, tiles=SMALL)
    torch.testing.assert_close(out, experts_reference(x, w, ids, gate_up, down) + res, **TOL)
    expect = torch.zeros(2, dtype=torch.int64)
    count_experts(ids, 8, expect)
    assert stats.tolist() == expect.tolist() == [3, 1]


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("tiles", [None, SMALL])
def test_quantized_decode_experts_match_the_dequantized_reference(fmt, tiles):
    g = torch.Generator().manual_seed(3)
    e, h, i, t, k = 8, 96, 64, 2, 3
    if fmt == "int4":
        gate_up, down = int4((e, 2 * i), h, 32, g), int4((e, h), i, 32, g)
    else:  # scale blocks straddling the tiles and a partial last block along each dim
        gate_up, down = fp8((e, 2 * i), h, (16, 40), g), fp8((e, h), i, (24, 48), g)
    x = torch.randn(t, h, generator=g)
    ids = torch.tensor([[0, 5, 2], [5, 7, 1]])
    weights = torch.rand(t, k, generator=g)
    dense = [dequantize(w) for w in (gate_up, down)]
    torch.testing.assert_close(decode_experts(x, weights, ids, gate_up, down, tiles=tiles),
                               experts_ref(x, weights, ids, *dense), **TOL)


def test_fused_experts_take_the_decode_path_up_to_its_slots(monkeypatch):
    calls = []
    real = fm.decode_experts
    monkeypatch.setattr(fm, "decode_experts",
                        lambda *a, **k: calls.append(a[2].numel()) or real(*a, **k))
    for t in (1, 5):
        x, w, ids, gate_up, down = dense_case(t, 2, seed=t)
        res = torch.randn_like(x)
        torch.testing.assert_close(fm.fused_experts(x, w, ids, gate_up, down, residual=res),
                                   experts_reference(x, w, ids, gate_up, down) + res, **TOL)
    assert calls == [2]  # 10 slots exceed MAX_DECODE_SLOTS for bf16: the grouped GEMMs


def test_int4_magic_unpacking_equals_conversions_in_fp16():
    """16-bit activations and scales: the magic-number unpacking (int and fp16 ops) gives the
    weights the int -> fp32 conversions give, so the outputs are equal bit for bit."""
    g = torch.Generator().manual_seed(5)
    e, h, i = 8, 64, 32
    gate_up = int4((e, 2 * i), h, 32, g, torch.float16)
    down = int4((e, h), i, 32, g, torch.float16)
    x = torch.randn(2, h, generator=g).half()
    ids = torch.tensor([[3, 1], [1, 6]])
    weights = torch.rand(2, 2, generator=g).half()
    magic = decode_experts(x, weights, ids, gate_up, down, dequant="magic")
    assert torch.equal(magic, decode_experts(x, weights, ids, gate_up, down, dequant="convert"))
    dense = [dequantize(w).half().float() for w in (gate_up, down)]
    torch.testing.assert_close(magic.float(), experts_ref(x.float(), weights.float(), ids,
                                                          *dense), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_masked_unpacking_matches_the_dequantized_reference(dtype):
    """"mask" (each nibble masked in place into fp32, int4_bits.MASK32): exact products, so in
    fp32 the reference over dequantized weights up to summation order; in bf16 within the
    rounding of the dequantized weights that the other unpackings apply."""
    g = torch.Generator().manual_seed(11)
    e, h, i = 8, 64, 32
    gate_up = int4((e, 2 * i), h, 32, g, dtype)
    down = int4((e, h), i, 32, g, dtype)
    x = torch.randn(2, h, generator=g).to(dtype)
    ids = torch.tensor([[3, 1, 7], [1, 6, 0]])
    weights = torch.rand(2, 3, generator=g).to(dtype)
    out = decode_experts(x, weights, ids, gate_up, down, tiles=SMALL, dequant="mask")
    ref = experts_ref(x.float(), weights.float(), ids, *[dequantize(w).float()
                                                         for w in (gate_up, down)])
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("shared_n", [40, 56, 24])
def test_shared_experts_fold_into_the_routed_launches(shared_n):
    """`shared` (the shared MLP's weights) in ceil(S / I) more slots a token: the routed result
    plus the MLP's output, as `residual` adds it (S a multiple of I, a partial last part, and
    fewer rows than I)."""
    from blockspec.layers.fused import silu_and_mul

    x, w, ids, gate_up, down = dense_case(3, 2, seed=shared_n)  # I = 40
    g = torch.Generator().manual_seed(shared_n)
    s_gu = torch.randn(2 * shared_n, x.shape[1], generator=g) / x.shape[1] ** 0.5
    s_dn = torch.randn(x.shape[1], shared_n, generator=g) / shared_n**0.5
    mlp = silu_and_mul(x @ s_gu.t(), use_triton=False) @ s_dn.t()
    stats = torch.zeros(2, dtype=torch.int64)
    out = decode_experts(x, w, ids, gate_up, down, stats=stats, tiles=SMALL, shared=(s_gu, s_dn))
    torch.testing.assert_close(out, experts_reference(x, w, ids, gate_up, down) + mlp, **TOL)
    expect = torch.zeros(2, dtype=torch.int64)
    count_experts(ids, 8, expect)
    assert stats.tolist() == expect.tolist()  # the shared slots are not counted


SPLIT = {"gate_up": SMALL["gate_up"], "down": SMALL["down"]._replace(split=True)}


@pytest.mark.parametrize("case", ["dense", "residual", "shared", "int4"])
def test_split_down_equals_the_looping_kernel_bit_for_bit(case):
    """tiles.split (one program per pick, the last to arrive sums: moe_down.py) gives the
    looping kernel's output exactly, and leaves its arrival counters zero."""
    from blockspec.layers.arrival import arrival_locks

    x, w, ids, gate_up, down = dense_case(3, 4, seed=21)
    kw = {}
    if case == "residual":
        kw["residual"] = torch.randn_like(x)
    elif case == "shared":  # 56 rows: one whole part of I = 40 and a partial one
        g = torch.Generator().manual_seed(2)
        kw["shared"] = (torch.randn(112, x.shape[1], generator=g) / 9,
                        torch.randn(x.shape[1], 56, generator=g) / 8)
    elif case == "int4":  # one token (four picks): the interpreter runs int4 slowly
        g = torch.Generator().manual_seed(4)
        gate_up, down = int4((8, 128), 96, 32, g), int4((8, 96), 64, 32, g)
        x, w, ids = x[:1, :1].repeat(1, 96), w[:1], ids[:1]
    loop = decode_experts(x, w, ids, gate_up, down, tiles=SMALL, **kw)
    split = decode_experts(x, w, ids, gate_up, down, tiles=SPLIT, **kw)
    assert torch.equal(split, loop)
    assert not arrival_locks(x.device, 1).any()


@pytest.mark.parametrize("t,k,group,tiles", [
    (1, 8, 8, None), (1, 8, 8, SMALL), (3, 2, 8, None), (1, 8, 32, None), (2, 4, 16, SMALL)])
def test_int4_subnormal_unpacking_matches_the_dequantized_reference(t, k, group, tiles):
    """"subnormal" (int4_bits.SUBNORMAL: each nibble an fp32 subnormal against inputs scaled by
    a power of two, the bias off once per word): the fp32 reference over dequantized weights up
    to fp32 rounding, with K (104, or 96) and I (40, 48 or 96) padded to whole tiles in SMALL.
    Groups of 16 or 32 columns: the words' sums scaled once a group where whole groups fill a
    tile (the default tiles, SMALL's gate_up), else once a word (SMALL's down). (The split down
    kernel over subnormal inputs: test_split_down_equals_the_looping_kernel_bit_for_bit.)"""
    g = torch.Generator().manual_seed(17 + t)
    e, h = 8, (104 if group == 8 else 96) if tiles else 128
    i = {8: 40, 16: 48, 32: 96}[group] if tiles else 64
    gate_up, down = int4((e, 2 * i), h, group, g), int4((e, h), i, group, g)
    x = torch.randn(t, h, generator=g) * 4
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    res = torch.randn(t, h, generator=g)
    out = decode_experts(x, weights, ids, gate_up, down, tiles=tiles, dequant="subnormal",
                         residual=res)
    ref = experts_ref(x, weights, ids, *[dequantize(w) for w in (gate_up, down)]) + res
    torch.testing.assert_close(out, ref, **TOL)


def test_subnormal_inputs_hold_scaled_columns_and_word_sums():
    from blockspec.layers.int4_bits import SUB_BIAS, subnormal_inputs

    x = torch.randn(2, 24)  # 3 words, padded to 4 (block_k 32)
    t = subnormal_inputs(x, 32)
    assert t.shape == (2, 9, 4)
    words = x.view(2, 3, 8)
    for j in range(8):
        torch.testing.assert_close(t[:, j, :3], words[..., j] * 2.0 ** (SUB_BIAS - 4 * (j % 4)),
                                   rtol=0, atol=0)
    torch.testing.assert_close(t[:, 8, :3], 8 * words.sum(-1))
    assert not t[:, :, 3].any()
