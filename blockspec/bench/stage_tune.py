"""Pipelined loads for the int4 decode experts (GemvTiles.stages, layers/gemv_rows.py
`_sub_chunk_staged`) on one GPU: each kernel's tiles x stages at one token (the other kernel
at its default), then the best pair against the defaults at 1..16 tokens, ms per layer, and
whether the staged kernels equal the same tiles unstaged bit for bit (benchmarks/decode_tune.py
--only stages)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.bench.kernel_tune import _decode_ms, _inputs

__all__ = ["STAGE_GRID", "sweep_stages"]

# (rows, columns an iteration, warps, stages) per kernel; down takes each pick in one chunk
# when staged (block_k >= Kimi's 2048 columns)
STAGE_GRID = {
    "gate_up": [(bn, bk, w, s) for s in (1, 2, 3) for bn, bk, w in
                ((8, 1024, 2), (8, 512, 2), (8, 1024, 4), (8, 512, 4), (16, 512, 4),
                 (8, 2048, 4))],
    "down": [(8, 1024, 2, 1)] + [(bn, 2048, w, s) for s in (1, 2, 3, 4) for bn, w in
                                 ((8, 2), (4, 2), (8, 4), (4, 1), (2, 1), (16, 4))],
}


def sweep_stages(dev: torch.device, layers: int = 2, tokens: tuple[int, ...] = (1, 2, 4, 8, 16),
                 log: Callable[[str], None] = print) -> dict:
    """STAGE_GRID at one token for Kimi K2.6's int4 experts (subnormal unpacking); the best
    pair at each token count against the default tiles, and its bit-equality with the same
    tiles at stages 1."""
    import blockspec.layers.moe_decode as md

    weights, x, routes = _inputs("kimi_int4", layers, dev, tokens)

    def time(t: int, tiles: dict | None) -> float:
        return _decode_ms(x[:t], routes[t], weights, tiles, "subnormal")

    res: dict = {"layers": layers, "by_tiles": [], "best": []}
    best = {}
    for kernel, grid in STAGE_GRID.items():
        rows = {}
        for cfg in grid:
            tiles = md.GemvTiles(*cfg[:3], stages=cfg[3])
            rows[tiles] = time(1, {kernel: tiles})
            res["by_tiles"].append({"kernel": kernel, "tiles": list(cfg), "ms": rows[tiles]})
            log(f"kimi_int4 {kernel} {list(cfg)}: {rows[tiles]:.4f} ms/layer")
        best[kernel] = min(rows, key=rows.get)
    res["best_tiles"] = {kn: list(v) for kn, v in best.items()}
    plain = {kn: v._replace(stages=1) for kn, v in best.items()}
    for t in tokens:
        (ids, wt), (g, d) = routes[t][0], weights[0]
        staged = md.decode_experts(x[:t], wt, ids, g, d, tiles=best)
        row = {"tokens": t, "best_ms": time(t, best), "default_ms": time(t, None),
               "equal_to_unstaged": bool(torch.equal(
                   staged, md.decode_experts(x[:t], wt, ids, g, d, tiles=plain)))}
        res["best"].append(row)
        log(f"kimi_int4 T={t}: best {row['best_ms']:.4f} ms/layer, default "
            f"{row['default_ms']:.4f}, equal to unstaged {row['equal_to_unstaged']}")
    return res
