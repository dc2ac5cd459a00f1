"""The step for any mix of prefill chunks, plain decodes and speculative blocks of any length up
to the max block: draft -> one target forward over the flat batch (the flat step's graph where a
bucket holds it, else eagerly) -> write drafter context -> sample -> accept."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.dflash.verify import accepted_counts
from blockspec.engine.decode_exec import BlockDrafts
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.flat_exec import FlatForward
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.row_sampling import SampleRows, row_logprobs, sample_rows
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import StepResult
from blockspec.models.qwen3 import CausalLM


class MixedStep:
    def __init__(self, model: CausalLM, proposer: DFlashProposer | None, bm: BlockManager,
                 vocab_size: int, device: torch.device, generator: torch.Generator,
                 synced: Callable[[torch.Tensor], list]) -> None:
        """`generator`: the synthetic-acceptance draws' (benchmarks); `synced`: the runner's
        timed host sync."""
        self.model, self.proposer, self.bm, self.device = model, proposer, bm, device
        self.vocab_size = vocab_size
        self.generator = generator
        self.synced = synced

    def __call__(self, seqs: list[Sequence], num_new_tokens: list[int], blens: list[int],
                 write_context: bool, synthetic: float | None,
                 flat: FlatForward | None = None,
                 block_drafts: BlockDrafts | None = None) -> StepResult:
        """`blens[i]`: sequence i's block (tokens verified; 0: it prefills or decodes plainly
        without a drafter); `write_context`: write the drafter's context of every fed token
        (False while the lazy context is detached); `flat`: the flat step to run the forward
        through (None: the eager forward of the batch's exact tensors); `block_drafts`: the
        draft step for blocks all of one length (None, or blocks cut short: one eager
        drafter pass over the blocks)."""
        dev = self.device
        spec = [i for i, b in enumerate(blens) if b >= 1]
        width = max((blens[i] for i in spec), default=1)
        drafts = self._drafts(seqs, blens, spec, width, block_drafts) if width >= 2 else None
        batch = FlatBatch.build(seqs, num_new_tokens, blens, width, self.bm)
        if flat is not None:
            hidden = flat(batch, drafts, write_context, width)
        else:
            hidden = self._forward(batch, drafts, write_context)
        advance = [n if not b else 0 for n, b in zip(num_new_tokens, blens)]
        rows = batch.sampled_rows
        if not len(rows):
            return StepResult(advance, [], [], [], [], [], [])
        # NOTE: non_blocking: a blocking copy would wait for the forward before the host could
        # queue the logits, sampling and acceptance behind it
        picked = hidden[torch.from_numpy(rows).to(dev, non_blocking=True)]
        logits = self.model.compute_logits(picked).float()
        spec_seqs = [seqs[i] for i in spec]
        n_last = len(batch.last_rows)
        row_seqs = batch.last_seqs + [s for s in spec_seqs for _ in range(width)]
        offsets = [0] * n_last + [min(j, blens[i] - 1) for i in spec for j in range(width)]
        draft_rows = [-1] * n_last + [k for k in range(len(spec)) for _ in range(width)]
        tokens = sample_rows(logits, SampleRows(row_seqs, offsets, drafts, draft_rows),
                             self.vocab_size)
        acc = self._accept(drafts, tokens[n_last:].view(len(spec), width), synthetic) \
            if spec else None
        lp = row_logprobs(logits, tokens, row_seqs)
        tok_list = self.synced(tokens)  # NOTE: the step's one host sync
        return self._result(batch, advance, spec, spec_seqs, blens, width, tok_list, lp, acc,
                            drafts.tolist() if synthetic is not None and drafts is not None
                            else None)

    def _drafts(self, seqs: list[Sequence], blens: list[int], spec: list[int], width: int,
                block_drafts: BlockDrafts | None) -> torch.Tensor:
        """[len(spec), width - 1] drafts: the draft step's where every block is whole."""
        picked = [seqs[i] for i in spec]
        if block_drafts is not None and all(blens[i] == width for i in spec) \
                and block_drafts.holds(width):
            return block_drafts(picked, width)
        return self._propose(seqs, blens, spec, width)

    def _forward(self, batch: FlatBatch, drafts: torch.Tensor | None,
                 write_context: bool) -> torch.Tensor:
        input_ids, positions, meta = batch.tensors(drafts, self.device)
        taps_ids = self.proposer.target_layer_ids if write_context else ()
        hidden, taps = self.model(input_ids, positions, meta, taps_ids)
        if write_context:
            self.proposer.write_context(taps, positions, meta.slot_mapping)
        return hidden

    def _propose(self, seqs: list[Sequence], blens: list[int], spec: list[int],
                 width: int) -> torch.Tensor:
        bm = self.bm
        picked = [seqs[i] for i in spec]
        return self.proposer.propose(
            [s.token_at(s.num_tokens - 1) for s in picked], [blens[i] for i in spec],
            [s.num_computed_tokens for s in picked], [s.block_table for s in picked],
            [[bm.slot(s, p) for p in range(s.num_computed_tokens,
                                           s.num_computed_tokens + blens[i])]
             for s, i in zip(picked, spec)], width)

    def _accept(self, drafts: torch.Tensor | None, target: torch.Tensor,
                synthetic: float | None) -> torch.Tensor:
        if drafts is None:
            return torch.zeros(target.shape[0], dtype=torch.int64, device=target.device)
        uniforms = None
        if synthetic is not None:
            uniforms = torch.rand(drafts.shape, generator=self.generator, device=drafts.device)
        return accepted_counts(drafts, target, uniforms, synthetic)

    @staticmethod
    def _result(batch: FlatBatch, advance: list[int], spec: list[int],
                spec_seqs: list[Sequence], blens: list[int], width: int, tok_list: list[int],
                lp: list, acc_t: torch.Tensor | None,
                synthetic_drafts: list[list[int]] | None) -> StepResult:
        """Each sequence's committed tokens: a non-block sequence its one sample, a block its
        accepted drafts and the target's pick after them."""
        n_last = len(batch.last_rows)
        acc = acc_t.tolist() if acc_t is not None else []
        out_tokens = [[t] for t in tok_list[:n_last]]
        out_lp = [[x] for x in lp[:n_last]]
        for k, i in enumerate(spec):
            base, a = n_last + k * width, acc[k]
            if synthetic_drafts is not None:  # benchmark mode: accepted drafts as drafted
                out_tokens.append(synthetic_drafts[k][:a] + [tok_list[base + a]])
            else:
                out_tokens.append(tok_list[base:base + a + 1])
            out_lp.append(lp[base:base + a + 1])
            advance[i] = a + 1
        drafted = [0] * n_last + [blens[i] - 1 for i in spec]
        return StepResult(advance, batch.last_seqs + spec_seqs, out_tokens, out_lp,
                          drafted, [0] * n_last + acc, [0] * n_last + [blens[i] for i in spec])
