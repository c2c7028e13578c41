"""``minivllm serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine.

vLLM: ``vllm/entrypoints/openai/api_server.py``. Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` for
  server-sent events, ending with ``data: [DONE]``);
* ``GET /v1/models``; ``GET /health`` (200, or 503 when the engine thread has died);
  ``GET /metrics`` (Prometheus, vLLM's names: see ``metrics.py``); ``GET /version``;
  ``POST /tokenize``, ``POST /detokenize``.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``:
400 for a malformed body or an invalid parameter (including a prompt longer than
max_model_len: nothing is truncated unless the request asks for it with vLLM's
``truncate_prompt_tokens``, which keeps the last k tokens), 401 for a missing or wrong key when ``--api-key``
is set (it guards the ``/v1/*`` routes, as in vLLM; health, metrics, version and
tokenization stay open), 404 for an unknown model name, 503 while more than
``--max-waiting-requests`` requests wait. A client that disconnects (streaming or not)
aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.async_llm import AsyncLLM, QueueFullError
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest,
                                                  message_text)
from minivllm.outputs import RequestOutput

logger = logging.getLogger("minivllm")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable"}


async def wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so the next ASGI
    message is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
        "code": status}})


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def build_app(llm: AsyncLLM, served_model_names: list[str], api_key: Optional[str] = None,
              metrics: Optional[ServerMetrics] = None) -> FastAPI:
    """The FastAPI app around a running :class:`AsyncLLM`."""
    app = FastAPI(title="minivllm", docs_url=None, redoc_url=None)
    metrics = metrics or ServerMetrics(served_model_names[0], None)
    model_name = served_model_names[0]

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return error_response(400, "invalid request body: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):  # never a bare 500 page
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "missing or invalid API key (send "
                                           "'Authorization: Bearer <key>')")
        return await call_next(request)

    def check_model(name: Optional[str]) -> None:
        if name is not None and name not in served_model_names:
            raise APIError(404, f"The model `{name}` does not exist; served: "
                                f"{', '.join(served_model_names)}", "model")

    def check_context(num_prompt_tokens: int, max_tokens: Optional[int]) -> None:
        """As vLLM's server: a request that cannot fit is refused, never cut short."""
        limit = llm.max_model_len
        if num_prompt_tokens > limit:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens, more than this "
                                f"model's maximum context length of {limit} tokens", "prompt")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                                f"prompt has {num_prompt_tokens} tokens and max_tokens is "
                                f"{max_tokens} ({num_prompt_tokens + max_tokens} in all)",
                           "max_tokens")

    def sampling_params(body, default_max_tokens, logprobs):
        try:
            return body.sampling_params(default_max_tokens, logprobs,
                                        llm.engine.default_sampling_params)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def run(request: Request, body, token_ids: list[int], params, prefix: str, streamer):
        """Check the context, add the request; then a StreamingResponse (``body.stream``)
        or the final RequestOutput. Returns (request id, created, that)."""
        try:  # truncate_prompt_tokens: keep the last k tokens before the length check
            token_ids = llm.engine.input_processor.truncate_prompt_tokens(
                token_ids, params.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None
        check_context(len(token_ids), body.max_tokens)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        outputs, gen = await start(body.engine_prompt(token_ids), params, rid)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return rid, created, StreamingResponse(
                sse(streamer(outputs, rid, created, params, include_usage), gen, request, rid),
                media_type="text/event-stream")
        return rid, created, await collect(request, outputs, gen)

    async def start(prompt, params, request_id):
        """Add the request; returns its output iterator (errors raise APIError)."""
        gen = llm.generate(prompt, params, request_id)
        try:
            first = await gen.__anext__()
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        except QueueFullError as e:
            raise APIError(503, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e)) from None
        except StopAsyncIteration:  # pragma: no cover - a stream always ends finished
            raise APIError(500, "the request produced no output") from None

        async def chained() -> AsyncIterator[RequestOutput]:
            yield first
            async for out in gen:
                yield out
        return chained(), gen

    async def collect(request: Request, outputs, gen) -> RequestOutput:
        """The final output; aborts the request as soon as the client disconnects."""
        async def last():
            final = None
            async for out in outputs:
                final = out
            return final

        task = asyncio.ensure_future(last())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()  # the engine stream's finally aborts the request
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(400, "client disconnected")
            return task.result()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()

    # --- routes ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not llm.is_healthy():
            return error_response(503, f"engine is not running: {llm.errored!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from minivllm import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": now, "owned_by": "minivllm",
             "root": llm.engine.model_config.model, "max_model_len": llm.max_model_len,
             "vocab_size": llm.engine.model_config.vocab_size}
            for n in served_model_names]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'")
        if llm.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        if body.messages is not None:
            text = chat_prompt(body.messages, True)
            ids = llm.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = llm.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        if llm.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    def chat_prompt(messages, add_generation_prompt: bool) -> str:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        try:
            conv = [{"role": m.role, "content": message_text(m)} for m in messages]
            return llm.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo or body.suffix is not None:
            raise APIError(400, "echo and suffix are not supported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of several texts is not "
                                    "supported)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise APIError(400, "prompt must not be empty", "prompt")
        params = sampling_params(body, 16, body.logprobs)
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise APIError(400, "a text prompt needs the model's tokenizer and this server "
                                    "has none: send token ids", "prompt")
            prompt = llm.tokenizer.encode(prompt)
        # a list of texts was reduced to its one text above: token ids are left
        rid, created, result = await run(request, body, cast(list[int], prompt), params,
                                         "cmpl", stream_completion)
        if isinstance(result, StreamingResponse):
            return result
        out = result
        c = out.outputs[0]
        choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason,
                  "logprobs": completion_logprobs(c, 0, len(c.token_ids))
                  if params.logprobs is not None else None}
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage(out)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (the server runs without one)")
        prompt = chat_prompt(body.messages, body.add_generation_prompt)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        params = sampling_params(body, None,
                                 (body.top_logprobs or 0) if body.logprobs else None)
        token_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        rid, created, result = await run(request, body, token_ids, params, "chatcmpl",
                                         stream_chat)
        if isinstance(result, StreamingResponse):
            return result
        out = result
        c = out.outputs[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                  "logprobs": chat_logprobs(c, 0, len(c.token_ids), params.logprobs)
                  if body.logprobs else None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage(out)}

    # --- streaming ------------------------------------------------------------------
    async def stream_completion(outputs, rid, created, params, include_usage):
        last = None
        async for out, delta, tok0, char0 in stream_deltas(outputs, params):
            last = out
            if delta is None:
                continue
            c = out.outputs[0]
            yield {"id": rid, "object": "text_completion", "created": created,
                   "model": model_name, "choices": [{
                       "index": 0, "text": delta,
                       "logprobs": completion_logprobs(c, tok0, len(c.token_ids), char0)
                       if params.logprobs is not None else None,
                       "finish_reason": c.finish_reason if out.finished else None}]}
        if include_usage and last is not None:
            yield {"id": rid, "object": "text_completion", "created": created,
                   "model": model_name, "choices": [], "usage": usage(last)}

    async def stream_chat(outputs, rid, created, params, include_usage):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model_name}
        yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
        last = None
        async for out, delta, tok0, _ in stream_deltas(outputs, params):
            last = out
            if delta is None:
                continue
            c = out.outputs[0]
            yield {**head, "choices": [{
                "index": 0, "delta": {"content": delta} if delta else {},
                "logprobs": chat_logprobs(c, tok0, len(c.token_ids), params.logprobs)
                if params.logprobs is not None else None,
                "finish_reason": c.finish_reason if out.finished else None}]}
        if include_usage and last is not None:
            yield {**head, "choices": [], "usage": usage(last)}

    async def abort_on_disconnect(request: Request, request_id: str) -> None:
        """Abort as soon as the client goes away, without waiting for a write to fail
        (a server can write many chunks into a closed socket before it notices)."""
        await wait_disconnect(request)
        llm.abort(request_id)

    async def sse(chunks, gen, request: Request, request_id: str) -> AsyncIterator[str]:
        watcher = asyncio.ensure_future(abort_on_disconnect(request, request_id))
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except RuntimeError as e:  # the engine failed mid-stream
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': 500}})}\n\n"
        finally:
            # A disconnect lands here. Closing the engine stream explicitly (not at
            # garbage collection) runs its finally, which aborts the request at once.
            watcher.cancel()
            await chunks.aclose()
            await gen.aclose()

    def completion_logprobs(c, start, end, offset0=0):
        """OpenAI's legacy completions format for tokens [start, end)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = offset0
        for i in range(start, min(end, len(c.logprobs or []))):
            entry, tid = c.logprobs[i], c.token_ids[i]
            tok = _token_text(entry, tid)
            tokens.append(tok)
            token_lps.append(entry[tid].logprob)
            tops.append({_token_text(entry, k): v.logprob for k, v in entry.items()})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(c, start, end, n_top):
        """OpenAI's chat format: the chosen token and the ``n_top`` most likely ones."""
        content = []
        for i in range(start, min(end, len(c.logprobs or []))):
            entry, tid = c.logprobs[i], c.token_ids[i]
            top = sorted((v.rank, k, v.logprob) for k, v in entry.items()
                         if v.rank is not None and v.rank <= n_top)
            tok = _token_text(entry, tid)
            content.append({"token": tok, "logprob": entry[tid].logprob,
                            "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": _token_text(entry, k), "logprob": lp,
                                              "bytes": list(_token_text(entry, k).encode("utf-8"))}
                                             for _, k, lp in top]})
        return {"content": content}

    return app


