"""Committed tokens into requests: stop checks, detokenization and RequestOutputs by output kind
(vLLM's OutputProcessor). The engine appends each step's tokens here and asks for the outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockspec.engine.detokenizer import IncrementalDetokenizer
from blockspec.engine.sequence import Sequence
from blockspec.outputs import RequestOutput

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class EngineRequest:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    text: str = ""  # output text after stop-string truncation
    emitted_chars: int = 0
    emitted_tokens: int = 0
    # NOTE: incremental detokenization costs two decodes per token; without streaming or stop
    # strings the text is decoded once, when the request finishes.
    incremental: bool = True
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS, see LLMEngine.add_request


class OutputProcessor:
    """The engine's requests (by id) and what turns their committed tokens into outputs."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] | set[int],
                 max_model_len: int, count_plain_steps: bool = False) -> None:
        """`count_plain_steps`: a speculative engine's outputs report their requests' plain
        decode steps (SpecStats.settle_plain_steps)."""
        self.tokenizer = tokenizer
        self.count_plain_steps = count_plain_steps
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, EngineRequest] = {}
        # Engine-wide totals (the server's periodic stats line): prompt tokens of requests whose
        # prefill finished (less prefix-cache hits), and generated tokens.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Live requests that report every step (output_kind other than "final_only").
        self.num_reporting = 0

    def add(self, request_id: str, req: EngineRequest) -> None:
        self.requests[request_id] = req
        self.num_reporting += req.output_kind != "final_only"

    def append(self, req: EngineRequest, tokens: list[int],
               logprobs: list[dict[int, float] | None], now: float
               ) -> tuple[str, str | int | None] | None:
        """Append generated tokens one by one, stopping exactly where decoding would stop.
        Returns (finish_reason, stop_reason) when the request is done."""
        seq, params = req.seq, req.seq.params
        metrics, out_ids = seq.metrics, seq.output_token_ids
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.num_prompt_tokens += metrics.num_prompt_tokens - metrics.num_cached_tokens
        self.num_generation_tokens += len(tokens)
        # NOTE: a sequence ends by length here at the latest (the context's end, or max_tokens)
        end = min(seq.max_tokens, self.max_model_len - len(seq.prompt_token_ids))
        for tok, lp in zip(tokens, logprobs):
            out_ids.append(tok)
            metrics.num_generated_tokens += 1
            if lp is not None:
                seq.logprobs.append(lp)
            eos = not params.ignore_eos and tok in self.eos_token_ids
            # NOTE: like vLLM, a stop token's own text is left out unless asked for.
            stop_tok = eos or tok in params.stop_token_ids
            keep = not stop_tok or params.include_stop_str_in_output
            delta = 0
            if req.incremental:
                text = req.detok.add([tok] if keep else [], final=eos or not keep)
                req.text += text
                delta = len(text)
            if len(out_ids) < end and (len(out_ids) < params.min_tokens
                                       or not stop_tok and not (delta and params.stop_strs)):
                continue  # NOTE: the common token: _check_stop would find nothing
                # (before min_tokens nothing stops a request but its length, as in vLLM)
            reason, stop = self._check_stop(req, tok, eos, delta, end)
            if reason is not None:
                if not req.incremental:
                    ids = seq.output_token_ids if keep else seq.output_token_ids[:-1]
                    req.text = self.tokenizer.decode(
                        ids, skip_special_tokens=params.skip_special_tokens)
                return reason, stop
        return None

    def _check_stop(self, req: EngineRequest, tok: int, eos: bool, delta_len: int,
                    end: int) -> tuple[str | None, str | int | None]:
        """`end`: the output length at which the sequence stops by length (see append)."""
        seq, params = req.seq, req.seq.params
        if eos:
            return "stop", None
        if tok in params.stop_token_ids:
            return "stop", tok
        if delta_len and params.stop_strs:
            longest = max(len(s) for s in params.stop_strs)
            window_start = max(0, len(req.text) - delta_len - longest + 1)
            hits = [(req.text.find(s, window_start), s) for s in params.stop_strs]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                req.text = req.text[: i + len(s)] if params.include_stop_str_in_output \
                    else req.text[:i]
                return "stop", s
        if len(seq.output_token_ids) >= end:
            if req.incremental:
                req.text += req.detok.add([], final=True)
            return "length", None
        return None, None

    def output(self, req: EngineRequest) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        # NOTE: while streaming, hold back text that could be the start of a stop string.
        hold = 0 if finished else max((len(s) - 1 for s in seq.params.stop_strs), default=0)
        visible = max(req.emitted_chars, len(req.text) - hold)
        delta_text = req.text[req.emitted_chars:visible]
        req.emitted_chars = visible
        start = req.emitted_tokens
        delta_ids = seq.output_token_ids[start:]
        req.emitted_tokens = len(seq.output_token_ids)
        want_lp = seq.params.logprobs is not None
        if req.output_kind == "delta" and not finished:
            text, ids, lps = delta_text, delta_ids, seq.logprobs[start:] if want_lp else None
        else:
            text, ids = req.text[:visible], list(seq.output_token_ids)
            lps = list(seq.logprobs) if want_lp else None
        if self.count_plain_steps:
            seq.metrics.spec.settle_plain_steps(len(seq.output_token_ids))
        out = RequestOutput(
            request_id=seq.request_id, prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids, text=text, token_ids=ids, finished=finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=lps,
            metrics=seq.metrics, delta_text=delta_text, delta_token_ids=delta_ids,
        )
        if finished:
            del self.requests[seq.request_id]
            self.num_reporting -= req.output_kind != "final_only"
        return out
