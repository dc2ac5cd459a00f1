"""DeepSeek-V3 / Kimi-K2 targets (MLA attention over a paged latent cache, MoE MLPs) against HF
transformers' own DeepseekV3ForCausalLM on tiny random checkpoints it wrote, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import PagedCache
from safetensors.torch import load_file, save_file

from blockspec import LLM, SamplingParams
from blockspec.config import ModelConfig
from blockspec.models.loader import load_model
from blockspec.tiny import build_tiny_deepseek_v3

TOL = dict(atol=1e-4, rtol=1e-4)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "no_q_lora": {},
    "q_lora_groups": {"q_lora_rank": 24, "n_group": 4, "topk_group": 2},
    "yarn_two_dense": {"rope_scaling": YARN, "first_k_dense_replace": 2, "num_layers": 4},
    # the decoder norms' eps is the config's, the latent norms' DeepSeek's fixed 1e-6
    "large_eps": {"q_lora_rank": 24, "rms_norm_eps": 0.5},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ds_path(request, tmp_path_factory) -> Path:
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp(request.param),
                                  **CASES[request.param], seed=len(request.param))


@pytest.fixture(scope="module")
def hf(ds_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ds_path), dtype=torch.float32).eval()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_reads_mla_and_moe(ds_path):
    cfg = ModelConfig.from_pretrained(ds_path)
    raw = json.loads((ds_path / "config.json").read_text())
    assert cfg.model_type == "deepseek_v3" and cfg.head_dim == raw["qk_rope_head_dim"]
    assert cfg.mla.kv_lora_rank == 32 and cfg.mla.latent_dim == 40
    assert cfg.mla.q_lora_rank == raw["q_lora_rank"] and cfg.mla.rope_interleave
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.n_shared_experts) == (8, 2, 1)
    assert cfg.moe.first_k_dense_replace == raw["first_k_dense_replace"]
    assert cfg.kv_cache_geometry == (1, 1, 40)  # one latent per token and layer


def test_engine_config_for_the_model(ds_path, caplog, monkeypatch):
    """The torch experts on CUDA turn graphs off (they read the router's choice on the host);
    a max_model_len beyond the model's positions is refused."""
    from blockspec.config import EngineConfig
    from blockspec.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # configs only: no GPU work
    mc = ModelConfig.from_pretrained(ds_path)
    config, max_len = EngineConfig(model=str(ds_path), device="cuda",
                                   linear_backend="torch").for_model(mc)
    assert config.enforce_eager and max_len == mc.max_position_embeddings
    assert "CUDA graphs off" in caplog.text
    for kw in (dict(device="cuda"), dict(device="cpu", linear_backend="torch")):
        assert not EngineConfig(model=str(ds_path), **kw).for_model(mc)[0].enforce_eager
    assert EngineConfig(model=str(ds_path), max_model_len=64).for_model(mc)[1] == 64
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        EngineConfig(model=str(ds_path),
                     max_model_len=mc.max_position_embeddings + 1).for_model(mc)


@torch.no_grad()
def test_prefill_and_decode_logits_match_hf(ds_path, hf):
    model = load_model(ds_path, ModelConfig.from_pretrained(ds_path), torch.float32, "cpu")
    ids = prompt(70)
    ref = hf(torch.tensor([ids])).logits[0]
    cache = PagedCache(model)
    table = [5, 1, 9, 3, 7]
    (first,), _ = cache.forward([(table, 0, ids[:50])])
    (rest,), _ = cache.forward([(table, 50, ids[50:])])  # over the cached latents
    torch.testing.assert_close(torch.cat([first, rest]), ref, **TOL)
    assert ref.abs().max() > 1.0 and not torch.allclose(ref[0], ref[-1], atol=1e-2)


@torch.no_grad()
def test_fused_input_projections_match_hf(ds_path, hf, monkeypatch):
    """q_proj (q_a_proj under q_lora) and kv_a_proj in one weight: the state dict unchanged,
    one product a layer, HF's logits; a weight replaced afterwards takes the two again."""
    import blockspec.models.deepseek_v3 as ds

    model = load_model(ds_path, ModelConfig.from_pretrained(ds_path), torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = [layer.self_attn for layer in model.model.layers]
    assert model.fuse_projections() == len(layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    products, fused_linear = [], ds.linear
    monkeypatch.setattr(ds, "linear", lambda *a: products.append(1) or fused_linear(*a))
    ids = prompt(40, seed=2)
    ref = hf(torch.tensor([ids])).logits[0]
    cache = PagedCache(model)
    (first,), _ = cache.forward([([2, 0, 4], 0, ids[:30])])
    (rest,), _ = cache.forward([([2, 0, 4], 30, ids[30:])])
    torch.testing.assert_close(torch.cat([first, rest]), ref, **TOL)
    assert len(products) == 2 * len(layers)
    kv = layers[0].kv_a_proj_with_mqa
    kv.weight = torch.nn.Parameter(kv.weight.detach().clone(), requires_grad=False)
    products.clear()
    (again,), _ = PagedCache(model).forward([([2, 0, 4], 0, ids)])
    torch.testing.assert_close(again, ref, **TOL)
    assert len(products) == len(layers) - 1


@torch.no_grad()
def test_triton_experts_give_the_same_logits(ds_path, hf):
    """The MoE layers' grouped-GEMM experts (Triton, interpreted here) in the whole model."""
    model = load_model(ds_path, ModelConfig.from_pretrained(ds_path), torch.float32, "cpu")
    moes = [m for m in model.modules() if hasattr(m, "experts_backend")]
    assert moes
    for m in moes:
        m.experts_backend = "triton"
    ids = prompt(40, seed=4)
    (logits,), _ = PagedCache(model).forward([([2, 0, 4], 0, ids)])
    torch.testing.assert_close(logits, hf(torch.tensor([ids])).logits[0], **TOL)


@torch.no_grad()
def test_decode_step_folds_the_shared_experts(ds_path, hf, monkeypatch):
    """A one-token step on the Triton experts takes the decode kernels with the shared experts
    folded in (MoE.shared_fold): the whole model's logits still equal HF's."""
    model = load_model(ds_path, ModelConfig.from_pretrained(ds_path), torch.float32, "cpu")
    moes = [m for m in model.modules() if hasattr(m, "experts_backend")]
    assert moes and all(m.shared_experts is not None for m in moes)
    for m in moes:
        m.experts_backend = "triton"
    folds = []
    real = type(moes[0]).shared_fold
    monkeypatch.setattr(type(moes[0]), "shared_fold",
                        lambda self, ids: folds.append(real(self, ids)) or folds[-1])
    ids = prompt(24, seed=5)
    cache = PagedCache(model)
    (_,), _ = cache.forward([([2, 0], 0, ids[:23])])
    assert all(f is None for f in folds)  # a prefill's slots: the grouped GEMMs
    folds.clear()
    (last,), _ = cache.forward([([2, 0], 23, ids[23:])])
    assert len(folds) == len(moes) and all(f is not None for f in folds)
    torch.testing.assert_close(last, hf(torch.tensor([ids])).logits[0, -1:], **TOL)


def fused_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with each layer's experts in transformers 5's two fused tensors."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        order = sorted(by_e)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in order])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in order])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_both_expert_layouts_load_the_same_weights(ds_path, tmp_path):
    cfg = ModelConfig.from_pretrained(ds_path)
    a = load_model(ds_path, cfg, torch.float32, "cpu")
    b = load_model(fused_copy(ds_path, tmp_path / "fused"), cfg, torch.float32, "cpu")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_greedy_generation_matches_hf_generate(ds_path, hf):
    prompts = [prompt(n, seed=n) for n in (5, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(ds_path), device="cpu", num_kv_blocks=64, max_num_seqs=2)
    assert all(layer.self_attn.input_weight is not None  # the engine fuses q and kv_a
               for layer in llm.engine.model.model.layers)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == ref


def test_dflash_greedy_equals_autoregressive_on_the_moe_target(deepseek_pair):
    """Blocks of 2, 4 and 8 verified over the latent cache, with preemption (a cache of 9
    blocks), chunked prefills beside decodes and prefix-cache hits (a shared prompt head)."""
    from helpers import force_block_lens

    target, drafter = deepseek_pair
    shared = prompt(40)
    prompts = [shared + prompt(n, seed=n) for n in (3, 17, 30)] + [prompt(9, 9), prompt(55, 5)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = [o.token_ids for o in LLM(str(target), device="cpu", num_kv_blocks=64)
           .generate(prompts, params)]
    llm = LLM(str(target), device="cpu", draft=str(drafter), speculation_policy="fixed",
              cost_profile="none", num_kv_blocks=9, max_num_seqs=3, max_num_batched_tokens=64)
    force_block_lens(llm, [2, 4, 8])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert set(llm.engine.spec_stats.block_len_steps) >= {2, 4, 8}


def kimi_k25_copy(src: Path, dst: Path) -> Path:
    """The checkpoint as Kimi-K2.5/K2.6 publish theirs: the text model's config under
    text_config (model_type kimi_k2), its weights under language_model., and a vision tower and
    projector beside it."""
    import shutil

    shutil.copytree(src, dst)
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    text.pop("architectures", None)
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": {"hidden_size": 8}}))
    tensors = {f"language_model.{k}": v for k, v in
               load_file(str(src / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_kimi_k25_wrapper_generates_the_same_tokens(deepseek_pair, tmp_path, caplog):
    target = deepseek_pair[0]
    wrapped = kimi_k25_copy(target, tmp_path / "kimi")
    cfg = ModelConfig.from_pretrained(wrapped)
    assert cfg.model_type == "deepseek_v3" and cfg.checkpoint_prefix == "language_model."
    prompts = [prompt(12, 1), prompt(40, 2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with caplog.at_level("INFO", logger="blockspec"):
        got = [o.token_ids for o in LLM(str(wrapped), device="cpu", num_kv_blocks=32)
               .generate(prompts, params)]
    assert "text-only: skipped 2 weights outside 'language_model.'" in caplog.text
    ref = [o.token_ids for o in LLM(str(target), device="cpu", num_kv_blocks=32)
           .generate(prompts, params)]
    assert got == ref


def test_multi_token_prediction_layers_are_skipped(deepseek_pair, tmp_path):
    """DeepSeek-V3 stores its MTP module as layer num_hidden_layers: skipped, not served; a
    layer past it is still an unexpected weight."""
    import shutil

    from blockspec.errors import ConfigError

    target = deepseek_pair[0]
    for extra, ok in ((0, True), (1, False)):
        dst = tmp_path / f"mtp{extra}"
        shutil.copytree(target, dst)
        raw = json.loads((dst / "config.json").read_text())
        raw["num_nextn_predict_layers"] = 1
        (dst / "config.json").write_text(json.dumps(raw))
        tensors = load_file(str(dst / "model.safetensors"))
        layer = raw["num_hidden_layers"] + extra
        tensors[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        cfg = ModelConfig.from_pretrained(dst)
        if ok:
            load_model(dst, cfg, torch.float32, "cpu")
        else:
            with pytest.raises(ConfigError, match="unexpected weight"):
                load_model(dst, cfg, torch.float32, "cpu")


def test_unserved_quantization_is_refused_by_name(deepseek_pair, tmp_path):
    """compressed-tensors W4A16 and FP8 blocks are served (tests/test_quant_models.py); other
    methods are refused with what is supported."""
    from blockspec.errors import ConfigError

    wrapped = kimi_k25_copy(deepseek_pair[0], tmp_path / "kimi")
    raw = json.loads((wrapped / "config.json").read_text())
    for quant, message in (({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
                           ({"quant_method": "compressed-tensors"}, "without config_groups")):
        raw["text_config"]["quantization_config"] = quant
        (wrapped / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match=f"{message}.*supported: compressed-tensors"):
            ModelConfig.from_pretrained(wrapped)


def test_distinct_experts_per_layer_forward_are_counted(deepseek_pair):
    """/metrics' blockspec_moe_experts_selected / _layer_forwards: every MoE layer forward of
    every step counted once, a one-token forward selects top_k = 2 experts, a prefill more."""
    from blockspec.server.engine_stats import EngineStats

    target = deepseek_pair[0]
    llm = LLM(str(target), device="cpu", num_kv_blocks=32)
    llm.generate([prompt(30, 7)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = EngineStats.of(llm.engine)
    cfg = llm.engine.model_config
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    steps = sum(llm.engine.runner.path_steps.values())
    assert stats.moe_layer_forwards == moe_layers * steps == moe_layers * 12
    assert 2 * stats.moe_layer_forwards < stats.moe_experts_selected \
        <= 2 * stats.moe_layer_forwards + moe_layers * (cfg.moe.num_experts - 2)


def test_generate_verbose_prints_experts_per_layer_forward(deepseek_pair, capsys):
    from blockspec.cli import main

    assert main(["generate", "--model", str(deepseek_pair[0]), "--draft", "none", "--device", "cpu",
                 "--prompt", "def f(x):", "--max-tokens", "4", "--num-kv-blocks", "32",
                 "--verbose"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "distinct routed experts" in x)
    per_forward = float(line.split("MoE: ")[1].split()[0])
    assert 2.0 <= per_forward <= 8.0 and "(of 8; top-2 per token)" in line


def test_mla_target_attention_runs_the_mla_kernel(deepseek_pair):
    """With the Triton attention backend an MLA target's layers run the MLA kernel (the generic
    one cannot hold a 576-wide latent for 64+ heads on a GPU), the drafter the generic one; the
    tokens are those of the torch backend (interpreted here)."""
    from blockspec.layers.attention import PagedAttention

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [prompt(21, 3), prompt(9, 4)]
    toks = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(deepseek_pair[0]), device="cpu", attention_backend=backend, num_kv_blocks=16,
                  draft=str(deepseek_pair[1]), speculation_policy="fixed")
        toks[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    names = {m.backend.name for m in llm.engine.model.modules() if isinstance(m, PagedAttention)}
    drafter = llm.engine.runner.proposer.drafter
    assert names == {"triton_mla"}
    assert {m.backend.name for m in drafter.modules() if isinstance(m, PagedAttention)} \
        == {"triton"}
    assert toks["triton"] == toks["torch"]
