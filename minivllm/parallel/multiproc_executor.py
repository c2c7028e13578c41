"""The multiprocess executor: ``tensor_parallel_size`` ranks, one process each
(``distributed_executor_backend="mp"``; vLLM: ``vllm/v1/executor/multiproc_executor.py``).

Rank 0 is the engine's own process: it schedules, runs its shard of the model and
samples. Ranks 1..tp-1 are worker processes; each loads the checkpoint, keeps its shard
(:func:`~minivllm.parallel.tensor_parallel.shard_model`) and allocates the KV cache of
its heads only, with the same number of blocks as rank 0, so the scheduler's block
tables are valid on every rank.

**Starting a worker.** Each worker is a fresh interpreter,
``python -c "from minivllm.parallel.multiproc_executor import worker_main; worker_main()"``
(:class:`WorkerProc`), not a ``multiprocessing`` child: the "spawn" and "forkserver"
start methods re-run the caller's ``__main__`` in every child, which fails for a script
read from stdin (``python - <<EOF``: there is no file ``<stdin>`` to re-run) and re-runs
the whole script when it has no ``if __name__ == "__main__"`` guard; "fork" copies a
process whose torch threads are already running. A worker imports only minivllm, with
rank 0's ``sys.path``, so it starts the same way from a script, stdin, ``python -c`` or
a notebook kernel.

Two channels, as in vLLM:

* **control** (vLLM: a shared-memory message queue broadcasting the scheduler output):
  one socket pair per worker (a :class:`multiprocessing.connection.Connection` at each
  end). Before rank 0 runs its model forward (or its LM head), it sends the same call
  with the same inputs (token ids, positions, attention metadata, or the hidden rows) to
  every worker. A worker waits on its connection without a timeout, so an idle engine
  keeps its workers; it exits when the connection closes (rank 0 went away).
* **data**: ``torch.distributed`` with the gloo backend (NCCL would be the CUDA one):
  the all-reduces and all-gathers inside the forward, in the same order on every rank.
  The rendezvous store (``TCPStore``) is hosted by worker 1, not by rank 0, so that
  rank 0's wait to join the group fails at once when the workers are stopped.

Each forward therefore runs on all ranks at once, and rank 0's results (which the
all-reduce makes equal on every rank) go on to the sampler. Only rank 0 samples.

**A worker's death** (vLLM: "Engine core initialization failed", and its worker monitor)
never leaves rank 0 waiting. While the workers start, rank 0 waits on their connections
and notices a closed one at once; afterwards a monitor thread polls them every 0.1 s,
and at the first one that ends it kills the others, which ends whatever wait rank 0 is
in (a collective inside the forward, or the join). Either way the caller gets a
``RuntimeError`` naming the rank, its pid and exit code (and the worker's traceback when
it died of a Python exception) within about a second, and no worker process is left.
The engine cannot run afterwards; build a new ``LLM``. Rank 0's own exception inside a
forward (Ctrl-C included) also stops the workers, since the ranks are then out of step.
A worker whose rank 0 dies exits too (its connection closes; it also watches its parent).

Limits (each raises a clear error at start): CPU only (the NCCL path is not written);
float weights (no ``quantization``); no speculative decoding, CUDA-graph emulation or
KV-scale calibration; swapped steps (``LLM.swap_step``) apply to rank 0's shard only, so
``swap_step`` is refused. One tensor-parallel engine per process at a time (the
default process group); :meth:`MultiprocExecutor.shutdown` frees it for the next.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from minivllm.parallel.emulated_tp import shard_merged_column, shard_qkv
from minivllm.parallel.tensor_parallel import TPGroup, shard_model

logger = logging.getLogger("minivllm")

_STARTUP_TIMEOUT_S = 300  # a worker imports torch and loads the checkpoint
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one all-reduce, once all ranks are running
_STORE_TIMEOUT = timedelta(seconds=30)  # connecting to worker 1's store (it is up by then)
_MONITOR_INTERVAL_S = 0.1  # how often the monitor thread polls the workers
_DEATH_GRACE_S = 5.0  # a failed collective: how long to wait for the monitor to see why
_STOP_TIMEOUT_S = 10.0  # shutdown(): an idle worker's clean exit
_HOST = "127.0.0.1"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding minivllm/
_WORKER_COMMAND = "from minivllm.parallel.multiproc_executor import worker_main; worker_main()"
# what a worker's control connection raises when rank 0 went away (closed its end)
_RANK0_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


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


# --- the worker process ---------------------------------------------------------------

def worker_main() -> None:
    """A worker process's entry point (run by :class:`WorkerProc` as ``python -c``; argv:
    the file descriptor of its control connection, rank 0's pid). Exits 0 when told to
    stop or when rank 0 goes away, 1 after an exception (its traceback sent to rank 0)."""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is rank 0's to handle
    _exit_with_parent(parent_pid)
    conn = Connection(fd)
    try:
        parent_path = conn.recv()  # rank 0's sys.path, before unpickling anything else
        sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
        rank, world_size, spec = conn.recv()
    except _RANK0_GONE:
        sys.exit(0)
    except BaseException:  # e.g. a function in the spec that cannot be imported here
        sys.exit(_report(conn, traceback.format_exc()))
    sys.exit(_serve(conn, rank, world_size, spec))


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when rank 0's process ends, whatever this one is waiting on."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="minivllm-parent-watch").start()


def _serve(conn: Connection, rank: int, world_size: int, spec: WorkerSpec) -> int:
    """Build the shard and its KV cache, join the group when rank 0 says so, then serve
    calls from rank 0 until told to stop or the connection closes. Returns the exit code."""
    try:
        torch.set_num_threads(spec.num_threads)
        store = None
        if rank == 1:  # the rendezvous store lives here (see the module docstring)
            store = dist.TCPStore(_HOST, 0, world_size, is_master=True,
                                  wait_for_workers=False, timeout=_STORE_TIMEOUT)
            conn.send(("store", store.port))
        model = build_shard(spec, TPGroup(rank, world_size))
        from minivllm.worker.model_runner import ModelRunner

        # the runner allocates and binds this rank's KV cache (same blocks as rank 0's)
        ModelRunner(model, spec.model_config, spec.cache_config, spec.device, spec.seed,
                    batch_invariant=spec.batch_invariant, logprobs_mode=spec.logprobs_mode)
        conn.send(("loaded", None))
        op, port = conn.recv()
        if op != "join":
            return 0
        if store is None:
            store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                                  timeout=_STORE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=_COLLECTIVE_TIMEOUT)
    except _RANK0_GONE:
        return 0
    except BaseException:
        return _report(conn, traceback.format_exc())
    with torch.inference_mode():
        while True:
            try:
                op, args = pickle.loads(conn.recv_bytes())
            except _RANK0_GONE:
                return 0
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
                return _report(conn, traceback.format_exc())
    dist.destroy_process_group()
    return 0


def _report(conn: Connection, tb: str) -> int:
    """Send a worker's traceback to rank 0 (to stderr if rank 0 is gone); exit code 1."""
    try:
        conn.send(("error", tb))
    except OSError:
        print(tb, file=sys.stderr)
    return 1


