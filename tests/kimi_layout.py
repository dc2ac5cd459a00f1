"""A tiny folder in Kimi K2.6's published layout: the kimi_k25 multimodal wrapper (text model
under language_model., a vision tower beside it), routed experts INT4 (compressed-tensors
pack-quantized, quantized by the package's own compressor) with the quantization_config in
text_config, and a tiktoken tokenizer that ships its own code (tokenization_kimi.py, mapped by
tokenizer_config.json's auto_map) with a chat template in chat_template.jinja."""

from __future__ import annotations

import base64
import inspect
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import torch
from quant_models import int4_checkpoint
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).parent / "fixtures"
# Kimi's special tokens sit above the BPE ranks; [MASK] stands where Kimi's drafter mask is
# (163838 = vocab - 2).
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
           "<|im_middle|>", "[MASK]", "[PAD]"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def learn_bpe(text: str, size: int) -> dict[bytes, int]:
    """tiktoken mergeable ranks: the 256 bytes, then the most frequent adjacent pairs merged
    in turn until `size` tokens."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    seqs = {w: [bytes([b]) for b in w.encode()] for w in words}
    while len(ranks) < size:
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            pairs.update({p: n for p in zip(s, s[1:])})
        pair = next((p for p, _ in pairs.most_common() if p[0] + p[1] not in ranks), None)
        if pair is None:
            break
        merged = pair[0] + pair[1]
        ranks[merged] = len(ranks)
        for s in seqs.values():
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == pair:
                    s[i:i + 2] = [merged]
                i += 1
    return ranks


def write_tiktoken_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """Kimi's tokenizer files in `out`; returns the special tokens' ids."""
    import json as json_module

    ranks = learn_bpe(inspect.getsource(json_module), vocab_size - len(SPECIAL))
    (out / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    special = {t: vocab_size - len(SPECIAL) + i for i, t in enumerate(SPECIAL)}
    shutil.copy(FIXTURES / "kimi_tokenizer" / "tokenization_kimi.py", out)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "special_tokens": special, "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
                                 for t, i in special.items()},
        "pad_token": "[PAD]", "model_max_length": 1048576}, indent=1))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    return special


def kimi_k26_folder(dense: Path, root: Path) -> Path:
    """The Kimi K2.6 layout of a tiny HF DeepSeek-V3 folder (vocab 512)."""
    int4 = int4_checkpoint(dense, root / "int4")
    out = root / "kimi-k2.6"
    shutil.copytree(int4, out)
    special = write_tiktoken_tokenizer(out, json.loads((dense / "config.json").read_text())
                                       ["vocab_size"])
    text = json.loads((int4 / "config.json").read_text())
    text.update(model_type="kimi_k2", bos_token_id=special["[BOS]"],
                eos_token_id=special["<|im_end|>"], pad_token_id=special["[PAD]"])
    text.pop("architectures", None)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "bos_token_id": special["[BOS]"], "eos_token_id": special["<|im_end|>"],
        "text_config": text, "vision_config": {"hidden_size": 8}}, indent=1))
    tensors = {f"language_model.{k}": v for k, v in
               load_file(str(int4 / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").unlink(missing_ok=True)
    return out
