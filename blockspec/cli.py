"""`blockspec` command line: generate, serve, bench, download, inspect, train-drafter,
eval-acceptance, generate-data."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from blockspec import __version__
from blockspec.config import ConfigError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model folder (config.json + safetensors + tokenizer) or Hugging Face "
                        "Hub id (org/name: fetched into the HF cache). Default: the embedded demo "
                        "pair (a 15.7M-parameter Python-code Qwen3 and its DFlash drafter; "
                        "--draft none for the target alone)")
    g.add_argument("--revision", default=None,
                   help="Hub id models: branch, tag or commit (default: main)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run the code a tokenizer ships (tokenizer_config.json's auto_map, e.g. "
                        "Kimi's tiktoken tokenizer) and fetch Hub repos' *.py files; off by "
                        "default")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available, else cpu")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="auto: the checkpoint's dtype on CUDA (fp32 -> bf16), float32 on CPU")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GiB",
                   help="KV-cache budget in GiB (default: 1 on CPU; on CUDA what remains of "
                        "--gpu-memory-utilization after weights and a profiled warm-up)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max running sequences")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget per step (prefills are chunked to fit)")
    g.add_argument("--decode-step-prefill-tokens", type=_prefill_cap, default=None,
                   metavar="N|auto",
                   help="cap on the prefill tokens of a step that also decodes, which delay "
                        "every running stream (0: no cap; auto: at least 512 and 12 per "
                        "decoding sequence, more while a backlog of prompts waits, the step's "
                        "graph bucket filled, the verify block beside it cut to what the step "
                        "costs allow, no cap past ~80 decoding sequences; default: auto for a "
                        "speculative engine on CUDA, else 0)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each decode step while the previous one runs: "
                        "plain and whole-block speculative steps of greedy batches without "
                        "logprobs (vLLM's --async-scheduling; default: on for one CUDA GPU, "
                        "off on CPU and with -tp > 1)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: do not use CUDA graphs")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on CPU")
    g.add_argument("--linear-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="matmuls of <= 16 rows (small decode steps); auto: triton on CUDA, "
                        "torch (cuBLAS) on CPU and for larger batches")
    t = p.add_argument_group("parallelism (docs/parallel.md)")
    t.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="GPUs to split the model over (attention heads, MLPs, vocabulary)")
    t.add_argument("--expert-parallel-size", "-ep", type=int, default=1, metavar="E",
                   help="groups the routed experts are split over (E divides N; each expert "
                        "split over N/E GPUs of its group)")
    t.add_argument("--nnodes", type=int, default=1, help="nodes of a multi-node run")
    t.add_argument("--node-rank", type=int, default=0,
                   help="this node's index (node 0 serves; the others run workers only)")
    t.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    t.add_argument("--master-port", type=int, default=None,
                   help="a free port on node 0 (default: any free port; one node only)")
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--draft", default=None,
                   help="DFlash drafter folder or Hub id (published checkpoint format): "
                        "enables DFlash; `none`: no drafter (also for the default demo pair)")
    d.add_argument("--draft-revision", default=None,
                   help="Hub id drafters: branch, tag or commit (default: main)")
    d.add_argument("--block-size", type=int, default=None,
                   help="the max block: tokens verified per step under the fixed policy "
                        "(default: the drafter's block_size; smaller is allowed)")
    d.add_argument("--speculation-policy", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: each step runs plain decode or one of --block-sizes, "
                        "whichever the measured step costs and live acceptance say commits the "
                        "most tokens per second; fixed: always the max block")
    d.add_argument("--lazy-draft-context", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="while the policy decodes plainly (a long streak, or a load at which it "
                        "would) skip all drafter work, and catch its context up with one target "
                        "pass before the drafter next runs (default: on with the adaptive "
                        "policy)")
    d.add_argument("--block-sizes", type=block_sizes_arg, default=None, metavar="4,8,16",
                   help="block lengths the adaptive policy may run (each gets CUDA graphs; "
                        "default: 2, 4, 8, 16 up to the max block, plus the max block)")
    d.add_argument("--cost-profile", default=None, metavar="PATH",
                   help="step-cost profile file, measured at start-up and reused while the "
                        "model, device, dtype and block lengths match (default: a file under "
                        "~/.cache/blockspec or $BLOCKSPEC_CACHE; 'none': measure every start)")


def block_sizes_arg(text: str) -> tuple[int, ...]:
    """`4,8,16` -> (4, 8, 16); anything else is a one-line argparse error."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 4,8,16, got {text!r}") from None
    if any(s < 2 for s in sizes):
        raise argparse.ArgumentTypeError(f"block sizes must be >= 2, got {text!r}")
    return sizes


