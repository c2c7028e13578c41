"""Planted faults: known, local numerical bugs to put into a running engine.

Chapters use them to show what a bug looks like in the metrics, tests use them to check
that the layer diff finds the right layer, and labs hide one for the learner to find.
Each is a context manager built on the step registry (:mod:`minivllm.steps`): it swaps
one step of one layer (or of the whole engine) for a faulty function and restores it on
exit. While one is active the engine runs every step eagerly (a CUDA graph captured
before would replay the unpatched step).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from minivllm.layers.rotary_embedding import rope_table_ref


def _check_llm(llm, layer: int):
    from minivllm.llm import LLM

    if not isinstance(llm, LLM):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    n = len(llm.llm_engine.model_runner.model.layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise ValueError(f"layer must be in [0, {n}), got {layer}")


def rms_norm_fp16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed entirely in float16 (input, sum of squares, scale): the classic
    "forgot to upcast" bug. Same signature as ``rms_norm_ref``."""
    h = x.to(torch.float16)
    variance = h.pow(2).mean(-1, keepdim=True)
    out = h * torch.rsqrt(variance + eps)
    return (weight.to(torch.float16) * out).to(x.dtype)


@contextlib.contextmanager
def fp16_rmsnorm(llm, layer: int, which: str = "input_layernorm"):
    """Compute one layer's RMSNorm in float16 (the "rms_norm" step of that module).

    Args:
        which: "input_layernorm" (before attention) or "post_attention_layernorm".
    """
    if which not in ("input_layernorm", "post_attention_layernorm"):
        raise ValueError(f"which must be 'input_layernorm' or 'post_attention_layernorm', "
                         f"got {which!r}")
    _check_llm(llm, layer)
    with llm.swap_step("rms_norm", rms_norm_fp16, where=f"layers.{layer}.{which}"):
        yield


@contextlib.contextmanager
def wrong_rope_theta(llm, layer, theta: float):
    """Give attention a rotary table with base ``theta`` (the "rotary.table" step).

    Args:
        layer: a decoder layer index (the model's other layers keep their table: a config
            bug where one module reads the wrong field), or None: every layer (the config
            itself is wrong, e.g. a converter that writes Llama 2's 10,000 for a model
            trained with another theta; the same as ``hf_overrides={"rope_theta": theta}``).
        theta: the wrong base, > 0. A model with rope scaling keeps its scaling.
    """
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ValueError(f"theta must be > 0, got {theta}")
    if layer is not None:
        _check_llm(llm, layer)
    else:
        _check_llm(llm, 0)

    def table(head_dim, max_position, base, rope_scaling=None):
        return rope_table_ref(head_dim, max_position, theta, rope_scaling)

    with llm.swap_step("rotary.table", table, where=layer):
        yield


ROPE_TABLE_STAGES = ("positions", "angles", "values")


