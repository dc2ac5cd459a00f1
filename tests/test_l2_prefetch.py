"""layers/l2_prefetch.py: the L2 hints' coverage (under the interpreter, each piece the kernel
would ask for is recorded instead), the mode switch and the model's plan (the side-stream joins:
test_side_stream.py). The PTX forms compile for sm_90 in test_triton_compile.py; whether they pay is
measured on a GPU (benchmarks/step_ab.py --ab l2_prefetch)."""

from __future__ import annotations

import pytest
import torch

import blockspec.layers.l2_prefetch as lp


@pytest.mark.parametrize("mode", ["lines", "bulk"])
def test_every_piece_of_every_tensor_is_asked_for_once_and_nothing_past_it(mode):
    pytest.importorskip("triton")
    unit = lp.PIECES[mode][0]
    # sizes below one piece, not a multiple of it, past one program's span, and many spans
    tensors = [torch.zeros(7, dtype=torch.float32), torch.zeros(3 * unit + 48, dtype=torch.uint8),
               torch.zeros(40 * 512 * unit // 2 + 5, dtype=torch.bfloat16),
               torch.zeros(unit * 2, dtype=torch.uint8)]
    for count in (1, 3, 4):
        ts = tensors[:count]
        pieces = [-(-(t.numel() * t.element_size() // 16 * 16) // unit) for t in ts]
        records = [torch.zeros(p + 64, dtype=torch.int8) for p in pieces]
        lp.launch_l2_prefetch(ts, mode, record=records)
        for r, p in zip(records, pieces):
            assert bool((r[:p] == 1).all()) and not r[p:].any()


def test_launch_refuses_what_it_cannot_ask_for():
    t = torch.zeros(64)
    with pytest.raises(ValueError, match="at most 4"):
        lp.launch_l2_prefetch([t] * 5, "lines")
    with pytest.raises(ValueError, match="contiguous"):
        lp.launch_l2_prefetch([torch.zeros(8, 8).t()], "lines")
    with pytest.raises(ValueError, match="mode"):
        lp.launch_l2_prefetch([t], "off")


def test_mode_is_off_off_cuda_and_unknown_values_fail(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH", "lines")
    assert lp.l2_prefetch_mode(torch.device("cpu")) == "off"
    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match="BLOCKSPEC_L2_PREFETCH"):
        lp.l2_prefetch_mode(torch.device("cpu"))
    started, launched = [], []
    monkeypatch.setattr(lp, "start_beside", lambda fn, device: started.append(fn))
    monkeypatch.setattr(lp, "launch_l2_prefetch", lambda ts, form: launched.append(form))
    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH", "lines+next")
    lp.prefetch_beside([torch.zeros(4)], torch.zeros(1))  # CPU: nothing starts
    lp.prefetch_next([torch.zeros(4)], torch.zeros(1))
    assert started == [] and launched == []
    # on a GPU (faked): beside in the mode's form; the next layer's only under "+next"
    monkeypatch.setattr(lp, "_sm90", lambda index: True)
    monkeypatch.setattr(lp, "triton", object())
    cuda = torch.device("cuda", 0)
    fake = type("T", (), {"device": cuda})()
    lp.prefetch_beside([torch.zeros(4)], fake)
    lp.prefetch_next([torch.zeros(4)], fake)
    lp.prefetch_next([], fake)
    assert len(started) == 1 and launched == ["lines"]
    started[0]()
    assert launched == ["lines", "lines"]
    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH", "bulk")
    lp.prefetch_next([torch.zeros(4)], fake)
    assert launched == ["lines", "lines"]


def test_the_model_plans_each_moe_layers_later_weights(tmp_path):
    from blockspec.config import ModelConfig
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=3)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu")
    model.fuse_projections()
    moe_layers = [layer for layer in model.model.layers if layer is not model.model.layers[0]
                  or model.config.moe.is_moe_layer(0)]
    assert model.plan_l2_prefetch(0) == 0
    assert model.plan_l2_prefetch(1 << 30) == len(moe_layers) > 0
    for layer in moe_layers:
        mlp = layer.mlp
        want = [layer.self_attn.o_proj.weight, mlp.gate.weight,
                mlp.shared_experts.gate_up_proj.weight, mlp.shared_experts.down_proj.weight]
        got = layer.self_attn.l2_prefetch
        assert [t.data_ptr() for t in got] == [t.data_ptr() for t in want]
    layers = list(model.model.layers)
    for layer, after in zip(layers, layers[1:] + [None]):
        if layer in moe_layers:
            want_next = () if after is None else (after.self_attn.input_weight,)
            assert [t.data_ptr() for t in layer.mlp.l2_prefetch_next] == \
                [t.data_ptr() for t in want_next]
    if not model.config.moe.is_moe_layer(0):
        assert model.model.layers[0].self_attn.l2_prefetch == ()
    # within a budget: in order, each that still fits (o_proj and the router, not gate_up)
    layer = moe_layers[-1]
    sizes = [t.numel() * t.element_size() for t in want]
    model.plan_l2_prefetch(sizes[0] + sizes[1] + sizes[3])
    assert [t.data_ptr() for t in layer.self_attn.l2_prefetch] == \
        [want[i].data_ptr() for i in (0, 1, 3)]
    assert lp.l2_budget(torch.device("cpu")) == 0
