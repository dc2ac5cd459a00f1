"""Acceptance of a drafted block against the target's own choices.

The target picks a token at every verified position (argmax when greedy, otherwise a sample of its
processed distribution). Drafts are accepted while each equals the target's choice at the position
before it; the target's choice after the last accepted draft is the bonus token. Every emitted token
is therefore the target's own choice given the committed prefix, so greedy output is token-identical
to autoregressive decoding and sampled output has exactly the target's distribution (for a greedy
drafter this equals rejection sampling with a one-hot proposal).
"""

from __future__ import annotations

import torch


def num_accepted(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """drafts [S, B-1] (padded with -1), target_tokens [S, B] -> accepted drafts per row [S].

    Emitted tokens for row i are target_tokens[i, : n[i] + 1].
    """
    match = drafts == target_tokens[:, :-1]
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def accepted_counts(drafts: torch.Tensor, target_tokens: torch.Tensor,
                    uniforms: torch.Tensor | None = None,
                    acceptance: float | torch.Tensor | None = None) -> torch.Tensor:
    """Accepted drafts per row [S]: the one acceptance rule of every step (eager or graphed).
    With `uniforms` (benchmark-only synthetic acceptance) draft j is accepted while its draw is
    under `acceptance`, whatever the target says; drafts of -1 (past a block's end) never are."""
    if uniforms is None:
        return num_accepted(drafts, target_tokens)
    hits = (uniforms < acceptance) & (drafts >= 0)
    return hits.to(torch.int64).cumprod(dim=1).sum(dim=1)