def rope_table_low_precision(head_dim: int, max_position: int, base: float,
                             rope_scaling: dict | None = None, *,
                             dtype: torch.dtype = torch.bfloat16,
                             stage: str = "angles") -> tuple[torch.Tensor, torch.Tensor]:
    """The "rotary.table" step with part of it in a 16-bit ``dtype`` (float32 result).

    stage:
        "positions": the positions are cast to ``dtype`` before the float32 product
            (huggingface/candle PR #3520: bf16 holds the integers exactly only up to
            256, so 257 becomes 256 and 15962 another multiple of 64);
        "angles": positions, inverse frequencies, their product and cos/sin all in
            ``dtype``, as under bf16 autocast (transformers PR #29285; EleutherAI/gpt-neox
            #1003 in fp16): the angle's rounding step grows with the angle, so the error
            grows with position;
        "values": the float32 table rounded to ``dtype`` once it is computed (the error
            of a value in [-1, 1], about 2^-9 in bf16, at any position).

    Raises:
        ValueError: an unknown stage or a dtype that is not float16/bfloat16.
    """
    if stage not in ROPE_TABLE_STAGES:
        raise ValueError(f"stage must be one of {ROPE_TABLE_STAGES}, got {stage!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if stage == "values":
        cos, sin = rope_table_ref(head_dim, max_position, base, rope_scaling)
        return cos.to(dtype).float(), sin.to(dtype).float()
    from minivllm.layers.rotary_embedding import rope_inv_freq

    inv_freq, attention_factor = rope_inv_freq(head_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64)
    if stage == "positions":
        freqs = torch.outer(t.to(dtype).float(), inv_freq)
    else:
        freqs = torch.outer(t.to(dtype), inv_freq.to(dtype))  # the product in dtype too
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return cos.float(), sin.float()


@contextlib.contextmanager
def low_precision_rope_table(llm, dtype: torch.dtype = torch.bfloat16, stage: str = "angles",
                             layer=None):
    """Install :func:`rope_table_low_precision` (the "rotary.table" step) in every layer
    (``layer=None``: one table is shared by all layers, as the loader builds it) or in
    one layer.

    Args:
        dtype: torch.bfloat16 or torch.float16.
        stage: "positions", "angles" or "values" (see :func:`rope_table_low_precision`).
        layer: None (all layers) or a decoder layer index.
    """
    if layer is not None:
        _check_llm(llm, layer)
    else:
        _check_llm(llm, 0)
    rope_table_low_precision(2, 1, 10000.0, dtype=dtype, stage=stage)  # check the arguments

    def table(head_dim, max_position, base, rope_scaling=None):
        return rope_table_low_precision(head_dim, max_position, base, rope_scaling,
                                        dtype=dtype, stage=stage)

    with llm.swap_step("rotary.table", table, where=layer):
        yield


@contextlib.contextmanager
def drop_outputs_on_resume(llm):
    """Preemption by recompute that forgets what the request generated (the
    "scheduler.preempt" step): the resumed request re-prefills its prompt only, so it
    generates its answer again from the start and its output holds the first part twice.
    vLLM had bugs of this family: #16832 (outputs truncated after a RECOMPUTE preemption),
    PR #5349 (inconsistent state after recompute), vllm-gaudi PR #524. Only requests that
    are preempted change."""
    from minivllm.core.scheduler import preempt_request_ref

    block_size = llm.llm_engine.cache_config.block_size

    def preempt(request):
        preempt_request_ref(request)
        del request.all_token_ids[request.num_prompt_tokens:]  # the bug: context lost
        del request.block_hashes[request.num_prompt_tokens // block_size:]

    with llm.swap_step("scheduler.preempt", preempt):
        yield


def preempt_double_append(request) -> None:
    """The "scheduler.preempt" step with the double-append bug: the reference reset, then
    the generated tokens appended to ``all_token_ids``, which already holds them (only as
    many as fit under the request's ``max_total_tokens``: the resumed sequence must still
    fit the KV pool, else the engine could never run it)."""
    from minivllm.core.scheduler import preempt_request_ref

    preempt_request_ref(request)
    room = max(0, request.max_total_tokens - request.num_tokens - 1)
    request.all_token_ids.extend(request.output_token_ids[:room])  # the bug


@contextlib.contextmanager
def double_append_on_resume(llm):
    """Preemption by recompute that appends the generated tokens to a sequence that
    already holds them (:func:`preempt_double_append` as the "scheduler.preempt" step):
    the resumed request re-prefills prompt + output + output, so it continues a text that
    repeats itself, and it reaches its length limit (counted on the whole sequence) early:
    a truncated answer, as in vllm #16832. vllm-gaudi PR #524 fixed output tokens appended
    twice. Requests that are never preempted do not change."""
    with llm.swap_step("scheduler.preempt", preempt_double_append):
        yield


def penalty_prompt_accounting_steps(llm=None, preempt=None):
    """The "sampler.penalties" step as an engine that counts re-prefilled output tokens
    as prompt tokens: after a preemption, the tokens a request had generated before it
    are handed to the penalties as part of the prompt (vllm PR #5349's review: recompute
    that re-prefills outputs as "prompt" changes repetition and frequency penalties).
    Frequency and presence penalties (output only) forget them; repetition (prompt or
    output) does not change.

    Args:
        llm: unused (the steps hold their own state); kept for a uniform call.
        preempt: the "scheduler.preempt" function to wrap (default the reference; e.g.
            :func:`preempt_double_append` to plant both bugs).
    Returns:
        ``(preempt, penalties)``: the two steps to swap together (the preempt step notes
        how many outputs each request had when it was preempted);
        :func:`penalty_prompt_accounting` does that.
    """
    from minivllm.core.scheduler import preempt_request_ref
    from minivllm.layers.sampler import penalties_ref

    base = preempt if preempt is not None else preempt_request_ref
    recomputed: dict[int, int] = {}  # id(request.output_token_ids) -> outputs at the last preemption

    def preempt_step(request):
        base(request)
        recomputed[id(request.output_token_ids)] = request.num_output_tokens

    def penalties(logits, prompt_token_ids, output_token_ids, presence_penalty,
                  frequency_penalty, repetition_penalty):
        prompts, outputs = [], []
        for p, o in zip(prompt_token_ids, output_token_ids):
            k = recomputed.get(id(o), 0)
            prompts.append(list(p) + list(o[:k]))  # the bug: re-prefilled output as prompt
            outputs.append(list(o[k:]))
        return penalties_ref(logits, prompts, outputs, presence_penalty, frequency_penalty,
                             repetition_penalty)

    return preempt_step, penalties


@contextlib.contextmanager
def penalty_prompt_accounting(llm):
    """Plant :func:`penalty_prompt_accounting_steps` (the "scheduler.preempt" and
    "sampler.penalties" steps). Only preempted requests with a frequency or presence
    penalty change."""
    preempt, penalties = penalty_prompt_accounting_steps(llm)
    with llm.swap_step("scheduler.preempt", preempt), \
            llm.swap_step("sampler.penalties", penalties):
        yield


def decode_attention_softmax_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   seq_lens: torch.Tensor, scale: float,
                                   softmax_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode attention written out (scores, mask, softmax, weighted sum) with the softmax
    computed in ``softmax_dtype``: the scores are rounded to it, normalized in it, and the
    probabilities are cast back to q's dtype for the sum over V. Same signature and
    layout as ``decode_attention_ref`` (the "attention.decode" step) plus the dtype; with
    ``softmax_dtype=torch.float32`` it is the reference up to float32 rounding.

    A decode kernel that keeps its probabilities in the activation dtype (bf16/fp16)
    while the prefill kernel accumulates them in float32 is the classic decode-only bug:
    the prompt's numbers stay right, every generated token's attention is rounded.
    """
    B, H, D = q.shape
    L, hkv = k.shape[1], k.shape[2]
    group = H // hkv
    kk = k.repeat_interleave(group, dim=2)  # [B, L, H, D]: query head h reads KV head h // group
    vv = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q, kk) * scale
    mask = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs.to(q.dtype), vv).to(q.dtype)


@contextlib.contextmanager
def decode_softmax_low_precision(llm, layer: int, dtype: torch.dtype = torch.bfloat16):
    """Compute one layer's **decode** attention softmax in ``dtype`` (the
    "attention.decode" step of that layer; prefill keeps the reference). A decode-only
    fault: ``LLM.score(ids, mode="prefill")`` is unchanged, ``mode="decode"`` drifts, and
    ``layer_diff`` between the two modes names the layer (chapter 6)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                         f"got {dtype}")
    _check_llm(llm, layer)

    def decode(q, k, v, seq_lens, scale):
        return decode_attention_softmax_dtype(q, k, v, seq_lens, scale, softmax_dtype=dtype)

    with llm.swap_step("attention.decode", decode, where=layer):
        yield


# --- paged-attention mapping faults (chapter 7) -------------------------------------------

def slot_mapping_off_by_one(block_table: torch.Tensor, positions: torch.Tensor,
                            block_size: int) -> torch.Tensor:
    """The "slot_mapping" step with an off-by-one at block boundaries: the block index is
    taken from ``pos - 1`` (clamped at 0) while the offset is ``pos % block_size``, a
    1-based/0-based mix-up. Every position is mapped right except the first token of each
    block after the first: position ``k * block_size`` (k >= 1) lands in the slot of
    position ``(k - 1) * block_size``, overwriting that token's K/V. Same signature and
    shapes as ``slot_mapping_ref`` (int64 in, int64 out)."""
    block = torch.clamp(positions - 1, min=0) // block_size
    return block_table.gather(-1, block) * block_size + positions % block_size


