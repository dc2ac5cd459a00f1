"""layers/side_stream.py: work beside the current stream, joined once where it is used. The
CUDA streams themselves are exercised on a GPU (benchmarks/step_ab.py --ab shared_beside
compares the logits bit for bit); here the join logic and the CPU path."""

from __future__ import annotations

import torch

import blockspec.layers.side_stream as ss


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)


def test_pending_joins_its_stream_once():
    side, main = FakeStream(), FakeStream()
    value = torch.ones(2)
    pending = ss.Pending(value, side, main)
    assert main.waited == []
    assert ss.resolve(pending) is value and ss.resolve(pending) is value
    assert main.waited == [side] and side.waited == []
    assert ss.resolve(value) is value and ss.resolve(None) is None


def test_off_cuda_the_work_runs_inline():
    x = torch.randn(3)
    assert torch.equal(ss.run_beside(lambda t: t * 2, x), x * 2)


def test_moe_runs_unfolded_shared_experts_beside_and_joins(monkeypatch, tmp_path):
    """MoE.forward hands its shared MLP to run_beside (Triton experts) and joins the result
    itself even where the experts never asked for it."""
    import blockspec.models.deepseek_moe as ds
    from blockspec.config import ModelConfig
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=2)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu")
    moe = next(m for m in model.modules() if isinstance(m, ds.MoE))
    x = torch.randn(3, model.config.hidden_size)
    want = moe(x)
    side, main, started = FakeStream(), FakeStream(), []

    def beside(fn, t):
        started.append(fn)
        return ss.Pending(fn(t), side, main)

    monkeypatch.setattr(ds, "run_beside", beside)
    monkeypatch.setattr(moe.experts, "forward", lambda x, w, ids, backend, stats, res=None:
                        torch.zeros_like(x))  # never resolves its residual
    moe.experts_backend = "triton"
    assert not moe.runs_shared_beside(x)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert moe.runs_shared_beside(x)
    monkeypatch.setattr(moe, "shared_fold", lambda num_slots: 1 / 0)  # never asked
    moe(x)
    assert started == [moe.shared_experts] and main.waited == [side]
    moe.shared_beside, started[:] = False, []
    assert not moe.runs_shared_beside(x)
    monkeypatch.undo()
    moe.experts_backend, moe.shared_beside = "torch", True
    torch.testing.assert_close(moe(x), want)
