"""The fixed-shape decode step: plain decode (Q = 1) or one whole speculative step
(draft -> verify -> write draft context -> pick -> accept, Q = block size), for a batch of
sequences that are all decoding. Everything is computed on the device from a few static input
buffers, so the same code runs eagerly (CPU, `--enforce-eager`) and as one CUDA graph per batch
bucket.

NOTE: padded lanes of a bucket read and write only the trash block (the KV pools have one block
more than the block manager hands out), so replaying a bucket larger than the batch is harmless.
NOTE: a change to what a step computes changes its cost: bump cost_profile.STEP_VERSION, so
cached cost profiles measured with the old step are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.dflash.verify import accepted_counts
from blockspec.layers.attention import AttentionMetadata
from blockspec.models.qwen3 import CausalLM


@dataclass
class StepBuffers:
    """Static inputs shared by every bucket (bucket b uses the first b rows)."""

    last_tokens: torch.Tensor  # [S] int64: each sequence's newest token (not yet in the cache)
    ctx_lens: torch.Tensor  # [S] int64: tokens already in the cache (= position of last token)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    uniforms: torch.Tensor  # [S, Q-1] fp32: synthetic-acceptance draws (benchmarks only)
    # NOTE: a device scalar, not a Python float, so graphs captured once serve any synthetic
    # acceptance probability set later (benchmarks switch it between runs).
    acceptance: torch.Tensor  # [] fp32: synthetic acceptance probability (benchmarks only)

    @classmethod
    def allocate(cls, max_seqs: int, max_blocks: int, q: int, device: torch.device,
                 acceptance: float = 0.0) -> StepBuffers:
        """Buffers for steps of any block length up to `q` (the max block)."""
        return cls(
            last_tokens=torch.zeros(max_seqs, dtype=torch.int64, device=device),
            ctx_lens=torch.zeros(max_seqs, dtype=torch.int64, device=device),
            block_tables=torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device),
            uniforms=torch.ones(max_seqs, max(q - 1, 1), dtype=torch.float32, device=device),
            acceptance=torch.tensor(float(acceptance), dtype=torch.float32, device=device),
        )


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a CUDA graph (a batch replays the smallest bucket that fits)."""
    return [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_num_seqs] \
        + [max_num_seqs]


def graphed_block_lens(adaptive: bool, spec_lens: list[int], max_block: int) -> list[int]:
    """Block lengths whose decode steps get CUDA graphs: every length the adaptive policy can
    choose (1 = plain), else only the max block (the fixed policy's, or plain decode without a
    drafter). NOTE: the runner captures these and the engine sizes their outputs' memory."""
    return [1, *spec_lens] if adaptive else [max_block]


@dataclass
class StepOutputs:
    target_tokens: torch.Tensor  # [S, Q] the target's greedy picks (argmax)
    logits: torch.Tensor  # [S * Q, V], for sampling and logprobs
    drafts: torch.Tensor | None  # [S, Q-1]
    num_accepted: torch.Tensor | None  # [S] accepted drafts under greedy (or synthetic) rules
    # [S, n_taps * H] the target's tapped hidden states, concatenated in the drafter's order
    # (a deferred-context plain step only; the runner stages them for a later batched write).
    taps: torch.Tensor | None = None


