"""`blockspec inspect MODEL [--draft D] [-tp N -ep E]`: what a model folder (and its DFlash
drafter) is and whether a layout holds it, before deploying. Reads configs and safetensors
headers only (sizing/plan.py); never loads a weight."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from blockspec.sizing.plan import RESERVE_BYTES, DraftReport, GiB, GpuPlan, ModelReport


def add_inspect_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="a model's (and drafter's) geometry, parameters, "
                                       "quantization, KV bytes and memory plan per GPU; reads "
                                       "configs and safetensors headers only",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF model folder (config.json; safetensors optional)")
    p.add_argument("--draft", default=None, help="DFlash drafter folder (config.json)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, dest="tp",
                   help="GPUs per model replica, as serve's -tp")
    p.add_argument("-ep", "--expert-parallel-size", type=int, default=1, dest="ep",
                   help="expert groups the routed experts are split into (divides TP)")
    p.add_argument("--gpu-memory-gib", type=float, default=141.0,
                   help="memory per GPU in GiB (default 141: an H200)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of it the engine may use, as for serve (default 0.9)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context to plan the KV cache for (default: the model's maximum)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                   default="auto", help="activation / KV-cache dtype (auto: the checkpoint's; "
                                        "fp32 as bf16)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from blockspec.sizing.plan import inspect_drafter, inspect_model, plan_layout

    model = inspect_model(args.model, args.dtype)
    draft = inspect_drafter(args.draft, model, args.dtype) if args.draft else None
    plan = plan_layout(model, draft, args.tp, args.ep, args.gpu_memory_gib,
                       args.gpu_memory_utilization, args.max_model_len)
    if args.json:
        print(json.dumps(report_dict(model, draft, plan), indent=1))
    else:
        sys.stdout.write(render(model, draft, plan))
    return 0


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _gib(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if abs(n) >= GiB // 10 else f"{n / (1 << 20):,.2f} MiB"


def report_dict(model: ModelReport, draft: DraftReport | None, plan: GpuPlan) -> dict:
    cfg = model.config
    out: dict[str, Any] = {
        "model": {"path": model.path, "architecture": model.architecture,
                  "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "params_total": model.params_total,
                  "params_active": model.params_active, "quantization": model.quantization,
                  "weights_bytes": model.weights_bytes, "weights_source": model.weights_source,
                  "skipped_bytes": model.skipped_bytes,
                  "kv_bytes_per_token": model.kv_bytes_per_token}}
    if draft is not None:
        d = draft.config
        out["draft"] = {"path": draft.path, "block_size": d.block_size, "layers": d.num_layers,
                        "target_layer_ids": d.target_layer_ids,
                        "mask_token_id": d.mask_token_id, "mask_token": draft.mask_token,
                        "pairs": draft.pairs, "pair_problem": draft.pair_problem,
                        "params": draft.params, "weights_bytes": draft.weights_bytes,
                        "kv_bytes_per_token": draft.kv_bytes_per_token}
    out["plan"] = {"tp": plan.tp, "ep": plan.ep, "gpu_bytes": plan.gpu_bytes,
                   "usable_bytes": plan.usable_bytes, "max_model_len": plan.max_model_len,
                   "weights_bytes_per_gpu": plan.weights_bytes,
                   "kv_bytes_per_token_per_gpu": plan.kv_bytes_per_token,
                   "context_bytes": plan.context_bytes, "left_bytes": plan.left_bytes,
                   "contexts": round(plan.contexts, 2), "fits": plan.fits,
                   "problems": plan.problems, "min_tp": plan.min_tp}
    return out


def _model_lines(m: ModelReport) -> list[str]:
    cfg = m.config
    shape = f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size:,}"
    if cfg.moe is not None:
        moe = cfg.moe
        shape += (f"; {cfg.num_hidden_layers - moe.first_k_dense_replace} MoE layers of "
                  f"{moe.num_experts} experts ({moe.moe_intermediate_size} wide, top-"
                  f"{moe.num_experts_per_tok}, {moe.n_shared_experts} shared), "
                  f"{moe.first_k_dense_replace} dense first")
    if cfg.mla is not None:
        mla = cfg.mla
        shape += (f"; MLA {cfg.num_attention_heads} heads, q_lora {mla.q_lora_rank}, kv_lora "
                  f"{mla.kv_lora_rank}, rope {mla.qk_rope_head_dim}, nope "
                  f"{mla.qk_nope_head_dim}, v {mla.v_head_dim}")
    skipped = "".join(f"; not served: {_gib(v)} {k}" for k, v in m.skipped_bytes.items())
    return [f"model         {m.path}",
            f"architecture  {m.architecture}",
            f"geometry      {shape}; context {cfg.max_position_embeddings:,}",
            f"parameters    {_count(m.params_total)} total, {_count(m.params_active)} "
            "activated per token",
            f"quantization  {m.quantization}",
            f"weights       {_gib(m.weights_bytes)} (from {m.weights_source}){skipped}",
            f"KV cache      {m.kv_bytes_per_token:,} bytes per token"]


def _draft_lines(d: DraftReport) -> list[str]:
    c, g = d.config, d.config.geometry
    mask = f"{c.mask_token_id}" + (f" ({d.mask_token!r})" if d.mask_token else "")
    pair = "yes" if d.pairs else f"NO: {d.pair_problem}"
    return [f"drafter       {d.path}",
            f"DFlash        block_size {c.block_size}, {c.num_layers} layers (hidden "
            f"{g.hidden_size}, {g.num_attention_heads} heads / {g.num_key_value_heads} KV of "
            f"{g.head_dim}), {_count(d.params)} parameters, {_gib(d.weights_bytes)}",
            f"target layers {c.target_layer_ids} (of {c.num_target_layers or '?'})",
            f"mask token    {mask}",
            f"pairs         {pair}",
            f"KV cache      {d.kv_bytes_per_token:,} bytes per token"]


def _plan_lines(p: GpuPlan) -> list[str]:
    share = max(p.tp // max(p.ep, 1), 1)
    lines = [f"plan per GPU  TP {p.tp} x EP {p.ep} ({p.tp} GPU{'s' * (p.tp > 1)}; routed "
             f"experts in {p.ep} group{'s' * (p.ep > 1)} of {share} GPU{'s' * (share > 1)})",
             f"  budget      {_gib(p.gpu_bytes)} x {p.usable_bytes / p.gpu_bytes:.2f} = "
             f"{_gib(p.usable_bytes)}",
             f"  weights     {_gib(p.weights_bytes)}",
             f"  reserve     {_gib(RESERVE_BYTES)} (CUDA graphs, allocator; activations are "
             "measured at start-up)",
             f"  KV cache    {p.kv_bytes_per_token:,} bytes per token; one "
             f"{p.max_model_len:,}-token context {_gib(p.context_bytes)}",
             f"  left        {_gib(p.left_bytes)} for the KV cache: {p.contexts:.1f} full "
             f"contexts, {max(p.left_bytes, 0) // p.kv_bytes_per_token:,} tokens"]
    lines += [f"  problem     {x}" for x in p.problems]
    if p.fits:
        lines.append("  verdict     fits")
    else:
        hint = f"; TP {p.min_tp} would" if p.min_tp and p.min_tp != p.tp else ""
        lines.append(f"  verdict     does NOT fit one {p.max_model_len:,}-token context{hint}")
    return lines


def render(model: ModelReport, draft: DraftReport | None, plan: GpuPlan) -> str:
    lines = _model_lines(model) + [""]
    if draft is not None:
        lines += _draft_lines(draft) + [""]
    return "\n".join(lines + _plan_lines(plan)) + "\n"
