"""MoE targets on one GPU (issue 21), one run: random bf16 weights (`load_format=dummy`) of real
shapes, writing partial results after every stage.

Moonlight-16B-A3B shape (DeepSeek-V3 architecture: MLA, 64 routed experts of 1408, top 6, 2
shared, 1 dense layer) + a 4-layer DFlash drafter (block 16; the adaptive policy picks among
2/4/8/16):
  1. AR decode at batch 1: graph replay and engine TPOT against the step's bytes floor (dense
     weights + the 6 experts per MoE layer its token selects + the latent KV);
  2. greedy outputs with graphs == eager (AR, and DFlash with its random drafter);
  3. closed loop, input 512 / output 256, C in --concurrency: AR vs the default (adaptive)
     DFlash engine with the LABELLED synthetic acceptance a (each draft position accepted with
     probability a; the text is not the target's: a system-timing mode only); at C=1 also fixed
     blocks 8 and 16, each against what the bytes model predicts from its measured experts per
     verify forward and tau, then adaptive once more (a check that the warm-up, mirroring
     AR's, leaves nothing cold for the sweep's first cell);
  4. HF transformers `generate` at C=1 on the same weights (outside reference).
Kimi-K2.6-width slice (hidden 7168, 64 heads, MLA 1536/512/128+64/128, 384 experts of 2048,
top 8, one shared; one dense + --kimi-moe-layers MoE layers):
  5. per-layer forward costs at batch 1..256 for 1 (AR), 8 and 16 (verify) tokens per sequence;
  6. with Kimi K2.6's INT4 experts (--kimi-int4-moe-layers MoE layers): AR batch-1 step against
     its bytes floor, the W4A16 experts' kernel at 1..64 tokens against bf16's (issue 23; bf16
     where its 42 GiB of experts fit beside the slice).

Usage: python benchmarks/moe_bench.py --out-dir DIR [--concurrency 1,8,32,64,128,256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.fullsize import INPUT_LEN, OUTPUT_LEN, prompts
from blockspec.bench.gpu_timing import copy_bandwidth, free, graph_ms, replay_ms
from blockspec.bench.headline import merge_latest
from blockspec.bench.moe_shapes import (
    KIMI_INT4,
    MOONLIGHT,
    expert_bytes,
    expert_kernel_times,
    kimi_slice,
    layer_times,
    step_floor_bytes,
    write_moe_folders,
)
from blockspec.bench.offline import run_requests
from blockspec.bench.timed_runs import timed_generate

ENGINE = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048,
              kv_cache_memory_gb=20, max_num_seqs=256, enable_prefix_caching=False)


def closed_loop(llm: LLM, c: int, seed: int) -> dict:
    """`blockspec bench offline`'s loop: max(8, 2c) requests, c at a time; output tok/s, tau,
    and the distinct experts per MoE layer forward of the run."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    model = llm.engine.model
    model.reset_expert_counts()
    torch.cuda.synchronize()
    records, dt, spec = run_requests(llm.engine, prompts(max(8, 2 * c), seed), params, c, "moe",
                                     show=False)
    selected, forwards = model.expert_counts().tolist()
    return {"output_tok_s": sum(r.output_tokens for r in records) / dt, "requests": len(records),
            "tau": spec.mean_acceptance_length if spec.num_steps else None,
            "block_len_steps": dict(spec.block_len_steps) if spec.num_steps else None,
            "experts_selected": selected, "moe_layer_forwards": forwards}


def verify_experts(run: dict, requests: int, parts: dict, num_experts: int) -> float:
    """Distinct experts per MoE layer of the run's decode/verify forwards: its prefills (one per
    request, 512 tokens: every expert) taken out of the counts."""
    prefill = requests * parts["moe_layers"]
    return (run["experts_selected"] - prefill * num_experts) / (run["moe_layer_forwards"]
                                                                 - prefill)


