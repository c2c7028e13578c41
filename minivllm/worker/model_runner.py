"""Model runner: owns the paged KV cache, turns a schedule into batch tensors, runs the
model and the sampler (vLLM: ``vllm/v1/worker/gpu_model_runner.py``).

Batch tensors for a step with requests r scheduled for n_r new tokens each:

* ``input_ids``, ``positions``: [sum n_r], the new tokens of every request, concatenated;
* ``slot_mapping``: [sum n_r], cache slot of each new token,
  ``block_table[pos // block_size] * block_size + pos % block_size``;
* per-request read slots for attention (see ``minivllm.attention.metadata``);
* ``logits_rows``: the last new token of each request whose whole sequence is now
  computed (it gets a sampled token); partial prefill chunks produce no token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from minivllm.attention.metadata import (AttentionMetadata, DecodeGroup, PagedMetadata,
                                         PrefillSeq, chunk_causal_mask, prefill_chunk_ref,
                                         slot_mapping_ref)
from minivllm.config import CacheConfig, ModelConfig
from minivllm.request import Request
from minivllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from minivllm.quantization.kv_cache import (LayerKVCache, calibrate_kv_amax, is_quantized, qmax,
                                            kv_scale_bytes_per_token, kv_scales_from_amax)

logger = logging.getLogger("minivllm")


@dataclass
class PromptLogprobsChunk:
    """Prompt log-probs for prompt positions [first_pos, first_pos + len) (the
    distribution of token p given tokens < p). token_logprobs/ranks: [L]; topk_*: [L, N]."""

    first_pos: int
    token_ids: list[int]
    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_ids: Optional[torch.Tensor]
    topk_logprobs: Optional[torch.Tensor]


@dataclass
class ModelRunnerOutput:
    """sampled_request_ids[i] got token sampled_token_ids[i] (= sampler_output.sampled[i],
    already on the host)."""

    sampled_request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampler_output: Optional[SamplerOutput] = None
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # requests whose logits, prompt log-probs, score rows or int8 K/V held NaN/inf
    nonfinite_request_ids: list[str] = field(default_factory=list)
    # LLM.score requests: (first position, [rows, vocab] float32 log-probs or logits,
    # positions in the chunk, the chosen positions or None: rows for all of them)
    score_rows: dict[str, tuple[int, torch.Tensor, int, Optional[list[int]]]] = \
        field(default_factory=dict)
    # speculative decoding: request id -> the tokens its verification emits (accepted
    # drafts, then one target token), 1 to k + 1 of them; these requests are not in
    # sampled_request_ids
    spec_outputs: dict[str, list[int]] = field(default_factory=dict)


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int,
                             cache_dtype: torch.dtype, dynamic_scales: bool = False) -> int:
    """K and V, all layers, one block (plus per-token scales when they are dynamic)."""
    elem = torch.empty((), dtype=cache_dtype).element_size()
    per_token = 2 * model_config.num_kv_heads * model_config.head_dim * elem \
        + kv_scale_bytes_per_token(model_config.num_kv_heads, dynamic_scales)
    return model_config.num_layers * block_size * per_token


class ModelRunner:
    """Runs the model on a scheduled batch.

    Args:
        model: our LlamaForCausalLM.
        model_config, cache_config: engine configs.
        device: torch device string.
        seed: seeds the generator used by unseeded random requests.
        cuda_graph_max_batch_size: on CUDA, capture decode steps of up to this many
            sequences in CUDA graphs (None: run eagerly). Needs the TRITON backend and a
            cache that is not int8 (whose NaN check syncs); otherwise a warning says why
            it runs eagerly.
        batch_invariant: the batch-invariant mode (``EngineArgs.batch_invariant``; see
            :meth:`_use_batch_invariant`): a request's logits do not depend on the batch.
        emulate_cuda_graphs: on CPU, with ``cuda_graph_max_batch_size``, capture decode
            steps in emulated graphs (``EngineArgs.emulate_cuda_graphs``, not a vLLM
            option; :class:`~minivllm.worker.cuda_graph.EmulatedCUDAGraphRunner`). The
            cache then gets one spare slot at the end, where padding rows' slot -1 writes.
    """

    def __init__(self, model, model_config: ModelConfig, cache_config: CacheConfig,
                 device: str = "cpu", seed: int = 0,
                 cuda_graph_max_batch_size: Optional[int] = None,
                 batch_invariant: bool = False, emulate_cuda_graphs: bool = False,
                 logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.batch_invariant = bool(batch_invariant)
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.block_size = cache_config.block_size
        num_slots = cache_config.num_blocks * cache_config.block_size
        emulate = bool(emulate_cuda_graphs and cuda_graph_max_batch_size
                       and self.device.type == "cpu")
        num_slots += emulate  # the spare slot that padding rows' slot -1 indexes
        # this rank's KV heads (all of them unless tensor parallel: model_config's / tp)
        shape = (num_slots, model.layers[0].self_attn.num_kv_heads, model_config.head_dim)
        # Zero-filled: padded (masked) reads then never meet NaN garbage.
        self.kv_caches: list[LayerKVCache] = []
        dynamic = cache_config.kv_scale_type == "dynamic"

        def zeros(shape_, dtype=cache_config.cache_dtype):
            return torch.zeros(shape_, dtype=dtype, device=self.device)

        for layer in model.layers:
            kv = LayerKVCache(
                zeros(shape), zeros(shape),
                torch.tensor(cache_config.k_scale, device=self.device),
                torch.tensor(cache_config.v_scale, device=self.device),
                zeros(shape[:2], torch.float32) if dynamic else None,
                zeros(shape[:2], torch.float32) if dynamic else None)
            layer.self_attn.kv_cache = kv
            self.kv_caches.append(kv)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.sampler = Sampler(gen, logprobs_mode)
        # The "slot_mapping" step (minivllm.steps) sets both: the slots a step writes
        # (slot_mapping) and the TORCH backend's read slots (read_slot_mapping; the
        # "slot_mapping.read" step alone; the TRITON kernels walk the block tables
        # themselves). Two attributes so that a writer and a reader can disagree, which is
        # how chapter 7 plants a reader-only bug (vllm #5543).
        self.slot_mapping = slot_mapping_ref
        self.read_slot_mapping = slot_mapping_ref
        # The "prefill_chunk" step (chapter 23): the read slots and mask of a prefill
        # chunk (TORCH backend); see _prefill_seq.
        self.prefill_chunk = prefill_chunk_ref
        # The "rejection_sampler" step (chapter 21): verifies a request's draft tokens.
        from minivllm.spec_decode.rejection_sampler import rejection_sampler_ref

        self.rejection_sampler = rejection_sampler_ref
        self.backend = model.layers[0].self_attn.backend
        self.paged = self.backend.needs_paged_metadata
        self.cuda_graphs = None
        if self.batch_invariant:
            self._use_batch_invariant()
        if cuda_graph_max_batch_size and self.device.type == "cuda":
            why = None
            if self.batch_invariant:
                why = "batch_invariant=True computes the LM head one row at a time"
            elif not self.paged:
                why = f"the {self.backend.name} attention backend builds shapes per step"
            elif cache_config.cache_dtype == torch.int8:
                why = "an int8 KV cache checks every step for NaN/inf K/V (a device sync)"
            if why:
                logger.warning("CUDA graphs are off: %s; decode runs eagerly "
                               "(use attention_backend='TRITON', or enforce_eager=True to "
                               "silence this)", why)
            else:
                from minivllm.worker.cuda_graph import CUDAGraphRunner

                self.cuda_graphs = CUDAGraphRunner(
                    model, cuda_graph_max_batch_size, model_config.max_model_len,
                    self.block_size, self.device)
        if emulate:
            why = None
            if self.batch_invariant:
                why = "batch_invariant=True computes the LM head one row at a time"
            elif self.paged:
                why = f"the emulation needs the TORCH attention backend, not {self.backend.name}"
            elif cache_config.cache_dtype == torch.int8:
                why = "an int8 KV cache checks every step for NaN/inf K/V (a host sync)"
            if why:
                raise ValueError(f"emulate_cuda_graphs=True cannot be used here: {why}")
            from minivllm.worker.cuda_graph import EmulatedCUDAGraphRunner

            self.cuda_graphs = EmulatedCUDAGraphRunner(
                model, cuda_graph_max_batch_size, model_config.max_model_len,
                self.block_size, self.device)

    def _use_batch_invariant(self) -> None:
        """Make every step's per-request result independent of the batch (chapter 5;
        vLLM ``VLLM_BATCH_INVARIANT=1``, Thinking Machines 2025).

        * Decode attention (TORCH backend): one sequence at a time over its own keys
          (:func:`~minivllm.attention.backends.torch_ref.decode_attention_batch_invariant`)
          instead of one masked SDPA over keys padded to the decode group's longest
          sequence, whose bits depend on the padded length. The TRITON backend's paged
          kernel is already invariant (fixed split size, splits merged in order).
        * Linear layers: CPU, one row at a time (:func:`~minivllm.layers.linear.rowwise`:
          oneDNN's float32 GEMM gives a row different bits at M >= 2 than alone); CUDA,
          ``kernels.batch_invariant.linear_batch_invariant`` (fixed tiles, no split-K).
          Quantized layers: one row at a time on both.
        * LM head: one row at a time (:meth:`_compute_logits`).
        * RMSNorm: CPU, unchanged: ``rms_norm_ref`` reduces each row on its own (torch's
          CPU reduction over the contiguous last dimension; checked bitwise in
          ``tests/test_batch_invariant.py``); CUDA, the one-row-per-program Triton kernel
          (``kernels.batch_invariant.rms_norm_batch_invariant``).
        * Prefill attention already runs one sequence at a time.
        Swapped steps (``LLM.swap_step``) still replace these inside their ``with`` block.
        """
        from minivllm.layers.linear import Linear, QuantLinear
        from minivllm.layers.rms_norm import RMSNorm

        cuda = self.device.type == "cuda"
        linear = "rows"
        if cuda:
            from kernels.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant

            linear = linear_batch_invariant
        for layer in self.model.layers:
            backend = layer.self_attn.backend
            if hasattr(backend, "set_batch_invariant"):
                backend.set_batch_invariant(True)
        for name, m in self.model.named_modules():
            if isinstance(m, Linear) and name != "lm_head":
                m.batch_invariant = linear
            elif isinstance(m, QuantLinear):
                m.batch_invariant = "rows"
            elif cuda and isinstance(m, RMSNorm):
                if m.fused_add_impl is not None:
                    from kernels.rms_norm import fused_add_rms_norm

                    m.use_kernels(rms_norm_batch_invariant, fused_add_rms_norm)
                else:
                    m.impl = rms_norm_batch_invariant

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits``; in batch-invariant mode one row at a time (the LM
        head's GEMM, like every other, can give a row different bits at another M)."""
        if self.batch_invariant:
            from minivllm.layers.linear import rowwise

            return rowwise(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    # --- KV-cache scales ---------------------------------------------------------------
    def calibrate_kv_scales(self, token_id_lists: list[list[int]]) -> None:
        """Set every layer's static K/V scales to ``amax / qmax`` measured on calibration
        sequences (``cache_config.kv_scale_granularity``): per tensor, per KV head, or K per
        (KV head, channel) with V per tensor ("channel", TORCH backend only).

        Raises:
            ValueError: NaN/inf K or V in calibration; "channel" on the TRITON backend."""
        m = qmax(self.cache_config.cache_dtype)
        granularity = self.cache_config.kv_scale_granularity
        if granularity == "channel" and self.backend.name != "TORCH":
            raise ValueError("kv_scale_granularity='channel' needs the TORCH attention backend "
                             f"(the {self.backend.name} kernels take [] or [num_kv_heads] scales)")
        amaxes = calibrate_kv_amax(self.model, token_id_lists, self.device,
                                   per_channel=granularity == "channel")
        for layer, (k_amax, v_amax) in enumerate(amaxes):
            if not bool(torch.isfinite(k_amax).all() & torch.isfinite(v_amax).all()):
                raise ValueError(f"KV-scale calibration saw NaN/inf keys or values in layer "
                                 f"{layer} (K amax {k_amax.tolist()}, V amax {v_amax.tolist()}); "
                                 "the model overflows on the calibration data, so no scale "
                                 "would be meaningful. Scales are unchanged.")
        for kv, (k_amax, v_amax) in zip(self.kv_caches, amaxes):
            if granularity == "tensor":
                k_amax, v_amax = k_amax.max(), v_amax.max()
            elif granularity == "channel":
                v_amax = v_amax.max()
            kv.set_scales(kv_scales_from_amax(k_amax, m).to(self.device),
                          kv_scales_from_amax(v_amax, m).to(self.device))

    def kv_cache_scales(self) -> dict:
        """The scales stored with the cache: ``{"type", "granularity", "k_scale", "v_scale"}``
        where k_scale/v_scale are per-layer lists (floats, per-head lists, or for K per
        channel [num_kv_heads][head_dim] nested lists); None for a
        float cache, and the string "dynamic" for per-token scales."""
        cc = self.cache_config
        if not is_quantized(cc.cache_dtype):
            return {"type": None, "granularity": None, "k_scale": None, "v_scale": None}
        if cc.kv_scale_type == "dynamic":
            return {"type": "dynamic", "granularity": "token", "k_scale": "dynamic",
                    "v_scale": "dynamic"}
        return {"type": "static", "granularity": cc.kv_scale_granularity,
                "k_scale": [kv.k_scale.tolist() for kv in self.kv_caches],
                "v_scale": [kv.v_scale.tolist() for kv in self.kv_caches]}

    # --- inputs ---------------------------------------------------------------------
    def _prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]):
        bs = self.block_size
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        decode_rows, decode_tables, decode_lens = [], [], []
        prefill_rows, prefill_tables, prefill_ns, prefill_lens = [], [], [], []
        prefill_totals: list[int] = []
        logits_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}  # req -> (row0, pos0, count)
        score_rows: dict[str, tuple[int, int, int]] = {}  # req -> (row0, pos0, count)
        spec_rows: dict[str, tuple[int, int]] = {}  # req -> (first verified row, k)
        row = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            seq_len = start + n
            table = block_tables[req.request_id]
            spec = req.spec_token_ids
            total = req.num_tokens + len(spec)
            if spec:  # a verification: the pending token, then the drafts
                input_ids.extend((req.all_token_ids[start:] + spec)[:n])
            else:
                input_ids.extend(req.all_token_ids[start:seq_len])
            positions.extend(range(start, seq_len))
            slots.append(self.slot_mapping(torch.tensor(table, dtype=torch.int64),
                                           torch.arange(start, seq_len), bs))
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(seq_len)
            else:
                prefill_rows.append(row)
                prefill_tables.append(table)
                prefill_ns.append(n)
                prefill_lens.append(seq_len)
                prefill_totals.append(total)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(seq_len, req.num_prompt_tokens - 1) - start
                prompt_rows[req.request_id] = (row, start, count)
            if req.score is not None:
                score_rows[req.request_id] = (row, start, n)
            if spec and seq_len == total:
                spec_rows[req.request_id] = (row + n - len(spec) - 1, len(spec))
            elif seq_len == req.num_tokens:
                logits_rows.append(row + n - 1)
                sample_reqs.append(req)
            row += n

        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev))
        if self.paged:
            meta.paged = self._paged_metadata(row, decode_rows, decode_tables, decode_lens,
                                              prefill_rows, prefill_tables, prefill_ns,
                                              prefill_lens)
        else:
            meta.decodes = self._decode_groups(decode_rows, decode_tables, decode_lens)
            meta.prefills = [self._prefill_seq(r, t, n, L, N) for r, t, n, L, N in
                             zip(prefill_rows, prefill_tables, prefill_ns, prefill_lens,
                                 prefill_totals)]
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, meta, logits_rows, sample_reqs, prompt_rows, score_rows, spec_rows

    def _prefill_seq(self, row: int, table: list[int], n: int, seq_len: int,
                     num_tokens: Optional[int] = None) -> PrefillSeq:
        """TORCH form of a sequence with n new tokens (positions seq_len - n .. seq_len -
        1 of a request of num_tokens tokens): the "prefill_chunk" step gives the read
        slots and the mask.

        The default step (:func:`~minivllm.attention.metadata.prefill_chunk_ref`) reads
        the slots of all seq_len tokens through the "slot_mapping.read" step and leaves
        the mask to the "attention.prefill" step (query i attends to keys 0..seq_len - n
        + i), so no mask is built here. A swapped step returns ``(kv_slots, mask)``; a
        mask equal to that standard one is dropped (the same attention call as the
        default path, bit for bit), any other is kept and the backend attends under it.

        Raises:
            ValueError: a swapped step returned something else than an int64 vector of
                slots and a bool [n, len(kv_slots)] mask.
        """
        num_tokens = seq_len if num_tokens is None else num_tokens
        table_t = torch.tensor(table, dtype=torch.int64)
        if self.prefill_chunk is prefill_chunk_ref:
            kv_slots = self.read_slot_mapping(table_t, torch.arange(seq_len), self.block_size)
            return PrefillSeq(row, row + n, kv_slots.to(self.device))
        got = self.prefill_chunk(table_t, seq_len - n, n, self.block_size, num_tokens)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ValueError("the prefill_chunk step must return (kv_slots, mask), got "
                             f"{type(got).__name__}")
        kv_slots, mask = got
        if not (isinstance(kv_slots, torch.Tensor) and kv_slots.dim() == 1
                and kv_slots.dtype == torch.int64 and kv_slots.numel() >= 1):
            raise ValueError("prefill_chunk: kv_slots must be a non-empty 1-D int64 tensor, "
                             f"got {getattr(kv_slots, 'dtype', type(kv_slots).__name__)} "
                             f"of shape {tuple(getattr(kv_slots, 'shape', ()))}")
        L = kv_slots.numel()
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                and tuple(mask.shape) == (n, L)):
            raise ValueError(f"prefill_chunk: mask must be a bool tensor of shape [n, "
                             f"len(kv_slots)] = [{n}, {L}], got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} of shape "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        num_slots = self.kv_caches[0].key.shape[0] if self.kv_caches else None
        if num_slots is not None and bool(((kv_slots < 0) | (kv_slots >= num_slots)).any()):
            raise ValueError(f"prefill_chunk: kv_slots outside the pool [0, {num_slots})")
        if L >= n and torch.equal(mask.cpu(), chunk_causal_mask(n, L)):
            mask = None  # the standard mask: the default attention call
        else:
            mask = mask.to(self.device)
        return PrefillSeq(row, row + n, kv_slots.to(self.device), mask)

    def _paged_metadata(self, num_rows, decode_rows, decode_tables, decode_lens,
                        prefill_rows, prefill_tables, prefill_ns, prefill_lens) -> PagedMetadata:
        """TRITON form: padded block tables and lengths (int32)."""
        dev = self.device

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        def tables(rows):
            width = max(len(t) for t in rows)
            return i32([t + [0] * (width - len(t)) for t in rows])

        p = PagedMetadata(block_size=self.block_size)
        if decode_rows:
            all_rows = len(decode_rows) == num_rows  # then rows are 0..B-1 in order
            p.decode_rows = None if all_rows else torch.tensor(decode_rows, device=dev)
            p.decode_block_tables = tables(decode_tables)
            p.decode_seq_lens = i32(decode_lens)
            p.decode_max_seq_len = max(decode_lens)
        if prefill_rows:
            p.prefill_query_starts = i32(prefill_rows)
            p.prefill_query_lens = i32(prefill_ns)
            p.prefill_seq_lens = i32(prefill_lens)
            p.prefill_block_tables = tables(prefill_tables)
            p.prefill_max_query_len = max(prefill_ns)
        return p

    def _decode_groups(self, rows: list[int], tables: list[list[int]],
                       lens: list[int]) -> list[DecodeGroup]:
        """Batch decode queries in groups of similar length: sorted by length, a new group
        starts when a sequence is both 1.5x and 256 tokens longer than the group's
        shortest, which bounds padding waste while keeping the number of groups small."""
        if not rows:
            return []
        bs, dev = self.block_size, self.device
        order = sorted(range(len(rows)), key=lambda i: lens[i])
        groups: list[list[int]] = [[order[0]]]
        for i in order[1:]:
            first = lens[groups[-1][0]]
            if lens[i] > 1.5 * first and lens[i] > first + 256:
                groups.append([i])
            else:
                groups[-1].append(i)
        out = []
        for members in groups:
            members.sort(key=lambda i: rows[i])  # keep batch order inside a group
            max_len = max(lens[i] for i in members)
            max_blocks = -(-max_len // bs)
            table = torch.zeros(len(members), max_blocks, dtype=torch.int64)
            for r, i in enumerate(members):
                t = tables[i][:max_blocks]
                table[r, :len(t)] = torch.tensor(t, dtype=torch.int64)
            j = torch.arange(max_len)
            seq_lens = torch.tensor([lens[i] for i in members])
            out.append(DecodeGroup(
                rows=torch.tensor([rows[i] for i in members], dtype=torch.int64, device=dev),
                kv_slots=self.read_slot_mapping(table, j.expand(len(members), max_len),
                                                bs).to(dev),
                seq_lens=seq_lens.to(dev),
                mask=(j[None, :] < seq_lens[:, None])[:, None, None, :].to(dev)))
        return out

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        dev = self.device
        ps = [r.params for r in reqs]

        def vec(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        all_greedy = all(p.temperature < 1e-5 for p in ps)
        meta = SamplingMetadata(
            temperature=None if all_greedy else vec([p.temperature for p in ps]),
            all_greedy=all_greedy)
        if any(p.top_k > 0 for p in ps):
            meta.top_k = vec([p.top_k for p in ps], torch.int64)
        if any(p.top_p < 1.0 for p in ps):
            meta.top_p = vec([p.top_p for p in ps])
        if any(p.min_p > 0.0 for p in ps):
            meta.min_p = vec([p.min_p for p in ps])
        if any(p.presence_penalty != 0.0 for p in ps):
            meta.presence_penalty = vec([p.presence_penalty for p in ps])
        if any(p.frequency_penalty != 0.0 for p in ps):
            meta.frequency_penalty = vec([p.frequency_penalty for p in ps])
        if any(p.repetition_penalty != 1.0 for p in ps):
            meta.repetition_penalty = vec([p.repetition_penalty for p in ps])
        if meta.presence_penalty is not None or meta.frequency_penalty is not None \
                or meta.repetition_penalty is not None:
            meta.prompt_token_ids = [r.prompt_token_ids for r in reqs]
            meta.output_token_ids = [r.output_token_ids for r in reqs]
        asked = [p.logprobs for p in ps if p.logprobs is not None]
        meta.max_num_logprobs = max(asked) if asked else None
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.params.seed)
                meta.generators[i] = r.generator
            if r.num_output_tokens < r.params.min_tokens:
                block = list(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    block += list(r.eos_token_ids)
                if block:
                    meta.min_tokens_block[i] = block
        return meta

    # --- the step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduled: list[tuple[Request, int]],
                      block_tables: dict[str, list[int]]) -> ModelRunnerOutput:
        """Run the model and the sampler on one scheduled step (vLLM:
        ``GPUModelRunner.execute_model``).

        Args:
            scheduled: ``SchedulerOutput.scheduled``, ``(request, n)`` in batch order; the
                new tokens of a request are positions ``[num_computed_tokens,
                num_computed_tokens + n)`` of ``request.all_token_ids``.
            block_tables: request id -> its block ids (``KVCacheManager.get_block_ids``),
                already long enough for the new tokens.

        Steps, with T = sum of n: ``_prepare`` builds ``input_ids`` and ``positions``
        [T] int64, ``slot_mapping`` [T] (the ``"slot_mapping"`` step) and the attention
        metadata of the backend (TORCH: read slots per prefill and per decode group;
        TRITON: padded int32 block tables and lengths); the model's forward writes this
        step's K/V into the cache at ``slot_mapping`` and returns hidden states
        [T, hidden]; the LM head runs on one row per request whose whole sequence is
        now computed (its last new token; a partial prefill chunk gets no token):
        logits [R, vocab] float32; the sampler draws one token per row, -1 where the
        row holds NaN/inf. Prompt log-probs and ``LLM.score`` rows are computed for the
        requests that ask for them. With CUDA graphs on, a pure decode batch that fits
        a captured graph replays it instead (``_execute_graph_decode``).

        Returns a ``ModelRunnerOutput`` (tokens already on the host; requests whose
        logits, int8 K/V, prompt log-probs or score rows held NaN/inf are listed in
        ``nonfinite_request_ids``). The requests' token counts are not advanced here:
        the scheduler counts the new tokens as computed (``update_after_step``) and the
        engine appends the sampled ones.
        """
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(scheduled):
            return self._execute_graph_decode([req for req, _ in scheduled], block_tables)
        ids, pos, meta, logits_rows, sample_reqs, prompt_rows, score_rows, spec_rows = \
            self._prepare(scheduled, block_tables)
        hidden = self.model(ids, pos, meta)
        out = ModelRunnerOutput()
        bad_ids = self._nonfinite_kv_requests(scheduled)
        if sample_reqs:
            logits = self._compute_logits(hidden[logits_rows])
            # A row holds NaN/inf iff its sum does (finite logits cannot overflow a sum
            # of 1e5 float32 terms); cheaper than isfinite over [rows, vocab].
            self._sample(out, logits, torch.isfinite(logits.sum(dim=-1)), sample_reqs, bad_ids)
        if spec_rows:
            self._verify(out, hidden, [r for r, _ in scheduled if r.request_id in spec_rows],
                         spec_rows, bad_ids)
        for req, _ in scheduled:
            if req.request_id in prompt_rows:
                row0, pos0, count = prompt_rows[req.request_id]
                chunk = self._prompt_logprobs(req, hidden[row0:row0 + count], pos0)
                out.prompt_logprobs[req.request_id] = chunk
                if not bool(torch.isfinite(chunk.token_logprobs).all()):
                    bad_ids.add(req.request_id)
            if req.request_id in score_rows:
                row0, pos0, count = score_rows[req.request_id]
                chosen = req.score.chosen_in(pos0, count)
                rows = self._score_rows(hidden[row0:row0 + count], pos0, chosen)
                if not req.score.logits:
                    rows = torch.log_softmax(rows, dim=-1)
                out.score_rows[req.request_id] = (pos0, rows.cpu(), count, chosen)
                if not bool(torch.isfinite(rows.sum(dim=-1)).all()):
                    bad_ids.add(req.request_id)
        out.nonfinite_request_ids = sorted(bad_ids)
        return out

    def _verify(self, out: ModelRunnerOutput, hidden: torch.Tensor, reqs: list[Request],
                spec_rows: dict[str, tuple[int, int]], bad_ids: set[str]) -> None:
        """Verify draft tokens (speculative decoding; vLLM: ``RejectionSampler``).

        Each request in ``reqs`` ran its pending token and its k drafts as one chunk
        (like a prefill chunk with context); its k + 1 rows from ``spec_rows[id][0]`` on
        go through the LM head: logits [k + 1, vocab] float32, row j scoring the sequence
        extended by drafts 0..j-1. Rows below ``min_tokens`` get EOS/stop ids masked as
        the sampler does. Greedy requests pass the rows' argmax to the
        "rejection_sampler" step; random ones pass p = softmax(top_k_top_p(logits / T))
        (the "sampler.top_k_top_p" step), the draft's q (``request.draft_probs``, None for
        n-gram drafts) and the request's generator. Results go to ``out.spec_outputs``;
        requests with NaN/inf logits to ``bad_ids``.

        Raises:
            ValueError: a swapped step returned something other than 1 to k + 1 token
                ids in [0, vocab).
        """
        idx = []
        for r in reqs:
            r0, k = spec_rows[r.request_id]
            idx.extend(range(r0, r0 + k + 1))
        logits = self._compute_logits(hidden[idx]).float()
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        V = logits.shape[1]
        off = 0
        for r in reqs:
            k = spec_rows[r.request_id][1]
            rows = logits[off:off + k + 1]
            ok = all(finite[off:off + k + 1])
            off += k + 1
            if not ok:
                bad_ids.add(r.request_id)
                continue
            p = r.params
            if r.num_output_tokens < p.min_tokens:
                block = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if block:
                    rows = rows.clone()
                    for j in range(k + 1):
                        if r.num_output_tokens + j < p.min_tokens:
                            rows[j, block] = float("-inf")
            if p.temperature < 1e-5:
                toks = self.rejection_sampler(list(r.spec_token_ids), None, None,
                                              rows.argmax(dim=-1).tolist(), None)
            else:
                dev = rows.device
                sub = self.sampler.top_k_top_p(
                    rows / p.temperature,
                    torch.full((k + 1,), p.top_k, dtype=torch.int64, device=dev)
                    if p.top_k > 0 else None,
                    torch.full((k + 1,), p.top_p, device=dev) if p.top_p < 1.0 else None)
                probs = torch.softmax(sub, dim=-1)
                toks = self.rejection_sampler(list(r.spec_token_ids), r.draft_probs, probs, None,
                                              self.request_generator(r))
            if isinstance(toks, torch.Tensor):
                toks = toks.tolist()
            toks = list(toks)
            if not 1 <= len(toks) <= k + 1 or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in toks):
                raise ValueError(f"the rejection_sampler step returned {toks!r:.120} for "
                                 f"{k} drafts; expected 1 to {k + 1} token ids in [0, {V})")
            out.spec_outputs[r.request_id] = toks

    def request_generator(self, r: Request) -> torch.Generator:
        """The generator of a random request's draws: its own (seeded) one, created on
        first use, or the engine's."""
        if r.params.seed is None:
            return self.sampler.generator
        if r.generator is None:
            r.generator = torch.Generator(device=self.device)
            r.generator.manual_seed(r.params.seed)
        return r.generator

    # A chunk of at least this many rows runs the LM head of ``LLM.score(positions=)``
    # on at least this many rows (see _score_rows).
    SCORE_HEAD_MIN_ROWS = 16

    def _score_rows(self, hidden: torch.Tensor, pos0: int,
                    chosen: Optional[list[int]]) -> torch.Tensor:
        """LM-head rows (float32 logits) of a score request's chunk: every row
        (``chosen`` None), or only the rows at positions ``chosen`` (``LLM.score(...,
        positions=)``), so that the head and the log-softmax skip the others.

        The chosen rows must equal the same rows of a full score bit for bit. The GEMM
        of a full chunk has ``len(hidden)`` rows, and a CPU GEMM's per-row result can
        depend on the row count and on where a row sits in the batch (oneDNN's packed
        float32 GEMM on this CPU: rows differ at 1-3, 5-7 and 9-11 rows, agree from 12
        on; bfloat16 agreed at every count). So: a chunk shorter than
        ``SCORE_HEAD_MIN_ROWS`` runs the head on all its rows (as the full score does)
        and keeps the chosen ones; a longer chunk runs it on the chosen rows, padded
        with neighbouring rows of the chunk to at least ``SCORE_HEAD_MIN_ROWS``."""
        if self.batch_invariant:  # one row at a time: any subset gives the same rows
            return self._compute_logits(hidden if chosen is None
                                        else hidden[[p - pos0 for p in chosen]])
        if chosen is None:
            return self.model.compute_logits(hidden)
        n = hidden.shape[0]
        offs = [p - pos0 for p in chosen]
        if not offs:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        k = self.SCORE_HEAD_MIN_ROWS
        if n < k or len(offs) >= n:
            return self.model.compute_logits(hidden)[offs]
        if len(offs) >= k:
            return self.model.compute_logits(hidden[offs])
        picked = set(offs)
        pad = [i for i in range(n) if i not in picked][: k - len(offs)]
        head_rows = sorted(picked.union(pad))
        where = {r: i for i, r in enumerate(head_rows)}
        logits = self.model.compute_logits(hidden[head_rows])
        return logits[[where[o] for o in offs]]

    def _execute_graph_decode(self, reqs: list[Request],
                              block_tables: dict[str, list[int]]) -> ModelRunnerOutput:
        """A pure decode step in a CUDA graph: the graph computes the logits and their
        finite flags; the sampler runs eagerly on the real rows."""
        logits, finite = self.cuda_graphs.run(reqs, block_tables)
        out = ModelRunnerOutput()
        bad_ids: set[str] = set()  # int8 caches (whose K/V are checked) run eagerly
        self._sample(out, logits, finite, reqs, bad_ids)
        out.nonfinite_request_ids = sorted(bad_ids)
        return out

    def _sample(self, out: ModelRunnerOutput, logits: torch.Tensor, finite: torch.Tensor,
                reqs: list[Request], bad_ids: set[str]) -> None:
        """Sample one token per row of logits [rows, vocab] (row i belongs to reqs[i]);
        the tokens and the rows' finite flags come back to the host in one transfer (one
        sync per step)."""
        so = self.sampler(logits, self._sampling_metadata(reqs))
        tokens = torch.where(finite, so.sampled, -1).tolist()  # -1: NaN/inf logits
        out.sampler_output = so
        out.sampled_request_ids = [r.request_id for r in reqs]
        out.sampled_token_ids = tokens
        bad_ids.update(r.request_id for r, t in zip(reqs, tokens) if t < 0)

    def _nonfinite_kv_requests(self, scheduled: list[tuple[Request, int]]) -> set[str]:
        """Requests with a token whose K/V was not finite in an int8 cache (which cannot
        store NaN/inf, see ``LayerKVCache.write``)."""
        bad_rows = None
        for kv in self.kv_caches:
            if kv.nonfinite_rows is not None:
                bad_rows = kv.nonfinite_rows if bad_rows is None else bad_rows | kv.nonfinite_rows
                kv.nonfinite_rows = None
        if bad_rows is None:
            return set()
        bad, row = set(), 0
        flags = bad_rows.tolist()
        for req, n in scheduled:
            if any(flags[row:row + n]):
                bad.add(req.request_id)
            row += n
        return bad

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, pos0: int) -> PromptLogprobsChunk:
        """Prompt positions pos0 + 1... as the sampler's logprobs_mode says: log-probs or
        logits (a prompt position is never processed, so "processed_" = "raw_")."""
        logits = self._compute_logits(hidden).float()
        logprobs = logits if self.sampler.logprobs_mode.endswith("logits") \
            else torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(req.prompt_token_ids[pos0 + 1:pos0 + 1 + hidden.shape[0]],
                               dtype=torch.int64, device=logprobs.device)
        tok_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > tok_lp[:, None]).sum(-1) + 1
        n = req.params.prompt_logprobs
        topk_lp = topk_ids = None
        if n > 0:
            topk_lp, topk_ids = logprobs.topk(n, dim=-1)
        return PromptLogprobsChunk(pos0 + 1, targets.tolist(), tok_lp, ranks, topk_ids, topk_lp)
