"""Tile sweeps of the batch-1 kernels of MoE targets on one GPU (benchmarks/kernel_tune.py):
the decode-step experts (layers/moe_decode.py) against the grouped GEMMs at 1, 2 and 4 tokens,
and the dense GEMV (layers/linear.py) per projection, at Moonlight's and Kimi K2.6's shapes.
Each timing reads several layers' weights (more bytes than L2 holds) in one CUDA graph."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch

from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.quant_dequant import QuantWeight

__all__ = ["EXPERT_SHAPES", "GEMV_SHAPES", "sweep_decode_experts", "sweep_gemv", "sweep_split",
           "sweep_tokens", "sweep_wide"]

# (experts, hidden, intermediate, top_k, int4)
EXPERT_SHAPES = {"moonlight_bf16": (64, 2048, 1408, 6, False),
                 "kimi_int4": (384, 7168, 2048, 8, True)}
# per projection (N, K): Moonlight's attention (no q_lora), shared experts (2 x 1408), dense
# layer, lm_head; Kimi K2.6's attention (q_lora 1536), shared expert, lm_head
GEMV_SHAPES = {"moonlight": [(3072, 2048), (576, 2048), (2048, 2048), (5632, 2048),
                             (2048, 2816), (22528, 2048), (2048, 11264), (163840, 2048)],
               "kimi": [(2112, 7168), (12288, 1536), (7168, 8192), (4096, 7168), (7168, 2048),
                        (163840, 7168)],
               # the dense fast path's (issue 20): qkv, o, gate_up, down, lm_head
               "qwen3_8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                            (151936, 4096)]}
ROUTER_SHAPES = {"moonlight": (64, 2048), "kimi": (384, 7168)}  # fp32 [E, H]
GEMV_GRID = [(bn, bk, w, 3) for bn, bk, w in itertools.product((2, 4, 8, 16, 32),
                                                                (256, 512, 1024, 2048), (4, 8))
             if bn * bk <= 32768]
DECODE_GRID = [(bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8, 16), (128, 256, 512),
                                                               (4, 8))
               if bn * bk <= 8192]
L2_BYTES = 64 << 20


def _experts(shape: tuple, layers: int, dev: torch.device) -> list[tuple]:
    e, h, i, _, quant = shape
    out = []
    for _ in range(layers):
        if quant:
            words = [torch.randint(-(1 << 31), (1 << 31) - 1, (e, n, k // 8), dtype=torch.int32,
                                   device=dev) for n, k in ((2 * i, h), (h, i))]
            scales = [torch.rand(e, n, k // 32, device=dev, dtype=torch.bfloat16) * 0.01
                      for n, k in ((2 * i, h), (h, i))]
            out.append((QuantWeight("int4", words[0], scales[0], (1, 32), h),
                        QuantWeight("int4", words[1], scales[1], (1, 32), i)))
        else:
            out.append((torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02,
                        torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.02))
    return out


def _routing(t: int, e: int, k: int, layers: int, dev: torch.device) -> list[tuple]:
    g = torch.Generator(device=dev).manual_seed(t)
    picks = [torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
             for _ in range(layers)]
    return [(ids, torch.rand(t, k, device=dev, generator=g).to(torch.bfloat16)) for ids in picks]


def _decode_all(calls: list[tuple], tiles: dict | None, dequant: str) -> list:
    import blockspec.layers.moe_decode as md

    return [md.decode_experts(*c, tiles=tiles, dequant=dequant) for c in calls]


def _decode_ms(x: torch.Tensor, routes: list[tuple], weights: list[tuple], tiles: dict | None,
               dequant: str) -> float:
    """ms per layer of the decode experts over every layer's routes and weights."""
    calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in zip(routes, weights)]
    return graph_ms(partial(_decode_all, calls, tiles, dequant)) / len(calls)


def _grouped(quant: bool) -> Callable:
    """The grouped GEMMs: the outputs the decode experts are checked against."""
    import blockspec.layers.fused_moe as fm
    import blockspec.layers.quant_gemm as qg

    # NOTE: explicit tiles keep fused_experts_quant on the grouped GEMMs at any size
    return partial(qg.fused_experts_quant, tiles=qg.DEFAULT_TILES["int4"]) if quant \
        else fm.grouped_experts


