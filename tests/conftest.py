"""Session-wide tiny checkpoints, built once with HF transformers' own model classes."""

from __future__ import annotations

import os

import torch

# NOTE: Triton reads TRITON_INTERPRET at its first import, which importing blockspec triggers;
# on a machine without a GPU the kernels must run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path

# NOTE: engines cache their step-cost profiles under $BLOCKSPEC_CACHE: never the user's
# ~/.cache from tests; each test gets its own folder (`_isolated_cache`), session- and
# module-scoped fixtures share this one.
os.environ["BLOCKSPEC_CACHE"] = tempfile.mkdtemp(prefix="blockspec-test-cache-")

import pytest
import torch

from blockspec.tiny import build_tiny_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def qwen3_path(models_root) -> Path:
    return build_tiny_model(models_root / "qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def llama_path(models_root) -> Path:
    return build_tiny_model(models_root / "llama", arch="llama", seed=1)


@pytest.fixture(scope="session")
def llama_tied_path(models_root) -> Path:
    return build_tiny_model(models_root / "llama-tied", arch="llama", tie_word_embeddings=True,
                            seed=2)


@pytest.fixture(scope="session")
def llama_rope_path(models_root) -> Path:
    return build_tiny_model(models_root / "llama-rope3", arch="llama", rope_scaling=LLAMA3_ROPE,
                            max_position_embeddings=1024, seed=3)


@pytest.fixture(scope="session")
def qwen3_sharded_path(models_root, qwen3_path) -> Path:
    """The qwen3 weights re-saved by HF in many small shards (model.safetensors.index.json)."""
    from transformers import AutoModelForCausalLM

    out = models_root / "qwen3-sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_path), dtype=torch.float32)
    hf.save_pretrained(str(out), max_shard_size="20KB")
    for name in TOKENIZER_FILES:
        if (qwen3_path / name).is_file():
            shutil.copy(qwen3_path / name, out / name)
    return out


@pytest.fixture(scope="session")
def deepseek_pair(models_root) -> tuple[Path, Path]:
    """A tiny DeepSeek-V3 target (q_lora, 4 expert groups) written by HF transformers, and a
    random 2-layer DFlash drafter (block 8) for it. NOTE: tests copy it before changing it."""
    from blockspec.dflash.checkpoint import build_random_drafter
    from blockspec.tiny import build_tiny_deepseek_v3

    target = build_tiny_deepseek_v3(models_root / "deepseek-v3", q_lora_rank=24, n_group=4,
                                    topk_group=2, seed=3)
    return target, build_random_drafter(models_root / "deepseek-v3-drafter", target,
                                        num_layers=2, block_size=8)


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def arch_path(request) -> Path:
    """Each supported architecture in turn."""
    return request.getfixturevalue(f"{request.param}_path")


_HF_CACHE: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="session")
def hf_model():
    """`hf_model(path)`: the HF transformers model for a folder, fp32, eval mode, cached."""
    from transformers import AutoModelForCausalLM

    def get(path: Path) -> torch.nn.Module:
        key = str(path)
        if key not in _HF_CACHE:
            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
            _HF_CACHE[key] = model.eval()
        return _HF_CACHE[key]

    return get


@pytest.fixture(scope="session")
def drafter16(models_root, qwen3_path) -> Path:
    """A random 2-layer, block-16 DFlash drafter for the tiny Qwen3 (spec and policy tests)."""
    from blockspec.dflash.checkpoint import build_random_drafter

    return build_random_drafter(models_root / "drafter16", qwen3_path, num_layers=2,
                                block_size=16)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
