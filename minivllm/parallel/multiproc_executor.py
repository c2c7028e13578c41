"""The multiprocess executor: ``tensor_parallel_size`` ranks, one process each
(``distributed_executor_backend="mp"``; vLLM: ``vllm/v1/executor/multiproc_executor.py``).

Rank 0 is the engine's own process: it schedules, runs its shard of the model and
samples. Ranks 1..tp-1 are worker processes started with ``spawn``; each loads the
checkpoint, keeps its shard (:func:`~minivllm.parallel.tensor_parallel.shard_model`) and
allocates the KV cache of its heads only, with the same number of blocks as rank 0, so
the scheduler's block tables are valid on every rank.

Two channels, as in vLLM:

* **control** (vLLM: a shared-memory message queue broadcasting the scheduler output):
  one pipe per worker. Before rank 0 runs its model forward (or its LM head), it sends
  the same call with the same inputs (token ids, positions, attention metadata, or the
  hidden rows) to every worker. A worker waits on its pipe without a timeout, so an idle
  engine keeps its workers.
* **data**: ``torch.distributed`` with the gloo backend (NCCL would be the CUDA one):
  the all-reduces and all-gathers inside the forward, in the same order on every rank.

Each forward therefore runs on all ranks at once, and rank 0's results (which the
all-reduce makes equal on every rank) go on to the sampler. Only rank 0 samples.

Limits (each raises a clear error at start): CPU only (the NCCL path is not written);
float weights (no ``quantization``); no speculative decoding, CUDA-graph emulation or
KV-scale calibration; swapped steps (``LLM.swap_step``) apply to rank 0's shard only, so
``swap_step`` is refused. One tensor-parallel engine per process at a time (the
default process group); :meth:`MultiprocExecutor.shutdown` frees it for the next.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from minivllm.parallel.emulated_tp import shard_merged_column, shard_qkv
from minivllm.parallel.tensor_parallel import TPGroup, shard_model

logger = logging.getLogger("minivllm")

_STARTUP_TIMEOUT_S = 300  # a worker imports torch and loads the checkpoint
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one all-reduce, once all ranks are running


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (sent pickled to each process).

    ``load_args``: :func:`~minivllm.models.loader.load_model`'s positional arguments;
    ``model_config`` / ``cache_config``: the engine's (same ``num_blocks`` on every rank).
    """

    load_args: tuple
    load_kwargs: dict
    model_config: Any
    cache_config: Any
    device: str
    seed: int
    batch_invariant: bool
    logprobs_mode: str
    lm_head_dtype: Any = None
    shard_qkv_fn: Callable = shard_qkv
    shard_merged_column_fn: Callable = shard_merged_column
    num_threads: int = 1


def build_shard(spec: WorkerSpec, group: TPGroup):
    """Load the model and keep this rank's shard; returns the model (KV caches unbound)."""
    from minivllm.models.loader import load_model

    model = load_model(*spec.load_args, **spec.load_kwargs)
    shard_model(model, group, spec.shard_qkv_fn, spec.shard_merged_column_fn)
    if spec.lm_head_dtype is not None:
        model.set_lm_head_dtype(spec.lm_head_dtype)
    return model