@contextlib.contextmanager
def off_by_one_slots(llm):
    """Plant :func:`slot_mapping_off_by_one` for writer and reader (the "slot_mapping"
    step). A sequence of at most ``block_size`` tokens is untouched; from the first block
    boundary on, the first token of each later block overwrites the first token of the
    block before it. Token by token (decode) the damage starts at position
    ``block_size``; a prefill that crosses a boundary writes both tokens in one call, so
    its earlier positions read the later token's K/V as well."""
    if not hasattr(llm, "swap_step"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    with llm.swap_step("slot_mapping", slot_mapping_off_by_one):
        yield


@contextlib.contextmanager
def reader_block_size(llm, block_size: int):
    """The reader computes its slots with ``block_size`` while the writer (and the block
    manager) use the engine's: a writer/reader block-size mismatch (the
    "slot_mapping.read" step; TORCH backend). The reader's slot
    ``table[pos // block_size] * block_size + pos % block_size`` points elsewhere in the
    pool, or past its end: then the read raises an index error on CPU (on a GPU an
    out-of-bounds read is an illegal memory access, or garbage)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    from minivllm.attention.metadata import slot_mapping_ref

    def read(block_table, positions, _engine_block_size):
        return slot_mapping_ref(block_table, positions, block_size)

    with llm.swap_step("slot_mapping.read", read):
        yield


@contextlib.contextmanager
def zeroed_block_tables(llm):
    """vllm #5543, fixed by vllm PR #7018 ("Fix block table for seqs that have prefix
    cache hits"): in a step whose batch mixes prefills **with** computed context (a
    prefix-cache hit, or a later chunk) and prefills **without** it, the attention reader
    gets an all-zero block table for the rows without context, so they attend to the K/V
    in block 0 (someone else's, or stale) instead of their own. Writes stay right, steps
    without such a mix and decode steps stay right.

    Planted on two steps: "slot_mapping" (the reference, which also notes per step which
    prefills start at position 0 and whether any starts later) and "slot_mapping.read"
    (which zeroes the table of a prefill without context when the step has one with
    context). The model runner computes every write slot of a step before any read slot,
    which is how the two functions tell steps apart."""
    if not hasattr(llm, "swap_step"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    from minivllm.attention.metadata import slot_mapping_ref

    state: dict[str, Any] = {"reading": True, "fresh": set(), "with_context": False}

    def write(block_table, positions, block_size):
        if state["reading"]:  # the first write of a new step
            state.update(reading=False, fresh=set(), with_context=False)
        if block_table.dim() == 1 and positions.shape[-1] > 1:  # a prefill (or a chunk)
            if int(positions[0]) == 0:
                state["fresh"].add(tuple(block_table.tolist()))
            else:
                state["with_context"] = True
        return slot_mapping_ref(block_table, positions, block_size)

    def read(block_table, positions, block_size):
        state["reading"] = True
        if (block_table.dim() == 1 and state["with_context"]
                and tuple(block_table.tolist()) in state["fresh"]):
            block_table = torch.zeros_like(block_table)  # the bug: an empty row, padded
        return slot_mapping_ref(block_table, positions, block_size)

    with llm.swap_step("slot_mapping", write), llm.swap_step("slot_mapping.read", read):
        yield


# --- prompt-processing faults (chapter 26) ------------------------------------------------

_BOS_ADDING: dict = {}


def bos_adding_tokenizer(tokenizer):
    """A copy of ``tokenizer`` that puts its ``bos_token`` in front of every text encoded
    with ``add_special_tokens=True`` (the default), as Llama-3's tokenizer does with
    ``<|begin_of_text|>``. SmolLM2's own tokenizer adds **no** BOS (``encode("Hello")`` is
    ``[19556]`` either way) and its ``bos_token`` is ``<|im_start|>`` (id 1), the token its
    chat template opens every message with; this copy behaves like a tokenizer that adds
    it. The original is not changed (the copy is cached per tokenizer object).

    Raises:
        ValueError: a tokenizer without a bos_token, or not backed by ``tokenizers``.
    """
    key = id(tokenizer)
    hit = _BOS_ADDING.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    import copy

    from tokenizers.processors import TemplateProcessing

    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    backend = getattr(tokenizer, "_tokenizer", None)
    if bos is None or bos_id is None or backend is None:
        raise ValueError("bos_adding_tokenizer needs a fast (tokenizers-backed) tokenizer "
                         f"with a bos_token; got {type(tokenizer).__name__} with bos_token="
                         f"{bos!r}")
    out = copy.deepcopy(tokenizer)
    out._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    _BOS_ADDING[key] = (tokenizer, out)
    return out


def render_chat_doubled_bos(tokenizer, conversation, add_generation_prompt: bool = True,
                            chat_template=None) -> list[int]:
    """The "prompt.chat_template" step with vLLM's pre-#16976 bug: render the template
    (which already opens with the BOS/start token), then tokenize the text with
    ``add_special_tokens=True`` through a tokenizer that adds a BOS
    (:func:`bos_adding_tokenizer`): the ids start with the token twice. Same signature
    as ``tokenizer.py:render_chat_ref``; the result is ``[bos_id] + render_chat_ref(...)``.
    vllm PR #16976; trl #3853; tpu-inference PR #1380 (GSM8K 0.90 -> 0.76 on
    Llama-3.3-70B); retaining-by-doing #5."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    return list(bos_adding_tokenizer(tokenizer).encode(text))  # the bug: special tokens on


