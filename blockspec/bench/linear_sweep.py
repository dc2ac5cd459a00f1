"""Batch-1 matmuls: cuBLAS (`x @ W.T`, M = 1) against blockspec/layers/linear.py's Triton GEMV
over a grid of configs, per projection of the Qwen3-8B-shape target (and the DFlash drafter's fc
and K/V projections). Each projection's weights are all read once per timing (every layer's), so
L2 holds none of them. Used by benchmarks/fast_path_ceiling.py (on the engines' own weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.linear import gemv, gemv_config

__all__ = ["GEMV_CONFIGS", "projections", "sweep", "time_projection"]

# (BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMV_CONFIGS = [(4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 8, 3), (16, 512, 4, 4),
                (16, 256, 4, 4), (16, 1024, 8, 2), (16, 512, 4, 3), (32, 256, 8, 3),
                (32, 512, 8, 3)]


def projections(model: nn.Module, drafter: nn.Module | None = None
                ) -> dict[str, list[torch.Tensor]]:
    """Every projection's weights, each a list over the layers (lm_head alone; with `drafter`,
    its fc and its layers' K/V slices of qkv_proj)."""
    layers = model.model.layers
    out = {"qkv_proj": [la.self_attn.qkv_proj.weight for la in layers],
           "o_proj": [la.self_attn.o_proj.weight for la in layers],
           "gate_up_proj": [la.mlp.gate_up_proj.weight for la in layers],
           "down_proj": [la.mlp.down_proj.weight for la in layers],
           "lm_head": [model.lm_head.weight]}
    if drafter is not None:
        out["drafter_fc"] = [drafter.fc.weight]
        out["drafter_kv"] = [la.self_attn.qkv_proj.weight[la.self_attn.q_size:]
                             for la in drafter.layers]
    return out


def time_projection(ws: list[torch.Tensor], copy_bw: float) -> dict:
    """cuBLAS vs every GEMV config (and the default, `gemv_config`) for the weights `ws`."""
    n, k = ws[0].shape
    x = torch.randn(1, k, device=ws[0].device, dtype=ws[0].dtype)
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    ref = (x @ ws[0].t()).float()

    def cublas() -> None:
        for w in ws:
            torch.mm(x, w.t(), out=y)

    def triton_all(cfg: tuple[int, int, int, int]) -> None:
        for w in ws:
            gemv(x, w, cfg)

    nbytes = sum(w.numel() * w.element_size() for w in ws)
    row: dict = {"bytes": nbytes, "cublas_ms": graph_ms(cublas), "configs": {}}
    default = gemv_config(n, k)
    for cfg in GEMV_CONFIGS:
        if k % cfg[1]:
            continue
        err = (gemv(x, ws[0], cfg).float() - ref).abs().max().item()
        row["configs"][str(list(cfg))] = {"ms": graph_ms(lambda cfg=cfg: triton_all(cfg)),
                                         "max_abs_err": err}
    best = min(row["configs"], key=lambda c: row["configs"][c]["ms"])
    row["best_config"], row["best_ms"] = best, row["configs"][best]["ms"]
    if default is not None:
        row["default_config"] = str(list(default))
        row["default_ms"] = row["configs"].get(row["default_config"], {}).get("ms") \
            or graph_ms(lambda: triton_all(default))
    for key in ("cublas", "best", "default"):
        if f"{key}_ms" in row:
            row[f"{key}_of_copy_bw"] = nbytes / (row[f"{key}_ms"] / 1e3) / copy_bw
    return row


def sweep(model: nn.Module, drafter: nn.Module | None = None, copy_bw: float = 1.0) -> dict:
    """`time_projection` for every projection; totals (cuBLAS, best config, default config)."""
    rows = {name: time_projection(ws, copy_bw)
            for name, ws in projections(model, drafter).items()}
    rows["total"] = {k: sum(r.get(k, r["cublas_ms"]) for r in rows.values())
                     for k in ("cublas_ms", "best_ms", "default_ms")}
    return {"M=1": rows}
