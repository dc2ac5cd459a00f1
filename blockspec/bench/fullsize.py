"""Full-size shapes for GPU benchmarks: a Qwen3-8B-shaped target and a 5-layer DFlash drafter
(block 16), written as HF folders whose weights `load_format=dummy` fills at random; the engine
the GPU scripts build on them, and their random prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from blockspec import LLM
from blockspec.bench.timed_runs import timed_generate
from blockspec.config import ModelConfig
from blockspec.dflash.checkpoint import new_drafter_config
from blockspec.tiny import build_tokenizer

__all__ = ["INPUT_LEN", "MASK_TOKEN", "OUTPUT_LEN", "QWEN3_8B", "make_llm", "prompts",
           "run_generate", "write_folders"]

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
    tie_word_embeddings=False, dtype="bfloat16", eos_token_id=151645,
)
MASK_TOKEN = 151669
INPUT_LEN, OUTPUT_LEN = 512, 256


def write_folders(root: Path) -> tuple[Path, Path]:
    """(target, drafter) folders under `root`: config.json and a tokenizer, no weights."""
    target, drafter = root / "qwen3-8b-shape", root / "dflash-b16-shape"
    for d in (target, drafter):
        d.mkdir(parents=True, exist_ok=True)
        build_tokenizer(d)  # only for the engine's tokenizer slot: prompts are token ids
    (target / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = new_drafter_config(ModelConfig.from_dict(QWEN3_8B, "qwen3"), num_layers=5,
                             block_size=16, mask_token_id=MASK_TOKEN)
    (drafter / "config.json").write_text(json.dumps(cfg.to_dict()))
    return target, drafter


def make_llm(target: Path, drafter: Path | None, **kw: Any) -> LLM:
    """The full-size engine on CUDA (bf16, dummy weights, no prefix caching); with `drafter`, a
    fixed DFlash block 16. `kw` overrides any engine argument."""
    # NOTE: no prefix caching: every timed request must pay its full 512-token prefill.
    args = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=1024,
                kv_cache_memory_gb=36, max_num_seqs=256, enable_prefix_caching=False)
    args.update(kw)
    if drafter is not None:
        # NOTE: the "DFlash block 16" figures: a fixed block, not the adaptive policy.
        args.update(draft=str(drafter), block_size=16, speculation_policy="fixed")
    return LLM(str(target), **args)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of INPUT_LEN token ids (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n, INPUT_LEN), generator=g).tolist()


def run_generate(llm: LLM, c: int, out_len: int, seed: int = 0) -> dict:
    """`timed_generate`'s record for `c` fresh random prompts (`prompts(c, seed)`)."""
    return timed_generate(llm, prompts(c, seed), out_len)[0]