@contextlib.contextmanager
def doubled_bos(llm):
    """Plant :func:`render_chat_doubled_bos` on the "prompt.chat_template" step: every
    ``LLM.chat`` prompt starts with ``<|im_start|><|im_start|>system`` (two id-1 tokens)
    on the embedded model. The unmodified engine renders then tokenizes with
    ``add_special_tokens=False``, so it cannot double the token with any tokenizer."""
    if not hasattr(llm, "swap_step"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    with llm.swap_step("prompt.chat_template", render_chat_doubled_bos):
        yield


def truncate_prompt_right(token_ids: list[int], truncate_prompt_tokens: int) -> list[int]:
    """The "prompt.truncate" step cut on the wrong side: keep the **first** k ids
    (transformers' default ``truncation_side="right"``). A chat prompt loses its end:
    the question and the generation prompt. Same signature as ``truncate_prompt_ref``."""
    return list(token_ids[:truncate_prompt_tokens])


@contextlib.contextmanager
def right_truncation(llm):
    """Plant :func:`truncate_prompt_right` on the "prompt.truncate" step (only requests
    with ``SamplingParams.truncate_prompt_tokens`` are affected)."""
    if not hasattr(llm, "swap_step"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    with llm.swap_step("prompt.truncate", truncate_prompt_right):
        yield
# --- prefix-cache key faults (chapter 22) ---------------------------------------------------

def hash_block_unchained(parent_hash, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """The "block_hash" step without its chain: each block hashed on its own tokens (and
    extra keys) only, as if every block were a first block. Same signature and output
    (32 bytes) as ``hash_block_tokens``. Equal hashes no longer mean equal prefixes: a
    block whose 16 tokens were cached anywhere (at another position, after another
    prefix) is found again."""
    from minivllm.core.kv_cache_manager import hash_block_tokens

    return hash_block_tokens(None, token_ids, extra_keys)


@contextlib.contextmanager
def unchained_block_hash(llm):
    """Plant :func:`hash_block_unchained` as the engine's "block_hash" step. The lookup
    still walks a request's blocks from the first and stops at the first miss, so a
    false hit needs the request's earlier blocks to hit too, but any cached block with
    the same tokens will do, wherever it was computed: the same retrieved passages in
    another order, or a block repeated inside a prompt, reuse K/V computed at other
    positions after other text. Generations change and the scheduler skips computing
    those tokens (the prefix-cache hit count rises). The prefix cache is reset on entry
    and exit, so no block cached under one key function is found under the other; use it
    with no requests in flight."""
    if not hasattr(llm, "swap_step"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise ValueError("unchained_block_hash: plant it with no requests in flight")
    engine.reset_prefix_cache()
    try:
        with llm.swap_step("block_hash", hash_block_unchained):
            yield
    finally:
        engine.reset_prefix_cache()


# --- chunked-prefill faults (chapter 23) --------------------------------------------------

def prefill_chunk_seqlen_k_full(block_table: torch.Tensor, start: int, n: int,
                                block_size: int, num_tokens: int):
    """The "prefill_chunk" step with the key length taken from the request's whole length
    (``seqlen_k = num_tokens``) instead of the chunk's end (``start + n``): nano-vllm #212,
    fixed by PR #213 ("correct seqlen_k to chunk boundary in prepare_prefill"). The chunk
    reads the slots of positions ``0 .. num_tokens - 1``, the later ones not written yet
    (zeros in a fresh pool, stale K/V in a reused block), under FlashAttention's
    bottom-right causal alignment: query i attends to keys ``0 .. num_tokens - n + i``,
    i.e. to unwritten positions past itself. The last chunk (and an unchunked prefill)
    has ``start + n == num_tokens`` and is right. Needs a block table covering
    ``num_tokens`` (see :func:`chunk_seqlen_k_full`)."""
    from minivllm.attention.metadata import chunk_causal_mask, slot_mapping_ref

    L = num_tokens  # the bug: should be start + n
    slots = slot_mapping_ref(block_table, torch.arange(L), block_size)
    return slots, chunk_causal_mask(n, L)


def prefill_chunk_no_past(block_table: torch.Tensor, start: int, n: int, block_size: int,
                          num_tokens: int):
    """The "prefill_chunk" step that forgets earlier chunks (kekzl/imp PRs #114/#117): a
    chunk reads only its own n slots (positions ``start .. start + n - 1``) under a plain
    lower-triangular mask, so a token in chunk k never sees chunks 0..k-1 (a needle in an
    earlier chunk is lost). The first chunk (and an unchunked prefill) is right."""
    from minivllm.attention.metadata import chunk_causal_mask, slot_mapping_ref

    slots = slot_mapping_ref(block_table, torch.arange(start, start + n), block_size)
    return slots, chunk_causal_mask(n, n)


def _check_torch_llm(llm):
    from minivllm.llm import LLM

    if not isinstance(llm, LLM):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")


@contextlib.contextmanager
def chunk_seqlen_k_full(llm):
    """Plant :func:`prefill_chunk_seqlen_k_full` (the "prefill_chunk" step; TORCH
    backend). Like nano-vllm, whose block manager allocates a sequence's every block at
    admission, the engine here allocates a request's whole sequence when it is first
    scheduled (``KVCacheManager.allocate_slots`` wrapped for the block), so the slots the
    wrong key length reads exist. Only chunked prefills change: with a budget
    (``max_num_batched_tokens``) >= the prompt, nothing does."""
    _check_torch_llm(llm)
    kv = llm.llm_engine.kv_cache_manager
    orig = kv.allocate_slots
    bs = kv.block_size

    def allocate_whole(request, num_new_tokens, new_computed_blocks=None):
        done = request.num_computed_tokens + len(new_computed_blocks or []) * bs
        return orig(request, max(num_new_tokens, request.num_tokens - done),
                    new_computed_blocks)

    had = "allocate_slots" in vars(kv)
    with llm.swap_step("prefill_chunk", prefill_chunk_seqlen_k_full):
        kv.allocate_slots = allocate_whole
        try:
            yield
        finally:
            if had:
                kv.allocate_slots = orig
            else:
                del kv.allocate_slots  # back to the class method


@contextlib.contextmanager
def chunk_no_past_kv(llm):
    """Plant :func:`prefill_chunk_no_past` (the "prefill_chunk" step; TORCH backend): every
    prefill chunk attends only to itself. Only chunked prefills change."""
    _check_torch_llm(llm)
    with llm.swap_step("prefill_chunk", prefill_chunk_no_past):
        yield


@contextlib.contextmanager
def skip_prefix_reset_on_rescale(llm):
    """``calibrate_kv_scales`` without its prefix-cache reset: blocks quantized with the
    old K/V scales stay findable and are read back with the new ones (each cached K/V
    value comes back multiplied by new scale / old scale). The K/V scales are an
    engine-wide setting, not part of the cache key, so the engine empties the cache when
    they change (``LLMEngine.calibrate_kv_scales``); this fault forgets that.

    Not a step of the registry: it wraps this engine's ``calibrate_kv_scales`` so that the
    KV-cache manager's ``reset_prefix_cache`` does nothing while it runs (both restored on
    exit). Needs a quantized KV cache with static scales (what calibration is for)."""
    if not hasattr(llm, "llm_engine"):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    calibrate = engine.calibrate_kv_scales

    def calibrate_without_reset(token_id_lists=None):
        kv.reset_prefix_cache = lambda: True  # the bug: the cache keeps its blocks
        try:
            return calibrate(token_id_lists)
        finally:
            del kv.reset_prefix_cache

    engine.calibrate_kv_scales = calibrate_without_reset
    try:
        yield
    finally:
        del engine.calibrate_kv_scales


# --- sampling faults (chapter 20) ---------------------------------------------------------

def top_k_top_p_wrong_order(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """The "sampler.top_k_top_p" step with the filters in the wrong order: top-p on the
    full distribution first, then top-k (vllm #718, fixed by vllm PR #1885; HF and vLLM
    now do top-k first, then top-p on the renormalised survivors). Same signature and
    tie rules as :func:`minivllm.layers.sampler.apply_top_k_top_p`. Logits [0.1, 0.2, 0.3,
    0.4], k=2, p=0.5 keep two tokens ([0, 0, .475, .525]) where the right order keeps one."""
    from minivllm.layers.sampler import apply_top_k_top_p

    return apply_top_k_top_p(apply_top_k_top_p(logits, None, top_p), top_k, None)


@contextlib.contextmanager
def top_p_before_top_k(llm):
    """Plant :func:`top_k_top_p_wrong_order` (the "sampler.top_k_top_p" step). Only
    requests with both ``top_k`` and ``top_p`` change."""
    with llm.swap_step("sampler.top_k_top_p", top_k_top_p_wrong_order):
        yield


def penalties_prompt_output_mixed(logits, prompt_token_ids, output_token_ids, presence_penalty,
                                  frequency_penalty, repetition_penalty):
    """The "sampler.penalties" step with vllm-metal's accounting before PR #69 (2026-01-10,
    reproduced there with SmolLM2-135M and the prompt "Paris Paris ..."): on the first step
    (no output yet) the repetition penalty does not see the prompt; on later steps prompt
    and output are merged into one list, so frequency and presence penalties also count
    the prompt's tokens. Same signature as :func:`minivllm.layers.sampler.penalties_ref`."""
    from minivllm.layers.sampler import penalties_ref

    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for p, o in zip(prompt_token_ids, output_token_ids):
        if len(o) == 0:
            prompts.append([])  # the bug: the first step forgets the prompt
            outputs.append([])
        else:
            prompts.append([])
            outputs.append(list(p) + list(o))  # the bug: the prompt counted as output
    return penalties_ref(logits, prompts, outputs, presence_penalty, frequency_penalty,
                         repetition_penalty)


@contextlib.contextmanager
def penalty_accounting_mixed(llm):
    """Plant :func:`penalties_prompt_output_mixed` (the "sampler.penalties" step)."""
    with llm.swap_step("sampler.penalties", penalties_prompt_output_mixed):
        yield


@contextlib.contextmanager
def residual_scale_reparam(llm, c: float = 4.0):
    """Multiply the residual stream by ``c`` without changing what the model computes (an
    exact reparametrization, chapters 10 and 12), through three registry steps:

    - "embedding": the embedding rows times ``c`` (the tied LM head keeps its weight);
    - "linear" at every ``o_proj`` and ``down_proj``: the output times ``c`` (the same as
      their weights times ``c``), so each layer adds ``c`` times its old update;
    - every RMSNorm's ``eps`` attribute times ``c**2`` (restored on exit), so that
      ``RMSNorm(c x; c^2 eps) = RMSNorm(x; eps)`` exactly, and everything a norm feeds
      (attention, MLP, the LM head) sees the same numbers as before. The attribute, not
      an "rms_norm" swap, so that whichever norm runs gets the compensated eps: the
      reference, a planted fault (:func:`rmsnorm_no_upcast`), a swapped
      "fused_add_rms_norm" step or a learner's function (chapter 10's lab).

    In exact arithmetic the logits do not change. With ``c`` a power of two every one of
    these scalings is exact in float32, bfloat16 and float16 alike (only the exponent
    moves) until a value passes the format's largest finite number: the engine's logits
    stay bit for bit the same (``tests/test_dtype_rule.py``), while the residual stream
    peaks ``c`` times higher. The embedded SmolLM2's peak is ~22.5k, 34 % of float16's
    65504; ``c=4`` takes it past it, so a float16 engine overflows (inf, then NaN) where
    bfloat16 and float32 do not: the pattern of models with large activations served in
    float16 (Gemma 3, transformers #36822; T5's ``wo``; OLMo's fp32 checkpoints served as
    fp16, INCIDENTS #13-14). Other ``c`` work too, exact up to one rounding per scaling.

    Args:
        llm: an ``LLM``.
        c: the scale, a finite number > 0 (a power of two for an exact reparametrization).
    Raises:
        ValueError: ``c`` not a finite positive number.
        TypeError: ``llm`` not an ``LLM``.
    """
    from minivllm.layers.linear import linear_ref
    from minivllm.layers.rms_norm import RMSNorm
    from minivllm.llm import LLM
    from minivllm.models.llama import embedding_ref

    if not isinstance(llm, LLM):
        raise TypeError(f"faults are planted into an LLM, got {type(llm).__name__}")
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf"):
        raise ValueError(f"c must be a finite number > 0, got {c!r}")
    c = float(c)

    def embedding(input_ids, weight):
        return embedding_ref(input_ids, weight) * c

    def linear(x, weight, bias):
        return linear_ref(x, weight, bias) * c

    norms = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, RMSNorm)]
    with llm.swap_step("embedding", embedding), \
            llm.swap_step("linear", linear, where="*.o_proj"), \
            llm.swap_step("linear", linear, where="*.down_proj"):
        old = [m.eps for m in norms]
        for m in norms:
            m.eps = m.eps * c * c
        try:
            yield
        finally:
            for m, e in zip(norms, old):
                m.eps = e


# --- normalization and the residual stream (chapter 10) -----------------------------------

def rms_norm_no_upcast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The "rms_norm" step with its mean square taken in the activation dtype: the
    "forgot to upcast" bug, with only the statistics wrong. ``x.pow(2).mean(-1)`` runs
    on the input's own dtype (fp16: a square past 65504, i.e. any |x| > 255.9, is inf,
    so the row's variance is inf and the row normalises to 0; bf16: every square and
    the mean rounded to 8 significant bits); the normalisation itself is done in float32
    as in ``rms_norm_ref``. Identical to the reference for float32 inputs. Same
    signature and output dtype as ``rms_norm_ref``."""
    variance = x.pow(2).mean(-1, keepdim=True)  # the bug: no .to(torch.float32) first
    h = x.to(torch.float32) * torch.rsqrt(variance.to(torch.float32) + eps)
    return weight * h.to(x.dtype)


@contextlib.contextmanager
def rmsnorm_no_upcast(llm, where=None):
    """Plant :func:`rms_norm_no_upcast` as the "rms_norm" step: in every RMSNorm
    (``where=None``), or where ``where`` says (a layer index, a list of them, or a
    module-name pattern as in ``LLM.swap_step``). On the embedded model in float16 the
    tokens whose residual stream passes |x| = 256 get an all-zero normalised input at
    every norm that sees them (chapter 10 measures which); float32 is unchanged."""
    _check_torch_llm(llm)
    with llm.swap_step("rms_norm", rms_norm_no_upcast, where=where):
        yield


# --- softmax and attention numerics (chapter 9) -------------------------------------------

def _layer_indices(llm, layers) -> list[int]:
    """``layers`` (None: all, an int, or a list of ints) as a checked list."""
    _check_torch_llm(llm)
    n = len(llm.llm_engine.model_runner.model.layers)
    if layers is None:
        return list(range(n))
    out = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    try:
        out = list(out)
    except TypeError:
        raise TypeError(f"layers must be None, a layer index or a list of them, got "
                        f"{layers!r}") from None
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                      for i in out):
        raise ValueError(f"layers must be indices in [0, {n}), got {layers!r}")
    return out


@contextlib.contextmanager
def qk_scale_reparam(llm, c: float = 256.0, layers=None):
    """An exact reparametrization that makes the raw scores q.k large: in each chosen
    layer, the query rows of ``qkv_proj`` are scaled by ``c`` and the layer's softmax
    scale by ``1 / c``, so ``(c q).k * (scale / c) == q.k * scale`` in real arithmetic and
    the model computes the same function. With ``c`` a power of two every factor is
    exact in floating point (a scaling by 2^k commutes with rounding, barring overflow),
    so an attention that multiplies by the scale before it leaves float32 gives the
    unmodified model's result; only code that rounds the *unscaled* product ``q.k`` to a
    16-bit format sees ``c`` times larger numbers, and overflows fp16 (max 65504) once
    ``c * max|q.k|`` passes it. The embedded SmolLM2's own max |q.k| (rotary applied) is
    about 486 (course chapter 9 measures it per layer), 135x below 65504, so it never
    overflows on its own; with c = 256 the largest layers pass 65504 under an eager
    ``q @ k^T`` in fp16 (:func:`eager_kq_attention`), the order of llama.cpp #7805 and
    vllm #14126 (INCIDENTS.md #15).

    Planted on the "linear" step of each chosen layer's ``self_attn.qkv_proj`` (its output's
    query columns times ``c``; float weights only) plus the layer's ``scaling`` attribute
    (divided by ``c``; restored on exit). Both backends read ``scaling``. While it is
    planted, those ``qkv_proj`` layers compute through ``linear_ref`` (the reference
    path: the engine's own in the default configuration, but not its TF32 emulation or
    its batch-invariant row-by-row path).

    Args:
        c: the factor, > 0 (a power of two keeps it exact).
        layers: None (all), a layer index, or a list of them.
    Raises:
        ValueError: c not a finite positive number, a layer out of range, or a quantized
            ``qkv_proj`` (no "linear" site).
    """
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf"):
        raise ValueError(f"c must be a finite number > 0, got {c!r}")
    idx = _layer_indices(llm, layers)
    model = llm.llm_engine.model_runner.model
    attns = [model.layers[i].self_attn for i in idx]
    q_size = attns[0].q_size
    c = float(c)

    def qkv_scaled_q(x, weight, bias):
        from minivllm.layers.linear import linear_ref

        y = linear_ref(x, weight, bias)
        y[..., :q_size] *= c
        return y

    old = [a.scaling for a in attns]
    with contextlib.ExitStack() as stack:
        for i in idx:
            stack.enter_context(llm.swap_step("linear", qkv_scaled_q,
                                              where=f"layers.{i}.self_attn.qkv_proj"))
        try:
            for a, s in zip(attns, old):
                a.scaling = s / c
            yield
        finally:
            for a, s in zip(attns, old):
                a.scaling = s


def _gqa(k: torch.Tensor, v: torch.Tensor, heads: int, dim: int):
    group = heads // k.shape[dim]
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def decode_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The "attention.decode" step in transformers' eager order
    (``eager_attention_forward`` in ``models/llama/modeling_llama.py``): ``q @ k^T`` in
    q's dtype (rounded to fp16/bf16 when the model runs in it), *then* times the scale,
    then a float32 softmax cast back to q's dtype, then ``@ v``. Same signature as
    ``decode_attention_ref``. In fp16 a raw product above 65504 becomes inf and the
    softmax of a row holding inf is NaN: llama.cpp #7805 (fixed by PR #8412, which forces
    the KQ product to F32). Padding rows (seq_lens 0) are NaN here: no guard."""
    B, H, D = q.shape
    kk, vv = _gqa(k, v, H, 2)  # [B, L, H, D]
    s = torch.einsum("bhd,blhd->bhl", q, kk) * scale  # rounded to q's dtype, then scaled
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhl,blhd->bhd", p, vv)


def prefill_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The "attention.prefill" step in transformers' eager order (see
    :func:`decode_attention_eager`). Same signature as ``prefill_attention_ref``."""
    n, H, D = q.shape
    L = k.shape[0]
    kk, vv = _gqa(k, v, H, 1)  # [L, H, D]
    s = torch.einsum("nhd,lhd->hnl", q, kk) * scale
    causal = torch.arange(L, device=q.device)[None, :] <= \
        torch.arange(L - n, L, device=q.device)[:, None]
    s = s.masked_fill(~causal[None], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hnl,lhd->nhd", p, vv)


@contextlib.contextmanager
def eager_kq_attention(llm, layers=None):
    """Plant :func:`decode_attention_eager` and :func:`prefill_attention_eager` (the
    "attention.decode" and "attention.prefill" steps of the chosen layers; TORCH backend):
    attention that rounds the unscaled ``q @ k^T`` to the model dtype. In float32 it is
    the reference up to rounding; in float16 it overflows where ``max|q.k| > 65504``
    (on the embedded model only after :func:`qk_scale_reparam`, see there); bfloat16 has
    float32's range and does not overflow, but rounds the product to 8 bits."""
    idx = _layer_indices(llm, layers)
    where = idx if len(idx) > 1 else idx[0]
    with llm.swap_step("attention.decode", decode_attention_eager, where=where), \
            llm.swap_step("attention.prefill", prefill_attention_eager, where=where):
        yield