def _inputs(name: str, layers: int, dev: torch.device, tokens: tuple[int, ...]
            ) -> tuple[list[tuple], torch.Tensor, dict[int, list[tuple]]]:
    """EXPERT_SHAPES[name]'s random weights for `layers` layers, activations [max(tokens), H]
    and each token count's routes (seeded by the count)."""
    e, h, _, k, _ = EXPERT_SHAPES[name]
    weights = _experts(EXPERT_SHAPES[name], layers, dev)
    x = torch.randn(max(tokens), h, device=dev, dtype=torch.bfloat16)
    return weights, x, {t: _routing(t, e, k, layers, dev) for t in tokens}


def _grouped_ms(run: Callable, x: torch.Tensor, routes: list[tuple],
                weights: list[tuple]) -> float:
    """ms per layer of the grouped GEMMs (`run`) over every layer's routes and weights."""
    calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in zip(routes, weights)]
    return graph_ms(lambda: [run(*c) for c in calls]) / len(calls)


def _rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sweep_decode_experts(name: str, layers: int, dev: torch.device,
                         log: Callable[[str], None] = print) -> dict:
    """Every DECODE_GRID tile of each kernel (the other at its default) at 1 token, then the
    best pair against the grouped GEMMs at 1, 2, 4 tokens; ms per layer."""
    import blockspec.layers.moe_decode as md

    shape = EXPERT_SHAPES[name]
    quant = shape[-1]
    weights, x, routes = _inputs(name, layers, dev, (1, 2, 4))

    def decode(t: int, tiles: dict | None, dequant: str = "magic") -> float:
        return _decode_ms(x[:t], routes[t], weights, tiles, dequant)

    run = _grouped(quant)

    res: dict = {"shape": dict(zip(("experts", "hidden", "inter", "top_k", "int4"), shape)),
                 "layers": layers}
    best = {}
    for kernel in ("gate_up", "down"):
        rows = {}
        for cfg in DECODE_GRID:
            rows[str(list(cfg))] = decode(1, {kernel: md.GemvTiles(*cfg)})
        best[kernel] = min(rows, key=rows.get)
        res[f"{kernel}_ms_by_tiles"] = rows
        default = md.DEFAULT_TILES[md.INT4 if quant else md.DENSE][kernel]
        log(f"{name} {kernel}: best {best[kernel]} {rows[best[kernel]]:.4f} ms/layer, default "
            f"{rows.get(str(list(default)), float('nan')):.4f}")
    named = {str(list(cfg)): cfg for cfg in DECODE_GRID}
    tiles = {kn: md.GemvTiles(*named[cfg]) for kn, cfg in best.items()}
    res["best_tiles"] = {kn: list(v) for kn, v in tiles.items()}
    if quant:
        res["convert_ms"] = decode(1, tiles, "convert")
        log(f"{name}: int4 by conversions {res['convert_ms']:.4f} ms/layer")
    res["by_tokens"] = []
    for t in (1, 2, 4):
        row = {"tokens": t, "decode_ms": decode(t, tiles),
               "grouped_ms": _grouped_ms(run, x[:t], routes[t], weights)}
        (ids, w), (gu, dn) = routes[t][0], weights[0]
        row["max_rel_diff_vs_grouped"] = _rel_diff(
            md.decode_experts(x[:t], w, ids, gu, dn, tiles=tiles), run(x[:t], w, ids, gu, dn))
        res["by_tokens"].append(row)
        log(f"{name} T={t}: decode {row['decode_ms']:.4f} ms/layer, grouped "
            f"{row['grouped_ms']:.4f}, max rel diff {row['max_rel_diff_vs_grouped']:.1e}")
    return res


