"""Our Qwen3 / Llama forward (paged attention, fused projections) against HF transformers, fp32."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import PagedCache
from safetensors.torch import load_file, save_file

from blockspec import LLM
from blockspec.config import ConfigError, ModelConfig, RopeConfig
from blockspec.layers.attention import AttentionMetadata
from blockspec.models.loader import load_model

TOL = dict(atol=1e-4, rtol=1e-4)


def ours(path: Path, cfg: ModelConfig | None = None) -> torch.nn.Module:
    cfg = cfg or ModelConfig.from_pretrained(path)
    return load_model(path, cfg, torch.float32, "cpu")


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def shuffled_table(num_blocks: int, total: int = 64, seed: int = 0) -> list[int]:
    """A non-contiguous, out-of-order block table, so paging bugs show."""
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    return ids[:num_blocks]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@torch.no_grad()
def hf_hidden(hf, ids: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(h[0] for h in hf(torch.tensor([ids]), output_hidden_states=True).hidden_states)


def prefill(model, ids: list[int], hidden_layer_ids=()):
    cache = PagedCache(model)
    table = shuffled_table(-(-len(ids) // cache.block_size))
    (logits,), (taps,) = cache.forward([(table, 0, ids)], hidden_layer_ids)
    return logits, taps


# -- logits parity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["qwen3_path", "llama_path", "llama_tied_path",
                                     "llama_rope_path"])
def test_prefill_logits_match_hf(request, hf_model, fixture):
    path = request.getfixturevalue(fixture)
    ids = tokens(300 if fixture == "llama_rope_path" else 77)
    logits, _ = prefill(ours(path), ids)
    ref = hf_logits(hf_model(path), ids)
    assert logits.shape == ref.shape == (len(ids), 512)
    torch.testing.assert_close(logits, ref, **TOL)
    # The comparison is not vacuous: logits are large and position-dependent.
    assert ref.abs().max() > 1.0
    assert not torch.allclose(ref[0], ref[-1], atol=1e-2)


def test_config_reads_hf_folder(qwen3_path, llama_rope_path, llama_tied_path):
    q = ModelConfig.from_pretrained(qwen3_path)
    assert (q.model_type, q.qk_norm, q.vocab_size, q.num_hidden_layers) == ("qwen3", True, 512, 4)
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (4, 2, 16)
    assert q.eos_token_ids == (0,) and q.dtype == torch.float32
    r = ModelConfig.from_pretrained(llama_rope_path)
    assert r.model_type == "llama" and not r.qk_norm
    assert r.rope == RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                                low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=256)
    assert r.max_position_embeddings == 1024
    assert ModelConfig.from_pretrained(llama_tied_path).tie_word_embeddings


def test_tied_embeddings_share_one_tensor(llama_tied_path):
    keys = load_file(str(llama_tied_path / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys  # HF drops the tied copy: the loader must not need it
    model = ours(llama_tied_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_llama3_rope_scaling_matters(llama_rope_path, hf_model):
    """Guard against a vacuous rope test: ignoring the scaling must break parity."""
    cfg = ModelConfig.from_pretrained(llama_rope_path)
    wrong = ours(llama_rope_path, replace(cfg, rope=RopeConfig(theta=cfg.rope.theta)))
    ids = tokens(300)
    logits, _ = prefill(wrong, ids)
    ref = hf_logits(hf_model(llama_rope_path), ids)
    assert (logits - ref).abs().max() > 1e-2


def test_sharded_checkpoint(qwen3_sharded_path, qwen3_path, hf_model):
    index = json.loads((qwen3_sharded_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (qwen3_sharded_path / "model.safetensors").exists()
    ids = tokens(40, seed=5)
    logits, _ = prefill(ours(qwen3_sharded_path), ids)
    torch.testing.assert_close(logits, hf_logits(hf_model(qwen3_path), ids), **TOL)


def test_sharded_checkpoint_through_llm(qwen3_sharded_path, qwen3_path):
    from blockspec import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LLM(str(qwen3_sharded_path), device="cpu", num_kv_blocks=16).generate("def f(x):", sp)
    b = LLM(str(qwen3_path), device="cpu", num_kv_blocks=16).generate("def f(x):", sp)
    assert a[0].token_ids == b[0].token_ids


# -- hidden-state taps -----------------------------------------------------------------------------
def test_hidden_layer_ids_match_hf_hidden_states(arch_path, hf_model):
    ids = tokens(50, seed=2)
    layer_ids = (0, 1, 2)
    _, taps = prefill(ours(arch_path), ids, hidden_layer_ids=layer_ids)
    ref = hf_hidden(hf_model(arch_path), ids)
    assert len(taps) == len(layer_ids)
    for i, tap in zip(layer_ids, taps):
        torch.testing.assert_close(tap, ref[i + 1], **TOL)


def test_hidden_layer_ids_order_and_subset(qwen3_path, hf_model):
    """Taps come back in the order the ids were asked in (CausalLM.forward's contract)."""
    ids = tokens(20, seed=3)
    _, taps = prefill(ours(qwen3_path), ids, hidden_layer_ids=(2, 0))
    ref = hf_hidden(hf_model(qwen3_path), ids)
    assert len(taps) == 2
    torch.testing.assert_close(taps[0], ref[3], **TOL)
    torch.testing.assert_close(taps[1], ref[1], **TOL)
    _, taps = prefill(ours(qwen3_path), ids, hidden_layer_ids=(1, 1))  # e.g. [1, 1] for 4 layers
    assert len(taps) == 2
    torch.testing.assert_close(taps[0], ref[2], **TOL)
    torch.testing.assert_close(taps[1], ref[2], **TOL)


def test_hidden_layer_ids_last_layer_matches_hf(qwen3_path, hf_model):
    ids = tokens(20, seed=4)
    _, taps = prefill(ours(qwen3_path), ids, hidden_layer_ids=(3,))
    torch.testing.assert_close(taps[0], hf_hidden(hf_model(qwen3_path), ids)[4], **TOL)


def test_taps_only_stops_after_the_last_tapped_layer(qwen3_path):
    """The lazy catch-up's taps_only pass: same taps, and the layers after the last tap never run
    (a hook on them fails the test if they do)."""
    model = ours(qwen3_path)
    ids = tokens(20, seed=5)
    _, full = prefill(model, ids, hidden_layer_ids=(1, 0))
    ran = []
    model.model.layers[2].self_attn.register_forward_pre_hook(lambda *_: ran.append(2))
    PagedCache(model)  # binds a KV cache to the attention layers
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(2))], list(range(len(ids))),
                                   "cpu")
    with torch.no_grad():
        hidden, taps = model(torch.tensor(ids), torch.arange(len(ids)), meta, (1, 0),
                             taps_only=True)
    assert hidden is None and not ran
    for got, want in zip(taps, full):
        torch.testing.assert_close(got, want, **TOL)


