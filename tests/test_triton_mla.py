"""The Triton MLA backend (absorbed multi-head latent attention over one latent cache bound as K
and V) against the torch reference backend with one KV head: compiled on a GPU, else in Triton's
interpreter on CPU (slow: sizes stay small)."""

from __future__ import annotations

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# NOTE: as in test_triton_attention.py: the interpreter must be chosen before triton's import.
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", minversion="3.7" if DEVICE == "cpu" else None)

import triton.language as tl  # noqa: E402
from helpers import NanEmptyTorch, run_file_with_triton_interpreter  # noqa: E402

import blockspec.layers.triton_mla as mla  # noqa: E402
from blockspec.layers.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from blockspec.layers.triton_kv_store import store_kv  # noqa: E402
from blockspec.layers.triton_mla import TritonMLABackend  # noqa: E402

TRITON_HERE = DEVICE == "cuda" or all(
    type(fn).__name__ == "InterpretedFunction" for fn in (tl.zeros, mla._mla_kernel))
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh process instead")
TORCH = TorchAttentionBackend()
GARBAGE = 1e3  # in every cache slot no query may see: any leak swamps the output
TOL = {torch.float32: 1e-4 if DEVICE == "cuda" else 2e-5, torch.bfloat16: 4e-2}
RANK, ROPE = 64, 16  # kept small under the interpreter; the real 512 + 64 in its own test