async def stream_deltas(outputs, params):
    """For each streamed ``RequestOutput``: ``(out, delta, first_token, first_char)``, where
    ``delta`` is the new text to send (see :func:`text_delta`) or None when there is
    nothing to send yet, and ``first_token``/``first_char`` are where the chunk's tokens
    and text start in the completion (for its log-probs)."""
    sent_text, sent_tokens = "", 0
    async for out in outputs:
        c = out.outputs[0]
        delta = text_delta(sent_text, c.text, out.finished, params)
        send = bool(delta) or out.finished
        yield out, delta if send else None, sent_tokens, len(sent_text)
        if send:
            sent_text += delta
            sent_tokens = len(c.token_ids)


def text_delta(sent: str, text: str, finished: bool, params) -> str:
    """New text to send: held back while it could still become a stop string (the longest
    stop string minus one character) or ends in a partial UTF-8 character ("\\ufffd")."""
    if finished:
        return text[len(sent):] if text.startswith(sent) else ""
    hold = max((len(s) for s in params._stop_list), default=1) - 1
    safe = text[:len(text) - hold] if hold > 0 else text
    safe = safe.rstrip("\ufffd")
    if len(safe) <= len(sent) or not safe.startswith(sent):
        return ""
    return safe[len(sent):]


def _token_text(entry: dict, token_id: int) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else str(token_id)


def usage(out: RequestOutput) -> dict:
    p, g = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def run_server(engine_args, host: str = "127.0.0.1", port: int = 8000,
               served_model_names: Optional[list[str]] = None, api_key: Optional[str] = None,
               max_waiting_requests: Optional[int] = None, log_stats: bool = True,
               log_interval_s: float = 5.0, precision_monitor=None) -> None:
    """Start the engine and serve until interrupted (``minivllm serve``).
    ``precision_monitor``: a :class:`minivllm.precision.monitor.DriftMonitor` fed every
    finished request (its state is exported as ``minivllm:precision_monitor_*`` gauges)."""
    import uvicorn

    from minivllm.quantization.calibration import calibration_sequences

    names = served_model_names or [engine_args.model]
    metrics = ServerMetrics(names[0], log_interval_s if log_stats else None)
    llm = AsyncLLM(engine_args, max_waiting_requests, on_step=metrics.on_step,
                   calibration_data=calibration_sequences)
    if precision_monitor is not None:
        llm.engine.set_precision_monitor(precision_monitor)
    app = build_app(llm, names, api_key, metrics)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    logger.info("serving %s on http://%s:%d (max_model_len %d)", ", ".join(names), host, port,
                llm.max_model_len)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        llm.shutdown()
