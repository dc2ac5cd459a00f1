"""A/B of a launch option on the batch-1 decode step, one GPU, one run (issues 21 and 23):
programmatic dependent launch (`--ab pdl`, layers/pdl.py), the dense experts' down projection a
program per pick (`--ab down_split`, moe_down.py), MLA's one-token launches (`--ab
mla_one_token`, layers/mla_one_token.py: the W_UK absorb with the rope / latent norm, the W_UV
absorb with the split-KV merge, against the separate launches) or the shared experts on a side
stream (`--ab shared_beside`, layers/side_stream.py) against folded into the routed launches
(Moonlight's bf16 experts) or before the routing (the Kimi slice's int4).

For each target (random weights, `load_format=dummy`): Moonlight-16B-A3B's shape, the
Kimi-K2.6-width slice with INT4 experts (benchmarks/moe_bench.py's) and optionally the dense
Qwen3-8B shape, one engine is started and its AR decode step (batch 1, context 640) is captured
again into a CUDA graph with the option off and on (read at capture). Each: median graph replay
of 50 (after 5, gpu_timing.replay_ms), its ratio to the step's bytes floor at the measured copy
bandwidth, and whether its logits equal the first capture's bit for bit (PDL changes no
arithmetic, so a difference is a race; the one-token launches keep the separate launches'
arithmetic but for the merge's fused multiply-add; the side stream changes only the order of
unfolded shared experts, while folded ones round differently).

Usage: python benchmarks/step_ab.py --out FILE.json
       [--ab pdl|mla_one_token|shared_beside|down_split[,...]]
       [--qwen3] [--skip moonlight,kimi_int4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import blockspec.models.deepseek_v3 as ds
from blockspec import LLM
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.fullsize import INPUT_LEN
from blockspec.bench.gpu_timing import copy_bandwidth, floor_bytes, free, replay_ms
from blockspec.bench.moe_shapes import (
    KIMI_INT4,
    MOONLIGHT,
    expert_bytes,
    kimi_slice,
    step_floor_bytes,
    write_moe_folders,
)
from blockspec.engine.decode_step import GraphedDecodeStep
from blockspec.layers import mla_one_token, moe_decode
from blockspec.layers.attention import PagedAttention

CTX = INPUT_LEN + 128


def set_pdl(llm: LLM, on: bool) -> None:
    os.environ["BLOCKSPEC_PDL"] = "1" if on else "0"


_ONE_TOKEN = (mla_one_token._one_token_triton, PagedAttention.partials)


def set_mla_one_token(llm: LLM, on: bool) -> None:
    """MLA's one-token launches (the model's default) or, off, the separate launches (the
    paths absorb_rope_norm and the model take where no one-token launch applies)."""
    set_pdl(llm, True)
    mla_one_token._one_token_triton = _ONE_TOKEN[0] if on else (lambda x, backend: False)
    PagedAttention.partials = _ONE_TOKEN[1] if on else (lambda self, q, meta: None)


def set_shared_beside(llm: LLM, on: bool) -> None:
    """Shared experts on a side stream (the default) or, off, folded into the routed decode
    launches where they can be (bf16: Moonlight), else before the routing (int4: Kimi)."""
    set_pdl(llm, True)
    for m in llm.engine.model.modules():
        if isinstance(m, ds.MoE):
            m.shared_beside = on


_DOWN = dict(moe_decode.DEFAULT_TILES[moe_decode.DENSE])


def set_down_split(llm: LLM, on: bool) -> None:
    """The dense decode experts' down projection one program per (token, pick, rows), the last
    to arrive summing in pick order (moe_down.py), or, off, one looping over the picks (the
    default): measured 7% faster alone at one token but slower in the step while the shared
    experts folded into it (docs/benchmarks.md); they run beside now."""
    set_pdl(llm, True)
    tiles = _DOWN["down"]
    moe_decode.DEFAULT_TILES[moe_decode.DENSE]["down"] = tiles._replace(split=on)


# option: (setter, the values compared (the first the baseline), the engine's default)
OPTIONS = {"pdl": (set_pdl, (False, True), True),
           "mla_one_token": (set_mla_one_token, (False, True), True),
           "shared_beside": (set_shared_beside, (False, True), True),
           "down_split": (set_down_split, (False, True), False)}


def variant(llm: LLM, option, on) -> tuple[float, torch.Tensor]:
    """(median replay ms, logits) of the batch-1 AR step captured with the option's value."""
    option(llm, on)
    runner = llm.engine.runner
    bufs = runner.bufs
    # NOTE: the capture's warm-up steps run on these inputs too (their KV goes to the trash
    # block), as the replays do
    bufs.block_tables.fill_(runner.trash_block)
    bufs.ctx_lens[:1].fill_(CTX)
    bufs.last_tokens[:1].fill_(1234)
    graph = GraphedDecodeStep(runner.steps[1], bufs, [1])
    graph.capture()
    ms = replay_ms(llm, 1, CTX, graphs=graph)
    logits = graph.outputs[1].logits[:1].clone()
    del graph
    free()
    return ms, logits


