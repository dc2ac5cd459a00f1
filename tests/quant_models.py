"""Tiny quantized checkpoints: an HF-written tiny DeepSeek-V3 folder with its Linear weights
quantized by the `compressed-tensors` package's own pack-quantized compressor (INT4, as Kimi
K2.x publish), or to block-scaled FP8 as DeepSeek-V3 publish (e4m3 `weight`, fp32
`weight_scale_inv`)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Kimi K2.x's published scheme: every Linear but attention, the dense and shared MLPs, lm_head.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def linear_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Modules of an HF DeepSeek-V3 checkpoint that are nn.Linear in the published (per-expert)
    model: 2-D weights but the embedding, norms and the router."""
    return [k[:-len(".weight")] for k, v in tensors.items()
            if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k
            and "norm" not in k and not k.endswith("mlp.gate.weight")]


def int4_config(group: int, targets: list[str], ignore: list[str]) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ignore,
            "config_groups": {"group_0": {"targets": targets, "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}}}


def _compress_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> dict:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group)
    groups = w.reshape(w.shape[0], -1, group)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(scale_dtype)}, scheme)


def _fp8_block(w: torch.Tensor, block: tuple[int, int]) -> dict:
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:n, :k]
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale_inv": scale.float()}


def _rewrite(src: Path, dst: Path, quantize, quant_config: dict) -> Path:
    """`dst`: `src` with each Linear weight that `quantize(module)` returns pieces for replaced
    by them, and `quant_config` as its quantization_config."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = dict(tensors)
    for module in linear_modules(tensors):
        pieces = quantize(module, tensors[f"{module}.weight"])
        if pieces is not None:
            del out[f"{module}.weight"]
            out.update({f"{module}.{k}": v.contiguous() for k, v in pieces.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def int4_checkpoint(src: Path, dst: Path, group: int = 32, targets: list[str] | None = None,
                    ignore: list[str] | None = None,
                    scale_dtype: torch.dtype = torch.float32) -> Path:
    """compressed-tensors W4A16 over the modules `targets` minus `ignore` cover (the package's
    own matcher; "Linear" covers them all). Default: Kimi K2.x's scheme."""
    from compressed_tensors.utils.match import match_name

    targets = targets or ["Linear"]
    ignore = KIMI_IGNORE if ignore is None else ignore

    def quantize(module: str, w: torch.Tensor) -> dict | None:
        hit = any(t == "Linear" or match_name(module, t) for t in targets)
        if not hit or any(match_name(module, i) for i in ignore):
            return None
        return _compress_int4(w, group, scale_dtype)

    return _rewrite(src, dst, quantize, int4_config(group, targets, ignore))


def fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """Every Linear but lm_head to e4m3 with one scale per `block`, as DeepSeek-V3 ship."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block)}
    return _rewrite(src, dst, lambda m, w: None if m == "lm_head" else _fp8_block(w, block),
                    config)


def hf_dequantized(path: Path) -> torch.nn.Module:
    """HF transformers' own model of a quantized folder, dequantized at load (fp32)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    method = json.loads((path / "config.json").read_text())["quantization_config"]
    if method["quant_method"] == "fp8":
        qc = FineGrainedFP8Config(dequantize=True,
                                  weight_block_size=tuple(method["weight_block_size"]))
    else:
        qc = CompressedTensorsConfig(dequantize=True)
    with warnings.catch_warnings():  # NOTE: "the folder's quantization_config is used"
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                    quantization_config=qc).eval()
