"""Full-size shapes for GPU benchmarks: a Qwen3-8B-shaped target and a 5-layer DFlash drafter
(block 16), written as HF folders whose weights `load_format=dummy` fills at random."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.config import ModelConfig
from blockspec.dflash.checkpoint import new_drafter_config
from blockspec.tiny import build_tokenizer

__all__ = ["INPUT_LEN", "MASK_TOKEN", "OUTPUT_LEN", "QWEN3_8B", "write_folders"]

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