class DecodeStep:
    """One step of block length `q`: 1 = plain decode, q > 1 = draft q - 1 tokens and verify q.

    With a proposer, the step writes the drafter's context K/V of the verified tokens, except a
    plain step built with `defer_context`: it returns the taps instead (`StepOutputs.taps`), and
    the caller must have them written before the drafter next runs (ModelRunner stages them).
    """

    def __init__(self, model: CausalLM, proposer: DFlashProposer | None, q: int,
                 kv_block_size: int, max_seq_len: int, synthetic: bool = False,
                 defer_context: bool = False) -> None:
        if defer_context and (proposer is None or q != 1):
            raise ValueError("only a plain step (q = 1) with a proposer can defer its context")
        self.model = model
        self.proposer = proposer
        self.q = q
        self.kv_block_size = kv_block_size
        self.max_seq_len = max_seq_len
        self.synthetic = synthetic  # accept drafts with probability bufs.acceptance (benchmarks)
        self.defer_context = defer_context

    def metadata(self, bufs: StepBuffers, s: int, causal: bool
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        q, bs = self.q, self.kv_block_size
        dev = bufs.ctx_lens.device
        ctx = bufs.ctx_lens[:s]
        tables = bufs.block_tables[:s]
        positions = ctx[:, None] + torch.arange(q, device=dev)[None, :]
        blocks = tables.gather(1, (positions // bs).to(torch.int64)).to(torch.int64)
        slots = (blocks * bs + positions % bs).reshape(-1)
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=torch.arange(0, (s + 1) * q, q, dtype=torch.int32, device=dev),
            seq_lens=(ctx + q).to(torch.int32),
            block_tables=tables,
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            causal=causal,
            token_seq_idx=torch.arange(s, device=dev).repeat_interleave(q),
            token_q_idx=torch.arange(q, device=dev).repeat(s),
        )
        return positions.reshape(-1), meta

    def __call__(self, bufs: StepBuffers, s: int) -> StepOutputs:
        q = self.q
        positions, meta = self.metadata(bufs, s, causal=True)
        last = bufs.last_tokens[:s]
        drafts = None
        if self.proposer is not None and q > 1:
            drafts = self.draft(bufs, s, positions, meta)
            ids = torch.cat([last[:, None], drafts], dim=1).reshape(-1)
        else:
            ids = last
        tap_ids = self.proposer.target_layer_ids if self.proposer is not None else ()
        hidden, taps = self.model(ids, positions, meta, tap_ids)
        staged = None
        if self.defer_context:
            # NOTE: one [S, n_taps * H] tensor: the runner stages it with a single copy, and the
            # drafter's fc reads that layout directly.
            staged = torch.cat(taps, dim=-1)
        elif self.proposer is not None:
            self.proposer.write_context(taps, positions, meta.slot_mapping)
        logits = self.model.compute_logits(hidden)
        target = logits.argmax(dim=-1).view(s, q)
        acc = None
        if drafts is not None:
            acc = accepted_counts(drafts, target, bufs.uniforms[:s, : q - 1], bufs.acceptance) \
                if self.synthetic else accepted_counts(drafts, target)
        return StepOutputs(target, logits, drafts, acc, staged)


    def draft(self, bufs: StepBuffers, s: int, positions: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        """The drafter's q - 1 tokens after each sequence's last token: [s, q - 1]."""
        p, q, last = self.proposer, self.q, bufs.last_tokens[:s]
        mask = torch.full((s, q - 1), p.mask_token_id, dtype=torch.int64, device=last.device)
        block = torch.cat([last[:, None], mask], dim=1).reshape(-1)
        draft_meta = AttentionMetadata(**{**meta.__dict__, "causal": False})
        return p.draft(block, positions, draft_meta, q=q).view(s, q - 1)


class DraftStep:
    """A speculative step's drafting alone, from the same buffers: [s, q - 1] drafts (what a
    mixed step verifies in its flat batch; graphed per batch bucket like the decode step)."""

    def __init__(self, step: DecodeStep) -> None:
        if step.proposer is None or step.q < 2:
            raise ValueError("a draft step needs a proposer and a block of q >= 2")
        self.step, self.q = step, step.q

    def __call__(self, bufs: StepBuffers, s: int) -> torch.Tensor:
        positions, meta = self.step.metadata(bufs, s, causal=True)
        return self.step.draft(bufs, s, positions, meta)


class GraphedDecodeStep:
    """One CUDA graph per batch bucket of a step over the static buffers (a DecodeStep, or a
    DraftStep); replay pads the batch up to the bucket."""

    def __init__(self, step: DecodeStep | DraftStep, bufs: StepBuffers,
                 buckets: list[int]) -> None:
        self.step = step
        self.bufs = bufs
        self.buckets = sorted(buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, StepOutputs] = {}

    def capture(self, pool: tuple | None = None, stream: torch.cuda.Stream | None = None
                ) -> None:
        """Captures every bucket. Pass one `pool` to several instances (largest block first),
        so all their graphs share one memory pool."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream() if stream is None else stream
        # NOTE: largest first, so smaller graphs reuse the pool's memory.
        for s in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits, autotuning, allocator growth
                    self.step(self.bufs, s)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[s] = self.step(self.bufs, s)
            self.graphs[s] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def replay(self, n: int) -> StepOutputs | torch.Tensor:
        s = self.bucket_for(n)
        self.graphs[s].replay()
        return self.outputs[s]