# -- paged / chunked / multi-token attention -------------------------------------------------------
@pytest.mark.parametrize("chunks", [(40, 50, 10), (16, 16, 68), (1, 99)])
def test_chunked_prefill_matches_one_pass(arch_path, hf_model, chunks):
    ids = tokens(sum(chunks), seed=6)
    model = ours(arch_path)
    one_pass, _ = prefill(model, ids)
    cache = PagedCache(model)
    table = shuffled_table(-(-len(ids) // 16), seed=1)
    ref = hf_logits(hf_model(arch_path), ids)
    start = 0
    for n in chunks:
        (logits,), _ = cache.forward([(table, start, ids[start:start + n])])
        torch.testing.assert_close(logits, ref[start:start + n], **TOL)
        start += n
    torch.testing.assert_close(logits[-1], one_pass[-1], **TOL)


def test_multi_token_query_at_end_of_cached_sequence(arch_path, hf_model):
    """A 4-token query after 60 cached tokens sees the cache plus a causal mask over itself."""
    ids = tokens(64, seed=7)
    cache = PagedCache(ours(arch_path))
    table = shuffled_table(4, seed=2)
    cache.forward([(table, 0, ids[:60])])
    (logits,), _ = cache.forward([(table, 60, ids[60:])])
    torch.testing.assert_close(logits, hf_logits(hf_model(arch_path), ids)[60:], **TOL)


def test_mixed_batch_prefill_verify_decode(arch_path, hf_model):
    """One forward serving a fresh prefill, a 5-token verify and a single-token decode, each with
    its own block table, equals HF run on each sequence alone."""
    hf = hf_model(arch_path)
    cache = PagedCache(ours(arch_path))
    blocks = shuffled_table(64, seed=3)
    a, b, c = tokens(37, seed=8), tokens(45, seed=9), tokens(18, seed=10)
    ta, tb, tc = blocks[:3], blocks[3:6], blocks[6:8]
    cache.forward([(tb, 0, b[:40]), (tc, 0, c[:17])])  # warm the cache of b and c
    (la, lb, lc), _ = cache.forward([(ta, 0, a), (tb, 40, b[40:]), (tc, 17, c[17:])])
    assert (la.shape[0], lb.shape[0], lc.shape[0]) == (37, 5, 1)
    torch.testing.assert_close(la, hf_logits(hf, a), **TOL)
    torch.testing.assert_close(lb, hf_logits(hf, b)[40:], **TOL)
    torch.testing.assert_close(lc, hf_logits(hf, c)[17:], **TOL)


# -- config and checkpoint errors ------------------------------------------------------------------
def copy_folder(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def test_unknown_architecture(qwen3_path, tmp_path):
    folder = copy_folder(qwen3_path, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["MistralForCausalLM"]
    raw["model_type"] = "mistral"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_pretrained(folder)
    msg = str(err.value)
    assert "MistralForCausalLM" in msg
    assert "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        LLM(str(folder), device="cpu", num_kv_blocks=4)


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ConfigError):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_missing_config(qwen3_path, tmp_path):
    folder = copy_folder(qwen3_path, tmp_path / "m", skip=("config.json",))
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(folder)
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(folder), device="cpu")


def test_invalid_config_json(qwen3_path, tmp_path):
    folder = copy_folder(qwen3_path, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.from_pretrained(folder)


def test_config_missing_required_key(qwen3_path, tmp_path):
    folder = copy_folder(qwen3_path, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    del raw["hidden_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_pretrained(folder)


def test_missing_weights(qwen3_path, tmp_path):
    folder = copy_folder(qwen3_path, tmp_path / "m", skip=("model.safetensors",))
    cfg = ModelConfig.from_pretrained(folder)
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(folder, cfg, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="safetensors"):
        LLM(str(folder), device="cpu", num_kv_blocks=4)


def test_missing_shard(qwen3_sharded_path, tmp_path):
    index = json.loads((qwen3_sharded_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    folder = copy_folder(qwen3_sharded_path, tmp_path / "m", skip=(shard,))
    with pytest.raises(ConfigError, match="missing"):
        load_model(folder, ModelConfig.from_pretrained(folder), torch.float32, "cpu")


def load_edited(src: Path, dst: Path, edit) -> None:
    """Load a copy of `src` whose weights `edit(weights)` changed in place."""
    folder = copy_folder(src, dst)
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"))
    load_model(folder, ModelConfig.from_pretrained(folder), torch.float32, "cpu")


def test_missing_tensor(qwen3_path, tmp_path):
    with pytest.raises(ConfigError, match="missing weights"):
        load_edited(qwen3_path, tmp_path / "m",
                    lambda w: w.pop("model.layers.2.self_attn.k_proj.weight"))


def test_untied_checkpoint_without_lm_head(qwen3_path, tmp_path):
    with pytest.raises(ConfigError, match="lm_head"):
        load_edited(qwen3_path, tmp_path / "m", lambda w: w.pop("lm_head.weight"))


def test_wrong_shape_tensor(qwen3_path, tmp_path):
    with pytest.raises(ConfigError, match="up_proj"):
        load_edited(qwen3_path, tmp_path / "m", lambda w: w.update(
            {"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64)}))


def test_unexpected_tensor(qwen3_path, tmp_path):
    with pytest.raises(ConfigError, match="unexpected weight"):
        load_edited(qwen3_path, tmp_path / "m", lambda w: w.update(
            {"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}))


# -- YaRN rope -------------------------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}


def test_yarn_frequencies_and_factor_match_hf():
    """inv_freq and the cos/sin factor against HF's own YaRN init, with DeepSeek's mscale pair,
    other ramp bounds, an explicit attention factor and untruncated ramps."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blockspec.layers.rotary import rope_attention_factor, rope_inv_freq

    cases = [dict(YARN), {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
             {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2},
             {**YARN, "attention_factor": 1.3, "truncate": False}]
    for params in cases:
        raw = dict(hidden_size=64, num_attention_heads=4, head_dim=16,
                   max_position_embeddings=512, rope_parameters=dict(params))
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig(**raw), "cpu")
        rope = RopeConfig.from_hf(raw)
        torch.testing.assert_close(rope_inv_freq(16, rope), hf_inv.float(), rtol=1e-6, atol=0)
        assert rope_attention_factor(rope) == pytest.approx(hf_factor, rel=1e-9), params


def test_yarn_prefill_logits_match_hf(models_root, hf_model):
    from blockspec.tiny import build_tiny_model

    path = build_tiny_model(models_root / "qwen3-yarn", rope_scaling=YARN, seed=5)
    ids = tokens(300)
    logits, _ = prefill(ours(path), ids)
    torch.testing.assert_close(logits, hf_logits(hf_model(path), ids), **TOL)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 4.0
    plain = ours(path, replace(cfg, rope=RopeConfig(theta=cfg.rope.theta)))
    assert not torch.allclose(prefill(plain, ids)[0], logits, atol=1e-2)  # YaRN matters here
