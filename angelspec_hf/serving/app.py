"""`angelspec serve`'s HTTP side: an OpenAI-compatible FastAPI app over an `EngineLoop`.

`/v1/chat/completions` and `/v1/completions` (streamed as server-sent events with `stream: true`), `/v1/models`,
`/health` and `/metrics` (Prometheus). A request is checked whole before it reaches the engine (400, the field
named), refused when the server is full (429) or stopping (503), cut off at its deadline, and freed from the batch
when its client disconnects. Text is detokenized incrementally: a piece is sent once no stop string can still
begin in it and it ends on a whole character.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..generation.engine import Request
from .engine_loop import EngineLoop, LiveRequest, ServerBusy, ShuttingDown
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseShape, error_body, usage


DISCONNECT_POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 1.0  # when the app stops, the ASGI server has already given open requests their grace  # how often a non-streamed request checks that its client is still there
ERRORS = {  # why the server ended a request -> HTTP status, OpenAI error type, metrics outcome
    "timeout": (504, "timeout_error", "timeout"),
    "shutdown": (503, "server_error", "unavailable"),
    "error": (500, "server_error", "error"),
}
FINISH_REASONS = {"eos": "stop", "length": "length", "stop": "stop"}  # the engine's -> OpenAI's


class RequestProblem(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class TextAssembler:
    """The text of a growing list of token ids, released piece by piece: held back while it ends in an incomplete
    character or could be the start of a stop string; `stopped` once a stop string appears (the text ends before
    it)."""

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.hold = max((len(stop) for stop in stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, tokens: list[int], final: bool = False) -> str:
        """Take new tokens; return the text that may be sent now (all of it when `final`)."""
        if self.stopped:
            return ""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cut = min(
            (i for i in (text.find(stop, max(0, self.sent - self.hold)) for stop in self.stop_strings) if i >= 0),
            default=-1,
        )
        if cut >= 0:
            self.stopped, self.text = True, text[:cut]
            return self._release(cut)
        self.text = text
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":  # a character whose bytes are still coming
                end -= 1
            end = max(self.sent, min(end, len(text) - self.hold))
        return self._release(end)

    def _release(self, end: int) -> str:
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece


def create_app(
    engine_loop: EngineLoop,
    tokenizer,
    model_name: str,
    default_max_tokens: int = 256,
    request_timeout: float | None = 600.0,
) -> FastAPI:
    """The app serving `engine_loop`'s engine as `model_name`; the loop starts with the app and stops with it. The
    ASGI server lets open requests finish first (uvicorn's `timeout_graceful_shutdown`); what is still running when
    the app stops ends with an error."""
    engine = engine_loop.engine
    metrics = engine_loop.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop, STOP_GRACE_SECONDS)

    app = FastAPI(title="angelspec serve", lifespan=lifespan)

    def count(endpoint: str, outcome: str) -> None:
        if metrics is not None:
            metrics.observe_request(endpoint, outcome)

    def refuse(endpoint: str, problem: RequestProblem, outcome: str = "invalid") -> JSONResponse:
        count(endpoint, outcome)
        headers = {"Retry-After": "1"} if problem.status == 429 else None
        return JSONResponse(
            error_body(problem.message, problem.kind, problem.param), status_code=problem.status, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(http: HTTPRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return refuse(_endpoint(http.url.path), RequestProblem(400, f"the body is not valid JSON: {first['msg']}"))
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return refuse(_endpoint(http.url.path), RequestProblem(400, message, param))

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "pending": engine_loop.pending})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "angelspec_hf"}],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            return Response("metrics are off\n", status_code=404, media_type="text/plain")
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def engine_request(body, prompt_ids: list[int], request_id: str) -> Request:
        """The engine request of a validated body, or RequestProblem (naming the field) if it cannot be served."""
        if body.model not in (None, model_name):
            raise RequestProblem(
                404,
                f"model {body.model!r} is not served here; this server serves {model_name!r}",
                "model",
                "not_found_error",
            )
        refused = body.unsupported()
        if refused is not None:
            raise RequestProblem(400, f"{refused}: not served by this server", refused)
        sampled = body.temperature > 0
        max_new_tokens = body.length
        if max_new_tokens is None:  # up to the server's default, within the target's context
            room = engine.context_limit - len(prompt_ids) if engine.context_limit else default_max_tokens
            max_new_tokens = max(1, min(default_max_tokens, room))
        request = Request(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            do_sample=sampled,
            temperature=body.temperature if sampled else 1.0,
            top_p=body.top_p if sampled and body.top_p < 1 else None,
            seed=body.seed,
            request_id=request_id,
            reproducible=body.seed is not None,  # the text depends on the seed alone, whatever the load
        )
        problem = engine.problem(request)
        if problem is not None:
            raise RequestProblem(
                400, problem, "max_tokens" if "max_new_tokens" in problem or "context" in problem else None
            )
        return request

    async def serve(body, http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        shape = ResponseShape(chat, model_name)
        try:
            prompt_ids = _encode(tokenizer, body, chat)
            request = engine_request(body, prompt_ids, shape.id)
            live = engine_loop.submit(request, timeout=request_timeout)
        except RequestProblem as problem:
            return refuse(endpoint, problem)
        except ServerBusy as busy:
            return refuse(endpoint, RequestProblem(429, str(busy), kind="rate_limit_error"), "busy")
        except ShuttingDown as stopping:
            return refuse(endpoint, RequestProblem(503, str(stopping), kind="server_error"), "unavailable")
        text = TextAssembler(tokenizer, body.stop_strings)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(live, text, shape, endpoint, include_usage), media_type="text/event-stream"
            )
        return await _collect(live, text, shape, endpoint, http)

    def take(live: LiveRequest, text: TextAssembler, progress) -> str:
        """Feed a request's progress to its text; the text that may be sent now. The progress that completes a stop
        string frees the request's row (once: what was already under way still arrives, and is dropped)."""
        stopped = text.stopped
        piece = text.add(progress.tokens, final=progress.finish_reason is not None)
        if text.stopped and not stopped and progress.finish_reason is None:
            engine_loop.cancel(live)
        return piece

    async def _collect(live: LiveRequest, text: TextAssembler, shape: ResponseShape, endpoint: str, http):
        while True:
            try:
                progress = await asyncio.wait_for(live.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    engine_loop.cancel(live)
                    count(endpoint, "disconnected")
                    return Response(status_code=499)
                continue
            take(live, text, progress)
            if progress.finish_reason is not None:
                break
        if progress.finish_reason in ERRORS:
            status, kind, outcome = ERRORS[progress.finish_reason]
            return refuse(
                endpoint, RequestProblem(status, progress.error or progress.finish_reason, kind=kind), outcome
            )
        count(endpoint, "ok")
        return JSONResponse(
            shape.response(text.text, _finish_reason(progress.finish_reason, text), _usage(live), _speculation(live))
        )

    async def _stream(
        live: LiveRequest, text: TextAssembler, shape: ResponseShape, endpoint: str, include_usage: bool
    ):
        finished = False
        try:
            yield _event(shape.chunk("", first=True))
            while True:
                progress = await live.events.get()
                piece = take(live, text, progress)
                if piece:
                    yield _event(shape.chunk(piece))
                if progress.finish_reason is not None:
                    break
            finished = True
            if progress.finish_reason in ERRORS:
                status, kind, outcome = ERRORS[progress.finish_reason]
                count(endpoint, outcome)
                yield _event(error_body(progress.error or progress.finish_reason, kind))
            else:
                count(endpoint, "ok")
                yield _event(shape.chunk(None, _finish_reason(progress.finish_reason, text)))
                if include_usage:
                    yield _event(shape.usage_chunk(_usage(live)))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream: its row leaves the batch at the next round
                engine_loop.cancel(live)
                count(endpoint, "disconnected")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await serve(body, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await serve(body, http, chat=False)

    return app


def _endpoint(path: str) -> str:
    return "chat" if path.endswith("chat/completions") else "completions"


def _encode(tokenizer, body, chat: bool) -> list[int]:
    """The prompt's token ids: the messages through the tokenizer's chat template, or the prompt as it is."""
    if not chat:
        return list(tokenizer(body.prompt)["input_ids"])
    try:
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    except ValueError as error:
        raise RequestProblem(400, f"messages: {error}", "messages") from None
    if tokenizer.chat_template is None:
        raise RequestProblem(400, "this model has no chat template: use /v1/completions", "messages")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _finish_reason(engine_reason: str, text: TextAssembler) -> str:
    return "stop" if text.stopped else FINISH_REASONS.get(engine_reason, engine_reason)


def _usage(live: LiveRequest) -> dict:
    return usage(len(live.output.prompt_ids), len(live.output.output_ids))


def _speculation(live: LiveRequest) -> dict:
    """τ (output tokens per target forward of this request, the prefill's token apart), drafted and accepted."""
    stats = live.output.stats
    rounds = len(stats.drafted)
    return {
        "tau": (len(live.output.output_ids) - 1) / rounds if rounds else None,
        "drafted_tokens": sum(stats.drafted),
        "accepted_tokens": sum(stats.accepted),
        "seconds": (live.finished or time.monotonic()) - live.submitted,
    }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
