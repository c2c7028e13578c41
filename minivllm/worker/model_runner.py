"""Model runner: owns the paged KV cache, turns a schedule into batch tensors, runs the
model and the sampler (vLLM: ``vllm/v1/worker/gpu_model_runner.py``).

One step, in :meth:`ModelRunner.execute_model`: ``_prepare_inputs`` flattens the
scheduled requests into :class:`ModelInputs` (token ids, positions, write slots and the
backend-neutral :class:`~minivllm.attention.metadata.CommonAttentionMetadata`); the
attention backend builds its own metadata from that (``build_metadata``, behind
:class:`~minivllm.attention.backends.abstract.AttentionBackend`); the model runs; the LM
head and the sampler run on the rows that get a token. Prompt log-probs and score rows
(:mod:`.score`), sampling tensors and draft verification (:mod:`.sampling`), the
batch-invariant mode (:mod:`.batch_invariant`) and CUDA graphs (:mod:`.cuda_graph`)
live beside it; the KV cache itself in :mod:`minivllm.attention.kv_cache`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from minivllm.attention import kv_cache as kvc
from minivllm.attention.kv_cache import LayerKVCache, kv_cache_bytes_per_block  # noqa: F401
from minivllm.attention.metadata import (CommonAttentionMetadata, prefill_chunk_ref,
                                         slot_mapping_ref)
from minivllm.config import CacheConfig, ModelConfig
from minivllm.request import Request
from minivllm.layers.sampler import Sampler
from minivllm.worker import sampling, score
from minivllm.worker.outputs import ModelRunnerOutput, PromptLogprobsChunk  # noqa: F401

logger = logging.getLogger("minivllm")


@dataclass
class ModelInputs:
    """One step's batch, flattened (vLLM: what ``GPUModelRunner._prepare_inputs`` returns).

    Requests r are scheduled for n_r new tokens each; T = sum n_r rows.

    Attributes:
        input_ids, positions: [T] int64 on the device, the new tokens of every request
            (positions ``num_computed_tokens ..``), concatenated in batch order.
        attn: the backend-neutral attention inputs (write slots [T], per-request rows,
            lengths and block tables); the backend builds its metadata from it.
        sample_reqs, logits_rows: the requests whose whole sequence is now computed and
            their last row (each gets one sampled token; a partial prefill chunk gets none).
        prompt_rows, score_rows: request id -> (first row, first position, rows) of the
            rows that give prompt log-probs / ``LLM.score`` rows.
        spec_rows: request id -> (first verified row, k) of a speculative verification.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: CommonAttentionMetadata
    logits_rows: list[int] = field(default_factory=list)
    sample_reqs: list[Request] = field(default_factory=list)
    prompt_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    score_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    spec_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


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
        batch_invariant: the batch-invariant mode (``EngineArgs.batch_invariant``;
            :func:`~minivllm.worker.batch_invariant.use_batch_invariant`): a request's
            logits do not depend on the batch.
        emulate_cuda_graphs: on CPU, with ``cuda_graph_max_batch_size``, capture decode
            steps in emulated graphs (``EngineArgs.emulate_cuda_graphs``, not a vLLM
            option; :class:`~minivllm.worker.cuda_graph.EmulatedCUDAGraphRunner`). The
            cache then gets one spare slot at the end, where padding rows' slot -1 writes.
        logprobs_mode: the sampler's ``logprobs_mode``.
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
        emulate = bool(emulate_cuda_graphs and cuda_graph_max_batch_size
                       and self.device.type == "cpu")
        self.initialize_kv_cache(spare_slot=emulate)
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
        # chunk (TORCH backend's build_metadata).
        self.prefill_chunk = prefill_chunk_ref
        # The "rejection_sampler" step (chapter 21): verifies a request's draft tokens.
        from minivllm.spec_decode.rejection_sampler import rejection_sampler_ref

        self.rejection_sampler = rejection_sampler_ref
        self.backend = model.layers[0].self_attn.backend  # builds the step's metadata
        self.paged = self.backend.needs_paged_metadata
        self.cuda_graphs = None
        if self.batch_invariant:
            from minivllm.worker.batch_invariant import use_batch_invariant

            use_batch_invariant(self.model, self.device)
        if cuda_graph_max_batch_size:  # decode steps in (emulated) CUDA graphs
            from minivllm.worker.cuda_graph import make_graph_runner

            self.cuda_graphs = make_graph_runner(
                model, self.backend.name, self.paged, cache_config.kv_cache_torch_dtype,
                self.batch_invariant, cuda_graph_max_batch_size, model_config.max_model_len,
                self.block_size, self.device, emulate)

    def initialize_kv_cache(self, spare_slot: bool = False) -> None:
        """Allocate the paged KV cache (vLLM: ``GPUModelRunner.initialize_kv_cache``):
        ``cache_config.num_gpu_blocks * block_size`` slots (plus one spare at the end with
        ``spare_slot``, where emulated CUDA graphs' padding rows write slot -1), one
        :class:`~minivllm.quantization.kv_cache.LayerKVCache` per layer, bound to its
        attention and kept in ``self.kv_caches``
        (:func:`~minivllm.attention.kv_cache.allocate_kv_caches`)."""
        cc = self.cache_config
        self.kv_caches: list[LayerKVCache] = kvc.allocate_kv_caches(
            self.model, cc, self.model_config.head_dim,
            cc.num_gpu_blocks * cc.block_size + spare_slot, self.device)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits``; in batch-invariant mode one row at a time (the LM
        head's GEMM, like every other, can give a row different bits at another M)."""
        if self.batch_invariant:
            from minivllm.layers.linear import rowwise

            return rowwise(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    # --- KV-cache scales (see minivllm.attention.kv_cache) -----------------------------
    def calibrate_kv_scales(self, token_id_lists: list[list[int]]) -> None:
        """Static K/V scales ``amax / qmax`` measured on calibration sequences
        (:func:`~minivllm.quantization.kv_calibration.calibrate_kv_amax`, then
        :func:`~minivllm.attention.kv_cache.set_kv_scales_from_amax`).

        Raises:
            ValueError: NaN/inf K or V in calibration (scales unchanged);
                ``kv_scale_granularity="channel"`` on another backend than TORCH."""
        from minivllm.quantization.kv_calibration import calibrate_kv_amax

        granularity = self.cache_config.kv_scale_granularity
        if granularity == "channel" and self.backend.name != "TORCH":
            raise ValueError("kv_scale_granularity='channel' needs the TORCH attention backend "
                             f"(the {self.backend.name} kernels take [] or [num_kv_heads] "
                             "scales)")
        amaxes = calibrate_kv_amax(self.model, token_id_lists, self.device,
                                   per_channel=granularity == "channel")
        kvc.set_kv_scales_from_amax(self.kv_caches, amaxes, self.cache_config, self.device)

    def kv_cache_scales(self) -> dict:
        """:func:`~minivllm.attention.kv_cache.kv_cache_scales` of this cache."""
        return kvc.kv_cache_scales(self.kv_caches, self.cache_config)

    def request_generator(self, r: Request) -> Optional[torch.Generator]:
        """:func:`~minivllm.worker.sampling.request_generator` with the engine's sampler."""
        return sampling.request_generator(r, self.sampler, self.device)

    # --- the step -------------------------------------------------------------------
    def _prepare_inputs(self, scheduled: list[tuple[Request, int]],
                        block_tables: dict[str, list[int]]) -> ModelInputs:
        """Flatten a schedule into :class:`ModelInputs` (arguments as in
        :meth:`execute_model`). A request with drafts (``spec_token_ids``) runs its
        pending token and the drafts; the write slots come from the "slot_mapping" step,
        ``block_table[pos // block_size] * block_size + pos % block_size``."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        starts, lens, seq_lens, totals, tables = [], [], [], [], []
        logits_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        score_rows: dict[str, tuple[int, int, int]] = {}
        spec_rows: dict[str, tuple[int, int]] = {}
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
                                           torch.arange(start, seq_len), self.block_size))
            starts.append(row)
            lens.append(n)
            seq_lens.append(seq_len)
            totals.append(total)
            tables.append(table)
            if (req.sampling_params.prompt_logprobs is not None
                    and start < req.num_prompt_tokens - 1):
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
        attn = CommonAttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device), query_starts=starts,
            query_lens=lens, seq_lens=seq_lens, num_tokens=totals, block_tables=tables,
            num_actual_tokens=row, block_size=self.block_size, device=self.device,
            num_slots=self.kv_caches[0].key.shape[0] if self.kv_caches else None,
            read_slot_mapping=self.read_slot_mapping, prefill_chunk=self.prefill_chunk)
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn=attn, logits_rows=logits_rows, sample_reqs=sample_reqs,
            prompt_rows=prompt_rows, score_rows=score_rows, spec_rows=spec_rows)

    @torch.inference_mode()
    def execute_model(self, scheduled: list[tuple[Request, int]],
                      block_tables: dict[str, list[int]]) -> ModelRunnerOutput:
        """Run the model and the sampler on one scheduled step (vLLM:
        ``GPUModelRunner.execute_model``).

        Args:
            scheduled: ``SchedulerOutput.scheduled``, ``(request, n)`` in batch order; the
                new tokens of a request are positions ``[num_computed_tokens,
                num_computed_tokens + n)`` of ``request.all_token_ids`` (for a request
                with drafts, its pending token and then ``spec_token_ids``).
            block_tables: request id -> its block ids (``KVCacheManager.get_block_ids``),
                already long enough for the new tokens.

        Returns:
            a :class:`ModelRunnerOutput`: one sampled token id per request whose whole
            sequence is now computed (host ints, -1 where its logits held NaN/inf, with
            the ``SamplerOutput``: log-probs, ranks), prompt log-probs and ``LLM.score``
            rows (float32, host) for the requests that asked, the tokens each
            speculative verification emits, and ``nonfinite_request_ids`` (requests whose
            logits, int8 K/V, prompt log-probs or score rows held NaN/inf). Request
            state is not changed here, apart from seeded generators created on first
            use: the scheduler counts the new tokens as computed
            (``update_after_step``) and the engine appends the sampled ones.

        Order of work, with T = sum of n and R the requests that get a token:

        1. With CUDA graphs on, a pure decode batch that fits a captured graph replays it
           instead (``_execute_graph_decode``; the graph computes the logits).
        2. ``_prepare_inputs``: input_ids and positions [T] int64, write slots [T]
           (the "slot_mapping" step), the rows of each request, as :class:`ModelInputs`.
        3. ``backend.build_metadata``: the attention metadata of this step (TORCH: read
           slots per prefill and per decode group; TRITON: padded int32 block tables
           and lengths).
        4. The model's forward writes this step's K/V into the cache at the write slots
           and returns hidden states [T, hidden] in the compute dtype.
        5. The LM head on the R rows (``_compute_logits``): logits [R, vocab] float32;
           the sampler draws one token per row (``_sample``, one host sync).
        6. Draft verification (:func:`~minivllm.worker.sampling.verify_drafts`), then
           prompt log-probs and score rows per request (:mod:`minivllm.worker.score`).
        """
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(scheduled):
            return self._execute_graph_decode([req for req, _ in scheduled], block_tables)
        inp = self._prepare_inputs(scheduled, block_tables)
        attn_metadata = self.backend.build_metadata(inp.attn)
        hidden = self.model(inp.input_ids, inp.positions, attn_metadata)
        out = ModelRunnerOutput()
        bad_ids = kvc.nonfinite_kv_requests(
            self.kv_caches, [r.request_id for r, _ in scheduled], inp.attn.query_lens)
        if inp.sample_reqs:
            logits = self._compute_logits(hidden[inp.logits_rows])
            # A row holds NaN/inf iff its sum does (finite logits cannot overflow a sum
            # of 1e5 float32 terms); cheaper than isfinite over [rows, vocab].
            self._sample(out, logits, torch.isfinite(logits.sum(dim=-1)), inp.sample_reqs,
                         bad_ids)
        if inp.spec_rows:
            reqs = [r for r, _ in scheduled if r.request_id in inp.spec_rows]
            spec = [inp.spec_rows[r.request_id] for r in reqs]
            idx = [i for r0, k in spec for i in range(r0, r0 + k + 1)]
            out.spec_outputs = sampling.verify_drafts(
                self._compute_logits(hidden[idx]).float(), reqs, [k for _, k in spec],
                self.rejection_sampler, self.sampler, self.device, bad_ids)
        for req, _ in scheduled:
            rid = req.request_id
            if rid in inp.prompt_rows:
                row0, pos0, count = inp.prompt_rows[rid]
                chunk = score.prompt_logprobs(
                    self._compute_logits(hidden[row0:row0 + count]).float(), req, pos0,
                    self.sampler.logprobs_mode)
                out.prompt_logprobs[rid] = chunk
                if not bool(torch.isfinite(chunk.token_logprobs).all()):
                    bad_ids.add(rid)
            if rid in inp.score_rows:
                row0, pos0, count = inp.score_rows[rid]
                assert req.score is not None  # score rows belong to score requests
                chosen = req.score.chosen_in(pos0, count)
                rows = score.score_logits(self._compute_logits, hidden[row0:row0 + count],
                                          pos0, chosen, self.batch_invariant,
                                          self.model.vocab_size)
                out.score_rows[rid], finite = score.score_chunk(req, rows, pos0, count, chosen)
                if not finite:
                    bad_ids.add(rid)
        out.nonfinite_request_ids = sorted(bad_ids)
        return out

    def _execute_graph_decode(self, reqs: list[Request],
                              block_tables: dict[str, list[int]]) -> ModelRunnerOutput:
        """A pure decode step in a CUDA graph: the graph computes the logits and their
        finite flags; the sampler runs eagerly on the real rows."""
        assert self.cuda_graphs is not None  # only called when graphs were captured
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
        so = self.sampler(logits, sampling.sampling_metadata(reqs, self.device))
        tokens = torch.where(finite, so.sampled, -1).tolist()  # -1: NaN/inf logits
        out.sampler_output = so
        out.sampled_request_ids = [r.request_id for r in reqs]
        out.sampled_token_ids = tokens
        bad_ids.update(r.request_id for r, t in zip(reqs, tokens) if t < 0)
