"""The one sampling path of every step: the logits rows a step produced (a prefill's last token, a
plain decode, the rows of a verify block) -> the target's pick at each row.

A row samples the output position `len(seq.output_token_ids) + offset`, where `offset` counts the
drafts ahead of it in its block; its randomness and its logits processing depend on that position
and on the tokens before it only, never on how the step was laid out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import Logprobs
from blockspec.layers.logits_processors import RowContext, process_logits
from blockspec.layers.sampler import SamplingTensors, chosen_logprobs, sample


@dataclass
class SampleRows:
    seqs: list[Sequence]  # per logits row: its sequence
    offsets: list[int]  # per row: drafts between the committed output and the row's position
    drafts: torch.Tensor | None = None  # [S, W-1] the step's drafts (-1: past a block's end)
    draft_rows: list[int] | None = None  # per row: its block's row of `drafts` (-1: none)


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Every sequence takes the raw argmax, so a graph's own pick and acceptance serve."""
    return all(s.plain_greedy for s in seqs)


def _contexts(rows: SampleRows) -> list[RowContext | None]:
    # NOTE: the only host sync for drafts, taken only when some request has processors.
    drafts = rows.drafts.tolist() if rows.drafts is not None else []
    ctxs: list[RowContext | None] = []
    for r, seq in enumerate(rows.seqs):
        if not seq.params.has_processors:
            ctxs.append(None)
            continue
        prefix: list[int] = []
        j = rows.offsets[r]
        if j and rows.draft_rows is not None and rows.draft_rows[r] >= 0:
            prefix = [t for t in drafts[rows.draft_rows[r]][:j] if t >= 0]
        ctxs.append(RowContext(seq.params, seq.prompt_token_ids,
                               seq.output_token_ids + prefix, seq.eos_token_ids))
    return ctxs


def sample_rows(logits: torch.Tensor, rows: SampleRows, vocab_size: int) -> torch.Tensor:
    """logits [R, V] -> token ids [R] (int64), one per row of `rows`."""
    if plain_greedy(rows.seqs):
        # NOTE: what sampling computes for these rows, without its per-row setup on the host
        return logits.argmax(dim=-1)
    params = [s.params for s in rows.seqs]
    logits = logits.float()
    if any(p.has_processors for p in params):
        logits = process_logits(logits, _contexts(rows))
    positions = [len(s.output_token_ids) + j for s, j in zip(rows.seqs, rows.offsets)]
    st = SamplingTensors.build(params, [s.sampling_seed for s in rows.seqs], positions,
                               vocab_size, logits.device)
    return sample(logits, st)


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                 row_seqs: list[Sequence]) -> list[Logprobs]:
    """Per row, for requests that asked: {chosen token: logprob, plus its top k} from the raw
    model distribution (vLLM's default), else None."""
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