def _worker_main(rank: int, world_size: int, init_method: str, spec: WorkerSpec,
                 conn) -> None:
    """A worker process: join the group, build the shard and its KV cache, then serve
    calls from rank 0 until told to stop or the pipe closes."""
    try:
        torch.set_num_threads(spec.num_threads)
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
        group = TPGroup(rank, world_size)
        model = build_shard(spec, group)
        from minivllm.worker.model_runner import ModelRunner

        # the runner allocates and binds this rank's KV cache (same blocks as rank 0's)
        ModelRunner(model, spec.model_config, spec.cache_config, spec.device, spec.seed,
                    batch_invariant=spec.batch_invariant, logprobs_mode=spec.logprobs_mode)
        conn.send(("ready", rank))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    with torch.inference_mode():
        while True:
            try:
                op, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # rank 0 went away
                break
            if op == "stop":
                break
            try:
                if op == "forward":
                    model(*args)
                elif op == "compute_logits":
                    model.compute_logits(*args)
                elif op == "call":
                    fn, fargs = args
                    fn(model, *fargs)
            except BaseException:
                traceback.print_exc()
                break  # rank 0's collective then fails on the closed connection
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    """Start ``tp - 1`` worker processes and make ``model`` rank 0's shard.

    Args:
        model: the full model rank 0 loaded (sharded here, in place).
        spec: what the workers need to load the same model.
        tp: tensor_parallel_size (>= 2).
    After construction, ``model.forward`` and ``model.compute_logits`` first send the
    same call to every worker, then run rank 0's shard; use the model as before.
    Raises:
        RuntimeError: another tensor-parallel engine is alive in this process, or a
            worker failed to start (its traceback is in the message).
    """

    def __init__(self, model, spec: WorkerSpec, tp: int):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process "
                               "(torch.distributed's default group is in use); call its "
                               "shutdown() first")
        self.tp, self.model = tp, model
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, tp, init_method, spec, child),
                            daemon=True, name=f"minivllm-tp-rank{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._stopped = False
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=tp,
                                    timeout=_COLLECTIVE_TIMEOUT)
            self.group = TPGroup(0, tp)
            shard_model(model, self.group, spec.shard_qkv_fn, spec.shard_merged_column_fn)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        forward, compute_logits = model.forward, model.compute_logits

        def forward_all_ranks(input_ids, positions, meta):
            self._send("forward", (input_ids, positions, meta))
            return forward(input_ids, positions, meta)

        def compute_logits_all_ranks(hidden):
            self._send("compute_logits", (hidden,))
            return compute_logits(hidden)

        # instance attributes: nn.Module.__call__ finds them before the class's methods
        model.forward = forward_all_ranks
        model.compute_logits = compute_logits_all_ranks
        logger.info("tensor_parallel_size=%d: %d worker process(es) ready (gloo)", tp, tp - 1)

    def _wait_ready(self) -> None:
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            if not conn.poll(_STARTUP_TIMEOUT_S):
                raise RuntimeError(f"tensor-parallel worker {rank} did not start within "
                                   f"{_STARTUP_TIMEOUT_S} s (alive: {p.is_alive()})")
            status, what = conn.recv()
            if status != "ready":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start:\n{what}")

    def _send(self, op: str, args: tuple) -> None:
        if self._stopped:
            raise RuntimeError("this tensor-parallel engine was shut down")
        payload = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker {rank} exited "
                                   f"(exit code {p.exitcode}); see its traceback above")
            conn.send_bytes(payload)

    def collective_rpc(self, fn: Callable, args: tuple = ()) -> Any:
        """Run ``fn(model, *args)`` on every rank (rank 0 last returns its result; vLLM:
        ``LLM.collective_rpc``). ``fn`` must be a module-level function (the workers
        import it by name) and may use collectives: every rank runs it at once."""
        self._send("call", (fn, args))
        return fn(self.model, *args)

    def shutdown(self) -> None:
        """Stop the workers and free the process group. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", ())))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_threads(tp: int) -> int:
    """Threads per worker process: the machine's cores shared among the tp ranks (at
    least 1), so tp = 3 on 2 cores does not oversubscribe them tp-fold."""
    return max(1, (os.cpu_count() or 1) // tp)


def start_tensor_parallel(model, args, vllm_config) -> MultiprocExecutor:
    """The engine's executor for ``tensor_parallel_size > 1``
    (``distributed_executor_backend="mp"``): workers load the same checkpoint as rank 0
    did (``args``: the EngineArgs; ``vllm_config``: the engine's configs)."""
    from pathlib import Path

    from minivllm.config import LM_HEAD_DTYPES
    from minivllm.engine.arg_utils import batch_invariant_enabled

    mc, tp = vllm_config.model_config, args.tensor_parallel_size
    spec = WorkerSpec(
        load_args=(Path(mc.path), vllm_config.hf_config, mc.dtype, mc.max_model_len,
                   args.device, vllm_config.attention_backend),
        load_kwargs={"float32_matmul_precision": args.float32_matmul_precision,
                     "load_format": args.load_format, "seed": args.seed},
        model_config=mc, cache_config=vllm_config.cache_config,
        device=args.device, seed=args.seed, batch_invariant=batch_invariant_enabled(args),
        logprobs_mode=args.logprobs_mode,
        lm_head_dtype=None if args.lm_head_dtype is None else LM_HEAD_DTYPES[args.lm_head_dtype],
        num_threads=worker_threads(tp))
    return MultiprocExecutor(model, spec, tp)
