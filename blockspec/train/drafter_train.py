"""Train a DFlash drafter against a frozen target (the published recipe, plain PyTorch).

Per step: `batch_size` packed sequences; the frozen HF target gives hidden states at the drafter's
target_layer_ids; up to `anchors_per_seq` random anchors per sequence become blocks
`[token a, mask x (B-1)]`; the drafter's block-sparse training forward predicts tokens a+1..a+B-1
through the target's lm_head; position-weighted cross-entropy; AdamW + cosine + warmup + clip.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from blockspec.config import ConfigError
from blockspec.dflash.checkpoint import save_drafter
from blockspec.train.drafter_data import load_sequences
from blockspec.train.drafter_forward import (
    acceptance_length,
    block_inputs,
    check_flex,
    default_gamma,
    position_weights,
    sample_anchors,
    train_forward,
    weighted_loss,
)
from blockspec.train.drafter_schedule import batch_indices, lr_factor, total_steps
from blockspec.train.drafter_setup import FrozenTarget, init_drafter

STATE_FILE = "training_state.pt"
# Flex vs dense on the fp32 check problem (values and gradients are O(1)); a mask error is O(0.1).
FLEX_TOLERANCE = 2e-2


@dataclass
class TrainArgs:
    target: str
    data: list[str]
    out: str
    block_size: int = 16
    num_layers: int = 1
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 4
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    max_len: int = 1024
    anchors_per_seq: int = 512
    anchor_chunk: int = 2048  # anchors per drafter pass, across sequences (memory); 0: all
    gamma: float | None = None
    eval_fraction: float = 0.02
    eval_every: int = 100
    eval_anchors: int = 64
    save_every: int = 500
    resume: str | None = None
    time_budget_s: float | None = None  # stop (annealed) at this many seconds of training
    device: str | None = None
    seed: int = 0
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    init_from_target: bool = False  # start the drafter layers as copies of the target's last ones
    attention: str = "auto"  # training attention: flex (CUDA), dense, auto (flex if it checks out)
    quiet: bool = False
    history: list[dict[str, float]] = field(default_factory=list)  # filled by train()


class Trainer:
    def __init__(self, args: TrainArgs) -> None:
        from transformers import AutoTokenizer

        self.args = args
        dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available")
        self.device = torch.device(dev)
        if args.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2, got {args.block_size}")
        if not (Path(args.target) / "config.json").is_file():
            raise ConfigError(f"target {args.target!r} is not a model folder (no config.json)")
        torch.manual_seed(args.seed)
        self.attention = self.pick_attention(args.attention)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(args.target)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load the tokenizer of {args.target!r}: {e}") from None
        self.train_seqs, self.eval_seqs = load_sequences(
            args.data, self.tokenizer, args.max_len, args.block_size, args.eval_fraction,
            args.seed)
        self.drafter = init_drafter(args.target, args, self.tokenizer, self.device)
        cfg = self.drafter.config
        self.target = FrozenTarget(args.target, cfg.target_layer_ids, self.device)
        self.gamma = args.gamma or default_gamma(args.block_size)
        self.weights = position_weights(args.block_size, self.gamma, self.device)
        self.steps = total_steps(args, len(self.train_seqs))
        # NOTE: the drafter owns no embedding / lm_head; every one of its parameters trains.
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=args.lr,
                                     weight_decay=args.weight_decay)
        self.step = 0
        self.elapsed = 0.0  # training seconds so far (resume keeps counting)
        if args.resume:
            self.load_state(args.resume)

    def pick_attention(self, wanted: str) -> str:
        """FlexAttention (fused, block-sparse) on CUDA when its outputs and gradients match the
        dense path on a check problem; dense otherwise (CPU: flex has no CPU backward)."""
        if wanted not in ("auto", "flex", "dense"):
            raise ConfigError(f"--attention must be auto, flex or dense, got {wanted!r}")
        if wanted == "dense" or (wanted == "auto" and self.device.type != "cuda"):
            return "dense"
        if self.device.type != "cuda":
            raise ConfigError("--attention flex needs a CUDA device (no CPU backward)")
        try:
            err = check_flex(self.device)
        except Exception as e:  # noqa: BLE001 - any compile/runtime failure means: use dense
            err, why = float("inf"), repr(e)[:300]
        else:
            why = f"max abs difference {err:.2e} from the dense path"
        if err > FLEX_TOLERANCE:
            if wanted == "flex":
                raise ConfigError(f"flex attention failed its check: {why}")
            print(f"train-drafter: flex attention failed its check ({why}); using dense",
                  flush=True)
            return "dense"
        return "flex"

    def autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16,
                              enabled=self.device.type == "cuda")

    def batch_losses(self, seqs: list[list[int]], max_anchors: int, gen: torch.Generator,
                     attention: str = "dense") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(loss share, per-block greedy tau) per drafter pass; the
        shares sum to the sum over `seqs` of each sequence's weighted loss (mean over its
        anchors). Sequences too short for a block contribute nothing.

        NOTE: equal-length sequences share one target forward and run through the drafter
        together, `anchor_chunk` anchors per pass at most (bounds the vocab-sized logits); a
        sequence with more anchors than that is split across passes. The caller may backward
        each share as it comes: the gradient equals the unchunked one."""
        cfg = self.drafter.config
        bsz = cfg.block_size
        groups: dict[int, list[list[int]]] = {}
        for seq in seqs:
            groups.setdefault(len(seq), []).append(seq)
        for length, group in groups.items():
            n = min(max_anchors, length - bsz)
            if n <= 0:
                continue
            tokens = torch.tensor(group, device=self.device)
            anchors = torch.stack([sample_anchors(length, bsz, max_anchors, gen)
                                   for _ in group]).to(self.device)
            taps = self.target.features(tokens)
            per_pass = self.args.anchor_chunk or n * len(group)
            if per_pass >= n:
                k = per_pass // n
                passes = [(slice(i, i + k), slice(0, n)) for i in range(0, len(group), k)]
            else:
                passes = [(slice(i, i + 1), slice(j, j + per_pass))
                          for i in range(len(group)) for j in range(0, n, per_pass)]
            for rows, cols in passes:
                part = anchors[rows, cols]
                blocks, labels = block_inputs(tokens[rows], part, bsz, cfg.mask_token_id)
                with torch.no_grad():
                    embeds = self.target.embed(blocks).flatten(0, 2).float()
                with self.autocast():
                    states = train_forward(self.drafter, taps[rows], embeds, part, attention)
                    states = states.view(part.numel(), bsz, -1)[:, 1:]
                    logits = self.target.lm_head(states)
                labels = labels.flatten(0, 1)
                share = weighted_loss(logits, labels, self.weights) * (part.numel() / n)
                yield share, acceptance_length(logits.argmax(-1), labels)

    def progress(self) -> float:
        """Fraction of the run done: steps, or time when a budget ends the run first (the LR
        schedule follows whichever is further along, so a time-boxed run still anneals)."""
        frac = self.step / self.steps
        if self.args.time_budget_s:
            frac = max(frac, self.elapsed / self.args.time_budget_s)
        return frac

    def train_step(self) -> float:
        a = self.args
        lr = a.lr * lr_factor(self.progress(), a.warmup_frac)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.drafter.train()
        gen = torch.Generator().manual_seed(a.seed * 7919 + self.step)
        seqs = [self.train_seqs[i]
                for i in batch_indices(self.step, a.batch_size, len(self.train_seqs), a.seed)]
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for share, _ in self.batch_losses(seqs, a.anchors_per_seq, gen, self.attention):
            (share / len(seqs)).backward()
            total += share.detach() / len(seqs)  # NOTE: no host sync per pass
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), a.grad_clip)
        self.opt.step()
        self.step += 1
        return total.item()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and greedy acceptance length tau (fixed anchors: comparable over time)."""
        self.drafter.eval()
        gen = torch.Generator().manual_seed(12345)
        loss, taus = 0.0, []
        seqs = self.eval_seqs
        for i in range(0, len(seqs), self.args.batch_size):
            # NOTE: dense for the small no-grad eval passes: no compile for their shapes.
            for share, tau in self.batch_losses(seqs[i:i + self.args.batch_size],
                                                   self.args.eval_anchors, gen, "dense"):
                loss += share.item()
                taus.append(tau.float())
        if not taus:
            return {}
        # NOTE: every sequence with anchors is counted once in the share sums.
        counted = sum(1 for s in seqs if len(s) > self.drafter.config.block_size)
        return {"eval_loss": loss / counted, "tau": torch.cat(taus).mean().item()}

    def save(self, out: str | Path | None = None) -> Path:
        out = Path(out or self.args.out)
        save_drafter(self.drafter, out)
        torch.save({"step": self.step, "steps": self.steps, "elapsed": self.elapsed,
                    "drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict()},
                   out / STATE_FILE)
        return out

    def load_state(self, path: str) -> None:
        f = Path(path) / STATE_FILE
        if not f.is_file():
            raise ConfigError(f"--resume {path!r}: no {STATE_FILE} there")
        state = torch.load(f, map_location=self.device, weights_only=True)
        try:
            self.drafter.load_state_dict(state["drafter"])
        except RuntimeError as e:
            raise ConfigError(f"--resume {path!r}: drafter shape mismatch ({e})") from None
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))

    def run(self) -> list[dict[str, float]]:
        """Trains to the end of the run, saving every `save_every` steps and at the end.

        NOTE: SIGTERM (e.g. `timeout`) or Ctrl-C ends the run after the current step with a
        checkpoint (resumable), so a time-limited job never loses everything it trained."""
        a = self.args
        history = a.history
        bar = tqdm(total=self.steps, initial=self.step, desc="train-drafter", disable=a.quiet)
        postfix: dict[str, float] = {}
        start = time.perf_counter() - self.elapsed
        stop: list[int] = []
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, lambda num, _frame: stop.append(num))
        try:
            while self.progress() < 1.0 and not stop:
                loss = self.train_step()
                self.elapsed = time.perf_counter() - start
                record = {"step": self.step, "loss": loss, "lr": self.opt.param_groups[0]["lr"]}
                postfix["loss"] = round(loss, 4)
                if self.eval_seqs and a.eval_every > 0 and (
                        self.step % a.eval_every == 0 or self.progress() >= 1.0):
                    ev = self.evaluate()
                    record.update(ev)
                    postfix.update({k: round(v, 4) for k, v in ev.items()})
                history.append(record)
                bar.set_postfix(postfix)
                bar.update(1)
                if a.save_every > 0 and self.step % a.save_every == 0:
                    self.save()
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)
        bar.close()
        self.save()
        if stop:
            print(f"train-drafter: stopped by signal {stop[0]} at step {self.step}; saved to "
                  f"{a.out} (--resume {a.out} continues)", flush=True)
        return history


def train(args: TrainArgs) -> list[dict[str, float]]:
    """Runs (or resumes) training; the drafter ends up in args.out. Returns per-step records."""
    return Trainer(args).run()
