"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from blockspec.chat import render_chat
from blockspec.config import EngineConfig
from blockspec.demo import default_pair
from blockspec.outputs import RequestOutput
from blockspec.parallel.driver import make_engine
from blockspec.sampling_params import SamplingParams

Prompt = str | list[int]
logger = logging.getLogger("blockspec")


class LLM:
    """An engine for offline generation, like vLLM's `LLM`.

    `model`: an HF folder (config.json + safetensors + tokenizer) or a Hugging Face Hub id
    (`org/name`, fetched into the HF cache; a folder that exists wins); None: the embedded demo
    pair (its DFlash drafter too, unless `draft` is given; `draft="none"`: the target alone).
    Engine arguments (keywords, see `blockspec.EngineConfig`; vLLM's names):
    `draft` (a DFlash drafter folder or Hub id: speculative decoding), `revision`,
    `draft_revision` (Hub branch, tag or commit), `trust_remote_code`, `block_size`, `block_sizes`,
    `speculation_policy` ("adaptive" | "fixed"), `lazy_draft_context`, `cost_profile`,
    `device` ("cpu" | "cuda"), `dtype`, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `kv_block_size`, `kv_cache_memory_gb`, `num_kv_blocks`,
    `gpu_memory_utilization`, `enable_prefix_caching`, `seed` (for requests without their own),
    `enforce_eager`, `attention_backend`, `linear_backend`, `tokenizer`,
    `trust_remote_code` (run a tokenizer's own code, e.g. Kimi's tiktoken tokenizer),
    `load_format` ("dummy": random weights, benchmarks only), `tensor_parallel_size`,
    `expert_parallel_size` (several GPUs, docs/parallel.md: call `engine.shutdown()` when done;
    spawned workers need the `if __name__ == "__main__":` guard in scripts).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        model, draft, note = default_pair(model, engine_args.pop("draft", None))
        if note:
            logger.warning(note)
        self.engine = make_engine(EngineConfig(model=model, draft=draft, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generates a reply for one conversation (a list of {"role", "content"} messages) or
        for each of several, through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) \
            else list(messages)
        prompts = [render_chat(self.tokenizer, list(c), add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
