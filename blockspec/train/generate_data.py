"""`blockspec generate-data`: drafter training data written by the target itself.

A drafter is judged on the target's own continuations, so it learns best from them (the published
recipe regenerates its training responses with the target). Prompts are windows cut from the
given documents; each output row is `{"input_ids": prompt + continuation, "prompt_len": n}` in the
target's token ids, which `train-drafter --data` reads as they are (no decode/re-encode drift).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError


def add_parser(subparsers: Any) -> None:
    gd = subparsers.add_parser(
        "generate-data", help="regenerate drafter training data with the target model")
    gd.add_argument("--model", required=True,
                    help="target model folder (HF format) or Hub id (org/name)")
    gd.add_argument("--data", required=True, nargs="+", metavar="FILE",
                    help="documents to cut prompts from (text or JSONL, as for train-drafter)")
    gd.add_argument("--out", required=True, metavar="JSONL", help="output file")
    gd.add_argument("--num-samples", type=int, default=1024)
    gd.add_argument("--prompt-tokens", type=int, default=128,
                    help="prompt length in tokens (shorter documents are used whole)")
    gd.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    gd.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gd.add_argument("--max-num-seqs", type=int, default=256)
    gd.add_argument("--max-model-len", type=int, default=None)
    gd.add_argument("--device", default=None)
    gd.add_argument("--dtype", default="auto")
    gd.add_argument("--enforce-eager", action="store_true")
    gd.add_argument("--seed", type=int, default=0)
    gd.add_argument("--time-budget-s", type=float, default=None,
                    help="stop after the round that passes this many seconds (keeps its rows)")
    gd.set_defaults(func=cmd_generate_data)


# A text window of this many characters per wanted token holds enough tokens for a prompt (BPE on
# code averages ~3-4 characters a token); a window that falls short tokenises the whole document.
WINDOW_CHARS_PER_TOKEN = 8


def cut_prompts(docs: list[str | list[int]], n: int, length: int, seed: int,
                tokenize: Callable[[str], list[int]] | None = None) -> list[list[int]]:
    """`n` prompt windows of `length` tokens, from documents drawn with probability ~ their
    length (a random start inside each); documents shorter than `length` give themselves.

    NOTE: text documents are weighted by characters, and a long one is tokenised only in a window
    of WINDOW_CHARS_PER_TOKEN * (length + 2) characters at a random offset (its first and last
    tokens dropped: the window's edges may cut a word), so the cost is ~n windows, not the drawn
    documents (a 250 MB corpus: most of it). Short documents are tokenised whole, once."""
    docs = [d for d in docs if d]
    if not docs:
        raise ConfigError("no non-empty document to cut prompts from")
    rng = random.Random(seed)
    picks = rng.choices(range(len(docs)), weights=[len(d) for d in docs], k=n)
    span = WINDOW_CHARS_PER_TOKEN * (length + 2)
    cache: dict[int, list[int]] = {}
    out = []
    for i in picks:
        d = docs[i]
        if isinstance(d, str) and len(d) > span:
            at = rng.randrange(len(d) - span + 1)
            ids = tokenize(d[at:at + span])[1:-1]
            if len(ids) >= length:
                out.append(ids[:length])
                continue
        if i not in cache:
            cache[i] = d if isinstance(d, list) else tokenize(d)
        doc = cache[i]
        start = rng.randrange(len(doc) - length + 1) if len(doc) > length else 0
        out.append(doc[start:start + length])
    return out


def cmd_generate_data(args: argparse.Namespace) -> int:
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams
    from blockspec.train.drafter_data import read_texts

    for name in ("num_samples", "prompt_tokens", "max_tokens", "max_num_seqs"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        raise ConfigError("--time-budget-s must be positive")
    if args.temperature < 0:
        raise ConfigError("--temperature must be >= 0")
    out = Path(args.out)
    if out.suffix != ".jsonl":
        raise ConfigError(f"--out must be a .jsonl file, got {args.out!r}")
    kw: dict[str, Any] = dict(max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                              enforce_eager=args.enforce_eager, seed=args.seed)
    if args.device:
        kw["device"] = args.device
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    llm = LLM(args.model, **kw)
    tok = llm.tokenizer
    prompts = cut_prompts(list(read_texts(args.data, tok)), args.num_samples, args.prompt_tokens,
                          args.seed, lambda t: tok(t, add_special_tokens=False)["input_ids"])
    limit = llm.engine.max_model_len
    if args.prompt_tokens + args.max_tokens > limit:
        raise ConfigError(f"--prompt-tokens + --max-tokens ({args.prompt_tokens + args.max_tokens})"
                          f" exceeds the model's max length {limit}")
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                             seed=None if args.temperature == 0 else args.seed * 100003 + i)
              for i in range(len(prompts))]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    # NOTE: rounds of a few full batches, so a time budget ends between rounds and keeps every
    # finished row; without a budget it is one round (the engine schedules all at once).
    per_round = 4 * args.max_num_seqs if args.time_budget_s else len(prompts)
    start, n_rows, n_tokens = time.perf_counter(), 0, 0
    with tmp.open("w") as f:
        for lo in range(0, len(prompts), per_round):
            outs = llm.generate(prompts[lo:lo + per_round], params[lo:lo + per_round],
                                use_tqdm=True)
            for prompt, o in zip(prompts[lo:lo + per_round], outs):
                n_tokens += len(o.token_ids)
                f.write(json.dumps({"input_ids": prompt + list(o.token_ids),
                                    "prompt_len": len(prompt)}) + "\n")
            n_rows += len(outs)
            if args.time_budget_s and time.perf_counter() - start >= args.time_budget_s:
                break
    tmp.replace(out)  # NOTE: never a half-written data file under the final name
    cut = f" (time budget reached; {len(prompts)} asked)" if n_rows < len(prompts) else ""
    print(f"wrote {n_rows} samples ({n_tokens} generated tokens) to {out}{cut}")
    return 0