# Wider tiles (more loads in flight a thread) for each kernel; int4's "magic" only where its
# [rows, words, 8] fp32 tile fits in registers.
WIDE_GRID = {"int4": [(4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (8, 2048, 4),
                      (4, 2048, 4), (8, 1024, 8), (16, 1024, 8), (8, 512, 2), (8, 1024, 2),
                      (16, 1024, 4), (16, 1024, 2), (8, 2048, 2), (16, 512, 2)],
             "bf16": [(4, 256, 4), (4, 512, 8), (4, 512, 4), (4, 1024, 4), (8, 512, 4),
                      (2, 1024, 4), (4, 1024, 8), (8, 1024, 8), (2, 2048, 4)]}


def sweep_wide(name: str, layers: int, dev: torch.device, dequants: tuple[str, ...],
               log: Callable[[str], None] = print) -> dict:
    """WIDE_GRID per kernel (the other at its default) and unpacking at 1 token; then each
    unpacking's best pair at 1, 2, 4 tokens against the defaults, ms per layer, and the max
    |diff| / max |grouped GEMMs| of its output."""
    import blockspec.layers.moe_decode as md

    quant = EXPERT_SHAPES[name][-1]
    weights, x, routes = _inputs(name, layers, dev, (1, 2, 4))
    run = _grouped(quant)

    def time(t: int, tiles: dict | None, dequant: str) -> float:
        return _decode_ms(x[:t], routes[t], weights, tiles, dequant)

    res: dict = {"layers": layers, "by_tiles": [], "best": []}
    for dequant in dequants:
        best = {}
        for kernel in ("gate_up", "down"):
            rows = {}
            for bn, bk, w in WIDE_GRID["int4" if quant else "bf16"]:
                if dequant == "magic" and quant and bn * bk > 8192:
                    continue
                if dequant == "subnormal" and kernel == "gate_up" and bn % 8:
                    continue  # the down kernel's inputs are whole words of gate_up's rows
                tiles = md.GemvTiles(bn, bk, w)
                rows[tiles] = time(1, {kernel: tiles}, dequant)
                res["by_tiles"].append({"dequant": dequant, "kernel": kernel,
                                        "tiles": list(tiles), "ms": rows[tiles]})
            best[kernel] = min(rows, key=rows.get)
            log(f"{name} {dequant} {kernel}: best {list(best[kernel])} "
                f"{rows[best[kernel]]:.4f} ms/layer")
        for t in (1, 2, 4):
            (ids, wt), (g, d) = routes[t][0], weights[0]
            got = md.decode_experts(x[:t], wt, ids, g, d, tiles=best, dequant=dequant)
            row = {"dequant": dequant, "tokens": t, "tiles": {kn: list(v) for kn, v in
                                                              best.items()},
                   "ms": time(t, best, dequant), "default_ms": time(t, None, md.DEFAULT_DEQUANT),
                   "max_rel_diff_vs_grouped": _rel_diff(got, run(x[:t], wt, ids, g, d))}
            res["best"].append(row)
            log(f"{name} {dequant} T={t}: best {row['ms']:.4f} ms/layer, default "
                f"{row['default_ms']:.4f}, rel diff {row['max_rel_diff_vs_grouped']:.1e}")
    return res


# The down kernel one program per pick (GemvTiles.split): rows x columns x warps per program.
SPLIT_GRID = {"int4": [(8, 2048, 4), (4, 2048, 4), (2, 2048, 4), (8, 1024, 4), (8, 1024, 2),
                       (4, 1024, 2), (16, 2048, 8), (8, 2048, 8)],
              "bf16": [(4, 256, 4), (4, 512, 4), (8, 512, 4), (2, 1024, 4), (4, 1024, 4),
                       (8, 1024, 8), (2, 2048, 4), (4, 2048, 8)]}


def sweep_split(name: str, layers: int, dev: torch.device, dequant: str = "subnormal",
                log: Callable[[str], None] = print) -> dict:
    """The down kernel one program per pick over SPLIT_GRID at 1 token (gate_up at its
    default), ms per layer (both kernels); the best at 1, 2, 4 tokens against the looping
    kernel in the default tiles, and whether it equals the looping kernel in its own tiles bit
    for bit."""
    import blockspec.layers.moe_decode as md

    quant = EXPERT_SHAPES[name][-1]
    weights, x, routes = _inputs(name, layers, dev, (1, 2, 4))

    def time(t: int, tiles: dict | None) -> float:
        return _decode_ms(x[:t], routes[t], weights, tiles, dequant)

    loop = {"down": md.DEFAULT_TILES[md.INT4 if quant else md.DENSE]["down"]._replace(split=False)}
    res: dict = {"layers": layers, "dequant": dequant, "looping_down": list(loop["down"]),
                 "by_tiles": []}
    rows = {}
    for cfg in SPLIT_GRID["int4" if quant else "bf16"]:
        tiles = md.GemvTiles(*cfg, split=True)
        rows[tiles] = time(1, {"down": tiles})
        res["by_tiles"].append({"tiles": list(tiles), "ms": rows[tiles]})
    best = min(rows, key=rows.get)
    log(f"{name} split down: best {list(best)} {rows[best]:.4f} ms/layer")
    res["best"] = []
    for t in (1, 2, 4):
        (ids, wt), (g, d) = routes[t][0], weights[0]
        looped = md.decode_experts(x[:t], wt, ids, g, d, dequant=dequant,
                                   tiles={"down": best._replace(split=False)})
        split = md.decode_experts(x[:t], wt, ids, g, d, tiles={"down": best}, dequant=dequant)
        row = {"tokens": t, "split_ms": time(t, {"down": best}), "looping_ms": time(t, loop),
               "equal_to_loop": bool(torch.equal(looped, split))}
        res["best"].append(row)
        log(f"{name} T={t}: split {row['split_ms']:.4f} ms/layer, looping "
            f"{row['looping_ms']:.4f}, bit-equal {row['equal_to_loop']}")
    return res

def sweep_tokens(name: str, layers: int, dev: torch.device, dequants: tuple[str, ...],
                 tokens: tuple[int, ...] = (1, 2, 4, 8, 16),
                 log: Callable[[str], None] = print) -> list[dict]:
    """The decode experts in their default tiles per unpacking against the grouped GEMMs at
    each token count (where the decode path should stop: moe_decode.MAX_DECODE_SLOTS), ms per
    layer, and the max |diff| / max |grouped| of each unpacking's output."""
    import blockspec.layers.moe_decode as md

    weights, x, routes = _inputs(name, layers, dev, tokens)
    run, rows = _grouped(EXPERT_SHAPES[name][-1]), []
    for t in tokens:
        row = {"tokens": t, "grouped_ms": _grouped_ms(run, x[:t], routes[t], weights)}
        (ids, wt), (g, d) = routes[t][0], weights[0]
        ref = run(x[:t], wt, ids, g, d)
        for dq in dequants:
            row[f"{dq}_ms"] = _decode_ms(x[:t], routes[t], weights, None, dq)
            row[f"{dq}_rel_diff"] = _rel_diff(md.decode_experts(x[:t], wt, ids, g, d, dequant=dq),
                                              ref)
        rows.append(row)
        log(f"{name} T={t}: " + ", ".join(f"{key} {v:.4g}" for key, v in row.items()
                                          if key != "tokens"))
    return rows

def _gemv_row(n: int, k: int, dev: torch.device) -> dict:
    from blockspec.layers.linear import gemv, gemv_config

    copies = max(1, -(-L2_BYTES * 2 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    row = {"copies": copies,
           "cublas": graph_ms(lambda: [torch.mm(x, w.t(), out=y) for w in ws]) / copies}
    default = gemv_config(n, k)
    for cfg in GEMV_GRID + ([default] if default else []):
        if k % cfg[1] == 0 and str(list(cfg)) not in row:
            row[str(list(cfg))] = graph_ms(lambda c=cfg: [gemv(x, w, c) for w in ws]) / copies
    configs = {c: v for c, v in row.items() if c.startswith("[")}
    row["best"] = min(configs, key=configs.get)
    row["default"] = str(list(default)) if default else None
    row["best_GBps"] = n * k * 2 / (configs[row["best"]] * 1e-3) / 1e9
    return row


def _router_row(n: int, k: int, dev: torch.device) -> dict:
    """The fp32 router: cuBLAS on x.float() against linear.router_logits (ms per layer)."""
    import torch.nn.functional as F

    from blockspec.layers.linear import router_logits

    ws = [torch.randn(n, k, device=dev) * 0.02 for _ in range(8)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    return {"cublas_on_cast": graph_ms(lambda: [F.linear(x.float(), w) for w in ws]) / 8,
            "router_gemv": graph_ms(lambda: [router_logits(x, w, "triton") for w in ws]) / 8}


def sweep_gemv(name: str, dev: torch.device, log: Callable[[str], None] = print) -> dict:
    """cuBLAS, the default config and every GEMV_GRID config per (N, K); ms per weight. And
    the router's fp32 GEMV."""
    res = {}
    if name in ROUTER_SHAPES:
        res["router"] = _router_row(*ROUTER_SHAPES[name], dev)
        log(f"router {name}: {res['router']}")
    for n, k in GEMV_SHAPES[name]:
        row = res[f"{n}x{k}"] = _gemv_row(n, k, dev)
        log(f"gemv {name} ({n}, {k}): cuBLAS {row['cublas'] * 1e3:.1f} us, default "
            f"{row.get(row['default'], float('nan')) * 1e3:.1f} us, best {row['best']} "
            f"{row[row['best']] * 1e3:.1f} us ({row['best_GBps']:.0f} GB/s)")
    return res