def make_case(q_lens: list[int], seq_lens: list[int], num_heads: int, rank: int = RANK,
              rope: int = ROPE, dtype: torch.dtype = torch.float32, block_size: int = 16,
              causal: bool = True, seed: int = 0):
    """Random q and one latent cache whose sequences own shuffled, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 5
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    slot = lambda table, p: table[p // block_size] * block_size + p % block_size
    written = torch.tensor([slot(t, p) for t, n in zip(tables, seq_lens) for p in range(n)],
                           dtype=torch.long)
    cache = torch.full((num_blocks, block_size, 1, rank + rope), GARBAGE)
    cache.view(-1, 1, rank + rope)[written] = torch.randn(len(written), 1, rank + rope,
                                                          generator=gen)
    slots = [slot(t, p) for t, n, q in zip(tables, seq_lens, q_lens) for p in range(n - q, n)]
    q = torch.randn(sum(q_lens), num_heads, rank + rope, generator=gen).to(DEVICE, dtype)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, slots, DEVICE, causal=causal)
    return q, cache.to(DEVICE, dtype), meta


def check(backend: TritonMLABackend, q, cache, meta) -> torch.Tensor:
    """The backend's output against the torch reference's over the first kv_lora_rank columns
    (the model's); the rope columns are zeros."""
    rank, scale = backend.kv_lora_rank, q.shape[-1] ** -0.5
    out = backend.attend(q, cache, cache, meta, scale)
    ref = TORCH.attend(q, cache, cache, meta, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[q.dtype]
    torch.testing.assert_close(out[..., :rank].float(), ref[..., :rank].float(), atol=tol,
                               rtol=tol)
    assert not out[..., rank:].any()
    return out


MIXED = ([1, 5, 16, 40], [300, 37, 140, 40])  # decode, verify, drafter-sized, pure prefill


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [16, 64])
def test_mixed_batch_matches_torch(heads, causal):
    check(TritonMLABackend(kv_lora_rank=RANK), *make_case(*MIXED, heads, causal=causal))


@needs_triton
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_at_the_real_latent_width(heads):
    """DeepSeek-V3 / Kimi-K2's 512 + 64 latent, one token per sequence: the heuristic splits
    the keys 8 ways (>= MIN_KEYS_PER_SPLIT_DECODE = 32 keys each of the longest 300, a power of
    two), so the merge runs at 512 columns."""
    q, cache, meta = make_case([1, 1, 1], [300, 1, 33], heads, 512, 64, seed=1)
    assert TritonMLABackend().plan(3, heads, meta, 1, q.device).splits == 8
    out = check(TritonMLABackend(), q, cache, meta)
    assert out[..., :512].abs().amax() > 0.1


@needs_triton
@pytest.mark.parametrize("q_len", [2, 3, 8, 16])
def test_verify_blocks(q_len):
    """Blocks of 2..16 tokens (query tiles of several tokens x 16 heads, padding past q_len)."""
    check(TritonMLABackend(kv_lora_rank=RANK),
          *make_case([q_len, q_len], [q_len + 50, q_len + 3], 16, seed=q_len))


@needs_triton
def test_prefill_chunks_over_a_cached_prefix():
    """Chunks over cached latents span many query tiles; one sequence is all new tokens."""
    check(TritonMLABackend(kv_lora_rank=RANK), *make_case([37, 20], [90, 20], 16, seed=2))


@needs_triton
@pytest.mark.parametrize("heads", [4, 12, 48])
def test_other_head_counts(heads):
    """A small model's 4 heads (the tiny checkpoint's), blocks of 12 heads (48 = 4 x 12: padding
    rows in each tile) and 3 blocks of 16."""
    check(TritonMLABackend(kv_lora_rank=RANK), *make_case(*MIXED, heads, seed=3))


@needs_triton
@pytest.mark.parametrize("block_size", [8, 64])
def test_other_block_sizes(block_size):
    check(TritonMLABackend(kv_lora_rank=RANK), *make_case(*MIXED, 16, block_size=block_size,
                                                          seed=4))


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits,split_keys", [(2, None), (4, 16), (16, 16)])
def test_split_kv(monkeypatch, splits, split_keys, causal):
    """Forced splits, including splits that get no keys (seq_len 5, a 16-way split of 97)."""
    monkeypatch.setattr(mla, "torch", NanEmptyTorch())
    backend = TritonMLABackend(kv_lora_rank=RANK, num_splits=splits, split_keys=split_keys)
    check(backend, *make_case([1, 16, 3, 1, 2], [300, 150, 5, 64, 97], 16, causal=causal,
                              seed=5))


@needs_triton
def test_bfloat16():
    backend = TritonMLABackend(kv_lora_rank=RANK)
    check(backend, *make_case(*MIXED, 16, dtype=torch.bfloat16, seed=6))
    check(TritonMLABackend(kv_lora_rank=RANK, num_splits=4),
          *make_case([1, 4], [260, 33], 16, dtype=torch.bfloat16, seed=6))


@needs_triton
def test_empty_and_tiny_sequences():
    """Sequences with no queries (and no keys) in the middle of a batch, one key, a first token
    that sees only itself; an all-empty batch."""
    for backend in (TritonMLABackend(kv_lora_rank=RANK),
                    TritonMLABackend(kv_lora_rank=RANK, num_splits=2)):
        check(backend, *make_case([1, 0, 3, 0, 1, 2], [1, 0, 40, 9, 2, 2], 16, seed=7))
        q, cache, meta = make_case([0, 0], [0, 5], 16, seed=7)
        assert backend.attend(q, cache, cache, meta, 1.0).shape == (0, 16, RANK + ROPE)


@needs_triton
@pytest.mark.parametrize("splits", [None, 4])
def test_flat_grid(splits):
    """Every sequence's query tiles in turn: one long query among short ones, empty sequences,
    tiles off a tile boundary; then a graph bucket's padding tokens and lanes, which leave the
    real rows as the exact launch computes them."""
    q_lens, seq_lens = [1, 21, 0, 3, 16, 1, 0], [40, 60, 0, 3, 20, 64, 5]
    q, cache, meta = make_case(q_lens, seq_lens, 16, seed=8)
    meta.flat_grid = True
    out = check(TritonMLABackend(kv_lora_rank=RANK, num_splits=splits), q, cache, meta)
    pad = 5
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:], dtype=q.dtype, device=q.device)])
    padded = AttentionMetadata(
        slot_mapping=meta.slot_mapping, cu_seqlens_q=torch.cat(
            [meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(2)]),
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(2)]),
        block_tables=torch.cat([meta.block_tables, meta.block_tables[:2]]),
        max_query_len=64, max_seq_len=4096, flat_grid=True)
    got = TritonMLABackend(kv_lora_rank=RANK, num_splits=splits).attend(
        q_pad, cache, cache, padded, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got[:q.shape[0]], out, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("short", [1, 16])
@pytest.mark.parametrize("flat", [True, False])
def test_short_queries_launched_apart(short, flat):
    """short_query_len: decodes and verify blocks get their own launch and tile beside the
    prefill chunks'; every row is computed once, whichever launch it falls to."""
    q, cache, meta = make_case([1, 37, 4, 0, 16, 2, 20], [40, 90, 9, 5, 30, 64, 20], 16, seed=9)
    meta.flat_grid, meta.short_query_len = flat, short
    check(TritonMLABackend(kv_lora_rank=RANK), q, cache, meta)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_latent_once(dtype):
    """k is v and k_cache is v_cache: one write per token (slot -1 skipped); a different v for
    a shared cache is refused rather than half-written."""
    gen = torch.Generator().manual_seed(10)
    latent = torch.randn(6, 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    cache = torch.randn(4, 16, 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([17, -1, 0, 63, -1, 40], device=DEVICE)
    ref = cache.clone()
    keep = slots >= 0
    ref.view(-1, 1, RANK + ROPE)[slots[keep]] = latent[keep]
    backend = TritonMLABackend(kv_lora_rank=RANK)
    backend.store_kv(latent, latent, cache, cache, slots)
    assert torch.equal(cache, ref)
    with pytest.raises(AssertionError, match="same tensor as k and v"):
        backend.store_kv(latent, latent.clone(), cache, cache, slots)


def test_tiles_and_launch_configs():
    """16 heads per program for 16-128 heads, a decode token's rows one 16-row tile, longer
    queries up to max_block_m rows; every query longer than a split-sized one the same tile."""
    be = TritonMLABackend()
    assert [mla.head_block(h) for h in (4, 12, 16, 48, 64, 128, 20)] == [4, 12, 16, 16, 16, 16,
                                                                          10]
    assert be.tiles(1, 128) == (16, 1, 16) and be.tiles(2, 16) == (16, 2, 32)
    assert {be.tiles(q, 64) for q in range(3, 600)} == {(16, 2, 32)}
    assert be.tiles(1, 4) == (4, 4, 16) and be.tiles(40, 4) == (4, 8, 32)
    with pytest.raises(ValueError, match="power of two"):
        TritonMLABackend(kv_lora_rank=48)


def test_bad_shapes_are_refused():
    q, cache, meta = make_case([1], [5], 16)
    with pytest.raises(ValueError, match="latent cache"):
        TritonMLABackend(kv_lora_rank=RANK).attend(q, cache.expand(-1, -1, 2, -1), cache, meta,
                                                   1.0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_partials_merged_by_the_w_uv_absorb(dtype):
    """attend_partials + mla_one_token.absorb_merge (the merge in the W_UV absorb's programs)
    against attend (the merge kernel) + absorb, at one token over 8 splits of which 4 got keys
    (the others weigh nothing: their partials were never written); nothing for other steps."""
    from blockspec.layers.mla_absorb import absorb
    from blockspec.layers.mla_one_token import absorb_merge

    q, cache, meta = make_case([1], [100], 16, dtype=dtype)
    backend, scale = TritonMLABackend(RANK, num_splits=8, split_keys=16), q.shape[-1] ** -0.5
    w_uv = torch.randn(16, 24, RANK, generator=torch.Generator().manual_seed(4)).to(DEVICE,
                                                                                     dtype)
    want = torch.empty(1, 16, 24, dtype=dtype, device=DEVICE)
    absorb(backend.attend(q, cache, cache, meta, scale)[..., :RANK], w_uv, want, "triton")
    part, lse = backend.attend_partials(q, cache, meta, scale)
    assert part.shape == (1, 16, 8, RANK) and lse.shape == (1, 16, 8)
    assert lse[..., 4:].eq(float("-inf")).all() and lse[..., :4].isfinite().all()
    got = torch.empty_like(want)
    absorb_merge(part, lse, w_uv, got)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the merge's fma: one rounding fewer
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert want.abs().max() > 1.0
    for case, b in ((make_case([2], [100], 16), backend),  # a verify block
                    (make_case([1, 1], [100, 50], 16), backend),  # two sequences
                    (make_case([1], [100], 16), TritonMLABackend(RANK, num_splits=1))):
        q, cache, meta = case
        assert b.attend_partials(q, cache, meta, scale) is None


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU model run (the interpreter is off here)")
def test_tiny_deepseek_v3_logits_match_torch_backend(tmp_path, monkeypatch):
    """The whole tiny DeepSeek-V3 (4 heads, a 32 + 8 latent) with the MLA backend on its
    attention layers: a prefill, then a verify block and a decode over the cached latents; with
    the Triton rope + norm too, which then writes the latents into the cache itself."""
    import functools

    from helpers import PagedCache

    import blockspec.models.deepseek_v3 as ds
    from blockspec.config import ModelConfig
    from blockspec.layers.attention import PagedAttention
    from blockspec.layers.mla_one_token import absorb_merge
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=2)
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.float32, "cpu")
    ids = torch.randint(1, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = [[([3, 1, 4], 0, ids[:30])], [([3, 1, 4], 30, ids[30:39])], [([3, 1, 4], 39, ids[39:])]]
    logits = {}
    direct = functools.partial(ds.absorb_rope_norm, use_triton=True)
    stores, merged = [], []
    monkeypatch.setattr(mla, "store_kv", lambda *args: stores.append(1) or store_kv(*args))
    monkeypatch.setattr(ds, "absorb_merge", lambda *a: merged.append(1) or absorb_merge(*a))
    for name in ("torch", "triton_mla", "direct", "one_token"):
        if name == "direct":
            monkeypatch.setattr(ds, "absorb_rope_norm", direct)
        cache = PagedCache(model, num_blocks=8)
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        for layer in layers:  # NOTE: the runner binds one latent cache as K and V
            layer.v_cache = layer.k_cache
            # NOTE: one_token: the decode step's 40 keys in splits of 8 or more
            layer.backend = TORCH if name == "torch" else TritonMLABackend(
                cfg.mla.kv_lora_rank, split_keys=8 if name == "one_token" else None)
        for m in model.modules():  # the absorbs' backend: Triton for the one-token launches
            if isinstance(m, ds.MLAttention):
                m.kv_b_proj.backend = "triton" if name == "one_token" else "torch"
        stores.clear()
        logits[name] = torch.cat([cache.forward(batch)[0][0] for batch in steps])
        assert len(stores) == (0 if name != "triton_mla" else 2 * len(steps))
        assert len(merged) == (2 if name == "one_token" else 0)  # the decode step's 2 layers
    for name in ("triton_mla", "direct", "one_token"):
        torch.testing.assert_close(logits[name], logits["torch"], atol=1e-4, rtol=1e-4)
    assert logits["torch"].abs().max() > 1.0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_metadata():
    """Captured once for a decode bucket (split-KV by the heuristic: 3 lanes x 8 head blocks),
    replayed after seq_lens / tables change; the store writes the shared latent once."""
    q, cache, meta = make_case([1, 1, 1], [300, 20, 150], 128, 512, 64, torch.bfloat16)
    cache.normal_()  # the replay's tables reach slots the first case left unwritten
    latent = torch.randn(3, 1, 576, device=DEVICE, dtype=torch.bfloat16)
    backend = TritonMLABackend()
    meta.max_seq_len = 2048  # the bucket's
    assert backend.plan(3, 128, meta, 1, q.device).splits > 1

    def step() -> torch.Tensor:
        backend.store_kv(latent, latent, cache, cache, meta.slot_mapping)
        return backend.attend(q, cache, cache, meta, 576**-0.5)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    other = make_case([1, 1, 1], [40, 290, 7], 128, 512, 64, torch.bfloat16, seed=1)[2]
    for name in ("slot_mapping", "seq_lens"):
        getattr(meta, name).copy_(getattr(other, name))
    meta.block_tables.zero_()[:, : other.block_tables.shape[1]].copy_(other.block_tables)
    graph.replay()
    ref = TORCH.attend(q, cache, cache, meta, 576**-0.5)
    torch.testing.assert_close(out[..., :512].float(), ref[..., :512].float(), atol=4e-2,
                               rtol=4e-2)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton cases ran in this process")
def test_in_fresh_process():
    run_file_with_triton_interpreter(__file__)
