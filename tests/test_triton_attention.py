"""The Triton paged-attention backend against the torch reference: compiled on a GPU, else on CPU
in Triton's interpreter (slow: sizes stay small)."""

from __future__ import annotations

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# NOTE: Triton picks interpreted vs compiled when triton.language is first imported (for its own
# library functions) and at each @triton.jit. If triton was imported before this file could set
# TRITON_INTERPRET=1 (conftest -> blockspec -> fused.py imports it), the kernels cannot run on CPU
# in this process: the cases skip here and test_in_fresh_process reruns this file in a new one.
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# NOTE: triton 3.6's interpreter fails on these kernels (compiled on a GPU they run fine).
pytest.importorskip("triton", minversion="3.7" if DEVICE == "cpu" else None)

import triton.language as tl  # noqa: E402
from helpers import NanEmptyTorch, run_file_with_triton_interpreter  # noqa: E402

import blockspec.layers.attention_splits as sp  # noqa: E402
import blockspec.layers.triton_attention as ta  # noqa: E402
from blockspec.layers.attention import (  # noqa: E402
    AttentionMetadata,
    PagedAttention,
    TorchAttentionBackend,
    get_backend,
)
from blockspec.layers.attention_splits import choose_num_splits  # noqa: E402
from blockspec.layers.triton_attention import TritonAttentionBackend  # noqa: E402

TRITON_HERE = DEVICE == "cuda" or all(
    type(fn).__name__ == "InterpretedFunction" for fn in (tl.zeros, ta._attn_kernel))
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh process instead")
TORCH = TorchAttentionBackend()
GARBAGE = 1e3  # in every cache slot no query may see: any leak swamps the output
# fp32 on a GPU: SDPA and the kernel sum in different orders over long rows.
TOL = {torch.float32: 1e-4 if DEVICE == "cuda" else 2e-5, torch.float16: 2e-2,
       torch.bfloat16: 4e-2}


