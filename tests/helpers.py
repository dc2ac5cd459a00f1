"""Shared test helpers (imported by the test modules; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.layers.attention import AttentionMetadata, PagedAttention

PROMPTS = [
    "def foo(x):",
    "import json\nclass Encoder:",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "    return functools.reduce(lambda a, b: a + b, items)\n",
]


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of the given lengths (no id 0, the EOS)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def assert_no_leaks(llm) -> None:
    """After a run every KV block is back in the free pool and nothing is left in flight."""
    engine = llm.engine
    bm = engine.block_manager
    assert not engine.has_unfinished()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.requests
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)


@dataclass
class PagedCache:
    """A KV cache bound to a model's PagedAttention layers, with hand-built metadata, so model
    tests exercise the paged path without the scheduler."""

    model: torch.nn.Module
    num_blocks: int = 64
    block_size: int = 16

    def __post_init__(self) -> None:
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        # Large garbage everywhere: attending to a slot that was never written shows in the logits.
        gen = torch.Generator().manual_seed(1234)
        self.cache = 50 * torch.randn(2, len(layers), self.num_blocks, self.block_size, kv_heads,
                                      head_dim, generator=gen)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.cache[0, i], self.cache[1, i]

    @torch.no_grad()
    def forward(self, batch: list[tuple[list[int], int, list[int]]],
                hidden_layer_ids: tuple[int, ...] = ()
                ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """batch: per sequence (block_table, num_cached_tokens, new_token_ids). Returns per sequence
        the logits of its new tokens [q_len, V] and its hidden-state taps."""
        ids, pos, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for table, start, new in batch:
            for j, tok in enumerate(new):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            q_lens.append(len(new))
            seq_lens.append(start + len(new))
            tables.append(list(table))
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, slots, "cpu")
        hidden, taps = self.model(torch.tensor(ids), torch.tensor(pos), meta, hidden_layer_ids)
        logits = self.model.compute_logits(hidden)
        splits = list(torch.split(logits, q_lens))
        tap_splits = [list(torch.split(t, q_lens)) for t in taps]
        per_seq_taps = [[t[b] for t in tap_splits] for b in range(len(batch))]
        return splits, per_seq_taps


def run_file_with_triton_interpreter(path: str) -> None:
    """Re-runs a test file in a fresh interpreter with TRITON_INTERPRET=1 (Triton reads it once,
    at import), for when this process imported Triton before the variable was set."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "fresh process instead" not in proc.stdout  # the Triton cases really ran there


def force_block_lens(llm, cycle: list[int]) -> None:
    """Replace the speculation policy's choice with a fixed cycle of block lengths."""
    it = itertools.cycle(cycle)
    llm.engine.runner.controller.choose = lambda n, ctx=None: next(it)


def record_drafter(llm) -> list[torch.Tensor]:
    """Every drafter forward's output (decode and mixed steps alike), in order."""
    out: list[torch.Tensor] = []
    llm.engine.runner.proposer.drafter.register_forward_hook(
        lambda m, i, o: out.append(o.detach().clone()))
    return out


def count_calls(monkeypatch, cls, name: str) -> list:
    """Wraps `cls.name` for the test; the returned list gets each call's positional arguments
    (after self)."""
    calls = []
    method = getattr(cls, name)

    def counted(self, *args):
        calls.append(args)
        return method(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return calls


def abort_in_flight(llm, prompts, params, steps: int) -> list[list[int]]:
    """Adds `prompts`, steps `steps` times, aborts the second request while a step launched
    ahead is in flight (async scheduling), and runs the rest to the end: the other requests'
    token ids; asserts the aborted one returned no finished output and no KV block leaked."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(steps):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng._pending is not None
    assert eng.abort(ids[1]).finish_reason == "abort"
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert ids[1] not in done and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return [done[i].token_ids for i in ids if i != ids[1]]


def cpu_llm(model, draft=None, **kw):
    """A CPU engine with a roomy KV cache; with a drafter, no cost-profile file (tests)."""
    from blockspec import LLM

    base = dict(device="cpu", num_kv_blocks=512)
    if draft is not None:
        base.update(draft=str(draft), cost_profile="none")
    return LLM(str(model), **{**base, **kw})


def greedy_token_ids(model, prompts, params) -> list[list[int]]:
    """Plain (no drafter) decoding's outputs: the reference speculative runs must equal."""
    return [o.token_ids for o in cpu_llm(model).generate(prompts, params)]


def count_block_len_steps(llm) -> tuple[dict, dict]:
    """Wrap the runner: engine steps and per-request steps by block length, as run."""
    engine_steps: dict[int, int] = {}
    per_req: dict[str, dict[int, int]] = {}
    execute = llm.engine.runner.execute

    def counting(seqs, num_new, *rest):
        res = execute(seqs, num_new, *rest)
        if res.block_len:
            engine_steps[res.block_len] = engine_steps.get(res.block_len, 0) + 1
        for seq, blen in zip(res.sampled_seqs, res.block_lens):
            if blen:
                d = per_req.setdefault(seq.request_id, {})
                d[blen] = d.get(blen, 0) + 1
        return res

    llm.engine.runner.execute = counting
    return engine_steps, per_req


class NanEmptyTorch:
    """`torch` for a kernel module, except that `empty` fills floats with NaN: a partial result
    a merge reads but no split wrote shows up (monkeypatch it over the module's `torch`)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kw):
        t = torch.empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t


def load_script(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
