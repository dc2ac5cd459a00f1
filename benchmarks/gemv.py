"""A plain Triton GEMV (y = W x, one row of x), benchmark-only: does a hand-written kernel read
the weights faster than cuBLAS at batch 1? Used by fast_path_ceiling.py; not an engine kernel
(no fusion, no split-K), so it only measures what a better GEMV could win.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages): a small grid, tried in full per projection.
CONFIGS = [(4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 8, 3), (16, 512, 4, 4), (16, 256, 4, 4),
           (16, 1024, 8, 2), (32, 256, 8, 3), (32, 512, 8, 3)]


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # NOTE: K % BLOCK_K == 0 (checked by the caller): no column mask in the loop.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    base = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, config: tuple = CONFIGS[1]) -> None:
    """y [N] = w [N, K] @ x [K] (fp32 accumulation)."""
    bn, bk, warps, stages = config
    n, k = w.shape
    if k % bk or not w.is_contiguous() or x.numel() != k or y.numel() != n:
        raise ValueError(f"gemv: bad shapes/config {tuple(w.shape)}, {bk}")
    _gemv_kernel[(triton.cdiv(n, bn),)](w, x, y, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)


def _graph_ms(fn, iters: int = 20) -> float:
    """Median replay time of `fn` captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def projections(model) -> dict[str, list[torch.Tensor]]:
    layers = model.model.layers
    return {"qkv_proj": [la.self_attn.qkv_proj.weight for la in layers],
            "o_proj": [la.self_attn.o_proj.weight for la in layers],
            "gate_up_proj": [la.mlp.gate_up_proj.weight for la in layers],
            "down_proj": [la.mlp.down_proj.weight for la in layers],
            "lm_head": [model.lm_head.weight]}


def time_projection(ws: list[torch.Tensor], copy_bw: float) -> dict:
    """Every weight of `ws` once, M = 1 (so L2 holds none of them): cuBLAS (`x @ W.T`) vs the
    best Triton config, each as one graph; GB/s and the share of copy bandwidth."""
    n, k = ws[0].shape
    x = torch.randn(1, k, device=ws[0].device, dtype=ws[0].dtype)
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    ref = x @ ws[0].t()

    def cublas() -> None:
        for w in ws:
            torch.mm(x, w.t(), out=y)

    def triton_all(cfg: tuple) -> None:
        for w in ws:
            gemv(w, x[0], y[0], cfg)

    nbytes = sum(w.numel() * w.element_size() for w in ws)
    row = {"bytes": nbytes, "cublas_ms": _graph_ms(cublas)}
    best = None
    for cfg in CONFIGS:
        if k % cfg[1]:
            continue
        gemv(ws[0], x[0], y[0], cfg)
        err = (y.float() - ref.float()).abs().max().item()
        t = _graph_ms(lambda cfg=cfg: triton_all(cfg))
        if best is None or t < best[0]:
            best = (t, cfg, err)
    row.update(triton_ms=best[0], triton_config=list(best[1]), triton_max_abs_err=best[2])
    for key in ("cublas", "triton"):
        gbps = nbytes / (row[f"{key}_ms"] / 1e3) / 1e9
        row[f"{key}_GBps"] = gbps
        row[f"{key}_of_copy_bw"] = gbps * 1e9 / copy_bw
    return row


def gemv_best(model, copy_bw: float) -> dict:
    """`time_projection` for each projection of the target (all layers) and its lm_head."""
    res = {name: time_projection(ws, copy_bw) for name, ws in projections(model).items()}
    total = {k: sum(r[k] for r in res.values()) for k in ("cublas_ms", "triton_ms")}
    total["best_of_both_ms"] = sum(min(r["cublas_ms"], r["triton_ms"]) for r in res.values())
    res["total"] = total
    return res