def _prefill_cap(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'auto', got {text!r}") \
            from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        kv_cache_memory_gb=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_step_prefill_tokens=args.decode_step_prefill_tokens,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        draft=args.draft, block_size=args.block_size,
        speculation_policy=args.speculation_policy, block_sizes=args.block_sizes,
        cost_profile=args.cost_profile, lazy_draft_context=args.lazy_draft_context,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, linear_backend=args.linear_backend,
        revision=args.revision, draft_revision=args.draft_revision,
        trust_remote_code=args.trust_remote_code, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=args.expert_parallel_size, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
    )


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder to run. Without --model: the embedded demo pair (target + its DFlash
    drafter, unless --draft is given or is `none`); in a checkout without the pair, a tiny
    random Qwen3. NOTE: may set args.draft, so call it before engine_kwargs(args)."""
    from blockspec.demo import default_pair

    model, draft, note = default_pair(args.model, getattr(args, "draft", None))
    if hasattr(args, "draft"):
        args.draft = draft
    if note:
        print(f"[blockspec] {note}", file=sys.stderr)
    return model


def cmd_generate(args: argparse.Namespace) -> int:
    from blockspec.llm import EngineConfig
    from blockspec.parallel.driver import make_engine
    from blockspec.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sample_seed, max_tokens=args.max_tokens, stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    engine = make_engine(EngineConfig(model=resolve_model(args), **engine_kwargs(args)))
    prompt = args.prompt
    if args.chat:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise ConfigError("--chat given but the model's tokenizer has no chat template")
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False,
            add_generation_prompt=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose and out is not None:
        elapsed = time.perf_counter() - start
        m = out.metrics
        print(f"[blockspec] {m.num_prompt_tokens} prompt tokens ({m.num_cached_tokens} cached), "
              f"{m.num_generated_tokens} generated in {elapsed:.2f}s "
              f"({m.num_generated_tokens / elapsed:.1f} tok/s), TTFT {m.ttft * 1e3:.1f} ms, "
              f"finish_reason={out.finish_reason}", file=sys.stderr)
        per_step = engine.timings.per_step_ms()
        print(f"[blockspec] {engine.timings.steps} engine steps, ms per step: "
              + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items()), file=sys.stderr)
        if hasattr(engine.model, "expert_counts"):
            selected, forwards = engine.model.expert_counts().tolist()
            moe = engine.model_config.moe
            print(f"[blockspec] MoE: {selected / max(forwards, 1):.1f} distinct routed experts "
                  f"per MoE layer forward (of {moe.num_experts}; top-{moe.num_experts_per_tok} "
                  "per token): what a step reads of the experts", file=sys.stderr)
        if engine.runner.proposer is not None:
            spec = m.spec
            hist = " ".join(f"{k}:{v}" for k, v in sorted(spec.acceptance_length_hist.items()))
            print(f"[blockspec] DFlash (max block {engine.spec_block_size}): {spec.summary()}; "
                  f"acceptance-length histogram {{{hist}}}", file=sys.stderr)
            print(f"[blockspec] speculation policy {engine.config.speculation_policy}: decode "
                  f"steps by block length (1 = plain) {spec.block_len_summary()}",
                  file=sys.stderr)
            view = engine.runner.controller.explain(1)
            if "rates" in view:
                # NOTE: why the policy chose what it chose, e.g. plain decode on a CPU, where a
                # verify of 16 tokens costs several plain steps.
                rates = ", ".join(f"{'plain' if L == 1 else f'block {L}'} {r:.0f}"
                                  for L, r in sorted(view["rates"].items()))
                first = view["acceptance"][0] if view["acceptance"] else 0.0
                print(f"[blockspec] policy's view at batch 1 (measured step costs + "
                      f"{view['overhead_s'][1] * 1e3:.2f} ms live per-step overhead, acceptance "
                      f"estimate {first:.2f} at position 1): expected tok/s {rates}",
                      file=sys.stderr)
            lazy = engine.runner.lazy
            if lazy is not None:
                print(f"[blockspec] lazy draft context: {lazy.num_detached_steps} detached steps, "
                      f"{lazy.num_catchups} catch-ups of {lazy.num_catchup_tokens} tokens "
                      f"({lazy.catchup_seconds * 1e3:.1f} ms)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockspec",
        description="LLM inference with block-diffusion speculative decoding (DFlash).")
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    add_engine_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--prompt", required=True, help="prompt text")
    s.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the tokenizer's chat template")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--verbose", "-v", action="store_true", help="print request metrics to stderr")
    gen.set_defaults(func=cmd_generate)

    from blockspec.server.cli import add_serve_parser, cmd_serve

    add_serve_parser(sub, add_engine_args)
    sub.choices["serve"].set_defaults(func=lambda a: cmd_serve(a, engine_kwargs, resolve_model))

    from blockspec.bench.cli import add_bench_parser, cmd_bench

    add_bench_parser(sub, add_engine_args)
    sub.choices["bench"].set_defaults(func=lambda a: cmd_bench(a, engine_kwargs, resolve_model))

    from blockspec.hub.cli import add_download_parser

    add_download_parser(sub)

    from blockspec.train.cli import add_train_parser

    add_train_parser(sub)

    from blockspec.cli_inspect import add_inspect_parser

    add_inspect_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    parser.set_defaults(argv=raw)  # NOTE: `bench compare` hands its flags to each offline run
    args = parser.parse_args(raw)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"blockspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nblockspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
