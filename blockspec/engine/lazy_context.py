"""Lazy drafter context (`lazy_draft_context`): "detached" plain decoding and the catch-up.

With a drafter, every committed token normally gets its drafter context K/V (written from the
target's tapped hidden states), so that any later step may draft. When the policy keeps choosing
plain decode, those writes are pure overhead. After DETACH_AFTER consecutive plain choices, or
at once when the policy would decode plainly at the engine's load (`policy_batch`), the runner
detaches: plain steps run a decode step built without the drafter (its own CUDA graphs), prefill
and mixed steps skip the context write, and nothing is staged; it re-attaches before new prefills
once the policy favours speculation at the load again. Before the drafter next runs for a
sequence, `catch_up` recomputes its missing context: one eager target pass over the tokens
[num_draft_ctx_tokens, num_computed_tokens), whose taps are written to the drafter's pool; the
policy weighs that cost before it speculates again (`switch_cost`).

NOTE (the invariant): whenever the drafter runs for a sequence, its drafter context is complete
(num_draft_ctx_tokens == num_computed_tokens). The runner catches up every sequence the drafter
will see before any step that drafts, whether detached or not (a sequence can keep a gap after
the engine re-attached: it was not scheduled, or was prefilling, when the catch-up ran).

NOTE: the catch-up's target K/V stores go to the trash block. The real K/V of those tokens are
in the cache already, and attention reads keys through the block tables after the layer's store
(qk_norm_rope_store, then PagedAttention.attend), so the pass sees exactly the cached keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.context_staging import ContextStaging
from blockspec.engine.decode_step import DecodeStep, GraphedDecodeStep
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence
from blockspec.engine.speculation import SpecController
from blockspec.layers.attention import AttentionMetadata
from blockspec.models.qwen3 import CausalLM
from blockspec.policy.cost_model import StepCostModel
from blockspec.policy.step_context import StepContext, SwitchCost

# Consecutive plain choices before detaching: a catch-up costs a target pass over every skipped
# token, so a short plain stretch between speculative steps keeps writing (batched, staged).
DETACH_AFTER = 64

__all__ = ["DETACH_AFTER", "LazyDraftContext"]


class LazyDraftContext:
    """Detached-mode state, the per-sequence drafter-context counts, and the catch-up pass."""

    def __init__(self, model: CausalLM, proposer: DFlashProposer, block_manager: BlockManager,
                 staging: ContextStaging, trash_block: int, max_num_batched_tokens: int,
                 max_model_len: int, max_num_seqs: int, device: torch.device) -> None:
        self.model = model
        self.proposer = proposer
        self.bm = block_manager
        self.staging = staging
        self.trash_block = trash_block
        self.max_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.device = device
        # The plain step without drafter work (no taps, no context write); graphs set by the
        # runner when it captures graphs.
        self.step = DecodeStep(model, None, 1, block_manager.block_size, max_model_len)
        self.graphs: GraphedDecodeStep | None = None
        self.detached = False
        self.plain_streak = 0  # consecutive steps whose chosen block length was 1
        # This step's load rule favours speculation while prefills are pending (see policy_batch).
        self.load_wants_drafter = False
        # Metrics.
        self.num_detached_steps = 0
        self.num_reattaches = 0  # by the load rule
        self.num_catchups = 0
        self.num_catchup_tokens = 0
        self.catchup_seconds = 0.0
        # Of the last catch-up of at least half a step budget (a smaller one is latency-bound).
        self.seconds_per_token: float | None = None

    # -- per step -------------------------------------------------------------------------------
    def policy_batch(self, num_decoding: int, ctx: StepContext,
                     controller: SpecController) -> int:
        """The load rule, before the policy chooses: the batch size to price this step at.

        `ctx.num_unfinished`: the engine's unfinished requests (running and waiting). When they
        outnumber this step's decoding sequences (prefills queued or in progress) and the
        policy would decode plainly at that load, the runner detaches now, before the prefills
        write any drafter context. While detached, the policy prices steps at the load, so a
        batch that is still filling does not catch up only to detach again; as requests finish
        the load falls to the decoding batch and the policy prices a return (`switch_cost`).
        Conversely, a detached runner whose policy now favours speculation at the load (its
        acceptance estimate or live step overhead moved) re-attaches before new prefills, so
        the requests it admits next get their drafter context as they prefill: otherwise under
        steady load every new request would need a catch-up, which the policy would not pay."""
        load = min(max(num_decoding, ctx.num_unfinished), self.max_num_seqs)
        self.load_wants_drafter = False
        if load > num_decoding:
            # NOTE: detach wherever the policy's choice at the load is plain decode, including a
            # best block whose modelled gain is above 1.0 but under the policy's min_gain: kept
            # attached there, the prefills and every plain step pay the drafter's context
            # writes for a speculation the policy does not take (block 2 put a=0.6, C=128 on
            # an H200 near 1.0x). A wrong detach forgoes at most that sub-min_gain gain.
            plain_at_load = controller.explain(load, ctx.drain)["choice"] == 1
            if plain_at_load and not self.detached:
                self._detach()
            elif not plain_at_load and controller.mode == "adaptive":
                # NOTE: not in fixed mode: its detached streaks are forced (tests) and stay so
                self.load_wants_drafter = True
                if self.detached:
                    # NOTE: sequences already decoding keep their gaps; the policy prices their
                    # catch-up (switch_cost) before the drafter runs for them.
                    self.detached, self.plain_streak = False, 0
                    self.num_reattaches += 1
        return load if self.detached else num_decoding

    def _detach(self) -> None:
        self.staging.flush()  # NOTE: staged rows are written (and counted) before detaching
        self.detached = True

    def before_step(self, seqs: list[Sequence], blens: list[int] | None, block_len: int,
                    num_decoding: int, plain_decode: bool) -> None:
        """Decide whether this step runs detached, and make the drafter's context whole where
        it will run. `blens`: the step's block per sequence when the drafter runs, else None.
        `plain_decode`: an all-decode step at L = 1 (the one that may stage)."""
        if blens is not None:
            # NOTE: the drafter sees every sequence with a block (blens >= 1), even one cut to
            # a single token near the context end: all of them get a complete context. The
            # runner has flushed the staging already (it does before every drafting step).
            self.catch_up([s for s, b in zip(seqs, blens) if b >= 1])
            self.detached, self.plain_streak = False, 0
            return
        if num_decoding:
            self.plain_streak = self.plain_streak + 1 if block_len == 1 else 0
        # NOTE: not while the load rule wants new prefills attached (they would get gaps).
        if not self.detached and self.plain_streak > DETACH_AFTER \
                and not self.load_wants_drafter:
            self._detach()
        if self.detached:
            self.num_detached_steps += 1
        elif not plain_decode:
            # NOTE: staged rows are written before this step's direct writes, so a flush counts
            # rows in position order (see ContextStaging._count_written).
            self.staging.flush()

    @staticmethod
    def count_written(seqs: list[Sequence], advance: list[int]) -> None:
        """After a step that wrote the drafter context of all its fed tokens: each sequence's
        context grows by the tokens it committed, if it was complete before the step."""
        for seq, adv in zip(seqs, advance):
            if seq.num_draft_ctx_tokens == seq.num_computed_tokens:
                seq.num_draft_ctx_tokens += adv

    # -- pricing a return to speculation -------------------------------------------------------
    def pending_tokens(self, seqs: list[Sequence], decoding: list[bool]) -> int:
        """Tokens the step's decoding sequences would need caught up to draft.
        NOTE: rows still staged are not pending (the flush before drafting writes them): a
        sequence has at most one per staged step."""
        staged = self.staging.num_staged_steps
        return sum(max(0, s.num_computed_tokens - s.num_draft_ctx_tokens - staged)
                   for s, d in zip(seqs, decoding) if d)

    def switch_cost(self, seqs: list[Sequence], decoding: list[bool]) -> SwitchCost:
        """The step's price of speculating (StepContext.switch_cost): (seconds, horizon) for the
        catch-up of its decoding sequences, and the mean number of tokens they have left
        (`max_tokens`; an end-of-sequence token may come sooner) to pay it back.
        Seconds: one plain step per step-budget chunk (the weights are read once per forward)
        plus, per token, the last large catch-up's seconds per token or, before one, the
        cheapest per-token cost in the cost model (optimistic, so a first catch-up happens and
        measures the real price).
        NOTE: the catch-up grows with the detached streak (~ batch x steps tokens), so a long
        detached stretch returns to speculation only where the gain repays it: without this
        price, a batch shrinking as requests finish tipped the policy back to speculation and
        paid a prefill-sized catch-up for a few steps (H200, a=0.6, C=128: 0.91x plain)."""

        def price(batch_size: int, cost_model: StepCostModel) -> tuple[float, float]:
            pending = self.pending_tokens(seqs, decoding)
            if not pending:
                return 0.0, 1.0
            per_token = self.seconds_per_token
            if per_token is None:
                per_token = cost_model.min_token_cost()
            chunks = -(-pending // self.max_tokens)
            left = [s.num_tokens_left for s, d in zip(seqs, decoding) if d]
            return (chunks * cost_model.cost(1, 1) + per_token * pending,
                    max(1.0, sum(left) / max(1, len(left))))

        return price

    # -- catch-up -------------------------------------------------------------------------------
    def catch_up(self, seqs: list[Sequence]) -> None:
        """Write the missing drafter context of `seqs` (eager, chunked by the step budget)."""
        todo = [s for s in seqs if s.num_draft_ctx_tokens < s.num_computed_tokens]
        if not todo:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = 0
        for chunk in self._chunks(todo):
            self._forward(chunk)
            tokens += sum(end - start for _, start, end in chunk)
        for s in todo:
            s.num_draft_ctx_tokens = s.num_computed_tokens
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        self.num_catchups += 1
        self.num_catchup_tokens += tokens
        self.catchup_seconds += secs
        if 2 * tokens >= self.max_tokens:
            self.seconds_per_token = secs / tokens

    def _chunks(self, seqs: list[Sequence]) -> Iterator[list[tuple[Sequence, int, int]]]:
        """(sequence, start, end) pieces, at most `max_tokens` tokens per chunk."""
        chunk: list[tuple[Sequence, int, int]] = []
        room = self.max_tokens
        for s in seqs:
            p = s.num_draft_ctx_tokens
            while p < s.num_computed_tokens:
                end = min(s.num_computed_tokens, p + room)
                chunk.append((s, p, end))
                room -= end - p
                p = end
                if not room:
                    yield chunk
                    chunk, room = [], self.max_tokens
        if chunk:
            yield chunk

    def _forward(self, chunk: list[tuple[Sequence, int, int]]) -> None:
        bs, bm, dev = self.bm.block_size, self.bm, self.device
        ids, positions, ctx_slots, trash_slots = [], [], [], []
        for s, start, end in chunk:
            for p in range(start, end):
                ids.append(s.token_at(p))
                positions.append(p)
                ctx_slots.append(bm.slot(s, p))
                trash_slots.append(self.trash_block * bs + p % bs)
        meta = AttentionMetadata.build([e - b for _, b, e in chunk], [e for _, _, e in chunk],
                                       [s.block_table for s, _, _ in chunk], trash_slots, dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        _, taps = self.model(torch.tensor(ids, dtype=torch.int64, device=dev), pos, meta,
                             self.proposer.target_layer_ids, taps_only=True)
        self.proposer.write_context(taps, pos, torch.tensor(ctx_slots, device=dev))