def make_case(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype = torch.float32, block_size: int = 16,
              causal: bool = True, seed: int = 0):
    """Random q and a paged cache whose sequences own shuffled, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 7
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    slot = lambda table, p: table[p // block_size] * block_size + p % block_size
    written = torch.tensor([slot(t, p) for t, n in zip(tables, seq_lens) for p in range(n)],
                           dtype=torch.long)
    caches = []
    for fill in (GARBAGE, -GARBAGE):
        cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill)
        cache.view(-1, num_kv_heads, head_dim)[written] = torch.randn(
            len(written), num_kv_heads, head_dim, generator=gen)
        caches.append(cache.to(DEVICE, dtype))
    slots = [slot(t, p) for t, n, q in zip(tables, seq_lens, q_lens) for p in range(n - q, n)]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, slots, DEVICE, causal=causal)
    return q, *caches, meta


def check(backend: TritonAttentionBackend, q, k_cache, v_cache, meta) -> None:
    scale = q.shape[-1] ** -0.5
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    ref = TORCH.attend(q, k_cache, v_cache, meta, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


MIXED = ([1, 5, 16, 40], [300, 37, 140, 40])  # decode, verify, drafter-sized, pure prefill


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 16), (4, 2, 64), (8, 2, 128)])
def test_mixed_batch_matches_torch(heads, kv_heads, head_dim, causal):
    check(TritonAttentionBackend(), *make_case(*MIXED, heads, kv_heads, head_dim, causal=causal))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    check(TritonAttentionBackend(), *make_case(*MIXED, 4, 1, 64, dtype=dtype, seed=1))


@needs_triton
def test_several_query_tiles_and_odd_group():
    """Small tiles: prefill spans many q tiles, and a GQA group of 3 leaves padding rows."""
    backend = TritonAttentionBackend(max_block_m=16, block_n=16)
    check(backend, *make_case([40, 7, 1], [90, 7, 20], 6, 2, 16, seed=2))
    check(backend, *make_case([40, 7, 1], [90, 7, 20], 6, 2, 16, causal=False, seed=2))


@needs_triton
@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_other_block_sizes(block_size):
    check(TritonAttentionBackend(), *make_case(*MIXED, 4, 2, 16, block_size=block_size, seed=3))


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv(splits, causal):
    """Forced splits, including splits that get no keys (seq_len 5 split 4 ways), and a block
    of 2 (the policy's smallest verify / drafter block)."""
    backend = TritonAttentionBackend(block_n=16, num_splits=splits)
    q_lens, seq_lens = [1, 16, 3, 1, 2], [300, 150, 5, 64, 97]
    check(backend, *make_case(q_lens, seq_lens, 8, 2, 64, causal=causal, seed=4))


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits,split_keys", [(32, 16), (32, None), (8, 64)])
def test_split_kv_skips_splits_past_the_context(monkeypatch, splits, split_keys, causal):
    """A launch with more splits than a short context fills (graphs size it from max_seq_len):
    each split gets >= split_keys keys, the rest write nothing, the merge reads only those."""
    monkeypatch.setattr(ta, "torch", NanEmptyTorch())
    backend = TritonAttentionBackend(block_n=16, num_splits=splits, split_keys=split_keys)
    q_lens, seq_lens = [1, 16, 3, 1, 2], [300, 150, 5, 64, 97]
    check(backend, *make_case(q_lens, seq_lens, 8, 2, 64, causal=causal, seed=5))


def test_split_limits_by_rows():
    assert sp.split_limits(16) == (sp.MIN_KEYS_PER_SPLIT_DECODE, sp.MAX_SPLITS_DECODE)
    assert sp.split_limits(64) == (sp.MIN_KEYS_PER_SPLIT_BLOCK, sp.MAX_SPLITS_BLOCK)
    # Batch 1 (8 KV-head programs): a 16-token block at max_model_len 40960 launches 16 splits,
    # a decode token 32; at max_model_len 1024, 8 and 16.
    assert choose_num_splits(8, 16, 40960, 132, *sp.split_limits(64)) == 16
    assert choose_num_splits(8, 1, 40960, 132, *sp.split_limits(16)) == 32
    assert choose_num_splits(8, 16, 1024, 132, *sp.split_limits(64)) == 8
    assert choose_num_splits(8, 1, 1024, 132, *sp.split_limits(16)) == 16


@needs_triton
def test_split_kv_half_precision():
    backend = TritonAttentionBackend(num_splits=4)
    check(backend, *make_case([1, 4], [260, 33], 4, 4, 64, dtype=torch.bfloat16, seed=5))


@needs_triton
def test_empty_sequences_do_not_crash():
    """Sequences with no queries (and no keys) in the middle of a batch; an all-empty batch."""
    for backend in (TritonAttentionBackend(), TritonAttentionBackend(num_splits=2)):
        check(backend, *make_case([1, 0, 3, 0], [20, 0, 40, 9], 4, 2, 16, seed=6))
        q, k_cache, v_cache, meta = make_case([0, 0], [0, 5], 4, 2, 16, seed=6)
        assert backend.attend(q, k_cache, v_cache, meta, 1.0).shape == (0, 4, 16)


@needs_triton
def test_padded_metadata_ints_give_same_result():
    """CUDA-graph buckets pass larger max_query_len / max_seq_len than the batch needs."""
    q, k_cache, v_cache, meta = make_case([1, 3], [100, 50], 4, 2, 16, seed=7)
    backend = TritonAttentionBackend()
    out = backend.attend(q, k_cache, v_cache, meta, 0.25)
    meta.max_query_len, meta.max_seq_len = 16, 4096
    torch.testing.assert_close(backend.attend(q, k_cache, v_cache, meta, 0.25), out,
                               atol=2e-5, rtol=2e-5)


def test_choose_num_splits():
    # 256 keys and 32 splits at most: the limits these cases were written for
    assert choose_num_splits(8, 1, 8192, 132, 256, 32) == 32
    assert choose_num_splits(64, 1, 4096, 132, 256, 32) == 4  # cdiv(264, 64) = 5 -> 4
    assert choose_num_splits(64, 1, 600, 132, 256, 32) == 2  # capped by 256 keys per split
    assert choose_num_splits(64, 1, 200, 132, 256, 32) == 1
    assert choose_num_splits(200, 1, 8192, 132, 256, 32) == 1  # enough programs already
    assert choose_num_splits(8, 40, 8192, 132, 256, 32) == 1  # prefill never splits


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(8)
    # NOTE: k/v already in the cache dtype: the interpreter's fp32 -> bf16 cast truncates.
    k, v = torch.randn(2, 6, 2, 64, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([17, -1, 0, 63, -1, 40], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_ref.view(-1, 2, 64)[slots[keep]] = k[keep]
    v_ref.view(-1, 2, 64)[slots[keep]] = v[keep]
    TritonAttentionBackend().store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_registry_lazy_import():
    assert get_backend("triton").name == "triton"


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU engine run (the interpreter is off here)")
def test_tiny_qwen3_greedy_matches_torch_backend(qwen3_path):
    from blockspec import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = ["def foo(x):", "import json\nclass Encoder:"]
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=32, kv_block_size=16)
    want = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    for module in llm.engine.runner.model.modules():
        if isinstance(module, PagedAttention):
            module.backend = get_backend("triton")
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_metadata():
    """Captured once for a bucket (split-KV on), replayed after seq_lens / tables change."""
    q, k_cache, v_cache, meta = make_case([1, 1, 1], [300, 20, 150], 8, 2, 64, torch.bfloat16)
    k_new, v_new = torch.randn(2, 3, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    backend = TritonAttentionBackend()
    meta.max_seq_len = 2048  # the bucket's

    def step() -> torch.Tensor:
        backend.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
        return backend.attend(q, k_cache, v_cache, meta, 0.125)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    other = make_case([1, 1, 1], [40, 290, 7], 8, 2, 64, torch.bfloat16, seed=1)[3]
    for name in ("slot_mapping", "seq_lens"):
        getattr(meta, name).copy_(getattr(other, name))
    meta.block_tables.zero_()[:, : other.block_tables.shape[1]].copy_(other.block_tables)
    graph.replay()
    ref = TORCH.attend(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-2, rtol=4e-2)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton cases ran in this process")
def test_in_fresh_process():
    run_file_with_triton_interpreter(__file__)


def test_long_queries_share_one_tile_shape():
    """Prefill chunks and mixed steps of any length > SPLIT_MAX_QUERY_LEN launch one BLOCK_M
    (so serving compiles no new variant for the lengths requests bring); short queries keep
    their own (the graphs' decode / verify shapes)."""
    be = TritonAttentionBackend()
    for group in (1, 2, 4, 8):
        long = {be.block_m(q, group) for q in range(sp.SPLIT_MAX_QUERY_LEN + 1, 600)}
        assert long == {max(be.max_block_m, group)}
        assert be.block_m(1, group) == max(16, group)
        assert be.block_m(16, group) == min(max(16, 16 * group), be.max_block_m)
    kernel = ta._attn_kernel
    if type(kernel).__name__ == "JITFunction":  # NOTE: the interpreter never specialises
        names = [kernel.arg_names[i] if isinstance(i, int) else i
                 for i in kernel.do_not_specialize]
        assert "stride_bt" in names


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [None, 4])
def test_flat_grid_matches_torch(causal, splits):
    """The flat grid (every sequence's query tiles in turn) over a batch of one long query among
    short ones, empty sequences, and tiles that start off a tile boundary."""
    backend = TritonAttentionBackend(flat_grid=True, num_splits=splits, max_block_m=16)
    q_lens, seq_lens = [1, 37, 0, 3, 16, 1, 0], [40, 90, 0, 3, 20, 64, 5]
    check(backend, *make_case(q_lens, seq_lens, 4, 2, 32, causal=causal, seed=9))


@needs_triton
def test_flat_grid_ignores_padding_tokens_and_lanes():
    """A graph bucket's padding: tokens past the last sequence and lanes with no query leave
    the real rows as an exact launch computes them."""
    q, k_cache, v_cache, meta = make_case([5, 2, 9], [30, 2, 44], 4, 2, 16, seed=10)
    exact = TritonAttentionBackend(flat_grid=True).attend(q, k_cache, v_cache, meta, 0.3)
    pad = 7
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:], dtype=q.dtype, device=q.device)])
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(2)])
    padded = AttentionMetadata(
        slot_mapping=meta.slot_mapping, cu_seqlens_q=cu,
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(2)]),
        block_tables=torch.cat([meta.block_tables, meta.block_tables[:2]]),
        max_query_len=64, max_seq_len=4096)
    out = TritonAttentionBackend(flat_grid=True).attend(q_pad, k_cache, v_cache, padded, 0.3)
    torch.testing.assert_close(out[:q.shape[0]], exact, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("short", [1, 4, 16])
@pytest.mark.parametrize("flat", [True, False])
def test_short_queries_launched_apart_match_torch(short, flat):
    """short_query_len: queries of up to `short` tokens get their own launch and tile beside the
    longer ones' (decode rows and verify blocks beside prefill chunks); every row is computed
    once, as the torch reference does, whichever launch it falls to."""
    q_lens, seq_lens = [1, 37, 4, 0, 16, 2, 20], [40, 90, 9, 5, 30, 64, 20]
    q, k_cache, v_cache, meta = make_case(q_lens, seq_lens, 4, 2, 32, seed=11)
    meta.flat_grid, meta.short_query_len = flat, short
    check(TritonAttentionBackend(), q, k_cache, v_cache, meta)
