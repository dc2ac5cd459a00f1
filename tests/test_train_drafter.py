"""The DFlash drafter trainer: the block-sparse mask, training forward == paged inference, the loss
falls, the checkpoint serves losslessly, resume is exact, eval-acceptance reports tau."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoTokenizer

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError, ModelConfig
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.dflash.proposer import load_drafter
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.tiny import corpus_text
from blockspec.train.cli import add_train_parser, cmd_train
from blockspec.train.drafter_forward import (
    acceptance_length,
    block_attention_mask,
    sample_anchors,
    train_forward,
)
from blockspec.train.drafter_train import TrainArgs, Trainer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_block_mask_matches_recipe():
    # Anchors 2 and 5, B = 4, 9 context positions: block 0 = positions 2..5, block 1 = 5..8.
    mask = block_attention_mask(torch.tensor([2, 5]), 4, 9)
    assert mask.shape == (8, 9 + 8)
    for q in range(8):
        blk, anchor = q // 4, [2, 5][q // 4]
        allowed = {p for p in range(9) if p < anchor} | {9 + 4 * blk + j for j in range(4)}
        assert {k for k in range(17) if mask[q, k]} == allowed, q
    # Spot checks: context strictly before the anchor, no attention across blocks.
    assert mask[0, 1] and not mask[0, 2]
    assert mask[4, 4] and not mask[4, 5]
    assert not mask[0, 9 + 4] and not mask[4, 9 + 3]
    assert mask[3, 9] and mask[0, 9 + 3]  # bidirectional inside a block


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["dense", "flex"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (6, 2)])
def test_block_sparse_attention_equals_masked_sdpa(heads, kv_heads, backend):
    from blockspec.train.drafter_forward import block_sparse_attention

    torch.manual_seed(heads)
    bsz, ctx_len, d = 4, 13, 8
    anchors = torch.tensor([[1, 5, 6, 9], [2, 3, 8, 9]])  # two sequences, own contexts
    seqs, nb = anchors.shape[0], anchors.shape[1] * bsz
    q = torch.randn(seqs, nb, heads, d, dtype=torch.float64)
    k_ctx, v_ctx = torch.randn(2, seqs, ctx_len, kv_heads, d, dtype=torch.float64)
    k_blk, v_blk = torch.randn(2, seqs, nb, kv_heads, d, dtype=torch.float64)
    ours = block_sparse_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, d**-0.5, backend)
    for s in range(seqs):
        keys = torch.cat([k_ctx[s], k_blk[s]]).transpose(0, 1)
        values = torch.cat([v_ctx[s], v_blk[s]]).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s].transpose(0, 1), keys, values,
            attn_mask=block_attention_mask(anchors[s], bsz, ctx_len), scale=d**-0.5,
            enable_gqa=heads != kv_heads).transpose(0, 1)
        torch.testing.assert_close(ours[s], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="FlexAttention has no CPU backward (the trainer runs this check on "
                           "CUDA before it uses flex)")
def test_flex_backend_gradients_equal_dense():
    from blockspec.train.drafter_forward import check_flex

    assert check_flex(torch.device("cuda")) < 1e-3


def test_attention_backend_choice(tmp_path, qwen3_path, greedy_corpus):
    from blockspec.train.drafter_forward import block_sparse_attention

    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="dense or flex"):
        block_sparse_attention(x, x, x, x, x, torch.ones(1, 1, dtype=torch.long), 1.0, "flash")
    if not torch.cuda.is_available():
        assert Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "a")).attention == "dense"
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "b", attention="flex"))


def test_sample_anchors_leave_room_for_labels():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(20, 8, 100, gen)
    assert a.numel() == 12 and a.min() >= 1 and a.max() + 8 <= 20
    assert (a.diff() > 0).all()
    assert sample_anchors(8, 8, 4, gen).numel() == 0


def test_acceptance_length():
    pred = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert acceptance_length(pred, labels).tolist() == [4, 2, 1]


def _bind_cache(drafter, num_blocks: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for layer in drafter.modules():
        if isinstance(layer, PagedAttention):
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = 50 * torch.randn(shape, generator=gen)  # unwritten slots show up
            layer.v_cache = 50 * torch.randn(shape, generator=gen)


@torch.no_grad()
def test_train_forward_equals_paged_inference(models_root, qwen3_path):
    path = build_random_drafter(models_root / "drafter-train-fwd", qwen3_path, num_layers=2,
                                block_size=4, target_layer_ids=[0, 2], seed=3)
    drafter = load_drafter(str(path), ModelConfig.from_pretrained(qwen3_path), 1024,
                           torch.float32, torch.device("cpu"))
    H, B, L = drafter.config.geometry.hidden_size, 4, 14
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(L, 2 * H, generator=gen)
    anchors = torch.tensor([1, 4, 6, 10])
    embeds = torch.randn(len(anchors) * B, H, generator=gen)
    ours = train_forward(drafter, taps, embeds, anchors)
    kv_bs = 4
    for i, a in enumerate(anchors.tolist()):
        _bind_cache(drafter, num_blocks=8, block_size=kv_bs)
        table = [5, 1, 7, 2]
        slots = [table[p // kv_bs] * kv_bs + p % kv_bs for p in range(a + B)]
        drafter.write_context(drafter.fuse(list(taps[:a].split(H, dim=-1))), torch.arange(a),
                              torch.tensor(slots[:a]))
        meta = AttentionMetadata.build([B], [a + B], [table], slots[a:], "cpu", causal=False)
        ref = drafter(embeds[i * B:(i + 1) * B], torch.arange(a, a + B), meta)
        torch.testing.assert_close(ours[i * B:(i + 1) * B], ref, atol=1e-4, rtol=1e-4)
    # A batch of sequences in one pass == each sequence on its own (no cross-sequence leak).
    taps2 = torch.randn(L, 2 * H, generator=gen)
    anchors2 = torch.tensor([2, 3, 9, 10])
    embeds2 = torch.randn(len(anchors2) * B, H, generator=gen)
    both = train_forward(drafter, torch.stack([taps, taps2]), torch.cat([embeds, embeds2]),
                         torch.stack([anchors, anchors2]))
    torch.testing.assert_close(both[:len(embeds)], ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[len(embeds):], train_forward(drafter, taps2, embeds2, anchors2),
                               atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def greedy_corpus(tmp_path_factory, qwen3_path, hf_model):
    """Target-regenerated text: the tiny target's own greedy continuations of corpus snippets."""
    tok = AutoTokenizer.from_pretrained(str(qwen3_path))
    model = hf_model(qwen3_path)
    text = corpus_text()
    rows = []
    for i in range(12):
        prompt = tok(text[i * 997:i * 997 + 40], add_special_tokens=False)["input_ids"][:8]
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=90, do_sample=False,
                             min_new_tokens=90)[0].tolist()
        rows.append({"text": tok.decode(ids)})
    path = tmp_path_factory.mktemp("corpus") / "greedy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(qwen3_path, corpus, out, **kw) -> TrainArgs:
    base = dict(target=str(qwen3_path), data=[str(corpus)], out=str(out), block_size=4,
                num_layers=1, steps=40, batch_size=2, lr=3e-3, max_len=96, anchors_per_seq=48,
                eval_fraction=0.2, eval_every=40, save_every=0, quiet=True, seed=0)
    base.update(kw)
    return TrainArgs(**base)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen3_path, greedy_corpus):
    out = tmp_path_factory.mktemp("trained") / "drafter"
    trainer = Trainer(_args(qwen3_path, greedy_corpus, out))
    before = trainer.evaluate()
    history = trainer.run()
    return out, before, history


