"""`blockspec train-drafter`, `blockspec eval-acceptance` (and registers `generate-data`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError
from blockspec.train.drafter_data import iter_jsonl


def add_train_parser(subparsers: Any) -> None:
    tr = subparsers.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    tr.add_argument("--target", required=True,
                    help="target model folder (HF format) or Hub id (org/name)")
    tr.add_argument("--data", required=True, nargs="+", metavar="FILE",
                    help="text or JSONL files (keys: text | prompt+response/completion | "
                         "messages)")
    tr.add_argument("--out", required=True, help="output folder (published drafter format)")
    tr.add_argument("--block-size", type=int, default=16)
    tr.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers")
    tr.add_argument("--steps", type=int, default=None, help="optimizer steps (default: epochs)")
    tr.add_argument("--epochs", type=float, default=None, help="passes over the data (default 1)")
    tr.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--max-len", type=int, default=1024, help="tokens per packed sequence")
    tr.add_argument("--anchors-per-seq", type=int, default=512)
    tr.add_argument("--anchor-chunk", type=int, default=2048,
                    help="anchors per drafter pass: bounds memory, same gradient (0: all)")
    tr.add_argument("--gamma", type=float, default=None,
                    help="loss decay exp(-(k-1)/gamma); default 7 (B=16), 5 (B=10), 4 (B=8)")
    tr.add_argument("--eval-fraction", type=float, default=0.02)
    tr.add_argument("--eval-every", type=int, default=100)
    tr.add_argument("--save-every", type=int, default=500)
    tr.add_argument("--resume", default=None, metavar="DIR", help="continue from a checkpoint")
    tr.add_argument("--time-budget-s", type=float, default=None,
                    help="end training after this many seconds (the LR schedule anneals to it)")
    tr.add_argument("--mask-token-id", type=int, default=None)
    tr.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    tr.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                    help="training attention: flex (FlexAttention, CUDA), dense; auto: flex on "
                         "CUDA if it matches dense on a check problem")
    tr.add_argument("--init-from-target", action="store_true",
                    help="start the drafter layers as copies of the target's last layers")
    tr.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    tr.add_argument("--seed", type=int, default=0)
    tr.set_defaults(func=cmd_train, train_command="train-drafter")

    ev = subparsers.add_parser("eval-acceptance",
                               help="measure a drafter's acceptance length on prompts")
    ev.add_argument("--model", default=None,
                    help="target model folder or Hub id (default: the embedded demo pair's "
                         "target, and its drafter unless --draft is given)")
    ev.add_argument("--draft", default=None, help="DFlash drafter folder or Hub id")
    ev.add_argument("--prompts", required=True, help="JSONL: prompt | messages | text")
    ev.add_argument("--block-size", type=int, default=None)
    ev.add_argument("--max-tokens", type=int, default=256)
    ev.add_argument("--num-prompts", type=int, default=None)
    ev.add_argument("--device", default=None)
    ev.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    ev.set_defaults(func=cmd_train, train_command="eval-acceptance")

    from blockspec.train.generate_data import add_parser

    add_parser(subparsers)


def cmd_train(args: argparse.Namespace) -> int:
    # NOTE: dispatch on our own default, not the parser's `dest`, so any parent parser works.
    command = getattr(args, "train_command", None)
    if command == "train-drafter":
        return _train(args)
    if command == "eval-acceptance":
        return _eval_acceptance(args)
    raise ConfigError(f"unknown training command {command!r}")


def _train(args: argparse.Namespace) -> int:
    from blockspec.train.drafter_train import TrainArgs, train

    for name in ("steps", "batch_size", "max_len", "anchors_per_seq", "num_layers",
                 "time_budget_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 <= args.eval_fraction < 1:
        raise ConfigError("--eval-fraction must be in [0, 1)")
    from blockspec.hub import resolve_model_path

    keys = TrainArgs.__dataclass_fields__
    fields = {k: v for k, v in vars(args).items() if k in keys and k != "history"}
    fields["target"] = resolve_model_path(args.target, what="target")
    history = train(TrainArgs(**fields))
    last = history[-1] if history else {}
    print(f"saved drafter to {args.out}: " + ", ".join(
        f"{k} {v:.4g}" for k, v in last.items() if k != "step"))
    return 0


def load_prompts(path: str, tokenizer: Any, limit: int | None) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts file {path!r} does not exist")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    prompts: list[str] = []
    for where, row in iter_jsonl(p):
        if isinstance(row, str):
            row = {"text": row}
        if "messages" in row or ("prompt" in row and has_template):
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if not has_template:
                raise ConfigError(f"{where}: 'messages' need a tokenizer with a chat template")
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True))
        elif "prompt" in row or "text" in row:
            prompts.append(str(row.get("prompt", row.get("text"))))
        else:
            raise ConfigError(f"{where}: no 'prompt', 'messages' or 'text' key")
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"no prompts in {path!r}")
    return prompts


def _eval_acceptance(args: argparse.Namespace) -> int:
    from blockspec.cli import resolve_model
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    model = resolve_model(args)
    if args.draft is None:
        raise ConfigError("eval-acceptance needs a drafter: give --draft")
    # NOTE: a fixed block: acceptance is measured at --block-size, not at policy-chosen lengths.
    llm = LLM(model, draft=args.draft, block_size=args.block_size, device=args.device,
              speculation_policy="fixed")
    prompts = load_prompts(args.prompts, llm.tokenizer, args.num_prompts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    stats = llm.engine.spec_stats
    rows = []
    print(f"{'prompt':>6} {'tokens':>7} {'tau':>6}")
    for i, out in enumerate(outs):
        spec = out.metrics.spec if out.metrics is not None else None
        tau = spec.mean_acceptance_length if spec is not None else 0.0
        rows.append({"prompt": i, "tokens": len(out.token_ids), "tau": tau})
        print(f"{i:>6} {len(out.token_ids):>7} {tau:>6.2f}")
    per_pos = stats.acceptance_rate_per_position
    print("per-position acceptance: " + " ".join(f"{r:.2f}" for r in per_pos))
    print(f"mean acceptance length (tau): {stats.mean_acceptance_length:.3f} "
          f"over {stats.num_steps} verify steps")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate_per_position": per_pos, "num_steps": stats.num_steps,
            "prompts": rows}, indent=2) + "\n")
    return 0