def target_ab(name: str, llm: LLM, floor: float, bw: float, options: list[str]) -> dict:
    """Each option's values in turn on one engine (the option back at the engine's default
    after), every row of `variants` keyed by its option."""
    res: dict = {"bytes_floor_ms": floor / bw * 1e3, "variants": []}
    for ab in options:
        setter, values, default = OPTIONS[ab]
        first = None
        for on in values * 2:  # twice each, alternating: drift shows
            try:
                ms, logits = variant(llm, setter, on)
            except Exception as exc:  # noqa: BLE001 - recorded, the other variant still runs
                res["variants"].append({ab: on, "error": repr(exc)})
                print(f"{name} {ab}={on}: FAILED {exc!r}", flush=True)
                continue
            first = logits if first is None else first
            diff = (logits.float() - first.float()).abs().max().item()
            row = {ab: on, "replay_ms": ms, "floor_ratio": ms / res["bytes_floor_ms"],
                   "logits_equal_first": bool(torch.equal(logits, first)),
                   "logits_max_abs_diff_first": diff}
            res["variants"].append(row)
            print(f"{name} {ab}={on}: replay {ms:.3f} ms ({row['floor_ratio']:.2f}x floor "
                  f"{res['bytes_floor_ms']:.3f} ms), logits equal {row['logits_equal_first']} "
                  f"(max diff {diff:.3g})", flush=True)
        setter(llm, default)
    return res


def moe_target(root: Path, name: str, shape: dict, bw: float, options: list[str]) -> dict:
    target, _ = write_moe_folders(root, name, shape)
    llm = LLM(str(target), device="cuda", dtype="bfloat16", load_format="dummy",
              max_model_len=2048, kv_cache_memory_gb=4, max_num_seqs=1,
              enable_prefix_caching=False)
    mc = llm.engine.model_config
    parts = expert_bytes(llm.engine.model)
    floor = step_floor_bytes(parts, mc.moe.num_experts_per_tok, CTX, mc)
    res = target_ab(name, llm, floor, bw, options)
    del llm
    free()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ab", default="pdl",
                    help=f"options compared, comma-separated: {', '.join(sorted(OPTIONS))}")
    ap.add_argument("--qwen3", action="store_true", help="also the dense Qwen3-8B shape")
    ap.add_argument("--skip", default="", help="moonlight,kimi_int4")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    options = args.ab.split(",")
    if unknown := [ab for ab in options if ab not in OPTIONS]:
        ap.error(f"--ab: unknown {', '.join(unknown)}; choose from {', '.join(sorted(OPTIONS))}")
    out, root = Path(args.out), Path(tempfile.mkdtemp())
    # NOTE: the engines start (and capture their own graphs) without PDL; each variant
    # captures its own graph under its options.
    os.environ["BLOCKSPEC_PDL"] = "0"
    bw = copy_bandwidth()
    res: dict = {"command": recorded_command("benchmarks/step_ab.py"), "commit": git_commit(),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.date.today().isoformat(), "copy_bandwidth_Bps": bw,
                 "context": CTX, "ab": args.ab}

    def save() -> None:
        out.write_text(json.dumps(res, indent=2) + "\n")

    if "moonlight" not in skip:
        res["moonlight"] = moe_target(root, "moonlight", MOONLIGHT, bw, options)
        save()
    if "kimi_int4" not in skip:
        shape = {**kimi_slice(6), "quantization_config": KIMI_INT4}
        res["kimi_int4"] = moe_target(root, "kimi-int4", shape, bw, options)
        save()
    if args.qwen3:
        from blockspec.bench.fullsize import make_llm, write_folders

        target, _ = write_folders(root)
        llm = make_llm(target, None, max_num_seqs=1, kv_cache_memory_gb=4)
        res["qwen3_8b"] = target_ab("qwen3_8b", llm, floor_bytes(llm, CTX), bw, options)
        save()
    os.environ.pop("BLOCKSPEC_PDL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
