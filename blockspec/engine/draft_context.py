"""The drafter's context K/V of every committed token, behind one interface, however it is
written: directly by a step that drafts or prefills (its forward calls
DFlashProposer.write_context), staged by an attached plain decode step (`ContextStaging`, one
batched write before the drafter next runs), or caught up after a detached stretch
(`LazyDraftContext`). The runner asks it what a step writes and tells it what a step did.

NOTE (the invariant): whenever the drafter runs for a sequence, its context is complete.
"""

from __future__ import annotations

import torch

from blockspec.config import EngineConfig
from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.context_staging import ContextStaging, staging_rows
from blockspec.engine.decode_step import DecodeStep, GraphedDecodeStep
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.lazy_context import LazyDraftContext
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_plan import Plan
from blockspec.models.qwen3 import CausalLM


class DraftContext:
    def __init__(self, staging: ContextStaging | None, lazy: LazyDraftContext | None) -> None:
        """`staging` None: no drafter (nothing to write); `lazy` None: never detached."""
        self.staging, self.lazy = staging, lazy

    @classmethod
    def build(cls, config: EngineConfig, hidden_size: int, model: CausalLM,
              proposer: DFlashProposer | None, bm: BlockManager, trash_block: int,
              max_model_len: int, dtype: torch.dtype) -> DraftContext:
        """The plain steps' staging and, with lazy_draft_context, the detachable context."""
        if proposer is None:
            return cls(None, None)
        device = torch.device(config.device)
        width = len(proposer.target_layer_ids) * hidden_size
        staging = ContextStaging(proposer, bm, trash_block, staging_rows(config.max_num_seqs),
                                 width, dtype, device)
        lazy = None
        if config.use_lazy_draft_context:
            lazy = LazyDraftContext(model, proposer, bm, staging, trash_block,
                                    config.max_num_batched_tokens, max_model_len,
                                    config.max_num_seqs, device)
        return cls(staging, lazy)

    @property
    def writes(self) -> bool:
        """Whether a prefill or mixed step writes the drafter context of its tokens now (not
        without a drafter, nor while detached: those tokens are caught up later)."""
        return self.staging is not None and not (self.lazy is not None and self.lazy.detached)

    def flush(self) -> None:
        """Writes every staged plain-step row now (before the drafter runs)."""
        if self.staging is not None:
            self.staging.flush()

    def before_step(self, seqs: list[Sequence], plan: Plan) -> bool:
        """Detach, re-attach or catch up for the step about to run; True if it caught up."""
        if plan.drafting:
            self.flush()  # NOTE: the drafter runs: its context must be whole
        lazy = self.lazy
        if lazy is None:
            return False
        catchups = lazy.num_catchups
        decode = plan.path == "decode"
        lazy.before_step(seqs, plan.blens if plan.drafting else None, plan.block_len,
                         plan.num_decoding, decode and plan.block_len == 1)
        return lazy.num_catchups != catchups

    def after_step(self, seqs: list[Sequence], plan: Plan, advance: list[int]) -> None:
        """Counts the context the step wrote into its sequences (lazy mode keeps exact counts).
        NOTE: an attached plain decode stages its rows (a drafter exists, so the plain step
        defers its context): they count when flushed."""
        lazy = self.lazy
        if lazy is None or lazy.detached:
            return
        staged = plan.block_len == 1 and plan.path == "decode"
        written = [(s, a) for s, a, d in zip(seqs, advance, plan.decoding)
                   if not (staged and d)]
        lazy.count_written([s for s, _ in written], [a for _, a in written])

    def plain_step(self, step: DecodeStep, graphs: GraphedDecodeStep | None
                   ) -> tuple[DecodeStep, GraphedDecodeStep | None]:
        """The plain decode step to run: while detached, the one without any drafter work."""
        if self.lazy is not None and self.lazy.detached:
            return self.lazy.step, self.lazy.graphs
        return step, graphs

    def reattach(self) -> None:
        """Start attached, as a fresh engine does (a policy switch). NOTE: a sequence left with a
        gap is caught up before it drafts (the invariant)."""
        if self.lazy is not None:
            self.lazy.detached, self.lazy.plain_streak = False, 0
