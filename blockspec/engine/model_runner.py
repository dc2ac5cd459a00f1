"""Owns the models and KV caches on the device; turns scheduled sequences into flat tensors, runs
one step (draft -> verify/prefill/decode -> write draft context -> sample -> accept), and returns
what each sequence committed. The host syncs once per step, to read the tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.engine.decode_step import DecodeStep, GraphedDecodeStep, StepBuffers
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.layers.sampler import SamplingTensors, chosen_logprobs, sample
from blockspec.models.qwen3 import CausalLM
from blockspec.spec.proposer import DFlashProposer
from blockspec.spec.verify import num_accepted

_GiB = 1 << 30

Logprobs = dict[int, float] | None


@dataclass
class StepResult:
    advance: list[int]  # per scheduled seq: tokens whose K/V this step committed
    sampled_seqs: list[Sequence]
    tokens: list[list[int]]  # per sampled seq: emitted tokens, in order
    logprobs: list[list[Logprobs]]
    drafted: list[int]  # per sampled seq: draft tokens verified this step (0 without a draft)
    accepted: list[int]  # per sampled seq: of which accepted


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def profile_activation_bytes(model: CausalLM, num_tokens: int, logit_rows: int,
                             block_size: int, dtype: torch.dtype) -> int:
    """Peak memory of the largest forward the engine will run (a full prefill chunk, then the
    logits of the largest decode batch), measured with a throwaway KV cache."""
    dev = next(model.parameters()).device
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    num_blocks = -(-num_tokens // block_size)
    cache = torch.zeros(2, len(layers), num_blocks, block_size, layers[0].num_kv_heads,
                        layers[0].head_dim, dtype=dtype, device=dev)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_blocks))],
                                       list(range(num_tokens)), dev)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden, _ = model(ids, torch.arange(num_tokens, device=dev), meta)
        rows = hidden[:1].expand(logit_rows, -1)
        model.compute_logits(rows).float().softmax(dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    del cache, hidden
    torch.cuda.empty_cache()
    return peak


def decide_num_blocks(config: EngineConfig, per_block: int, activation_bytes: int = 0) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * _GiB)
    elif str(config.device).startswith("cuda"):
        _, total = torch.cuda.mem_get_info()
        # NOTE: measured after a warm-up forward: weights, peak activations, and 1 GiB for the
        # CUDA graphs' pool and allocator slack stay outside the KV budget.
        used = torch.cuda.memory_allocated()
        budget = int(total * config.gpu_memory_utilization) - used - activation_bytes - _GiB
    else:
        budget = _GiB
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"KV-cache memory budget ({budget / _GiB:.2f} GiB) is smaller than one "
                          f"KV block ({per_block / _GiB:.4f} GiB); raise --kv-cache-memory")
    return num_blocks


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: CausalLM,
                 block_manager: BlockManager, dtype: torch.dtype, max_model_len: int,
                 proposer: DFlashProposer | None = None) -> None:
        self.model_cfg = model_cfg
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.synthetic = config.synthetic_acceptance
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)
        # NOTE: one block more than the manager hands out: the trash block for padded lanes.
        self.trash_block = block_manager.num_blocks
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.kv_cache = torch.zeros(2, len(layers), block_manager.num_blocks + 1,
                                    block_manager.block_size, model_cfg.num_key_value_heads,
                                    model_cfg.head_dim, dtype=dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        q = proposer.block_size if proposer is not None else 1
        self.decode = DecodeStep(model, proposer, q, block_manager.block_size, max_model_len,
                                 config.synthetic_acceptance)
        max_blocks = -(-(max_model_len + q) // block_manager.block_size)
        self.bufs = StepBuffers.allocate(config.max_num_seqs, max_blocks, q, self.device)
        self.bufs.block_tables.fill_(self.trash_block)
        self.graphs: GraphedDecodeStep | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                       if b < config.max_num_seqs] + [config.max_num_seqs]
            self.graphs = GraphedDecodeStep(self.decode, self.bufs, buckets)
            self.graphs.capture()

    def block_len(self, seq: Sequence) -> int:
        """Tokens verified for a decoding sequence: its last token plus the drafts."""
        if self.proposer is None or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        return min(self.proposer.block_size, self.max_model_len - seq.num_computed_tokens)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        blens = [self.block_len(s) for s in seqs]
        q = self.decode.q
        decoding = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                       for s, n in zip(seqs, num_new_tokens))
        if decoding and (self.proposer is None or all(b == q for b in blens)):
            return self._execute_decode(seqs)
        return self._execute_mixed(seqs, num_new_tokens, blens)

    def _execute_decode(self, seqs: list[Sequence]) -> StepResult:
        """All sequences decoding with the full block: the fixed-shape (graphable) step."""
        n, q, bufs = len(seqs), self.decode.q, self.bufs
        tables = np.full((n, bufs.block_tables.shape[1]), self.trash_block, dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        bufs.last_tokens[:n].copy_(torch.tensor([s.token_at(s.num_tokens - 1) for s in seqs]),
                                   non_blocking=True)
        bufs.ctx_lens[:n].copy_(torch.tensor([s.num_computed_tokens for s in seqs]),
                                non_blocking=True)
        bufs.block_tables[:n].copy_(torch.from_numpy(tables), non_blocking=True)
        if self.synthetic is not None:
            bufs.uniforms.uniform_(generator=self.default_generator)
        bucket = self.graphs.bucket_for(n) if self.graphs is not None else None
        if bucket is not None:
            # Padded lanes: trash block, empty context.
            bufs.block_tables[n:bucket].fill_(self.trash_block)
            bufs.ctx_lens[n:bucket].zero_()
            out = self.graphs.replay(n)
        else:
            out = self.decode(bufs, n)
        params = [s.params for s in seqs]
        target = out.target_tokens[:n]
        logits = out.logits[:n * q]
        row_seqs = [s for s in seqs for _ in range(q)]
        if not all(p.greedy for p in params):
            st = SamplingTensors.build([s.params for s in row_seqs],
                                       [s.generator for s in row_seqs],
                                       self.model_cfg.vocab_size, self.device)
            target = sample(logits.float(), st, self.default_generator).view(n, q)
        acc = None
        if out.drafts is not None:
            acc = out.num_accepted[:n] if self.synthetic is not None or all(
                p.greedy for p in params) else num_accepted(out.drafts[:n], target)
        lp = self._logprobs(logits.float(), target.reshape(-1), row_seqs) if any(
            p.logprobs is not None for p in params) else [None] * (n * q)
        return self._emit(seqs, target, out.drafts, acc, lp, q)

    def _emit(self, seqs: list[Sequence], target: torch.Tensor, drafts: torch.Tensor | None,
              acc: torch.Tensor | None, lp: list[Logprobs], q: int) -> StepResult:
        """One host sync, then each sequence's committed tokens: accepted drafts + bonus."""
        n = len(seqs)
        parts = [target.reshape(n, -1)]
        if acc is not None:
            parts += [drafts[:n], acc[:n, None]]
        host = torch.cat(parts, dim=1).tolist()  # NOTE: the step's one host sync
        tokens, lps, drafted, accepted = [], [], [], []
        for i, row in enumerate(host):
            tgt = row[:q]
            a = row[-1] if acc is not None else 0
            if acc is not None and self.synthetic is not None:
                # Benchmark mode: the drafts themselves are committed (their K/V are in the cache).
                toks = row[q:q + a] + [tgt[a]]
            else:
                toks = tgt[:a + 1]
            tokens.append(toks)
            lps.append(lp[i * q:i * q + a + 1])
            drafted.append(q - 1 if acc is not None else 0)
            accepted.append(a)
        return StepResult([len(t) for t in tokens], list(seqs), tokens, lps, drafted, accepted)

    def _execute_mixed(self, seqs: list[Sequence], num_new_tokens: list[int],
                       blens: list[int]) -> StepResult:
        """Any mix of prefill chunks, decodes and (possibly short) speculative blocks."""
        bm, dev = self.bm, self.device
        spec = [i for i, b in enumerate(blens) if b >= 1]
        drafts = None
        if any(blens[i] >= 2 for i in spec):
            drafts = self.proposer.propose(
                [seqs[i].token_at(seqs[i].num_tokens - 1) for i in spec],
                [blens[i] for i in spec], [seqs[i].num_computed_tokens for i in spec],
                [seqs[i].block_table for i in spec],
                [[bm.slot(seqs[i], p) for p in range(seqs[i].num_computed_tokens,
                                                     seqs[i].num_computed_tokens + blens[i])]
                 for i in spec])

        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        draft_dst, draft_src = [], []  # flat target rows <- flat draft indices
        last_rows, last_seqs = [], []  # non-speculative sequences that sample one token
        verify_rows = []  # [len(spec)][block_size]: target rows whose logits verify each block
        width = self.proposer.block_size if self.proposer else 1
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            q = blens[i] or n
            base = len(ids)
            for p in range(start, start + q):
                ids.append(seq.token_at(p) if p < seq.num_tokens else 0)
                positions.append(p)
                slots.append(bm.slot(seq, p))
            if blens[i]:
                k = len(verify_rows)
                draft_dst += range(base + 1, base + q)
                draft_src += range(k * (width - 1), k * (width - 1) + q - 1)
                verify_rows.append([base + min(j, q - 1) for j in range(width)])
            elif start + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                last_seqs.append(seq)
            q_lens.append(q)
            seq_lens.append(start + q)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        if draft_dst:
            input_ids[torch.tensor(draft_dst, device=dev)] = drafts.view(-1)[
                torch.tensor(draft_src, device=dev)]
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata.build(q_lens, seq_lens, [s.block_table for s in seqs], slots, dev)
        taps_ids = self.proposer.target_layer_ids if self.proposer else ()
        hidden, taps = self.model(input_ids, pos_t, meta, taps_ids)
        if self.proposer is not None:
            self.proposer.write_context(taps, pos_t, meta.slot_mapping)

        spec_seqs = [seqs[i] for i in spec]
        rows = last_rows + [r for vr in verify_rows for r in vr]
        advance = [n if not blens[i] else 0 for i, n in enumerate(num_new_tokens)]
        if not rows:
            return StepResult(advance, [], [], [], [], [])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
        row_seqs = last_seqs + [s for s in spec_seqs for _ in range(width)]
        st = SamplingTensors.build([s.params for s in row_seqs], [s.generator for s in row_seqs],
                                   self.model_cfg.vocab_size, dev)
        tokens = sample(logits, st, self.default_generator)
        acc_t = None
        if spec_seqs:
            target = tokens[len(last_rows):].view(len(spec_seqs), width)
            acc_t = (num_accepted(drafts, target) if drafts is not None
                     else torch.zeros(len(spec_seqs), dtype=torch.int64, device=dev))
            if self.synthetic is not None and drafts is not None:
                u = torch.rand(drafts.shape, generator=self.default_generator, device=dev)
                hits = (u < self.synthetic) & (drafts >= 0)
                acc_t = hits.to(torch.int64).cumprod(dim=1).sum(dim=1)
        lp = self._logprobs(logits, tokens, row_seqs)
        tok_list = tokens.tolist()  # NOTE: the step's one host sync
        acc = acc_t.tolist() if acc_t is not None else []
        draft_list = drafts.tolist() if self.synthetic is not None and drafts is not None else []

        out_tokens = [[t] for t in tok_list[:len(last_rows)]]
        out_lp = [[x] for x in lp[:len(last_rows)]]
        drafted = [0] * len(last_rows)
        for k, i in enumerate(spec):
            base = len(last_rows) + k * width
            a = acc[k]
            if draft_list:  # benchmark mode: accepted drafts are committed as drafted
                out_tokens.append(draft_list[k][:a] + [tok_list[base + a]])
            else:
                out_tokens.append(tok_list[base:base + a + 1])
            out_lp.append(lp[base:base + a + 1])
            drafted.append(blens[i] - 1)
            advance[i] = a + 1
        accepted = [0] * len(last_rows) + acc
        return StepResult(advance, last_seqs + spec_seqs, out_tokens, out_lp, drafted, accepted)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                  row_seqs: list[Sequence]) -> list[Logprobs]:
        want = [s.params.logprobs for s in row_seqs]
        if all(w is None for w in want):
            return [None] * len(row_seqs)
        k = max(w or 0 for w in want)
        chosen, top_vals, top_ids = (x.tolist() for x in chosen_logprobs(logits, tokens, k))
        toks = tokens.tolist()
        out: list[Logprobs] = []
        for r, w in enumerate(want):
            if w is None:
                out.append(None)
                continue
            d = {toks[r]: chosen[r]}
            for j in range(w):
                d.setdefault(top_ids[r][j], top_vals[r][j])
            out.append(d)
        return out
