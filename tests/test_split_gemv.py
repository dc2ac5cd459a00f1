"""The split-K GEMV (layers/split_gemv.py) under Triton's interpreter: each split's partial
summed in split order by the last program to arrive, its counters left zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from blockspec.layers.arrival import arrival_locks  # noqa: E402
from blockspec.layers.split_gemv import split_config, split_gemv  # noqa: E402


def test_split_config_shares_whole_chunks():
    assert split_config(384, 7168) == (2, 512, 7)  # Kimi K2.6's router: 14 chunks
    assert split_config(64, 2048) == (2, 512, 4)  # Moonlight's: 4 chunks
    assert split_config(64, 8192) == (2, 512, 8)
    assert split_config(64, 768)[2] == 1  # no whole chunk


@pytest.mark.parametrize("n,k,config", [(10, 256, (2, 32, 4)), (7, 192, (4, 32, 3)),
                                        (64, 1024, None)])
def test_split_gemv_sums_the_splits_in_order(n, k, config):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) / k**0.5
    got = split_gemv(x, w, torch.float32, config)
    splits = (config or split_config(n, k))[2]
    parts = [F.linear(c.float(), d) for c, d in zip(x.chunk(splits, 1), w.chunk(splits, 1))]
    ref = parts[0]
    for p in parts[1:]:
        ref = ref + p
    assert got.dtype == torch.float32 and got.shape == (1, n)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, F.linear(x.float(), w), atol=1e-5, rtol=1e-5)
    assert torch.equal(split_gemv(x, w, torch.float32, config), got)
    assert not arrival_locks(x.device, 64).any()


def test_split_gemv_declines_what_it_does_not_cover():
    x, w = torch.randn(1, 768), torch.randn(8, 768)
    assert split_gemv(x, w) is None  # 768 columns: no whole chunks of 512
    assert split_gemv(torch.randn(2, 1024), torch.randn(8, 1024)) is None  # two rows