# --- rank 0 ---------------------------------------------------------------------------

class _WorkerDied(Exception):
    """Internal: a worker was seen dead (``MultiprocExecutor.dead``); the caller gets a
    RuntimeError that names it."""


class WorkerProc:
    """One worker process (rank >= 1) and rank 0's end of its control connection (vLLM:
    ``WorkerProc``). Answers ``is_alive()``, ``exitcode`` and ``pid`` as a
    ``multiprocessing.Process`` would."""

    def __init__(self, rank: int):
        self.rank = rank
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.error: Optional[str] = None  # the traceback it sent before dying, if any

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> Optional[int]:
        """None while running; negative: killed by that signal."""
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def read_error(self) -> None:
        """Keep the traceback the worker sent before it ended, if it sent one."""
        try:
            while self.conn.poll(0):
                status, what = self.conn.recv()
                if status == "error":
                    self.error = what
        except (EOFError, OSError):
            pass

    def describe_death(self) -> str:
        """The worker's death in words: its rank, pid, exit code (and signal, if killed)."""
        self.join(timeout=_DEATH_GRACE_S)  # its exit code (the process may still be ending)
        code = self.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how += f", {signal.Signals(-code).name}"
        return f"tensor-parallel worker {self.rank} (pid {self.pid}) died ({how})"


