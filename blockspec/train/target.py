"""Trains the demo target: a small Qwen3ForCausalLM from scratch on packed corpus tokens.

The result is an ordinary HF folder (config.json, bf16 model.safetensors, tokenizer files,
generation_config.json with eos 0), so blockspec and HF transformers both load it.
Optimizer state for `--resume` lives next to it in `<out>.state.pt`, never inside it (it ships).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# ~15.7M parameters at vocab 8192 (tied embeddings): 31 MB in bf16, leaving room for a drafter
# inside the package's 50 MB.
PRESETS: dict[str, dict] = {
    "demo": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1024),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128),
}
EOS_ID = 0


def build_model(vocab_size: int, preset: str = "demo", max_positions: int = 2048, seed: int = 0):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.02,
        eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=EOS_ID, **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                                               bos_token_id=None)
    return model


def num_params(model: torch.nn.Module) -> int:
    # Tied embedding/lm_head is one tensor: count unique storage once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def tokenize_split(path: str | os.PathLike, tokenizer, chunk: int = 512) -> torch.Tensor:
    """All docs of a JSONL split as one int32 stream, each doc followed by <|endoftext|>."""
    from blockspec.train.corpus import read_texts

    texts = read_texts(path)
    backend = tokenizer.backend_tokenizer
    parts: list[np.ndarray] = []
    for i in range(0, len(texts), chunk):
        for enc in backend.encode_batch(texts[i:i + chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [EOS_ID], dtype=np.int32))
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int32)


def lr_at(progress: float, lr: float, warmup: float, min_ratio: float = 0.1) -> float:
    if progress < warmup:
        return lr * progress / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def random_batch(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    # NOTE: offsets come from a CPU generator whatever the device, so runs and resumes replay.
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
    idx = (starts[:, None] + torch.arange(seq_len + 1)[None]).to(tokens.device)
    w = tokens[idx].long()
    return w[:, :-1], w[:, 1:]


def lm_loss(model, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch: int, max_windows: int,
             device: str, autocast: bool) -> float:
    """Mean loss over fixed, non-overlapping held-out windows (the same ones every call)."""
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    if n <= 0:
        return float("nan")
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch))[:, None] * seq_len + torch.arange(seq_len + 1)
        w = tokens[idx.to(tokens.device)].long().to(device)
        total += lm_loss(model, w[:, :-1], w[:, 1:], autocast).item() * len(idx)
    model.train(was_training)
    return total / n


def save_checkpoint(model, tokenizer, out: str | os.PathLike, summary: dict) -> None:
    """HF folder with bf16 weights; the live model stays fp32."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # NOTE: tied: the loaders rebuild it from embed_tokens
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(str(out), state_dict=sd)
    # save_pretrained records the live (fp32) dtype; the file on disk is bf16.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")


