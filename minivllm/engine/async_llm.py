"""AsyncLLM: the engine driven by one background thread, for the OpenAI server.

vLLM: ``vllm/v1/engine/async_llm.py`` (there the engine core runs in another process;
here a thread keeps it readable). One thread owns the :class:`LLMEngine`: it applies
queued commands (add, abort), runs ``step()`` while there is work, and after each step
publishes every tracked request's progress to the asyncio side. Handlers never touch the
engine directly, so nothing needs a lock around the scheduler or the KV cache.

A request's stream yields :class:`RequestOutput` snapshots (cumulative: all tokens so
far) and ends with the finished one. ``abort`` (a client that went away) finishes the
request with "abort" and frees its KV blocks in the next loop iteration.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Union

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting_requests`` allows (HTTP 503)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_tokens: int = 0


@dataclass
class StepRecord:
    """What one engine step did, for metrics (seconds are time.monotonic())."""

    now: float
    outputs: list  # RequestOutput snapshots of tracked requests that progressed
    new_tokens: dict = field(default_factory=dict)  # request id -> tokens added this step
    finished: list = field(default_factory=list)  # finished RequestOutputs


class AsyncLLM:
    """Run an :class:`LLMEngine` in a background thread; stream outputs to asyncio.

    Args:
        engine_args: the engine's arguments.
        max_waiting_requests: refuse new requests (``QueueFullError``) while this many
            are already waiting; None for no limit.
        on_step: called in the engine thread after every step with a
            :class:`StepRecord` (metrics).
        calibration_data: see :class:`LLMEngine` (the server passes the bundled sets).
    """

    def __init__(self, engine_args: EngineArgs, max_waiting_requests: Optional[int] = None,
                 on_step: Optional[Callable[["AsyncLLM", StepRecord], None]] = None,
                 calibration_data: Optional[Callable[..., list[list[int]]]] = None):
        self.engine = LLMEngine.from_engine_args(engine_args, calibration_data)
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.errored: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    # --- called from asyncio handlers ------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    def is_healthy(self) -> bool:
        return self.errored is None and self._thread.is_alive()

    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its snapshots until it finishes.

        Raises:
            ValueError / TypeError: the engine refused the request (bad parameters, a
                prompt over max_model_len, ...), before anything was yielded.
            QueueFullError: too many waiting requests.
            RuntimeError: the engine thread died.
        If the consumer stops iterating (a disconnected client), the request is aborted.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        fut = self._submit("add", prompt, params, request_id, stream)
        await asyncio.wrap_future(fut)  # raises the engine's validation error
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished)."""
        self._submit("abort", request_id)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    # --- the engine thread ------------------------------------------------------------
    def _submit(self, *command) -> Future:
        fut: Future = Future()
        if not self.is_healthy():
            fut.set_exception(RuntimeError(f"the engine is not running ({self.errored!r})"))
            return fut
        self._commands.put((fut, command))
        return fut

    def _apply(self, fut: Future, command) -> None:
        kind = command[0]
        try:
            if kind == "add":
                _, prompt, params, request_id, stream = command
                waiting = self.engine.scheduler.num_waiting
                if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests are already waiting "
                                         f"(max_waiting_requests={self.max_waiting_requests})")
                self.engine.add_request(prompt, params, request_id=request_id)
                self._streams[request_id] = stream
            elif kind == "abort":
                rid = command[1]
                if rid in self._streams:
                    self.engine.abort_request(rid)
                    out = self.engine.finished_outputs.pop(rid, None)
                    stream = self._streams.pop(rid)
                    if out is not None:
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
                        if self.on_step is not None:  # gauges drop, "abort" is counted
                            self.on_step(self, StepRecord(time.monotonic(), [], {}, [out]))
            fut.set_result(None)
        except BaseException as e:  # reported to the caller, the loop goes on
            fut.set_exception(e)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._apply(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_unfinished_requests())
                if not engine.has_unfinished_requests():
                    continue
                finished = engine.step()
                self._publish(finished)
        except BaseException as e:  # the engine is broken: fail every open stream
            logger.exception("engine thread failed")
            self.errored = e
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
            self._streams.clear()

    def _publish(self, finished: list[RequestOutput]) -> None:
        now = time.monotonic()
        record = StepRecord(now=now, outputs=[])
        done = {o.request_id: o for o in finished}
        for rid in list(self._streams):
            stream = self._streams[rid]
            out = done.get(rid)
            if out is None:
                out = self.engine.finished_outputs.pop(rid, None)  # e.g. finished "error"
            if out is None:
                req = self.engine.scheduler.requests.get(rid)
                if req is None or req.num_output_tokens == stream.sent_tokens:
                    continue
                out = self.engine.output_processor.make_output(req)
            n = len(out.outputs[0].token_ids)
            record.new_tokens[rid] = n - stream.sent_tokens
            stream.sent_tokens = n
            record.outputs.append(out)
            if out.finished:
                record.finished.append(out)
                del self._streams[rid]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        for rid in done:
            self.engine.finished_outputs.pop(rid, None)
        if self.on_step is not None:
            try:
                self.on_step(self, record)
            except Exception:  # metrics must never break serving
                logger.exception("on_step callback failed")
