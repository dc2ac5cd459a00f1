"""Benchmark suite: `blockspec bench serve | offline | report`.

`serve` drives any OpenAI-compatible server over HTTP, `offline` drives the engine in-process, and
both write the same result-file shape, which `report` turns into comparison tables and plots.
"""
