"""Byte-level BPE for the demo target, trained on the corpus and saved as an HF fast tokenizer.

Same special tokens and chat template as `blockspec.tiny`, so code that works with the tiny
checkpoints works with the demo pair.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from blockspec.train.corpus import read_texts

# NOTE: order fixes the ids: <|endoftext|> must be 0 (eos/pad of the configs and the drafter's
# training data rely on it); <|mask|> is the DFlash mask token.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _batches(texts: list[str], max_bytes: int | None, size: int = 256) -> Iterator[list[str]]:
    used = 0
    for i in range(0, len(texts), size):
        chunk = texts[i:i + size]
        if max_bytes is not None:
            if used >= max_bytes:
                return
            used += sum(len(t) for t in chunk)
        yield chunk


def train_tokenizer(corpus: str | os.PathLike, out: str | os.PathLike, vocab_size: int = 8192,
                    max_train_mb: float | None = 64.0, show_progress: bool = False) -> int:
    """Trains on `corpus/train.jsonl` (the first `max_train_mb`; BPE merges saturate long before
    the whole corpus), saves to `out`, returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = read_texts(Path(corpus) / "train.jsonl")
    tok = Tokenizer(models.BPE())
    # NOTE: no prefix space and a ByteLevel decoder: decode(encode(x)) == x byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress,
    )
    max_bytes = None if max_train_mb is None else int(max_train_mb * 1e6)
    tok.train_from_iterator(_batches(texts, max_bytes), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        # Cleaning up "tokenization spaces" would rewrite code (" ." -> "."): never.
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True, help="folder written by blockspec.train.corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-train-mb", type=float, default=64.0)
    a = ap.parse_args(argv)
    n = train_tokenizer(a.corpus, a.out, a.vocab_size, a.max_train_mb, show_progress=True)
    print(f"tokenizer: vocab {n} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
