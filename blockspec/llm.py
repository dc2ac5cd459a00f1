"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

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
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p, stream=False, output_kind="final_only"))
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) > 4
        engine.closed_batch = True  # NOTE: nothing is added until these are done
        try:
            with tqdm(total=len(prompts), desc="generate", unit="req", disable=not show) as bar:
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        finally:
            engine.closed_batch = False
        return [results[rid] for rid in ids]


def _is_token(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
