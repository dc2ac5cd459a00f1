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


def default_pair(model: str | None, draft: str | None) -> tuple[str, str | None, str | None]:
    """(model, draft, what to tell the user) for a model or drafter the caller left out: no model
    means the demo pair (its drafter too, unless `draft` is given; `draft="none"`: no drafter),
    or a tiny random Qwen3 in a checkout without the pair."""
    no_draft = draft in ("none", "")
    draft = None if no_draft else draft
    if model is not None:
        return model, draft, None
    target, drafter = demo_target(), demo_drafter()
    if target is None:
        from blockspec.tiny import default_demo_model

        path = default_demo_model()
        return str(path), draft, (f"no model given and no demo pair in this install: using a "
                                  f"tiny random model at {path} (random weights: expect "
                                  "gibberish)")
    if draft is None and not no_draft and drafter is not None:
        draft = str(drafter)
    with_draft = " + its DFlash drafter" if draft else ""
    return str(target), draft, (f"no model given: using the demo pair (15.7M-parameter "
                                f"Python-code Qwen3{with_draft}) at {target.parent}")