def moonlight_ar(res: dict, target: Path, bw: float) -> None:
    ar = LLM(str(target), **ENGINE)
    timed_generate(ar, prompts(2, 99), 8)  # warm-up
    ctx = INPUT_LEN + OUTPUT_LEN // 2
    parts = expert_bytes(ar.engine.model)
    mc = ar.engine.model_config
    floor = step_floor_bytes(parts, mc.moe.num_experts_per_tok, ctx, mc)
    run = timed_generate(ar, prompts(4, 7), OUTPUT_LEN)[0]
    res["bytes"] = parts
    res["ar_b1"] = {"context": ctx, "floor_bytes": floor, "bytes_floor_ms": floor / bw * 1e3,
                    "graph_replay_ms": replay_ms(ar, 1, ctx), "engine_tpot_ms": None}
    one = timed_generate(ar, prompts(1, 8), OUTPUT_LEN)[0]
    b1 = res["ar_b1"]
    b1["engine_tpot_ms"] = one["mean_tpot_ms"]
    b1["floor_ratio_replay"] = b1["graph_replay_ms"] / b1["bytes_floor_ms"]
    b1["floor_ratio_engine"] = b1["engine_tpot_ms"] / b1["bytes_floor_ms"]
    res["ar_c4_generate"] = run
    print(f"Moonlight AR b1: floor {b1['bytes_floor_ms']:.3f} ms, replay "
          f"{b1['graph_replay_ms']:.3f} ms ({b1['floor_ratio_replay']:.2f}x), engine TPOT "
          f"{b1['engine_tpot_ms']:.3f} ms ({b1['floor_ratio_engine']:.2f}x)", flush=True)
    res["ar"] = {}
    for c in res["concurrency"]:
        res["ar"][f"C={c}"] = closed_loop(ar, c, 1000 + c)
        print(f"Moonlight AR C={c}: {res['ar'][f'C={c}']['output_tok_s']:.0f} tok/s", flush=True)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    res["_tokens_ar_graphs"] = [o.token_ids for o in ar.generate(prompts(4, 3), greedy,
                                                                 use_tqdm=False)]


def moonlight_dflash(res: dict, target: Path, drafter: Path, bw: float, a: float) -> None:
    sp = LLM(str(target), draft=str(drafter), synthetic_acceptance=a, benchmark_mode=True,
             **ENGINE)
    # NOTE: warmed as moonlight_ar's engine is before its sweep (4 requests, then 1, of the
    # sweep's lengths), so the sweep's first cell is no cold start (docs/benchmarks.md)
    timed_generate(sp, prompts(2, 99), 8)
    timed_generate(sp, prompts(4, 7), OUTPUT_LEN)
    timed_generate(sp, prompts(1, 8), OUTPUT_LEN)
    res["dflash"] = {}
    for c in res["concurrency"]:
        r = closed_loop(sp, c, 1000 + c)
        ar_c = res.get("ar", {}).get(f"C={c}", {}).get("output_tok_s")
        r["ratio_vs_ar"] = r["output_tok_s"] / ar_c if ar_c else None
        res["dflash"][f"C={c}"] = r
        print(f"Moonlight DFlash a={a} C={c}: {r['output_tok_s']:.0f} tok/s, tau {r['tau']}, "
              f"blocks {r['block_len_steps']}, {r['ratio_vs_ar']}", flush=True)
    mc, parts = sp.engine.model_config, res["bytes"]
    drafter_bytes = sum(p.numel() * p.element_size() for n, p in
                        sp.engine.runner.proposer.drafter.named_parameters())
    lm_head = mc.vocab_size * mc.hidden_size * 2  # the drafter's logits through the target's
    ctx = INPUT_LEN + OUTPUT_LEN // 2
    ar_c1 = res.get("ar", {}).get("C=1", {}).get("output_tok_s")
    res["dflash_c1_fixed"] = {}
    for L in (8, 16):
        sp.engine.runner.set_policy("fixed", L)
        r = closed_loop(sp, 1, 1001)
        e = verify_experts(r, r["requests"], parts, mc.moe.num_experts)
        spec_floor = step_floor_bytes(parts, e, ctx, mc, drafter_bytes + lm_head)
        predicted = r["tau"] * res["ar_b1"]["floor_bytes"] / spec_floor
        r.update(experts_per_verify_layer=e, spec_floor_bytes=spec_floor,
                 predicted_ratio=predicted,
                 ratio_vs_ar=r["output_tok_s"] / ar_c1 if ar_c1 else None)
        res["dflash_c1_fixed"][f"L={L}"] = r
        print(f"Moonlight DFlash fixed {L} C=1: {r['output_tok_s']:.0f} tok/s, tau "
              f"{r['tau']:.2f}, {e:.1f} experts/layer, ratio {r['ratio_vs_ar']} vs bytes model "
              f"{predicted:.2f}", flush=True)
    sp.engine.runner.set_policy("adaptive")
    # NOTE: adaptive at C=1 once more, after the fixed blocks: equal to the first C=1 run
    # unless the warm-up above leaves something cold for the sweep's first cell
    r = res["dflash_c1_adaptive_again"] = closed_loop(sp, 1, 1001)
    r["ratio_vs_ar"] = r["output_tok_s"] / ar_c1 if ar_c1 else None
    print(f"Moonlight DFlash a={a} C=1 again (after the fixed blocks): "
          f"{r['output_tok_s']:.0f} tok/s, tau {r['tau']}, blocks {r['block_len_steps']}",
          flush=True)