def test_training_reduces_loss(trained):
    _, before, history = trained
    first = sum(r["loss"] for r in history[:3]) / 3
    last = sum(r["loss"] for r in history[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert history[-1]["eval_loss"] < before["eval_loss"] - 1.0
    assert history[-1]["tau"] > before["tau"]


def test_checkpoint_serves_losslessly(trained, qwen3_path, greedy_corpus):
    out, _, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    prompts = [r["text"][:30] for r in map(json.loads, greedy_corpus.read_text().splitlines())]
    ar = [o.token_ids for o in LLM(str(qwen3_path), device="cpu").generate(prompts[:4], GREEDY)]
    llm = LLM(str(qwen3_path), device="cpu", draft=str(out), speculation_policy="fixed")
    assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == ar
    assert llm.engine.spec_stats.num_steps > 0


def test_resume_continues_exactly(tmp_path, qwen3_path, greedy_corpus):
    kw = dict(steps=6, anchors_per_seq=16, eval_every=0)
    full = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "full", **kw))
    full.run()
    part = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "part", **kw))
    for _ in range(3):
        part.train_step()
    part.save()
    resumed = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "part",
                            resume=str(tmp_path / "part"), **kw))
    assert resumed.step == 3
    resumed.run()
    assert resumed.step == 6
    for (name, a), b in zip(full.drafter.state_dict().items(),
                            resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_anchor_chunks_give_the_same_step(tmp_path, qwen3_path, greedy_corpus):
    kw = dict(steps=2, anchors_per_seq=24, eval_every=0)
    whole = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "a", anchor_chunk=0, **kw))
    chunked = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "b", anchor_chunk=5, **kw))
    assert whole.train_step() == pytest.approx(chunked.train_step(), rel=1e-5)
    for (name, a), b in zip(whole.drafter.state_dict().items(),
                            chunked.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_resume_without_state_is_a_config_error(tmp_path, qwen3_path, greedy_corpus):
    with pytest.raises(ConfigError, match="training_state.pt"):
        Trainer(_args(qwen3_path, greedy_corpus, tmp_path, resume=str(tmp_path)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cli_train_and_eval_acceptance(tmp_path, qwen3_path, greedy_corpus, trained, capsys):
    args = _parser().parse_args([
        "train-drafter", "--target", str(qwen3_path), "--data", str(greedy_corpus),
        "--out", str(tmp_path / "d"), "--block-size", "4", "--steps", "2", "--max-len", "64",
        "--anchors-per-seq", "8", "--device", "cpu"])
    assert cmd_train(args) == 0
    assert (tmp_path / "d" / "model.safetensors").is_file()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "def f(x):"}\n{"prompt": "import json"}\n{"text": "return"}\n')
    args = _parser().parse_args([
        "eval-acceptance", "--model", str(qwen3_path), "--draft", str(trained[0]),
        "--prompts", str(prompts), "--max-tokens", "16", "--num-prompts", "2", "--device", "cpu",
        "--out", str(tmp_path / "res.json")])
    assert cmd_train(args) == 0
    printed = capsys.readouterr().out
    assert "mean acceptance length (tau)" in printed
    res = json.loads((tmp_path / "res.json").read_text())
    assert len(res["prompts"]) == 2 and 1.0 <= res["mean_acceptance_length"] <= 4.0
    assert len(res["acceptance_rate_per_position"]) == 3


def test_cli_user_errors(tmp_path, qwen3_path):
    args = _parser().parse_args([
        "train-drafter", "--target", str(qwen3_path), "--data", str(tmp_path / "missing.txt"),
        "--out", str(tmp_path / "d"), "--block-size", "4", "--device", "cpu"])
    with pytest.raises(ConfigError, match="does not exist"):
        cmd_train(args)
    args = _parser().parse_args(["train-drafter", "--target", str(qwen3_path), "--data", "x",
                                 "--out", "o", "--steps", "0"])
    with pytest.raises(ConfigError, match="--steps must be positive"):
        cmd_train(args)


# -- time budget, token-id data, generate-data -----------------------------------------------------

def test_time_budget_ends_the_run_annealed(tmp_path, qwen3_path, greedy_corpus):
    trainer = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "d", steps=100_000,
                            time_budget_s=1.0, eval_every=0))
    history = trainer.run()
    assert 1 <= trainer.step < 100_000 and trainer.elapsed >= 1.0
    assert history[-1]["lr"] < 0.2 * 3e-3  # the cosine reached (nearly) its end, not step 1's
    assert (tmp_path / "d" / "model.safetensors").is_file()