class MultiprocExecutor:
    """Start ``tp - 1`` worker processes and make ``model`` rank 0's shard.

    Args:
        model: the full model rank 0 loaded (sharded here, in place).
        spec: what the workers need to load the same model.
        tp: tensor_parallel_size (>= 2).
    After construction, ``model.forward`` and ``model.compute_logits`` first send the
    same call to every worker, then run rank 0's shard; use the model as before.
    ``procs``: the :class:`WorkerProc` of ranks 1..tp-1.
    Raises:
        RuntimeError: another tensor-parallel engine is alive in this process, or a
            worker failed to start ("Engine core initialization failed: ...", naming the
            rank and its exit code, with its traceback if it raised); no worker is left.
            Later, from a forward, ``compute_logits`` or :meth:`collective_rpc`: a worker
            died (see the module docstring); the executor is then shut down.
    """

    def __init__(self, model, spec: WorkerSpec, tp: int):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process "
                               "(torch.distributed's default group is in use); call its "
                               "shutdown() first")
        self.tp, self.model = tp, model
        self.procs: list[WorkerProc] = []
        self.dead: Optional[WorkerProc] = None  # the first worker that died
        self._stopped = False
        self._stopping = threading.Event()  # shutdown() began: workers' exits are expected
        self._died = threading.Event()  # the monitor saw a worker die
        self._monitor: Optional[threading.Thread] = None
        try:
            for rank in range(1, tp):
                self.procs.append(WorkerProc(rank))
            for w in self.procs:
                w.conn.send(sys.path)
                w.conn.send((w.rank, tp, spec))
            self.group = TPGroup(0, tp)
            shard_model(model, self.group, spec.shard_qkv_fn, spec.shard_merged_column_fn)
            store = self._wait_loaded()
            self._monitor = threading.Thread(target=self._monitor_workers, daemon=True,
                                             name="minivllm-tp-monitor")
            self._monitor.start()
            for w in self.procs:
                w.conn.send(("join", store.port))
            dist.init_process_group("gloo", store=store, rank=0, world_size=tp,
                                    timeout=_COLLECTIVE_TIMEOUT)
        except BaseException as e:
            self._fail(e, starting=True)
        forward, compute_logits = model.forward, model.compute_logits

        def forward_all_ranks(input_ids, positions, meta):
            return self._on_all_ranks("forward", (input_ids, positions, meta), forward)

        def compute_logits_all_ranks(hidden):
            return self._on_all_ranks("compute_logits", (hidden,), compute_logits)

        # instance attributes: nn.Module.__call__ finds them before the class's methods
        model.forward = forward_all_ranks
        model.compute_logits = compute_logits_all_ranks
        logger.info("tensor_parallel_size=%d: %d worker process(es) ready (gloo)", tp, tp - 1)

    def _wait_loaded(self) -> dist.TCPStore:
        """Wait until every worker has loaded its shard, noticing at once one that dies
        or raises. Returns rank 0's client of worker 1's rendezvous store, connected as
        soon as worker 1 announces it (before loading), so that from then on worker 1's
        death closes the connection and fails any wait on the store at once."""
        pending = list(self.procs)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        store = None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("Engine core initialization failed: tensor-parallel "
                                   f"worker(s) {[w.rank for w in pending]} did not start "
                                   f"within {_STARTUP_TIMEOUT_S} s")
            ready = wait([w.conn for w in pending], timeout=min(left, 1.0))
            for w in [w for w in pending if w.conn in ready]:
                try:
                    status, what = w.conn.recv()
                except (EOFError, OSError):  # its end closed: the process ended
                    self.dead = w
                    raise _WorkerDied() from None
                if status == "error":
                    w.error, self.dead = what, w
                    raise _WorkerDied()
                if status == "store":
                    store = dist.TCPStore(_HOST, what, self.tp, is_master=False,
                                          timeout=_STORE_TIMEOUT)
                else:  # "loaded"
                    pending.remove(w)
            for w in pending:  # a closed connection says it first; this is to be sure
                if not w.is_alive():
                    w.read_error()
                    self.dead = w
                    raise _WorkerDied()
        assert store is not None
        return store

    def _monitor_workers(self) -> None:
        """Poll the workers (vLLM: ``MultiprocExecutor.start_worker_monitor``); at the
        first one that ends before shutdown(), record it and kill the others, which ends
        any wait of rank 0 on them (a collective, or the join: the store is in worker 1)."""
        while not self._stopping.is_set():
            for w in self.procs:
                if w.is_alive() or self._stopping.is_set():
                    continue
                w.read_error()
                self.dead = w
                logger.error("tensor-parallel worker %d (pid %d) died (exit code %s); "
                             "stopping the others", w.rank, w.pid, w.exitcode)
                for other in self.procs:
                    other.kill()
                self._died.set()
                return
            self._stopping.wait(_MONITOR_INTERVAL_S)

    def _fail(self, cause: BaseException, starting: bool = False) -> NoReturn:
        """``cause`` was raised on rank 0 during a call that involves every rank (or while
        starting them). Stop the workers (the ranks are out of step) and raise: a
        RuntimeError naming the worker that died, if one did (a failed collective waits
        up to 5 s for the monitor, which sees a death within 0.1 s), else ``cause``."""
        if self._monitor is not None and isinstance(cause, (RuntimeError, OSError)):
            self._died.wait(_DEATH_GRACE_S)
        dead = self.dead or self._first_dead(1.0 if isinstance(cause, OSError) else 0.0)
        if dead is not None:
            dead.join(timeout=_DEATH_GRACE_S)  # one that raised exits by itself: its code
        self._stop(graceful=False)
        if dead is not None:
            what = "Engine core initialization failed: " if starting else ""
            tb = f"\nThe worker's traceback:\n{dead.error}" if dead.error else ""
            raise RuntimeError(f"{what}{dead.describe_death()}; the other workers were "
                               f"stopped, build a new LLM.{tb}") \
                from (None if isinstance(cause, _WorkerDied) else cause)
        if not starting:
            logger.error("%s on rank 0 mid-step: the tensor-parallel workers were stopped "
                         "(the ranks were out of step); build a new LLM", type(cause).__name__)
        raise cause

    def _first_dead(self, wait_s: float) -> Optional[WorkerProc]:
        """A worker that has ended, looking for up to ``wait_s`` (a closed connection
        comes a moment before the exit); None if all are alive."""
        deadline = time.monotonic() + wait_s
        while True:
            for w in self.procs:
                if not w.is_alive():
                    w.read_error()
                    return w
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _on_all_ranks(self, op: str, args: tuple, local: Callable) -> Any:
        """Send ``op`` to every worker, then run ``local(*args)`` (rank 0's part)."""
        self._send(op, args)
        try:
            return local(*args)
        except BaseException as e:
            self._fail(e)

    def _send(self, op: str, args: tuple) -> None:
        if self.dead is not None:  # the monitor saw it: the group is stopped
            self._fail(_WorkerDied())
        if self._stopped:
            raise RuntimeError("this tensor-parallel engine was shut down")
        payload = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.procs:
            try:
                w.conn.send_bytes(payload)
            except OSError as e:  # its end closed: it died
                self._fail(e)

    def collective_rpc(self, fn: Callable, args: tuple = ()) -> Any:
        """Run ``fn(model, *args)`` on every rank (rank 0 last returns its result; vLLM:
        ``LLM.collective_rpc``). ``fn`` must be a module-level function of an importable
        module, not of the caller's ``__main__`` (the workers import it by name and never
        run ``__main__``), and may use collectives: every rank runs it at once.
        Raises:
            ValueError: ``fn`` is defined in ``__main__`` (nothing is sent; the engine
                keeps running).
            RuntimeError: a worker died (the executor is then shut down).
        """
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"collective_rpc: {getattr(fn, '__qualname__', fn)} is defined in "
                             "__main__, which the worker processes do not import; define it "
                             "in a module")
        return self._on_all_ranks("call", (fn, args), lambda fn, fargs: fn(self.model, *fargs))

    def shutdown(self) -> None:
        """Stop the workers and free the process group. Safe to call twice."""
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        """Tell the workers to stop (``graceful``: wait up to 10 s for an idle worker's
        clean exit) and kill what is left, reaping every process; free the group."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if graceful:
            for w in self.procs:
                try:
                    w.conn.send_bytes(pickle.dumps(("stop", ())))
                except OSError:
                    pass
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for w in self.procs:
                w.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.procs:
            w.kill()
            w.join()
        if self._monitor is not None:
            self._monitor.join()
        for w in self.procs:
            w.conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            # a failed join: init_process_group had already counted its group, and the
            # next engine's rank 0 would rendezvous as group "1" while its new workers wait
            # as group "0", forever; destroy_process_group() resets the same counter
            dist.distributed_c10d._world.group_count = 0


def worker_threads(tp: int) -> int:
    """Threads per worker process: the machine's cores shared among the tp ranks (at
    least 1), so tp = 3 on 2 cores does not oversubscribe them tp-fold."""
    return max(1, (os.cpu_count() or 1) // tp)


def start_tensor_parallel(model, args, vllm_config) -> MultiprocExecutor:
    """The engine's executor for ``tensor_parallel_size > 1``
    (``distributed_executor_backend="mp"``): workers load the same checkpoint as rank 0
    did (``args``: the EngineArgs; ``vllm_config``: the engine's configs). Raises
    RuntimeError if a worker fails to start (see :class:`MultiprocExecutor`)."""
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
