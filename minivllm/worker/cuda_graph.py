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
  an eager run's (see :mod:`kernels.paged_attention`).

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

import torch

from minivllm.attention.metadata import AttentionMetadata, PagedMetadata
from minivllm.engine.request import Request
from minivllm.utils import forward_hooks_registered, hook_dicts

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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = torch.cuda.graph_pool_handle()
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
        self.max_blocks = -(-max_model_len // block_size)
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