def test_bad_input_ids_row_is_a_config_error(tmp_path, qwen3_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, "x"]}) + "\n")
    with pytest.raises(ConfigError, match="input_ids"):
        Trainer(_args(qwen3_path, bad, tmp_path / "d"))


def test_cut_prompts_windows():
    from blockspec.train.generate_data import WINDOW_CHARS_PER_TOKEN, cut_prompts

    docs = [list(range(100)), [7, 8, 9]]
    prompts = cut_prompts(docs, 50, 10, seed=0)
    assert len(prompts) == 50 and prompts == cut_prompts(docs, 50, 10, seed=0)
    for p in prompts:
        assert p == [7, 8, 9] or (len(p) == 10 and p == list(range(p[0], p[0] + 10)))
    with pytest.raises(ConfigError):
        cut_prompts([[]], 1, 4, seed=0)
    # Text documents: a short one is tokenised whole and once; a long one only in a window around
    # a random offset (its edge tokens dropped), so no prompt pays for the whole document.
    seen = []

    def tokenize(text):
        seen.append(text)
        return [ord(c) for c in text]

    long_doc = "".join(chr(0x100 + k) for k in range(4000))
    texts = ["a" * 40, "b" * 40, long_doc]
    prompts = cut_prompts(texts, 40, 8, seed=1, tokenize=tokenize)
    assert len(prompts) == 40 and all(len(p) == 8 for p in prompts)
    assert prompts == cut_prompts(texts, 40, 8, seed=1, tokenize=tokenize)  # seeded
    span = WINDOW_CHARS_PER_TOKEN * 10
    windows = [t for t in seen if t[0] >= chr(0x100)]
    assert windows and all(len(t) == span for t in windows)  # never the whole long document
    whole = [t for t in seen if t[0] < chr(0x100)]
    assert len(whole) == 2 * len(set(whole))  # each short document once per call
    for p in prompts:  # 8 consecutive tokens of one document, inside the window's edges
        text = "".join(map(chr, p))
        assert text in ("a" * 8, "b" * 8) or (text in long_doc and text != long_doc[:8])


