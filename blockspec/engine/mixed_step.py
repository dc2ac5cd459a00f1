"""The eager step for any mix of prefill chunks, plain decodes and speculative blocks of any
length up to the max block (mixed into ModelRunner)."""

from __future__ import annotations

import torch

from blockspec.dflash.verify import num_accepted
from blockspec.engine.row_sampling import SampleRows, sample_rows
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import Logprobs, StepResult
from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.sampler import chosen_logprobs


class MixedStepMixin:
    """Needs from the runner: bm, device, model, model_cfg, proposer, lazy, synthetic,
    default_generator."""

    def _execute_mixed(self, seqs: list[Sequence], num_new_tokens: list[int],
                       blens: list[int]) -> StepResult:
        """Any mix of prefill chunks, decodes and (possibly short) speculative blocks."""
        bm, dev = self.bm, self.device
        spec = [i for i, b in enumerate(blens) if b >= 1]
        # NOTE: every block of the step is padded to the step's widest one (its chosen L).
        width = max((blens[i] for i in spec), default=1)
        drafts = None
        if width >= 2:
            drafts = self.proposer.propose(
                [seqs[i].token_at(seqs[i].num_tokens - 1) for i in spec],
                [blens[i] for i in spec], [seqs[i].num_computed_tokens for i in spec],
                [seqs[i].block_table for i in spec],
                [[bm.slot(seqs[i], p) for p in range(seqs[i].num_computed_tokens,
                                                     seqs[i].num_computed_tokens + blens[i])]
                 for i in spec], width)

        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        draft_dst, draft_src = [], []  # flat target rows <- flat draft indices
        last_rows, last_seqs = [], []  # non-speculative sequences that sample one token
        verify_rows = []  # [len(spec)][width]: target rows whose logits verify each block
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            q = blens[i] or n
            base = len(ids)
            for p in range(start, start + q):
                ids.append(seq.token_at(p) if p < seq.num_tokens else 0)
                positions.append(p)
                slots.append(bm.slot(seq, p))
            if blens[i]:
                k = len(verify_rows)
                draft_dst += range(base + 1, base + q)
                draft_src += range(k * (width - 1), k * (width - 1) + q - 1)
                verify_rows.append([base + min(j, q - 1) for j in range(width)])
            elif start + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                last_seqs.append(seq)
            q_lens.append(q)
            seq_lens.append(start + q)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        if draft_dst:
            input_ids[torch.tensor(draft_dst, device=dev)] = drafts.view(-1)[
                torch.tensor(draft_src, device=dev)]
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata.build(q_lens, seq_lens, [s.block_table for s in seqs], slots, dev)
        # NOTE: detached (lazy_draft_context): no drafter context now; caught up before the
        # drafter next runs for these sequences.
        write = self.proposer is not None and not (self.lazy is not None and self.lazy.detached)
        taps_ids = self.proposer.target_layer_ids if write else ()
        hidden, taps = self.model(input_ids, pos_t, meta, taps_ids)
        if write:
            self.proposer.write_context(taps, pos_t, meta.slot_mapping)

        spec_seqs = [seqs[i] for i in spec]
        rows = last_rows + [r for vr in verify_rows for r in vr]
        advance = [n if not blens[i] else 0 for i, n in enumerate(num_new_tokens)]
        if not rows:
            return StepResult(advance, [], [], [], [], [], [])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
        row_seqs = last_seqs + [s for s in spec_seqs for _ in range(width)]
        offsets = [0] * len(last_rows) + [min(j, blens[i] - 1) for i in spec for j in range(width)]
        draft_rows = [-1] * len(last_rows) + [k for k in range(len(spec)) for _ in range(width)]
        tokens = sample_rows(logits, SampleRows(row_seqs, offsets, drafts, draft_rows),
                             self.model_cfg.vocab_size)
        acc_t = None
        if spec_seqs:
            target = tokens[len(last_rows):].view(len(spec_seqs), width)
            acc_t = (num_accepted(drafts, target) if drafts is not None
                     else torch.zeros(len(spec_seqs), dtype=torch.int64, device=dev))
            if self.synthetic is not None and drafts is not None:
                u = torch.rand(drafts.shape, generator=self.default_generator, device=dev)
                hits = (u < self.synthetic) & (drafts >= 0)
                acc_t = hits.to(torch.int64).cumprod(dim=1).sum(dim=1)
        lp = self._logprobs(logits, tokens, row_seqs)
        tok_list = self.synced(tokens)  # NOTE: the step's one host sync
        acc = acc_t.tolist() if acc_t is not None else []
        draft_list = drafts.tolist() if self.synthetic is not None and drafts is not None else []

        out_tokens = [[t] for t in tok_list[:len(last_rows)]]
        out_lp = [[x] for x in lp[:len(last_rows)]]
        drafted = [0] * len(last_rows)
        for k, i in enumerate(spec):
            base = len(last_rows) + k * width
            a = acc[k]
            if draft_list:  # benchmark mode: accepted drafts are committed as drafted
                out_tokens.append(draft_list[k][:a] + [tok_list[base + a]])
            else:
                out_tokens.append(tok_list[base:base + a + 1])
            out_lp.append(lp[base:base + a + 1])
            drafted.append(blens[i] - 1)
            advance[i] = a + 1
        accepted = [0] * len(last_rows) + acc
        block_lens = [0] * len(last_rows) + [blens[i] for i in spec]
        return StepResult(advance, last_seqs + spec_seqs, out_tokens, out_lp, drafted, accepted,
                          block_lens)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                  row_seqs: list[Sequence]) -> list[Logprobs]:
        want = [s.params.logprobs for s in row_seqs]
        if all(w is None for w in want):
            return [None] * len(row_seqs)
        k = max(w or 0 for w in want)
        chosen, top_vals, top_ids = (x.tolist() for x in chosen_logprobs(logits, tokens, k))
        toks = tokens.tolist()
        out: list[Logprobs] = []
        for r, w in enumerate(want):
            if w is None:
                out.append(None)
                continue
            d = {toks[r]: chosen[r]}
            for j in range(w):
                d.setdefault(top_ids[r][j], top_vals[r][j])
            out.append(d)
        return out
