"""The embedded demo pair: a small Python-code Qwen3 target and its DFlash drafter (block 16),
shipped as HF folders inside the package (blockspec/demo_pair/{target,drafter}), built by
`benchmarks/build_demo_pair.py` (record: blockspec/demo_pair/build_record.json).

`blockspec generate` and `blockspec serve` use it when no `--model` is given.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo_pair"


def demo_target() -> Path | None:
    """The shipped demo target folder, or None in a checkout built without it."""
    path = DEMO_DIR / "target"
    return path if (path / "model.safetensors").is_file() else None


def demo_drafter() -> Path | None:
    path = DEMO_DIR / "drafter"
    return path if (path / "model.safetensors").is_file() else None
