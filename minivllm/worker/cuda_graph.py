"""CUDA graphs for decode steps (vLLM: ``vllm/v1/worker/gpu_model_runner.py``,
``capture_model``; ``vllm/compilation/cuda_graph.py``).

A decode step of a small model launches hundreds of small kernels; on a GPU the CPU
time to launch them can exceed the GPU time to run them. A CUDA graph records the
launches of one forward pass once and replays them with a single call. A graph replays
*exactly* what was recorded: the same kernels, grids and buffer addresses. So:

* inputs live in static buffers (token ids, positions, slot mapping, block tables,
  sequence lengths) that each step overwrites before replaying;
* one graph per batch size in ``capture_sizes`` (1, 2, 4, 8, 16, 24, ... as vLLM); a
  batch of 5 runs in the size-8 graph, padded with 3 dummy rows: slot -1 (the store
  kernel skips it) and sequence length 0 (attention returns 0 for it);
* the decode kernel's grid is recorded for ``max_model_len`` keys: programs past a
  sequence's end return at once, and because the split size is fixed, the result equals
  an eager run's (see :mod:`minivllm_kernels.paged_attention`).

The LM head runs inside the graph (it is the largest single matmul of a decode step);
the sampler runs outside it, on the real rows only. Steps with prefill tokens, scoring
requests, or more sequences than the largest graph run eagerly. A replay calls no
Python, so a change to the model's Python after capture would silently miss every graph
step: all steps also run eagerly while a forward hook is registered on the model, and
inside :meth:`CUDAGraphRunner.suspended` (which the planted faults of
:mod:`minivllm.precision.faults` enter).

Padding changes the matmuls' row count M. cuBLAS may pick a different kernel for M=8
than for M=5, so graph and eager logits can differ in the last bits (in bfloat16 that
can flip a near-tie argmax): this is chapter 24's incident, measured, not a bug.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.attention.metadata import AttentionMetadata, PagedMetadata
from minivllm.request import Request
from minivllm.utils import cdiv, forward_hooks_registered, hook_dicts

logger = logging.getLogger("minivllm")


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_batch_size (which is always included)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_batch_size + 1, 8)) if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class CUDAGraphRunner:
    """Captures the model's decode step, LM head included, for each capture size and
    replays it.

    Inputs live in two static device buffers, filled each step from pinned host mirrors
    by asynchronous copies: int64 ``[3, max_batch]`` (token ids, positions, slot mapping)
    and int32 ``[max_batch * (1 + max_blocks)]`` (sequence lengths, then the block
    tables). The graph's outputs are the logits ``[bs, vocab]`` float32 and a finite flag
    per row.

    Args:
        model: our LlamaForCausalLM on CUDA, TRITON attention backend, caches bound.
        max_batch_size: largest captured batch.
        max_model_len: longest sequence (sets the block-table width and the decode
            kernel's number of split programs).
        block_size: tokens per cache block.
        device: the CUDA device.
    """

    def __init__(self, model, max_batch_size: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self._alloc_buffers(max_batch_size, max_model_len, block_size, device)
        # batch size -> (graph, (logits, finite flags)); the CPU emulation stores its own
        # graph type (EmulatedCUDAGraph) and capture output here
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self._capture_all()
        self._watch_model()

    def _watch_model(self) -> None:
        """Keep every submodule's forward (pre-)hook dict, to see cheaply (one pass over
        them, a few microseconds) whether a hook has been registered since capture."""
        self._hook_dicts = hook_dicts(self.model.modules())
        self._warned_hooks = False
        self._suspended = 0

    @contextlib.contextmanager
    def suspended(self):
        """Run every step eagerly inside this block (nestable): for a change to the
        model's Python (a patched module or function) that a replay would not see."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def hooks_registered(self) -> bool:
        """True while a forward or forward-pre hook is registered on any of the model's
        modules, or globally (``torch.nn.modules.module.register_module_forward_hook``)."""
        return forward_hooks_registered(self._hook_dicts)

    def _alloc_buffers(self, max_batch_size: int, max_model_len: int, block_size: int,
                       device: torch.device) -> None:
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = n = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = cdiv(max_model_len, block_size)
        self._i64 = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(n * (1 + self.max_blocks), dtype=torch.int32, device=device)
        pin = torch.device(device).type == "cuda"
        self._host_i64 = torch.zeros(3, n, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(self._i32.shape, dtype=torch.int32, pin_memory=pin)
        self._np_i64, self._np_i32 = self._host_i64.numpy(), self._host_i32.numpy()
        self.input_ids, self.positions, self.slot_mapping = self._i64.unbind(0)
        self.seq_lens = self._i32[:n]
        self.block_tables = self._i32[n:].view(n, self.max_blocks)
        self.slot_mapping.fill_(-1)

    def _meta(self, bs: int) -> AttentionMetadata:
        paged = PagedMetadata(block_size=self.block_size, decode_rows=None,
                              decode_block_tables=self.block_tables[:bs],
                              decode_seq_lens=self.seq_lens[:bs],
                              decode_max_seq_len=self.max_model_len)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], paged=paged)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        logits = self.model.compute_logits(hidden)
        # a row holds NaN/inf iff its sum does (see ModelRunner.execute_model)
        return logits, torch.isfinite(logits.sum(dim=-1))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory pool the largest allocated.
        for bs in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles kernels
                self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Fresh views: the rotary embedding reuses its cos/sin when it sees the *same*
            # positions tensor again, which would leave that lookup out of the graph.
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(bs)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, scheduled: list[tuple[Request, int]]) -> bool:
        """True for a pure-decode step (one new token per request, no scoring) that fits
        the largest graph, outside :meth:`suspended`, while no forward hook is registered
        on the model (a replay would skip it; the step then runs eagerly, and a warning
        says so once)."""
        if self._suspended or not (0 < len(scheduled) <= self.max_batch_size
                and all(n == 1 and req.score is None for req, n in scheduled)):
            return False
        if self.hooks_registered():
            if not self._warned_hooks:
                logger.warning("forward hooks are registered on the model: decode steps run "
                               "eagerly, without CUDA graphs, while they are (a graph replay "
                               "would not call them)")
                self._warned_hooks = True
            return False
        self._warned_hooks = False  # warn again if hooks come back
        return True

    def _fill_inputs(self, reqs: list[Request], block_tables: dict[str, list[int]]) -> int:
        """Write the step's inputs into the static buffers (through the pinned host
        mirrors: NumPy views, then asynchronous copies); returns the capture size used."""
        b = len(reqs)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        n, bsz = self.max_batch_size, self.block_size
        ids, pos, slots, lens, rows = [], [], [], [], []
        for req in reqs:
            p = req.num_computed_tokens
            table = block_tables[req.request_id]
            ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(table[p // bsz] * bsz + p % bsz)
            lens.append(p + 1)
            rows.append(table)
        # Written through NumPy views of the pinned buffers (no temporary tensors).
        # Padding rows: token 0 at position 0, write nothing (slot -1), attend to nothing
        # (length 0).
        h64, h32 = self._np_i64, self._np_i32
        h64[:, :b] = (ids, pos, slots)
        h64[:2, b:bs] = 0
        h64[2, b:bs] = -1
        h32[:b] = lens
        h32[b:bs] = 0
        width = max(len(t) for t in rows)
        h32[n:n + b * self.max_blocks].reshape(b, self.max_blocks)[:, :width] = \
            [t + [0] * (width - len(t)) for t in rows]
        # whole int64 buffer (6 KB at 256 rows); lengths and the first bs table rows
        self._i64.copy_(self._host_i64, non_blocking=True)
        end = n + bs * self.max_blocks
        self._i32[:end].copy_(self._host_i32[:end], non_blocking=True)
        return bs

    def run(self, reqs: list[Request], block_tables: dict[str, list[int]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for ``reqs`` (each decodes its next token): fill the pinned
        inputs, copy them to the static buffers, pad, replay. Returns the real
        rows' logits [B, vocab] float32 and finite flags [B] bool (views of the graph's
        outputs, valid until the next replay)."""
        b = len(reqs)
        bs = self._fill_inputs(reqs, block_tables)
        graph, (logits, finite) = self.graphs[bs]
        graph.replay()
        return logits[:b], finite[:b]


# --------------------------------------------------------------------------------------
# CPU emulation (course chapter 24). NOT a vLLM feature: vLLM captures graphs on GPUs only
# and runs its CPU backend eagerly. It exists so that a laptop can show what a replay
# bound at capture time does (padding, static buffers, a stale capture).
# --------------------------------------------------------------------------------------

# Ops whose only effect is a host value (a sync). The Python branch that value decided
# was frozen at capture; a replay, like a CUDA graph's, skips them.
_HOST_ONLY_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                  torch.ops.aten.equal.default}


# Depth of on_default_stream() blocks: while > 0, an EmulatedCUDAGraph capture runs ops
# without recording them.
_OFF_CAPTURE_DEPTH = 0


@contextlib.contextmanager
def on_default_stream():
    """Run the enclosed ops as a kernel launched on a stream the capture does not follow,
    for the CPU emulation below (course chapter 24; not a vLLM API).

    vllm #2147 (2023-12): the exllama GPTQ kernels were launched with
    ``kernel<<<grid, block>>>``, on CUDA's legacy default stream instead of PyTorch's
    current stream, which is the one a ``torch.cuda.graph`` capture records. During
    capture they ran once and were left out of the graph; each replay then read their
    output memory without anything writing it (the fix, vllm PR #2318 (2024-01), launched
    them on the current stream). Inside this block an :class:`EmulatedCUDAGraph` capture
    runs the ops (the capture's own outputs are right) but does not record them, and the
    tensors they make count, for the recording, as tensors from outside the capture: a
    replay reads their contents as they are at that moment and never recomputes them. An
    in-place write into a static tensor made here is not replayed either.

    What the emulation cannot show: on a GPU the uncaptured kernel's output may sit in
    memory the graph's pool hands to other tensors, so a replay can read anything (in
    float16, the inf/nan of vllm #2147). Here the recording holds such a tensor, so a
    replay reads the last values written into it: stale, finite rows.

    Outside a capture (eager steps, real CUDA graphs) it changes nothing. Nestable.
    """
    global _OFF_CAPTURE_DEPTH
    _OFF_CAPTURE_DEPTH += 1
    try:
        yield
    finally:
        _OFF_CAPTURE_DEPTH -= 1


class EmulatedCUDAGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``: :meth:`capture` runs a function once
    and records every ATen op it dispatches (a ``TorchDispatchMode``); :meth:`replay`
    re-executes that op list, and nothing else.

    What is recorded is what a CUDA graph records: the ops, their arguments and the
    tensors they read and write. Tensors that existed before capture (weights, the KV
    cache, static input buffers, constants) are referenced, so a replay reads their
    *current* contents; tensors made during capture are recomputed. Everything Python
    decided during capture is frozen: which module ran, a forward hook (or its absence),
    a patched function or step, a branch on a host value (``int(t.min()) > 0``), shapes.
    So a hook registered, or a step patched, after capture is never run by a replay.
    Ops run inside :func:`on_default_stream` during capture are not recorded (a kernel
    launched on a stream the capture does not follow, vllm #2147).

    The outputs are static too: a replay copies its results into the tensors the
    captured function returned (as a CUDA graph writes into its captured outputs).
    Unlike a CUDA graph, a replay runs the ops from Python, one by one: no speed-up
    (course chapter 24 cites the H200's measured one instead).
    """

    def __init__(self):
        self._ops: list = []
        self._num_slots = 0
        self._out_slots: list[int] = []
        self.outputs = None

    def capture(self, fn, *args):
        """Run ``fn(*args)`` once, recording its ops; returns (and keeps) its outputs, a
        tensor or a tuple of tensors, which each :meth:`replay` overwrites in place."""
        from torch.utils._pytree import tree_flatten

        tape = _Tape()
        with tape:
            out = fn(*args)
        self._ops, self._num_slots = tape.ops, len(tape.made)
        leaves, _ = tree_flatten(out)
        self._out_slots = [tape.slot[id(t)] for t in leaves]
        self.outputs = out
        self._out_leaves = leaves
        return out

    @torch.inference_mode()
    def replay(self) -> None:
        """Re-execute the recorded ops on the current contents of the static tensors; the
        results land in the captured outputs."""
        from torch.utils._pytree import tree_unflatten

        env: list = [None] * self._num_slots
        for func, args, kwargs, top, nested, spec, out_slots in self._ops:
            if spec is not None:  # a tensor made during capture sits inside kwargs
                leaves = list(args)
                for pos, slot in top:
                    leaves[pos] = env[slot]
                args, kwargs = tree_unflatten(leaves, spec)
            elif top or nested:
                args = list(args)
                for pos, slot in top:
                    args[pos] = env[slot]
                copied = set()
                for pos, j, slot in nested:  # a list argument (cat, index_put's indices)
                    if pos not in copied:
                        args[pos] = list(args[pos])  # a copy: the template stays as it is
                        copied.add(pos)
                    args[pos][j] = env[slot]
            out = func(*args, **kwargs)
            if out_slots is None:
                continue
            if isinstance(out, torch.Tensor):
                if out_slots[0] >= 0:
                    env[out_slots[0]] = out
            else:
                for slot, t in zip(out_slots, out):
                    if slot >= 0:
                        env[slot] = t
        for static, slot in zip(self._out_leaves, self._out_slots):
            static.copy_(env[slot])


class _Tape(TorchDispatchMode):
    """Records, per dispatched op, ``(op, args, kwargs, top, nested, spec, out_slots)``
    for :class:`EmulatedCUDAGraph`: the arguments with every tensor made during capture
    replaced by None, where those go (``top``: (arg index, slot); ``nested``: (arg index,
    list index, slot); or, when one sits in kwargs, ``spec``, a pytree spec over the
    flattened (args, kwargs) and ``top`` indexes its leaves), and the slot of each output
    made here (-1: a non-tensor or an outside tensor changed in place; None: none)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo wrapper (and import) around every recorded op

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.made: list[torch.Tensor] = []  # strong refs: ids stay unique during capture
        self.slot: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _OFF_CAPTURE_DEPTH:  # on_default_stream(): run, do not record
            return out
        single = isinstance(out, torch.Tensor)
        out_leaves = [out] if single else (list(out) if isinstance(out, (tuple, list)) else [out])
        if func in _HOST_ONLY_OPS and not any(isinstance(t, torch.Tensor) for t in out_leaves):
            return out
        made = self.slot
        ext_ids: set[int] = set()

        def ref(x):
            if isinstance(x, torch.Tensor):
                if id(x) in made:
                    return made[id(x)]
                ext_ids.add(id(x))
            return None

        spec = None
        top, nested = [], []
        if any(ref(x) is not None for x in tree_flatten(kwargs)[0]):
            leaves, spec = tree_flatten((args, kwargs))
            top = [(i, ref(x)) for i, x in enumerate(leaves) if ref(x) is not None]
            leaves = list(leaves)
            for i, _ in top:
                leaves[i] = None
            stored_args, stored_kwargs = tuple(leaves), None
        else:
            stored = list(args)
            for i, x in enumerate(args):
                if ref(x) is not None:
                    top.append((i, made[id(x)]))
                    stored[i] = None
                elif isinstance(x, (list, tuple)):
                    inner = [(i, j, made[id(y)]) for j, y in enumerate(x) if ref(y) is not None]
                    if inner:
                        nested += inner
                        stored[i] = [None if ref(y) is not None else y for y in x]
            stored_args, stored_kwargs = tuple(stored), dict(kwargs)
        out_slots: list[int] = []
        for t in out_leaves:
            if not isinstance(t, torch.Tensor) or id(t) in ext_ids:
                out_slots.append(-1)  # a non-tensor, or an in-place op on an outside tensor
            elif id(t) in made:
                out_slots.append(made[id(t)])  # in place on a tensor made during capture
            else:
                made[id(t)] = len(self.made)
                out_slots.append(len(self.made))
                self.made.append(t)
        if single or not isinstance(out, (tuple, list)):
            out_slots = out_slots[:1]
        kept = None if all(sl < 0 for sl in out_slots) else tuple(out_slots)
        # Tensors made during capture are not kept in the op (the replay supplies its own).
        self.ops.append((func, stored_args, stored_kwargs, tuple(top), tuple(nested), spec,
                         kept))
        return out


class EmulatedCUDAGraphRunner(CUDAGraphRunner):
    """:class:`CUDAGraphRunner` on CPU with :class:`EmulatedCUDAGraph` (the engine's
    ``emulate_cuda_graphs=True``; NOT a vLLM option, see ``EngineArgs``).

    Same capture sizes (:func:`capture_sizes`), the same static buffers written in place
    by the same ``_fill_inputs`` (padding rows: token 0, position 0, slot -1, length 0),
    the same ``can_run`` / :meth:`suspended` rules and the same ``run``. What differs:

    * the TORCH backend reads K/V through slots, not block tables, so the captured step
      derives the read slots ``[bs, max_model_len]`` and the key mask from the static
      block tables and lengths (these ops are in the capture, so each replay recomputes
      them from the buffers' current contents). Keys are padded to ``max_model_len``,
      not to the longest sequence of the step as an eager step pads them;
    * the CPU cache store has no "skip slot -1": the model runner gives the cache one
      spare slot at the end, which slot -1 indexes and no block covers;
    * the capture runs once on the padding rows (every length 0), so branches on host
      values are frozen as the padding decided them (the fully-masked-row guard of
      ``decode_attention_ref`` always runs, as on a GPU).

    Numerics: a replayed row equals the same row computed eagerly at the padded shape,
    bit for bit. Against an ordinary eager step it can differ where a kernel's bits
    depend on the shape: float32 SDPA on CPU depends on the padded key length (a few
    1e-8 in the attention output), MKL float32 ``F.linear`` on the row count M
    (``PACK_CPU_WEIGHTS = False``), and oneDNN-packed float32 linears on some CPUs: on
    an AVX-512/AMX Xeon, SmolLM2's ``down_proj`` (1536 inputs) gave a row other bits at
    M = 1 than at any M > 1 while its 576-input linears kept them; capped at AVX2
    kernels none changed (course chapter 24, section 6, measures the CPU at hand).

    Args: as :class:`CUDAGraphRunner`; ``device`` must be the CPU.
    """

    def __init__(self, model, max_batch_size: int, max_model_len: int, block_size: int,
                 device: torch.device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"EmulatedCUDAGraphRunner runs on the CPU, got device {device!r} "
                             "(on CUDA use CUDAGraphRunner, real graphs)")
        if getattr(model.layers[0].self_attn.backend, "name", None) != "TORCH":
            raise ValueError("EmulatedCUDAGraphRunner needs the TORCH attention backend")
        super().__init__(model, max_batch_size, max_model_len, block_size, device)

    def _meta(self, bs: int) -> AttentionMetadata:
        from minivllm.attention.metadata import DecodeGroup, slot_mapping_ref

        L = self.max_model_len
        j = torch.arange(L)
        lens = self.seq_lens[:bs].long()
        group = DecodeGroup(
            rows=torch.arange(bs),
            kv_slots=slot_mapping_ref(self.block_tables[:bs].long(), j.expand(bs, L),
                                      self.block_size),
            seq_lens=lens,
            mask=(j[None, :] < lens[:, None])[:, None, None, :])
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], decodes=[group])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._forward(self.sizes[-1])  # warm-up: fills the weight caches (packed, TF32)
        for bs in reversed(self.sizes):
            graph = EmulatedCUDAGraph()
            out = graph.capture(self._forward, bs)
            self.graphs[bs] = (graph, out)
        logger.info("captured emulated CUDA graphs (CPU) for decode batch sizes %s", self.sizes)


def make_graph_runner(model, backend_name: str, paged: bool, cache_dtype: torch.dtype,
                      batch_invariant: bool, max_batch_size: int, max_model_len: int,
                      block_size: int, device: torch.device, emulate: bool):
    """The model runner's graph runner (vLLM: ``GPUModelRunner.capture_model``), or None.

    On CUDA: a :class:`CUDAGraphRunner`, unless graphs cannot capture this engine
    (batch-invariant mode, a backend without the block-table form (``paged`` False),
    an int8 cache): then None, with a warning that says why. With ``emulate`` (CPU): an
    :class:`EmulatedCUDAGraphRunner`.

    Raises:
        ValueError: ``emulate`` where the emulation cannot run (batch-invariant mode,
            another backend than TORCH, an int8 cache).
    """
    if device.type == "cuda":
        why = None
        if batch_invariant:
            why = "batch_invariant=True computes the LM head one row at a time"
        elif not paged:
            why = f"the {backend_name} attention backend builds shapes per step"
        elif cache_dtype == torch.int8:
            why = "an int8 KV cache checks every step for NaN/inf K/V (a device sync)"
        if why:
            logger.warning("CUDA graphs are off: %s; decode runs eagerly "
                           "(use attention_backend='TRITON', or enforce_eager=True to "
                           "silence this)", why)
            return None
        return CUDAGraphRunner(model, max_batch_size, max_model_len, block_size, device)
    if not emulate:
        return None
    why = None
    if batch_invariant:
        why = "batch_invariant=True computes the LM head one row at a time"
    elif paged:
        why = f"the emulation needs the TORCH attention backend, not {backend_name}"
    elif cache_dtype == torch.int8:
        why = "an int8 KV cache checks every step for NaN/inf K/V (a host sync)"
    if why:
        raise ValueError(f"emulate_cuda_graphs=True cannot be used here: {why}")
    return EmulatedCUDAGraphRunner(model, max_batch_size, max_model_len, block_size, device)
