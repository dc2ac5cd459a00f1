"""Tensor and expert parallelism on CPU: 2 ranks (the caller and one spawned worker) over gloo
give the same greedy tokens as one process, in fp32."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.tiny import build_tiny_model

PROMPTS = [list(range(1, 30)), [7, 8, 9], [5] * 11]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KW = dict(device="cpu", num_kv_blocks=32, max_num_seqs=2)  # 2 seqs: a later one joins a batch


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def parallel_tokens(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), **{**KW, **kw})
    try:
        return tokens(llm)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def ds_ref(deepseek_pair) -> list[list[int]]:
    return tokens(LLM(str(deepseek_pair[0]), **KW))


def test_tp1_is_the_single_process_engine(qwen3_path):
    llm = LLM(str(qwen3_path), **KW)
    assert type(llm.engine) is LLMEngine and not dist.is_initialized()


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2, expert_parallel_size=4),
                                dict(tensor_parallel_size=0),
                                dict(tensor_parallel_size=4, nnodes=3)])
def test_bad_layouts_are_refused(qwen3_path, kw):
    with pytest.raises(ConfigError):
        EngineConfig(model=str(qwen3_path), device="cpu", **kw)


@pytest.mark.parametrize("kv_heads,tied", [(2, False), (1, True)])
def test_tp2_qwen3_greedy_equals_one_process(tmp_path, kv_heads, tied):
    """KV heads split (2 over 2 ranks) and replicated (1 on both), untied and tied LM head;
    a seeded sampled request beside the greedy ones (every rank samples the same tokens)."""
    path = build_tiny_model(tmp_path / "m", num_kv_heads=kv_heads, tie_word_embeddings=tied)
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12,
                                     ignore_eos=True), GREEDY]
    ref = tokens(LLM(str(path), **KW), params=params)
    llm = LLM(str(path), **KW, tensor_parallel_size=2)
    try:
        assert tokens(llm, params=params) == ref
        attn = llm.engine.model.model.layers[0].self_attn.block
        # NOTE: this rank loaded its slice only: 2 of 4 query heads, 1 KV head (K and V)
        assert attn.qkv_proj.weight.shape[0] == (2 + 2 * 1) * 16
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_deepseek_v3_greedy_equals_one_process(deepseek_pair, ds_ref, ep):
    """MLA query heads split; every expert split over 2 ranks (EP 1) or whole on one (EP 2)."""
    assert parallel_tokens(deepseek_pair[0], tensor_parallel_size=2, expert_parallel_size=ep) \
        == ds_ref


@pytest.mark.parametrize("ep", [2])
def test_tp2_int4_experts_greedy_equals_one_process(deepseek_pair, tmp_path, ep):
    """Kimi K2.x's checkpoint format (compressed-tensors int4 routed experts, the rest dense)
    loaded and run over 2 ranks, whole experts on each (EP 2); this rank holds only its slice.
    NOTE: EP 1 (each expert's packed columns and scale groups split) passes too; the slices'
    arithmetic for every split is the next test's, in one process (suite time)."""
    from quant_models import int4_checkpoint

    path = int4_checkpoint(deepseek_pair[0], tmp_path / "int4", group=16)
    ref = tokens(LLM(str(path), **KW))
    llm = LLM(str(path), **KW, tensor_parallel_size=2, expert_parallel_size=ep)
    try:
        assert tokens(llm) == ref
        local = llm.engine.model.model.layers[1].mlp.block.experts.local
        # NOTE: 8 experts of intermediate 32 (4 int4 words per row of down's columns)
        assert tuple(local.down_proj_packed.shape) == ((8, 64, 2) if ep == 1 else (4, 64, 4))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_tp2_dflash_greedy_equals_autoregressive(deepseek_pair, ds_ref, policy):
    """Fixed blocks of 8; the adaptive policy prices steps by rank 0's cost profile and step
    times on every rank (else the ranks would plan different steps and hang)."""
    target, drafter = deepseek_pair
    llm = LLM(str(target), **KW, tensor_parallel_size=2, draft=str(drafter),
              speculation_policy=policy, cost_profile="none")
    try:
        assert tokens(llm) == ds_ref
        steps = llm.engine.spec_stats.block_len_steps
        assert steps[8] > 0 if policy == "fixed" else sum(steps.values()) > 0
    finally:
        llm.engine.shutdown()


def test_a_killed_worker_ends_the_engine_with_an_error(qwen3_path):
    from blockspec.parallel.driver import WorkerDiedError

    llm = LLM(str(qwen3_path), **KW, tensor_parallel_size=2)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    os.kill(engine.workers[1].pid, signal.SIGKILL)
    engine.workers[1].join()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()  # NOTE: shut down: a new engine may start


def test_the_server_answers_with_tp2(qwen3_path):
    import httpx

    from blockspec.parallel.driver import make_engine
    from blockspec.server.api import build_app
    from blockspec.server.runner import BackgroundServer

    prompt = "def fibonacci(n):"
    want = LLM(str(qwen3_path), **KW).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].text
    engine = make_engine(EngineConfig(model=str(qwen3_path), **KW, tensor_parallel_size=2))
    try:
        with BackgroundServer(build_app(engine, "tiny", log_stats_interval=None)) as srv:
            r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json=dict(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        engine.shutdown()


@pytest.fixture
def cli_engine_stopped() -> Iterator[None]:
    """A CLI command leaves its engine to the process's exit: stop it after the test."""
    from blockspec.parallel.driver import ParallelEngine

    yield
    if ParallelEngine._active is not None:
        ParallelEngine._active.shutdown()


def test_generate_cli_takes_tp(qwen3_path, capsys, cli_engine_stopped):
    from blockspec.cli import main

    argv = ["generate", "--model", str(qwen3_path), "--device", "cpu", "--num-kv-blocks", "32",
            "--prompt", "def fibonacci(n):", "--max-tokens", "8"]
    assert main(argv) == 0
    want = capsys.readouterr().out
    assert want.strip()
    assert main([*argv, "-tp", "2"]) == 0
    assert capsys.readouterr().out == want


def test_bench_offline_records_the_layout(qwen3_path, tmp_path, capsys, cli_engine_stopped):
    import json

    from blockspec.cli import main

    out = tmp_path / "tp2.json"
    rc = main(["bench", "offline", "--model", str(qwen3_path), "--device", "cpu", "-tp", "2",
               "--num-kv-blocks", "64", "--concurrency", "1", "--num-prompts", "2",
               "--input-len", "8", "--output-len", "4", "--warmup-tokens", "0",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["label"].startswith("TP2 ")
    assert res["config"]["engine"]["parallel"] == {
        "tensor_parallel_size": 2, "expert_parallel_size": 1, "layout": "TP2"}


@pytest.mark.parametrize("tp,ep,want", [(1, 1, ""), (8, 1, "TP8"), (8, 8, "EP8"),
                                        (8, 4, "EP4x2")])
def test_layout_labels(tp, ep, want):
    from blockspec.parallel.launch import layout_label

    assert layout_label(tp, ep) == want


def _vocab_parallel_rank(rank: int, port: int, x, weight) -> None:
    import torch

    from blockspec.layers.linear import Linear
    from blockspec.parallel.layers import ParallelLMHead, VocabParallelEmbedding
    from blockspec.parallel.state import init_parallel, shutdown_parallel

    init_parallel(rank, 2, 1, f"tcp://127.0.0.1:{port}", "cpu")
    try:
        per, vocab = 4, weight.shape[0]  # 7 rows over 2 ranks: rank 1 pads one row
        shard = torch.zeros(per, weight.shape[1])
        shard[:min(per, vocab - rank * per)] = weight[rank * per:(rank + 1) * per]
        head = Linear(weight.shape[1], per, bias=False)
        head.weight.data.copy_(shard)
        lm = ParallelLMHead(head, vocab, rank * per)
        full = x @ weight.T
        torch.testing.assert_close(lm(x), full)
        assert torch.equal(lm.greedy(x), full.argmax(-1))
        ids = torch.arange(vocab)
        assert torch.equal(VocabParallelEmbedding(shard, rank * per)(ids), weight)
    finally:
        shutdown_parallel()


def test_vocab_parallel_head_and_embedding_match_the_whole_ones():
    """Logits, the greedy pick without gathering them (all logits negative: a padding row's
    zero logit must never win) and the embedding, against plain torch on the whole matrix."""
    import torch
    import torch.multiprocessing as mp

    from blockspec.parallel.launch import free_port

    g = torch.Generator().manual_seed(0)
    weight = torch.rand(7, 5, generator=g) + 0.5
    x = -torch.rand(6, 5, generator=g) - 0.1  # every logit < 0
    mp.spawn(_vocab_parallel_rank, args=(free_port(), x, weight), nprocs=2)


def test_a_checkpoint_missing_a_weight_is_refused_by_name(qwen3_path, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_path, broken)
    (file,) = broken.glob("*.safetensors")
    weights = load_file(file)
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, file)
    with pytest.raises(ConfigError, match="missing weights.*layers.1.mlp.down_proj"):
        LLM(str(broken), **KW, tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_two_nodes_run_as_one_engine(qwen3_path):
    """--nnodes 2 on one host: node 1 (the CLI, in a subprocess) only hosts rank 1's worker
    and exits 0 once node 0's engine shuts down."""
    import subprocess
    import sys

    from blockspec.parallel.launch import free_port

    port = free_port()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "generate", "--model", str(qwen3_path),
         "--device", "cpu", "--num-kv-blocks", "32", "--max-num-seqs", "2", "--prompt", "x",
         "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        llm = LLM(str(qwen3_path), **KW, tensor_parallel_size=2, nnodes=2, master_port=port)
        try:
            one = [PROMPTS[1]]
            assert tokens(llm, one) == tokens(LLM(str(qwen3_path), **KW), one)
        finally:
            llm.engine.shutdown()
        assert node1.wait(timeout=60) == 0
    finally:
        node1.kill()


def test_int4_expert_slices_sum_to_the_whole_experts(deepseek_pair, tmp_path):
    """Without processes: the partial outputs of each rank's slice (experts by group, each
    expert's intermediate size by part) add up to the whole experts' output, which is what the
    MoE block's all-reduce computes; a quantized Linear is refused by name."""
    import torch
    from quant_models import int4_checkpoint

    from blockspec.models.loader import load_model
    from blockspec.parallel.layers import GroupQuantExperts
    from blockspec.parallel.shard import shard_layer
    from blockspec.parallel.state import ParallelState

    path = int4_checkpoint(deepseek_pair[0], tmp_path / "int4", group=16)
    cfg = ModelConfig.from_pretrained(path)
    whole = load_model(path, cfg, torch.float32, "cpu").model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    ids = torch.randint(0, 8, (5, 2), generator=g)
    weights = torch.rand(5, 2, generator=g)
    stats = torch.zeros(2, dtype=torch.int64)
    want = whole(x, weights, ids, "torch", stats)
    for groups, parts in ((1, 2), (2, 1), (2, 2)):
        got = sum(GroupQuantExperts(whole.sliced(g_ * 8 // groups, 8 // groups, p, parts),
                                    g_ * 8 // groups, 8 // groups, 8)(x, weights, ids, "torch",
                                                                      stats)
                  for g_ in range(groups) for p in range(parts))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="whole 16-column scale groups"):
        whole.sliced(0, 8, 0, 4)  # 32 / 4 = 8 columns: half a scale group
    int4_all = int4_checkpoint(deepseek_pair[0], tmp_path / "all", group=8, ignore=["lm_head"])
    layer = load_model(int4_all, ModelConfig.from_pretrained(int4_all), torch.float32,
                       "cpu").model.layers[1]
    with pytest.raises(ConfigError, match="not a quantized Int4Linear"):
        shard_layer(layer, ParallelState(0, 2, 1, None))