def test_generate_data_writes_target_greedy_ids(tmp_path, qwen3_path):
    from blockspec.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": corpus_text()[i * 500:(i + 1) * 500]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "gen.jsonl"
    assert main(["generate-data", "--model", str(qwen3_path), "--data", str(docs), "--out",
                 str(out), "--num-samples", "3", "--prompt-tokens", "8", "--max-tokens", "6",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3
    llm = LLM(str(qwen3_path), device="cpu", dtype="float32")
    for r in rows:
        prompt = r["input_ids"][:r["prompt_len"]]
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
        assert r["input_ids"][r["prompt_len"]:] == list(want)
    assert main(["generate-data", "--model", str(qwen3_path), "--data", str(docs), "--out",
                 str(tmp_path / "x.txt")]) != 0  # not .jsonl: a one-line error


def test_generate_data_time_budget_keeps_finished_rounds(tmp_path, qwen3_path):
    from blockspec.cli import main

    docs = tmp_path / "docs.txt"
    docs.write_text(corpus_text()[:3000])
    out = tmp_path / "gen.jsonl"
    # Rounds of 4 * max-num-seqs prompts: the budget runs out in the first round, whose rows stay.
    assert main(["generate-data", "--model", str(qwen3_path), "--data", str(docs), "--out",
                 str(out), "--num-samples", "7", "--prompt-tokens", "8", "--max-tokens", "3",
                 "--max-num-seqs", "1", "--time-budget-s", "1e-6", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["input_ids"]) == 11 for r in rows)
    assert not out.with_name(out.name + ".tmp").exists()


def test_batched_passes_give_the_per_sequence_loss(tmp_path, qwen3_path, greedy_corpus):
    """Passes over several sequences, or over parts of one, sum to the same loss."""
    losses = []
    for chunk in (0, 7, 20, 1000):
        trainer = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / f"c{chunk}",
                                anchor_chunk=chunk, anchors_per_seq=10))
        seqs = trainer.train_seqs[:3] + [trainer.train_seqs[0][:40]]  # two lengths
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            losses.append(sum(sh.item() for sh, _ in trainer.batch_losses(seqs, 10, gen)))
    for x in losses[1:]:
        assert abs(x - losses[0]) < 1e-4 * abs(losses[0]), losses


def test_init_from_target_copies_the_last_layers(tmp_path, qwen3_path, greedy_corpus):
    from safetensors.torch import load_file

    target = load_file(str(qwen3_path / "model.safetensors"))
    n = 1 + max(int(k.split(".")[2]) for k in target if k.startswith("model.layers."))
    trainer = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "d", num_layers=2,
                            init_from_target=True))
    d = trainer.drafter
    for i, j in ((0, n - 2), (1, n - 1)):
        attn, src = d.layers[i].self_attn, f"model.layers.{j}."
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        torch.testing.assert_close(q, target[src + "self_attn.q_proj.weight"].float())
        torch.testing.assert_close(v, target[src + "self_attn.v_proj.weight"].float())
        torch.testing.assert_close(d.layers[i].mlp.down_proj.weight,
                                   target[src + "mlp.down_proj.weight"].float())
        torch.testing.assert_close(d.layers[i].input_layernorm.weight,
                                   target[src + "input_layernorm.weight"].float())
    fresh = Trainer(_args(qwen3_path, greedy_corpus, tmp_path / "e", num_layers=2))
    assert not torch.equal(fresh.drafter.layers[0].mlp.down_proj.weight,
                           d.layers[0].mlp.down_proj.weight)


def test_sigterm_saves_a_resumable_checkpoint(tmp_path, qwen3_path, greedy_corpus, capsys):
    import os
    import signal

    out = tmp_path / "d"
    trainer = Trainer(_args(qwen3_path, greedy_corpus, out, steps=50, eval_every=0))
    step = trainer.train_step

    def step_then_term() -> float:
        loss = step()
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` does
        return loss

    trainer.train_step = step_then_term
    trainer.run()
    assert trainer.step == 3 and "stopped by signal" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    resumed = Trainer(_args(qwen3_path, greedy_corpus, out, steps=50, eval_every=0,
                            resume=str(out)))
    assert resumed.step == 3