def load_corpus_tokens(corpus: str | os.PathLike, tokenizer,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(train tokens, held-out tokens, seconds spent tokenizing); raises when the train split
    cannot fill even one window of `seq_len`."""
    t0 = time.perf_counter()
    train_tokens = tokenize_split(Path(corpus) / "train.jsonl", tokenizer)
    held_tokens = tokenize_split(Path(corpus) / "heldout.jsonl", tokenizer)
    tokenize_s = time.perf_counter() - t0
    if len(train_tokens) <= seq_len + 1:
        raise ValueError(f"corpus has {len(train_tokens)} train tokens, need > {seq_len + 1}")
    return train_tokens, held_tokens, tokenize_s


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are left undecayed)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr,
                             betas=(0.9, 0.95), fused=fused)


def load_train_state(state_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                     gen: torch.Generator) -> tuple[int, float]:
    """Restores model, optimizer and batch generator from `--resume` state; (step, elapsed)."""
    # NOTE: load on CPU: the generator state must stay a CPU tensor; the model and
    # optimizer copy their tensors to the device themselves.
    st = torch.load(state_path, map_location="cpu", weights_only=False)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    return st["step"], st["elapsed"]


def run_fraction(step: int, steps: int, elapsed: float, time_budget_s: float | None) -> float:
    """How far along the run is: by steps, or by time when a budget is further along."""
    frac = step / steps
    if time_budget_s:
        frac = max(frac, elapsed / time_budget_s)
    return frac


def optimizer_step(fwd, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor, clip: float, autocast: bool) -> torch.Tensor:
    """One forward / backward / clipped AdamW update; returns the (graph-free) loss."""
    loss = lm_loss(fwd, x, y, autocast)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def heldout_ppl(held: float) -> float | None:
    """Perplexity of a held-out loss (capped at e^30); None when there is no loss (NaN)."""
    return math.exp(min(held, 30)) if held == held else None


def train(corpus: str, tokenizer_dir: str, out: str, *, preset: str = "demo", steps: int = 1000,
          batch_size: int = 32, seq_len: int = 1024, lr: float = 1.5e-3, warmup: float = 0.03,
          weight_decay: float = 0.1, clip: float = 1.0, eval_every: int = 200,
          eval_windows: int = 256, time_budget_s: float | None = None, compile: bool = False,
          resume: bool = False, device: str | None = None, seed: int = 0,
          progress: bool = True) -> dict:
    """Trains for `steps` (or until `time_budget_s`, whichever ends first: the cosine schedule
    follows whichever is further along, so a time-limited run still anneals) and saves `out`."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.startswith("cuda")
    if autocast:
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_tokens, held_tokens, tokenize_s = load_corpus_tokens(corpus, tok, seq_len)
    if autocast:  # a few hundred MB at most: batches are then gathered on the GPU
        train_tokens, held_tokens = train_tokens.to(device), held_tokens.to(device)
    model = build_model(len(tok), preset, max(2048, seq_len), seed).to(device)
    n_params = num_params(model)
    print(f"target: {preset} Qwen3, {n_params / 1e6:.2f}M params ({n_params * 2 / 1e6:.1f} MB "
          f"bf16), train {len(train_tokens) / 1e6:.2f}M tokens, heldout "
          f"{len(held_tokens) / 1e6:.3f}M, tokenized in {tokenize_s:.1f}s", flush=True)
    opt = make_optimizer(model, lr, weight_decay, fused=autocast)
    gen = torch.Generator().manual_seed(seed)
    state_path = Path(str(out).rstrip("/") + ".state.pt")
    step, elapsed = 0, 0.0
    if resume and state_path.is_file():
        step, elapsed = load_train_state(state_path, model, opt, gen)
        print(f"resumed at step {step}", flush=True)
    fwd = torch.compile(model) if compile else model
    model.train()
    first_loss = last_loss = held = float("nan")
    losses: list[float] = []
    bar = tqdm(total=steps, initial=step, desc="target", disable=not progress, mininterval=2.0)
    start = time.perf_counter() - elapsed
    while True:
        elapsed = time.perf_counter() - start
        frac = run_fraction(step, steps, elapsed, time_budget_s)
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, lr, warmup)
        x, y = random_batch(train_tokens, batch_size, seq_len, gen)
        loss = optimizer_step(fwd, model, opt, x.to(device, non_blocking=True),
                              y.to(device, non_blocking=True), clip, autocast)
        step += 1
        if step == 1 or step % 10 == 0:
            last_loss = loss.item()
            losses.append(last_loss)
            first_loss = losses[0]
        if eval_every and step % eval_every == 0:
            held = evaluate(model, held_tokens, seq_len, batch_size, eval_windows, device,
                            autocast)
        bar.update(1)
        ppl = heldout_ppl(held)
        bar.set_postfix(loss=f"{last_loss:.3f}", held=f"{held:.3f}",
                        ppl="-" if ppl is None else f"{ppl:.1f}", refresh=False)
    bar.close()
    held = evaluate(model, held_tokens, seq_len, batch_size, eval_windows, device, autocast)
    summary = {
        "preset": preset, "params": n_params, "vocab_size": len(tok), "steps": step,
        "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "tokens_seen": step *
        batch_size * seq_len, "train_tokens": len(train_tokens), "heldout_tokens":
        len(held_tokens), "first_loss": first_loss, "final_train_loss": last_loss,
        "heldout_loss": held, "heldout_ppl": heldout_ppl(held),
        "train_seconds": round(elapsed, 1), "device": device,
    }
    save_checkpoint(model, tok, out, summary)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "elapsed": elapsed}, state_path)
    print(f"target: step {step}, train loss {last_loss:.3f}, heldout loss {held:.3f} "
          f"(ppl {summary['heldout_ppl']}), {elapsed:.0f}s -> {out}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    train(a.corpus, a.tokenizer, a.out, preset=a.preset, steps=a.steps, batch_size=a.batch_size,
          seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, eval_every=a.eval_every,
          time_budget_s=a.time_budget_s, compile=a.compile, resume=a.resume, device=a.device,
          seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