def moonlight_equality(res: dict, target: Path, drafter: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    toks = {}
    for name, kw in (("ar_eager", {"enforce_eager": True}),
                     ("dflash_graphs", {"draft": str(drafter)}),
                     ("dflash_eager", {"draft": str(drafter), "enforce_eager": True})):
        llm = LLM(str(target), **{**ENGINE, **kw, "seed": 0})
        toks[name] = [o.token_ids for o in llm.generate(prompts(4, 3), greedy, use_tqdm=False)]
        del llm
        free()
    ref = res.pop("_tokens_ar_graphs", None)
    res["graphs_equal_eager"] = {"ar": toks["ar_eager"] == ref,
                                 "dflash": toks["dflash_graphs"] == toks["dflash_eager"],
                                 "dflash_equals_ar": toks["dflash_graphs"] == ref}
    print(f"graphs == eager: {res['graphs_equal_eager']}", flush=True)


def hf_generate(target: Path) -> dict:
    """HF transformers' DeepseekV3ForCausalLM on our dummy weights (names are HF's), C=1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from blockspec.config import ModelConfig
    from blockspec.dflash.checkpoint import unfused_state_dict
    from blockspec.models.loader import build_model, init_dummy_weights

    ours = build_model(ModelConfig.from_pretrained(target), torch.bfloat16, "cuda")
    init_dummy_weights(ours)
    state = unfused_state_dict(ours)
    del ours
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(target)),
                                              dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    del state
    x = torch.tensor(prompts(1), device="cuda")
    hf.generate(x, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = hf.generate(x, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    torch.cuda.synchronize()
    n = y.shape[1] - x.shape[1]
    return {"output_tok_s": n / (time.perf_counter() - t0), "output_tokens": n,
            "missing_keys": len(missing), "unexpected_keys": len(unexpected)}


def kimi_layers(res: dict, root: Path, num_moe: int) -> None:
    target, _ = write_moe_folders(root, "kimi-k2.6-slice", kimi_slice(num_moe))
    llm = LLM(str(target), **{**ENGINE, "kv_cache_memory_gb": 2, "max_num_seqs": 16,
                              "enforce_eager": True})
    res["kimi_slice"] = {"moe_layers": num_moe, "bytes": expert_bytes(llm.engine.model),
                         "rows": []}
    for row in layer_times(llm.engine.model, [1, 8, 32, 64, 128, 256], [1, 8, 16], 640,
                           graph_ms):
        res["kimi_slice"]["rows"].append(row)
        print(f"Kimi slice B={row['batch']} q={row['tokens_per_seq']}: MoE layer "
              f"{row['moe_layer_ms']:.3f} ms, {row['experts_per_moe_layer']:.1f} experts",
              flush=True)


def kimi_int4(res: dict, root: Path, num_moe: int, bw: float) -> None:
    """Issue 23's run: the Kimi-width slice with Kimi K2.6's INT4 experts: AR batch-1 step
    against its bytes floor, and the W4A16 experts' kernel at 1..64 tokens against bf16's."""
    shape = {**kimi_slice(num_moe), "quantization_config": KIMI_INT4}
    target, _ = write_moe_folders(root, "kimi-k2.6-int4-slice", shape)
    llm = LLM(str(target), **{**ENGINE, "kv_cache_memory_gb": 4, "max_num_seqs": 64})
    timed_generate(llm, prompts(2, 99), 8)  # warm-up
    model, mc = llm.engine.model, llm.engine.model_config
    parts = expert_bytes(model)
    ctx = INPUT_LEN + OUTPUT_LEN // 2
    floor_ms = step_floor_bytes(parts, mc.moe.num_experts_per_tok, ctx, mc) / bw * 1e3
    replay = replay_ms(llm, 1, ctx)
    r = res["kimi_int4_slice"] = {"moe_layers": num_moe, "bytes": parts, "context": ctx,
                                  "bytes_floor_ms": floor_ms, "graph_replay_ms": replay,
                                  "floor_ratio_replay": replay / floor_ms}
    print(f"Kimi INT4 slice AR b1: floor {floor_ms:.3f} ms, replay {replay:.3f} ms "
          f"({replay / floor_ms:.2f}x)", flush=True)
    ref = bf16_experts(mc)
    if ref is None:
        r["kernel_note"] = "bf16 experts not timed: they do not fit next to the slice here"
        print(f"  {r['kernel_note']}", flush=True)
    r["kernel"] = expert_kernel_times(model, [1, 8, 16, 32, 64], graph_ms, ref)
    for row in r["kernel"]:
        bf16 = f"; bf16 {row['bf16_ms']:.3f} ms" if "bf16_ms" in row else ""
        print(f"  W4A16 experts, {row['tokens']} tokens ({row['experts']} experts): "
              f"{row['ms']:.3f} ms, {row['GBps']:.0f} GB/s{bf16}", flush=True)


def bf16_experts(mc) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Random bf16 experts of the slice's shape (gate_up, down), or None where they do not fit
    in the memory left (42 GiB for Kimi's 384 experts: an 80 GB card holding the slice)."""
    moe = mc.moe
    shapes = [(moe.num_experts, 2 * moe.moe_intermediate_size, mc.hidden_size),
              (moe.num_experts, mc.hidden_size, moe.moe_intermediate_size)]
    need = sum(2 * math.prod(s) for s in shapes)
    if need > torch.cuda.mem_get_info()[0] * 0.9:
        return None
    return tuple(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for s in shapes)


def headline(res: dict, out: Path) -> None:
    figures = {}
    if "ar_b1" in res:
        figures["moe_ar_b1_floor_ratio"] = round(res["ar_b1"]["floor_ratio_engine"], 3)
    sp, ar = res.get("dflash", {}), res.get("ar", {})
    if "C=1" in sp and "C=1" in ar:
        figures["moe_dflash_speedup_c1"] = round(sp["C=1"]["ratio_vs_ar"], 3)
    ratios = [r["ratio_vs_ar"] for r in sp.values() if r.get("ratio_vs_ar")]
    if len(ratios) == len(res["concurrency"]):
        figures["moe_adaptive_min_ratio_vs_ar"] = round(min(ratios), 3)
    merge_latest(res, figures, out / "latest.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--acceptance", type=float, default=0.86)
    ap.add_argument("--kimi-moe-layers", type=int, default=3)
    ap.add_argument("--kimi-int4-moe-layers", type=int, default=6)
    ap.add_argument("--skip", default="",
                    help="stages to skip: ar,dflash,equality,hf,kimi,kimi_int4")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(",")) - {""}
    res: dict = {"benchmark": "moe_bench (issue 21): Moonlight-16B-A3B shape + 4-layer DFlash "
                              "drafter, Kimi-K2.6-width slice; random bf16 weights, synthetic "
                              "acceptance (labelled)",
                 "command": recorded_command("benchmarks/moe_bench.py"),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds"), "commit": git_commit(),
                 "synthetic_acceptance": args.acceptance, "input_len": INPUT_LEN,
                 "output_len": OUTPUT_LEN,
                 "concurrency": [int(c) for c in args.concurrency.split(",")]}
    root = Path(tempfile.mkdtemp())
    target, drafter = write_moe_folders(root, "moonlight-16b-a3b-shape", MOONLIGHT,
                                        draft_layers=4)
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    stages = {"ar": lambda: moonlight_ar(res, target, bw),
              "dflash": lambda: moonlight_dflash(res, target, drafter, bw, args.acceptance),
              "equality": lambda: moonlight_equality(res, target, drafter),
              "hf": lambda: res.update(hf_generate_c1=hf_generate(target)),
              "kimi": lambda: kimi_layers(res, root, args.kimi_moe_layers),
              "kimi_int4": lambda: kimi_int4(res, root, args.kimi_int4_moe_layers, bw)}
    for name, fn in stages.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the benchmark reports what it could
            res.setdefault("errors", {})[name] = repr(e)
            print(f"stage {name} FAILED: {e!r}", flush=True)
        res.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
        free()
        (out / "moe_bench.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    headline(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