def _softmax_no_max(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    e = torch.exp(s.to(dtype))  # the bug: no max subtracted, computed in the model dtype
    return e / e.sum(-1, keepdim=True)


def decode_attention_no_max(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The "attention.decode" step with a softmax that does not subtract the row max:
    scores in float32 (so the product cannot overflow), then ``exp(s) / sum(exp(s))`` in
    q's dtype. ``exp`` overflows above 88.7 in float32/bfloat16 and above 11.09 in
    float16 (ln 65504), and inf / inf is NaN. Same signature as ``decode_attention_ref``."""
    B, H, D = q.shape
    kk, vv = _gqa(k, v, H, 2)
    s = torch.einsum("bhd,blhd->bhl", q.float(), kk.float()) * scale
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = _softmax_no_max(s, q.dtype)
    return torch.einsum("bhl,blhd->bhd", p, vv)


def prefill_attention_no_max(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """The "attention.prefill" step with the softmax of :func:`decode_attention_no_max`."""
    n, H, D = q.shape
    L = k.shape[0]
    kk, vv = _gqa(k, v, H, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kk.float()) * scale
    causal = torch.arange(L, device=q.device)[None, :] <= \
        torch.arange(L - n, L, device=q.device)[:, None]
    s = s.masked_fill(~causal[None], float("-inf"))
    p = _softmax_no_max(s, q.dtype)
    return torch.einsum("hnl,lhd->nhd", p, vv)


@contextlib.contextmanager
def softmax_without_max(llm, layers=None):
    """Plant :func:`decode_attention_no_max` and :func:`prefill_attention_no_max` on the
    chosen layers (TORCH backend): a softmax without max subtraction, in the model dtype.
    Harmless while every scaled score stays below ln(max) of the dtype (88.7 for float32
    and bfloat16; the embedded model's largest scaled score is about 486 / 8 = 61), NaN in
    float16 as soon as one passes 11.09."""
    idx = _layer_indices(llm, layers)
    where = idx if len(idx) > 1 else idx[0]
    with llm.swap_step("attention.decode", decode_attention_no_max, where=where), \
            llm.swap_step("attention.prefill", prefill_attention_no_max, where=where):
        yield


# --- speculative decoding (chapter 21) -----------------------------------------------------

def rejection_sampler_first_unverified(draft_token_ids, draft_probs, target_probs, target_argmax,
                                       generator):
    """The "rejection_sampler" step with draft token 0 accepted without verification
    (INCIDENTS.md #23, lattice #243): the verifier starts checking at draft 1. It calls
    the reference with position 0's target replaced by the draft itself (greedy: the
    argmax; random: a point mass), so draft 0 is always accepted and the rest is
    verified as usual. Output changes only when the target would have rejected draft 0.
    Same signature as :func:`minivllm.spec_decode.rejection_sampler.rejection_sampler_ref`."""
    from minivllm.spec_decode.rejection_sampler import rejection_sampler_ref

    draft = list(draft_token_ids)
    if draft:
        if target_argmax is not None:
            target_argmax = [draft[0]] + list(target_argmax)[1:]
        else:
            target_probs = target_probs.clone()
            target_probs[0] = 0.0
            target_probs[0, draft[0]] = 1.0
    return rejection_sampler_ref(draft, draft_probs, target_probs, target_argmax, generator)


@contextlib.contextmanager
def spec_accept_first_unverified(llm):
    """Plant :func:`rejection_sampler_first_unverified` (the "rejection_sampler" step) on
    an LLM built with ``speculative_config``."""
    with llm.swap_step("rejection_sampler", rejection_sampler_first_unverified):
        yield


# --- CUDA graphs (chapter 24) ---------------------------------------------------------------

@contextlib.contextmanager
def stale_cuda_graph_capture(llm):
    """The graph runner as it was before commit b4220d8: a pure decode step that fits a
    captured graph replays it even while a forward hook is registered or the runner is
    :meth:`~minivllm.worker.cuda_graph.CUDAGraphRunner.suspended` (which the planted
    faults above and ``LLM.swap_step`` enter). A replay runs what was captured, so such a
    hook misses every graph step and such a patch is silently not applied on them (on
    the H200 a hook registered after capture ran for 1 of 6 steps). Needs an LLM with
    graphs: ``device="cuda"``, or ``emulate_cuda_graphs=True`` on the CPU.

    Raises:
        ValueError: the LLM has no graph runner (``enforce_eager=True``, or CPU without
            ``emulate_cuda_graphs``).
    """
    graphs = llm.llm_engine.model_runner.cuda_graphs
    if graphs is None:
        raise ValueError("stale_cuda_graph_capture needs an LLM with CUDA graphs (device='cuda' "
                         "with the TRITON backend, or emulate_cuda_graphs=True on the CPU)")

    def can_run(scheduled) -> bool:  # no hook check, no suspension check
        return 0 < len(scheduled) <= graphs.max_batch_size \
            and all(n == 1 and req.score is None for req, n in scheduled)

    graphs.can_run = can_run
    try:
        yield
    finally:
        del graphs.can_run


# --- KV-cache scale delivery (chapter 18) --------------------------------------------------

KV_SCALE_SIDES = ("read", "write")


def quantize_kv_scale_dropped(x: torch.Tensor, cache_dtype: torch.dtype,
                              scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The "kv.quantize" step with its scale lost on the way: stores ``Q(x / 1.0)``
    whatever scale the layer holds. Same signature as ``quantize_kv``."""
    from minivllm.quantization.kv_cache import quantize_kv

    return quantize_kv(x, cache_dtype, 1.0)


def dequantize_kv_scale_dropped(x: torch.Tensor, dtype: torch.dtype,
                                scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The "kv.dequantize" step with its scale lost on the way: reads back ``stored *
    1.0`` whatever scale the layer holds. Same signature as ``dequantize_kv``."""
    from minivllm.quantization.kv_cache import dequantize_kv

    return dequantize_kv(x, dtype, 1.0)


@contextlib.contextmanager
def kv_scale_dropped(llm, side: str = "read", layers=None):
    """One side of the quantized KV cache loses its scales: the writer quantizes with the
    layer's scale and the reader dequantizes with 1.0 (``side="read"``), or the writer
    quantizes with 1.0 and the reader multiplies by the layer's scale (``side="write"``).

    The incidents (INCIDENTS.md #10): NVIDIA/TensorRT-LLM PR #16916 (Kimi K3, fp8 KV: the
    MLA generation path passed ``None`` for ``kv_scale_orig_quant`` / ``kv_scale_quant_orig``;
    GSM8K 96.44 with a bf16 KV cache, 74.45 with fp8 KV, 96.89 once scale buffers of 1.0
    were passed, 96.74 with 4.0); sgl-project/sglang #18818 (scales loaded from
    ``--quantization-param-path`` never reached ``set_kv_buffer``); flashinfer-ai/flashinfer
    #1023 (``k_scale``/``v_scale`` passed positionally and dropped).

    Every stored K (and V) value comes back multiplied by ``s`` (read side dropped: by
    ``1 / s``, write side dropped: by ``s``), where ``s`` is that layer's scale, so the
    damage is set by how far the scale is from 1.0, not by the fp8 rounding. With scales
    of 1.0 (vLLM's default when a checkpoint ships none) the fault changes nothing: the
    logits are bit-identical. Planted on the "kv.quantize" (write) or "kv.dequantize"
    (read) step of :mod:`minivllm.steps` (TORCH attention backend).

    Args:
        llm: an ``LLM`` with a quantized KV cache (fp8_e4m3, fp8_e5m2, int8), static or
            dynamic scales.
        side: "read" or "write": the side that drops its scale.
        layers: None (every layer), a layer index or a list of them.
    Raises:
        ValueError: an unknown side, a float KV cache (it has no scale to drop), layer
            indices out of range, or the TRITON backend (the kernels apply the scales).
        TypeError: not an ``LLM``, or malformed ``layers``.
    """
    from minivllm.quantization.kv_cache import is_quantized

    if side not in KV_SCALE_SIDES:
        raise ValueError(f"side must be one of {KV_SCALE_SIDES}, got {side!r}")
    idx = _layer_indices(llm, layers)
    dtype = llm.llm_engine.cache_config.cache_dtype
    if not is_quantized(dtype):
        raise ValueError(f"kv_scale_dropped needs a quantized KV cache (fp8_e4m3, fp8_e5m2 "
                         f"or int8); this engine stores K/V as {dtype}, which has no scale")
    step, fn = (("kv.dequantize", dequantize_kv_scale_dropped) if side == "read"
                else ("kv.quantize", quantize_kv_scale_dropped))
    with llm.swap_step(step, fn, where=None if layers is None else idx):
        yield


# --- KV-cache outlier channels (chapter 19) ------------------------------------------------

def _index_list(value, n: int, what: str) -> list[int]:
    """An int or a non-empty list of ints, each in [0, n), as a sorted list without repeats."""
    out = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        out = list(out)
    except TypeError:
        raise TypeError(f"{what} must be an index or a list of them, got {value!r}") from None
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                      for i in out):
        raise ValueError(f"{what} must be indices in [0, {n}), got {value!r}")
    return sorted(set(out))


@contextlib.contextmanager
def k_outlier_reparam(llm, layer, head, channel, c: float = 64.0):
    """An exact reparametrization that plants K outlier channels: in each chosen layer,
    the key dimensions ``{j, j + head_dim/2}`` (one rotary pair per chosen ``channel``
    j) of KV head ``head`` are multiplied by ``c``, and the same dimensions of the query
    heads that read that KV head (``head * group .. (head + 1) * group - 1``, GQA) by
    ``1 / c``.

    Why the model computes the same function: rotary (the rotate-half layout,
    :mod:`minivllm.layers.rotary_embedding`) rotates each pair ``(x_j, x_{j+D/2})`` by an
    angle that depends only on the position; a uniform scaling of the pair commutes with
    that rotation, so after rotary the stored key pair is ``c`` times the old one and the
    query pair ``1 / c`` times, and every score ``q . k`` (a sum over pairs) is unchanged.
    With ``c`` a power of two each factor is exact in floating point (only the exponent
    moves), so a float32 engine's logits stay at the noise floor (bit for bit here,
    ``tests/test_kv_outliers.py``); only a KV cache that quantizes K sees a channel ``c``
    times larger. The embedded SmolLM2's |K| never exceeds about 21, so with c = 64 a
    chosen channel reaches hundreds: past e4m3's 448 at scale 1.0, and it sets a
    per-tensor or per-head int8 scale that rounds every other channel of the layer (or
    head) to a few levels. This is the shape of the K outliers reported for models
    without QK-norm (verl PR #4435, Qwen2.5-Math-7B with fp8 KV answering "????"; KIVI,
    arXiv:2402.02750: K's outliers sit in fixed channels), INCIDENTS.md #11.

    Planted on the "linear" step of each chosen layer's ``self_attn.qkv_proj`` (its
    output's chosen K and q columns scaled; float weights only), so calibration
    (``LLM.calibrate_kv_scales``) run inside the block sees the outliers. While it is
    planted, those ``qkv_proj`` layers compute through ``linear_ref`` (the engine's own
    path in the default configuration).

    Args:
        llm: an ``LLM`` (TORCH attention backend).
        layer: a layer index or a list of them.
        head: a KV-head index or a list of them (in ``[0, num_kv_heads)``).
        channel: a head dimension j in ``[0, head_dim)`` or a list of them; each brings
            its rotary partner ``(j + head_dim/2) % head_dim``.
        c: the factor, a finite number > 0 (a power of two keeps it exact).
    Yields:
        the planted K channels, a sorted list of ``(layer, kv_head, dim)`` tuples.
    Raises:
        ValueError: ``c`` not a finite positive number, an index out of range.
        TypeError: not an ``LLM``, or malformed indices.
    """
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf"):
        raise ValueError(f"c must be a finite number > 0, got {c!r}")
    idx = _layer_indices(llm, layer)
    attn = llm.llm_engine.model_runner.model.layers[idx[0]].self_attn
    H, Hq, D = attn.num_kv_heads, attn.num_heads, attn.head_dim
    heads = _index_list(head, H, "head")
    dims = sorted({d for j in _index_list(channel, D, "channel") for d in (j, (j + D // 2) % D)})
    group = Hq // H
    k_cols = torch.tensor([attn.q_size + h * D + d for h in heads for d in dims])
    q_cols = torch.tensor([(h * group + g) * D + d for h in heads for g in range(group)
                           for d in dims])
    c = float(c)

    def qkv_outlier(x, weight, bias):
        from minivllm.layers.linear import linear_ref

        y = linear_ref(x, weight, bias)
        y[..., k_cols.to(y.device)] *= c
        y[..., q_cols.to(y.device)] /= c
        return y

    with contextlib.ExitStack() as stack:
        for i in idx:
            stack.enter_context(llm.swap_step("linear", qkv_outlier,
                                              where=f"layers.{i}.self_attn.qkv_proj"))
        yield [(i, h, d) for i in idx for h in heads for d in dims]


def _gate_up_layout_rank(model, contiguous: bool) -> None:
    """On one tensor-parallel rank (run on all ranks at once by ``collective_rpc``):
    gather every rank's ``gate_up_proj`` rows, rebuild the full ``[gate; up]`` matrix and
    keep this rank's rows in the contiguous (wrong) layout, or put the saved correct
    shard back."""
    from minivllm.parallel.emulated_tp import shard_contiguous

    group = model.embed_tokens.group
    for layer in model.layers:
        lin, n = layer.mlp.gate_up_proj, layer.mlp.intermediate
        if not contiguous:
            if hasattr(lin, "_correct_weight"):
                lin.weight.data = lin._correct_weight
                del lin._correct_weight
            continue
        lin._correct_weight = lin.weight.data
        parts = group.all_gather(lin.weight.data, dim=0).split(2 * n)  # [gate_r; up_r]
        full = torch.cat([p[:n] for p in parts] + [p[n:] for p in parts])
        inter = n * group.world_size
        lin.weight.data = shard_contiguous(full, [inter, inter], group.rank,
                                           group.world_size).clone()


@contextlib.contextmanager
def tp_gate_up_contiguous(llm):
    """Real tensor parallelism with the fused ``gate_up_proj`` cut into tp contiguous
    pieces (vllm #3775, fixed in PR #3869; course chapter 25): rank r then holds gate
    rows and up rows that do not belong together (at tp = 2, rank 0 holds all of gate
    and rank 1 all of up), so SiLU-and-mul pairs the wrong units. The emulated twin is
    ``emulate_tensor_parallel(llm, tp, shard_merged_column_fn=shard_contiguous)``.

    Applied on every rank through ``LLMEngine.collective_rpc``; undone on exit.

    Raises:
        ValueError: the engine does not run with tensor_parallel_size > 1.
    """
    engine = llm.llm_engine
    if engine.model_executor is None:
        raise ValueError("tp_gate_up_contiguous needs an LLM with tensor_parallel_size > 1 "
                         "(for tp = 1 use minivllm.parallel.emulated_tp with "
                         "shard_merged_column_fn=shard_contiguous)")
    engine.reset_prefix_cache()  # cached K/V came from the correct layout
    engine.collective_rpc(_gate_up_layout_rank, (True,))
    try:
        yield
    finally:
        engine.reset_prefix_cache()
        engine.collective_rpc(_gate_up_layout_rank, (False,))


# --- fp8 activation-scale delivery (chapter 17) ---------------------------------------------

def fp8_linear_input_scale_dropped(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                                   x_scale, bias) -> torch.Tensor:
    """The "fp8.linear" step with the static input scale lost on the way: a layer that
    holds a calibrated ``input_scale`` quantizes its input as ``e4m3(clamp(x / 1.0,
    ±448))``, the value engines fall back to when no scale arrives. A dynamic layer
    (``x_scale`` None) is computed as usual. Same signature as ``fp8_linear_ref``."""
    from minivllm.quantization.w8a8 import fp8_linear_ref

    one = None if x_scale is None else torch.ones((), dtype=torch.float32, device=x.device)
    return fp8_linear_ref(x, q_w, w_scale, one, bias)


@contextlib.contextmanager
def input_scale_dropped(llm, layers=None):
    """A W8A8 fp8 engine with static activation scales loses them between the checkpoint
    and the GEMM: each chosen layer quantizes its input with scale 1.0 instead of its
    calibrated ``input_scale`` (:func:`fp8_linear_input_scale_dropped` on the
    "fp8.linear" step of :mod:`minivllm.steps`).

    The family of incidents (INCIDENTS.md #10, there on the KV-cache side): a scale that
    was computed and shipped but never reached the kernel, which then used its default
    1.0 (NVIDIA/TensorRT-LLM PR #16916: ``None`` passed for the KV scale buffers;
    sgl-project/sglang #18818: loaded scales that never reached ``set_kv_buffer``;
    sglang PR #20705: a float assigned over the scale parameter fell back to 1.0;
    flashinfer-ai/flashinfer #1023: scales passed positionally and dropped).

    What 1.0 does to an activation, unlike to K/V: e4m3 holds magnitudes up to 448, and
    a calibrated scale ``amax / 448`` maps the layer's largest input there. With 1.0,
    inputs above 448 saturate (on the embedded SmolLM2 the down_proj inputs of layers 11
    and 28 reach a few thousand), and inputs below 2^-6 (most of the small ones) fall into
    e4m3's subnormals, whose step is 2^-9, or to 0 below 2^-10.

    Args:
        llm: an ``LLM`` with ``quantization="fp8"`` and ``activation_scheme="static"``
            (or such a saved checkpoint).
        layers: None (every decoder layer's fp8 linears), a layer index or a list of them.
    Raises:
        ValueError: the engine has no fp8 linear layer, or its fp8 layers have no static
            input scale (dynamic scales: nothing to drop); layer indices out of range.
        TypeError: not an ``LLM``, or malformed ``layers``.
    """
    from minivllm.layers.linear import Fp8Method, QuantLinear

    idx = _layer_indices(llm, layers)
    model = llm.llm_engine.model_runner.model
    fp8 = [m for i in idx for m in model.layers[i].modules()
           if isinstance(m, QuantLinear) and isinstance(m.method, Fp8Method)]
    if not fp8:
        raise ValueError("input_scale_dropped needs an engine built with quantization='fp8' "
                         "(activation_scheme='static'); this one has no fp8 linear layer there")
    if all(m.input_scale is None for m in fp8):
        raise ValueError("input_scale_dropped needs static activation scales "
                         "(quantization_config={'activation_scheme': 'static'}); this engine's "
                         "fp8 layers compute dynamic per-token scales, so there is no "
                         "input_scale to drop")
    with llm.swap_step("fp8.linear", fp8_linear_input_scale_dropped,
                       where=None if layers is None else idx):
        yield
