"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.outputs import RequestOutput
from blockspec.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (strings or token-id lists) and returns outputs in order.
        A progress bar shows when there are more than a few prompts (`use_tqdm` forces it)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif len(prompts) and _is_token(prompts[0]):  # one token-id prompt (list, tuple, array)
            prompts = [list(prompts)]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids: list[list[str]] = []  # per prompt: its samples' request ids
        try:
            for prompt, p in zip(prompts, params):
                ids.append([engine.add_request(prompt, s, stream=False, output_kind="final_only")
                            for s in p.samples()])
        except Exception:
            self._abort(ids)
            raise
        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) > 4
        engine.closed_batch = True  # NOTE: nothing is added until these are done
        try:
            with tqdm(total=sum(map(len, ids)), desc="generate", unit="req",
                      disable=not show) as bar:
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            self._abort(ids)  # NOTE: the engine stays usable for the next call
            raise
        finally:
            engine.closed_batch = False
        return [_parent([results[rid] for rid in rids]) for rids in ids]

    def _abort(self, ids: list[list[str]]) -> None:
        for rids in ids:
            for rid in rids:
                self.engine.abort(rid)


def _parent(samples: list[RequestOutput]) -> RequestOutput:
    """One output per prompt: the sample itself (n = 1) or the first with all n attached."""
    if len(samples) == 1:
        return samples[0]
    return dataclasses.replace(samples[0], samples=samples)


def _is_token(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
