"""The shared setup of the adaptive-policy benchmarks (benchmarks/policy_sweep.py and
benchmarks/plain_ab.py): the engines and prompts of a full-size GPU run or of a tiny CPU smoke
run, the warm-up length, and the lazy drafter context's counters to diff per run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from blockspec import LLM
from blockspec.bench.fullsize import make_llm, write_folders

if TYPE_CHECKING:
    from blockspec.engine.lazy_context import LazyDraftContext

__all__ = ["WARMUP_TOKENS", "Setup", "lazy_counts"]

WARMUP_TOKENS = 8


class Setup:
    """What differs between the H200 run and the CPU smoke run."""

    def __init__(self, smoke: bool, root: Path, cost_profile: str | None,
                 lazy_draft_context: bool | None = None) -> None:
        self.smoke = smoke
        self.cost_profile = cost_profile
        self.lazy_draft_context = lazy_draft_context
        if smoke:
            from blockspec.dflash.checkpoint import build_random_drafter
            from blockspec.tiny import build_tiny_model

            self.target = build_tiny_model(root / "tiny-target", arch="qwen3")
            self.drafter = build_random_drafter(root / "tiny-drafter", self.target, num_layers=2,
                                                block_size=16)
            self.input_len, self.vocab = 16, 500
        else:
            self.target, self.drafter = write_folders(root)
            self.input_len, self.vocab = 512, 151000

    def llm(self, draft: bool, acceptance: float | None = None) -> LLM:
        spec = dict(draft=str(self.drafter), block_size=16, speculation_policy="adaptive",
                    synthetic_acceptance=acceptance, benchmark_mode=True,
                    cost_profile=self.cost_profile,
                    lazy_draft_context=self.lazy_draft_context) if draft else {}
        if self.smoke:
            return LLM(str(self.target), device="cpu", num_kv_blocks=1024, max_model_len=256,
                       max_num_seqs=64, enable_prefix_caching=False, **spec)
        # NOTE: the drafter goes in as keyword arguments, not make_llm's drafter slot, so the
        # speculative engine differs from the plain one only by what is set here.
        return make_llm(self.target, None, **spec)

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1, self.vocab, (n, self.input_len), generator=g).tolist()


def lazy_counts(lazy: LazyDraftContext | None) -> dict[str, float]:
    """The lazy drafter context's counters (detached steps, catch-ups), to diff per run."""
    if lazy is None:
        return {}
    return {"detached_steps": lazy.num_detached_steps, "reattaches": lazy.num_reattaches,
            "catchups": lazy.num_catchups,
            "catchup_tokens": lazy.num_catchup_tokens, "catchup_s": lazy.catchup_seconds}
