"""The draft-model proposer (vLLM: ``vllm/v1/spec_decode/draft_model.py``): a second model
proposes k tokens autoregressively; the target verifies them.

The draft runs in its own engine (its own weights, dtype, quantization and paged KV
cache, no prefix caching), driven directly through its ``ModelRunner``: per target
request it keeps a draft-side :class:`~minivllm.request.Request` whose
``num_computed_tokens`` counts the tokens whose draft K/V is valid. Before each
proposal that count is cut back to the longest common prefix of what the draft
computed (the sequence and its own earlier drafts) and the target's actual sequence,
so rejected drafts are recomputed, never reused.
"""

from __future__ import annotations


import torch

from minivllm.request import Request
from minivllm.layers.sampler import apply_top_k_top_p
from minivllm.sampling_params import SAMPLING_EPS, SamplingParams


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Args:
        spec: the SpeculativeConfig (method "draft_model").
        target: the target LLMEngine (its device, seed, block size, max_model_len,
            max_num_seqs and number of KV blocks are reused).
    Raises:
        ValueError: the draft's vocabulary size differs from the target's, or its
            max_position_embeddings is below the target's max_model_len.
    """

    def __init__(self, spec, target):
        from minivllm.engine.arg_utils import EngineArgs
        from minivllm.engine.llm_engine import LLMEngine

        ta, mc, cc = target.args, target.model_config, target.cache_config
        args = EngineArgs(
            model=spec.model, dtype=spec.dtype if spec.dtype is not None else mc.dtype,
            quantization=spec.quantization, max_model_len=mc.max_model_len,
            block_size=cc.block_size, num_gpu_blocks_override=cc.num_gpu_blocks,
            max_num_seqs=ta.max_num_seqs, enable_prefix_caching=False,
            skip_tokenizer_init=True, seed=ta.seed, device=ta.device, enforce_eager=True,
            attention_backend=ta.attention_backend)
        from minivllm.models.loader import load_hf_config, resolve_model_path

        vocab = load_hf_config(resolve_model_path(spec.model)).get("vocab_size")
        if vocab != mc.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has vocab_size "
                             f"{vocab}, the target {mc.vocab_size}; a draft must share the "
                             "target's vocabulary")
        try:
            self.engine = LLMEngine(args)
        except ValueError as e:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} could not "
                             f"be built for this target: {e}") from e
        self.k = spec.num_speculative_tokens
        self.states: dict[str, Request] = {}

    def release(self, live_ids) -> None:
        """Free the draft state (and draft KV blocks) of requests not in ``live_ids``."""
        for rid in [r for r in self.states if r not in live_ids]:
            self.engine.kv_cache_manager.free(self.states.pop(rid))

    @torch.inference_mode()
    def _logits(self, scheduled) -> torch.Tensor:
        runner, kv = self.engine.model_runner, self.engine.kv_cache_manager
        tables = {d.request_id: kv.get_block_ids(d.request_id) for d, _ in scheduled}
        inp = runner._prepare_inputs(scheduled, tables)
        hidden = runner.model(inp.input_ids, inp.positions, runner.backend.build_metadata(inp.attn))
        return runner._compute_logits(hidden[inp.logits_rows]).float()

    def propose(self, requests, max_drafts: dict, generators: dict) -> dict:
        """request id -> (draft token ids, draft probs [n, V] float32 or None for greedy
        requests), at most ``max_drafts[id]`` tokens each.

        ``generators``: request id -> the generator its random draws use (random requests
        only). Greedy requests draft by argmax; random ones sample from the draft's
        distribution q after the request's temperature, top-k and top-p, and return q.
        A request whose draft KV cannot be allocated gets no drafts this step."""
        kv = self.engine.kv_cache_manager
        active = []
        for req in requests:
            limit = min(self.k, max_drafts[req.request_id])
            if limit <= 0:
                continue
            d = self.states.get(req.request_id)
            if d is None:
                d = Request(req.request_id, req.all_token_ids, SamplingParams(),
                            max_model_len=self.engine.model_config.max_model_len)
                self.states[req.request_id] = d
            d.num_computed_tokens = _common_prefix(d.all_token_ids, req.all_token_ids,
                                                   min(d.num_computed_tokens, req.num_tokens - 1))
            d.all_token_ids = list(req.all_token_ids)
            num_new = req.num_tokens - d.num_computed_tokens
            if not kv.allocate_slots(d, num_new + limit - 1):
                continue
            active.append([req, d, limit, num_new])
        drafts: dict[str, list[int]] = {a[0].request_id: [] for a in active}
        probs: dict[str, list] = {a[0].request_id: [] for a in active}
        step = 0
        while True:
            batch = [a for a in active if step < a[2]]
            if not batch:
                break
            logits = self._logits([(d, n) for _, d, _, n in batch])
            for i, a in enumerate(batch):
                req, d, _, n = a
                p = req.sampling_params
                if p.temperature < SAMPLING_EPS:
                    tok = int(logits[i].argmax())
                else:
                    row = logits[i:i + 1] / p.temperature
                    row = apply_top_k_top_p(
                        row, torch.tensor([p.top_k], device=row.device) if p.top_k > 0 else None,
                        torch.tensor([p.top_p], device=row.device) if p.top_p < 1.0 else None)
                    q = torch.softmax(row, dim=-1)[0]
                    tok = int(torch.multinomial(q, 1, generator=generators.get(req.request_id)))
                    probs[req.request_id].append(q)
                d.num_computed_tokens += n
                d.append_output_token(tok)
                drafts[req.request_id].append(tok)
                a[3] = 1
            step += 1
        return {rid: (toks, torch.stack(probs[rid]) if probs[rid] else None)
                for rid, toks in drafts.items()}
