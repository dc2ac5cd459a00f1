"""When kernels launch with programmatic dependent launch (layers/pdl.py): CUDA on sm90+ unless
BLOCKSPEC_PDL=0; never on CPU, where the interpreter must not see `launch_pdl`."""

from __future__ import annotations

import torch

import blockspec.layers.pdl as pdl


def test_cpu_never_launches_with_pdl(monkeypatch):
    monkeypatch.delenv("BLOCKSPEC_PDL", raising=False)
    assert pdl.pdl_args(torch.device("cpu")) == {"USE_PDL": False}


def test_cuda_sm90_launches_with_pdl_unless_turned_off(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)
    monkeypatch.delenv("BLOCKSPEC_PDL", raising=False)
    assert pdl.pdl_args(cuda) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    assert pdl.pdl_args(cuda) == {"USE_PDL": False}
    monkeypatch.setenv("BLOCKSPEC_PDL", "1")
    assert pdl.pdl_args(torch.device("cuda", 1)) == {"USE_PDL": False}  # not sm90+
