"""`blockspec bench serve | offline | compare | report`: argument parsing and dispatch.

The heavy modules (httpx client, engine, matplotlib) are imported per subcommand, so `blockspec
--help` stays fast. `python -m blockspec.bench.cli SUBCOMMAND ...` runs the same commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from blockspec.bench.common import DEFAULT_CONCURRENCY
from blockspec.config import ConfigError


def _add_workload_args(p: argparse.ArgumentParser, out: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help=f"comma-separated requests in flight, one level each "
                        f"(default {DEFAULT_CONCURRENCY})")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per concurrency level (default: max(4*C, 8))")
    g.add_argument("--dataset", default="random",
                   help="'random' or a JSONL file (keys: prompt, text, messages or "
                        "conversations); default random")
    g.add_argument("--input-len", type=int, default=None,
                   help="random: prompt length in tokens (default 512); files: truncate "
                        "prompts to this many tokens (offline only)")
    g.add_argument("--output-len", type=int, default=256,
                   help="max_tokens of every request (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --output-len tokens (fixed-length benchmark)")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--label", default=None, help="config name in result tables")
    if out:
        g.add_argument("--out", default=None, metavar="RESULT.json",
                       help="write the results (rewritten after every level)")


def _add_offline_args(o: argparse.ArgumentParser,
                      add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """The engine and benchmark flags of `bench offline` (and of `bench compare`, which passes
    them to each config's offline run)."""
    add_engine_args(o)
    b = o.add_argument_group("benchmark")
    b.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of the checkpoint's shapes (system benchmarks)")
    b.add_argument("--synthetic-acceptance", type=float, default=None, metavar="A",
                   help="BENCHMARK-ONLY: accept each draft position with probability A instead "
                        "of verifying (needs --draft; output is not the target's; results are "
                        "labelled synthetic)")
    b.add_argument("--chat", action="store_true",
                   help="wrap plain prompts as a user message with the chat template")
    b.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens per warm-up request: 2 x C requests before each level, of the "
                        "dataset's prompts cut to 32 tokens (random ones with --dataset random); "
                        "0: only the initial warm-up")
    b.add_argument("--step-trace", action="store_true",
                   help="diagnostics: record every step of each level and group the gaps "
                        "between a stream's outputs over 25 ms by the steps inside them "
                        "(each level's 'step_trace' in --out)")


def _add_subcommands(parser: argparse.ArgumentParser,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    sub.required = True

    s = sub.add_parser("serve", help="sweep concurrency against an OpenAI-compatible server")
    c = s.add_argument_group("server")
    c.add_argument("--base-url", required=True,
                   help="server address, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    c.add_argument("--model", default=None,
                   help="model name in requests (default: the first of GET /v1/models)")
    c.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    c.add_argument("--api-key", default=None,
                   help="bearer token (default: $OPENAI_API_KEY); never written to results")
    c.add_argument("--tokenizer", default=None,
                   help="tokenizer folder: chat datasets on the completions endpoint then use "
                        "its chat template (else turns are joined)")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="run the code that --tokenizer ships (e.g. Kimi's tiktoken tokenizer)")
    c.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request (default 600)")
    _add_workload_args(s)

    o = sub.add_parser("offline", help="sweep concurrency with the engine in-process (no HTTP)")
    _add_offline_args(o, add_engine_args)
    _add_workload_args(o)

    c = sub.add_parser("compare", help="one model over parallel layouts, plain and with its "
                                       "drafter: an offline sweep each, then one table")
    _add_offline_args(c, add_engine_args)
    g = c.add_argument_group("compare")
    g.add_argument("--layouts", required=True, metavar="L,L,...",
                   help="comma-separated: tpN (tensor parallel over N devices), epN (N devices, "
                        "whole experts on each), epAxB (A expert groups of B devices), e.g. "
                        "tp8,ep8,ep4x2; tp1 is one device")
    g.add_argument("--speculative", choices=["off", "on", "both"], default=None,
                   help="each layout plain (off), with --draft (on) or both (default: both "
                        "with --draft, else off)")
    g.add_argument("--out", required=True, metavar="DIR",
                   help="folder for each config's result JSON, compare.md, compare.png and "
                        "compare.json")
    _add_workload_args(c, out=False)

    r = sub.add_parser("report", help="comparison tables and a plot from result files")
    r.add_argument("results", nargs="+", metavar="RESULT.json")
    r.add_argument("--columns", default="1,32,64,128",
                   help="concurrency columns of the tables (default 1,32,64,128; 'all')")
    r.add_argument("--out", default=None, metavar="TABLE.md", help="write the tables here")
    r.add_argument("--plot", default=None, metavar="SWEEP.png",
                   help="write a tok/s-vs-concurrency plot")
    r.add_argument("--extra", action="store_true",
                   help="also TTFT, TPOT and acceptance-length tables")


def add_bench_parser(subparsers: Any,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Registers `bench` (with serve / offline / compare / report) on the top-level
    subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: serve (HTTP sweep), offline (engine sweep), compare "
                      "(parallel layouts), report")
    _add_subcommands(bench, add_engine_args)


def cmd_bench(args: argparse.Namespace,
              engine_kwargs: Callable[[argparse.Namespace], dict[str, Any]],
              resolve_model: Callable[[argparse.Namespace], str]) -> int:
    """Runs one bench subcommand. User errors raise ConfigError (the CLI prints one line)."""
    from blockspec.bench.report import format_report

    if args.bench_command == "report":
        from blockspec.bench.report import run_report

        run_report(args)
        return 0
    if args.bench_command == "serve":
        from blockspec.bench.serve import run_serve

        result = run_serve(args)
    elif args.bench_command == "compare":
        from blockspec.bench.compare import run_compare

        return run_compare(args)
    elif args.bench_command == "offline":
        from blockspec.bench.offline import run_offline

        result = run_offline(args, engine_kwargs, resolve_model)
    else:
        raise ConfigError(f"unknown bench command {args.bench_command!r}")
    cols = [lv["concurrency"] for lv in result["levels"]]
    print("\n" + format_report([result], [result["label"]], cols, extra=True), end="")
    if args.out:
        print(f"[blockspec] results written to {args.out}", file=sys.stderr)
    failed = sum(lv["failed"] for lv in result["levels"])
    if failed:
        errors = list(dict.fromkeys(e for lv in result["levels"] for e in lv["errors"]))[:3]
        print(f"[blockspec] warning: {failed} request(s) failed; first errors: {errors}",
              file=sys.stderr)
    if not any(lv["completed"] for lv in result["levels"]):
        print("blockspec: error: every benchmark request failed", file=sys.stderr)
        return 1
    return 0

