"""The routes: /health, /v1/models, /v1/chat/completions, /v1/completions, /metrics.

Every request is handled on the ASGI event loop; generation happens on the pipeline thread,
which hands events back through `loop.call_soon_threadsafe`. A client that goes away (a closed
stream, or a dropped connection while waiting for a non-streaming answer) cancels its ticket: the
pipeline stops at its next commit and drains what it has in flight.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..decode.result import GenerationResult
from ..runtime.tokenizer import NoChatTemplateError
from ..runtime.parallel import slot_rows
from ..runtime.service import Service
from ..runtime.service_request import Event, GenerationRequest, InvalidRequest, ServiceUnavailable
from ..wording import human_bytes
from ..errors import UsageError
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_errors import ApiError, invalid, unavailable
from .openai_request import ParsedRequest, check_tokens, parse_chat, parse_completion, parse_json
from .openai_response import Reply

MAX_BODY_BYTES = 4_000_000  # 4 MB
DISCONNECT_POLL_S = 0.5  # a non-streaming request checks this often whether its client is still there


@dataclass
class ServerSettings:
    """What the routes need besides the service."""

    model: str  # the target's name, as /v1/models lists it and every response's "model" says
    draft: str | None = None  # the draft's name, "lookup", or None
    api_key: str | None = None  # if set, /v1/* and /metrics need `Authorization: Bearer KEY`
    max_body_bytes: int = MAX_BODY_BYTES
    on_finished: Callable[[str, GenerationResult], None] | None = None  # (endpoint, result) after each request
    # The front's restarts (server/front.RecoveryStats), when the server outlives its job; None otherwise.
    recovery: Callable[[], object] | None = None
    # What each slot does, when the slots are not this process's (a front asks its job's head); None:
    # the service's own (runtime/parallel.slot_rows).
    slots: Callable[[], list[dict]] | None = None


def build_app(service: Service, settings: ServerSettings) -> Starlette:
    metrics = ServerMetrics(service, settings.recovery, settings.slots)
    api = _Api(service, settings, metrics)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.prometheus, methods=["GET"]),
        Route("/slots", api.slots, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.metrics = metrics
    app.state.answers_in_flight = lambda: api.answers_in_flight
    service.add_observer(lambda ticket, result: api.finished(ticket.tag, result))
    return app


async def _http_error(_request: Request, exc: HTTPException) -> Response:
    what = {404: "no such endpoint; see /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics, /slots",
            405: "method not allowed on this endpoint"}.get(exc.status_code, exc.detail)
    return ApiError(exc.status_code, what, code="not_found" if exc.status_code == 404 else None).response()


class _Api:
    def __init__(self, service: Service, settings: ServerSettings, metrics: ServerMetrics):
        self.service, self.settings, self.metrics = service, settings, metrics
        # Generation answers not yet fully written: the HTTP server's stop waits for them, so a request
        # ended by a shutdown still gets its error event (sse-starlette drops open streams on exit).
        self.answers_in_flight = 0

    # -- plain endpoints ---------------------------------------------------------------------
    async def health(self, _request: Request) -> Response:
        status = self.service.status
        recovery = self.settings.recovery() if self.settings.recovery is not None else None
        lost = list(getattr(recovery, "hosts_lost", []) or [])
        if status == "ok":
            return JSONResponse({"status": "degraded", "hosts_lost": lost} if lost else {"status": "ok"})
        if status == "restarting":  # no pipeline for now: requests wait for the next one
            return JSONResponse({"status": "degraded", "pipeline": "restarting", "hosts_lost": lost,
                                 "message": self.service.message}, status_code=503)
        body = {"status": status} if status == "loading" else {"status": "error", "message": self.service.message}
        return JSONResponse(body, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def slots(self, request: Request) -> Response:
        """What each slot does (llama-server's GET /slots): id, n_ctx, is_processing, and for a busy
        slot its request (id_task), mode, prompt tokens, tokens decoded so far, reused tokens, drafter."""
        if (denied := self._denied(request)) is not None:
            return denied
        if self.service.status == "loading":
            return JSONResponse({"status": "loading"}, status_code=503)
        if self.settings.slots is not None:
            return JSONResponse(await asyncio.to_thread(self.settings.slots))
        return JSONResponse(slot_rows(self.service))

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        data = [{"id": self.settings.model, "object": "model", "created": 0, "owned_by": "pipeinfer",
                 "meta": {"role": "target"}}]
        if self.settings.draft is not None:
            data.append({"id": self.settings.draft, "object": "model", "created": 0, "owned_by": "pipeinfer",
                         "meta": {"role": "draft"}})
        return JSONResponse({"object": "list", "data": data})

    # -- generation --------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse: Callable[[dict], ParsedRequest]) -> Response:
        endpoint = request.url.path
        if (denied := self._denied(request)) is not None:
            return denied
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(ev: Event) -> None:  # the pipeline thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        try:
            parsed = parse(parse_json(await _read_body(request, self.settings.max_body_bytes)))
            ticket = self.service.submit(self._generation(parsed), on_event, tag=endpoint)
        except ApiError as e:
            self.metrics.refused(endpoint, "rejected")
            return e.response()
        except ServiceUnavailable as e:
            self.metrics.refused(endpoint, "rejected")
            return unavailable(e.args[0], e.retry_after, code=e.reason).response()
        # The loaded model's name, whatever the client asked for ("gpt-4", "any"), as llama-server answers:
        # the response says which model wrote it.
        reply = Reply(parsed.chat, self.settings.model)
        self.answers_in_flight += 1
        if parsed.stream:
            return EventSourceResponse(self._stream(endpoint, reply, parsed, ticket, events), sep="\n", ping=15)
        try:
            return await self._wait(request, endpoint, reply, ticket, events)
        finally:
            self.answers_in_flight -= 1

    def _generation(self, p: ParsedRequest) -> GenerationRequest:
        """Tokenize and check the request: ApiError (400) naming the field if it cannot run."""
        service = self.service
        try:
            if p.chat:
                prompt = service.tokenize(messages=p.messages)
            elif isinstance(p.prompt, list):
                check_tokens(p.prompt, service.tokenizer.n_vocab)
                prompt = p.prompt
            else:
                prompt = service.tokenize(text=p.prompt)
            gen = GenerationRequest(prompt, mode=p.mode, n_predict=p.max_tokens, stop=p.stop,
                                    sampling=p.sampling(service.cfg.sampling), speculative=p.speculative)
            service.check(gen)
        except InvalidRequest as e:
            field = {"prompt": "messages" if p.chat else "prompt", "n_predict": p.max_tokens_field}.get(e.field, e.field)
            raise invalid(field, str(e) if field in str(e) else f"{field}: {e}", e.code) from None
        except NoChatTemplateError:
            raise invalid("messages", "this model has no chat template in its GGUF metadata; use /v1/completions "
                                      "with a raw prompt") from None
        except UsageError as e:  # any other refusal of the prompt by the tokenizer
            raise invalid("messages" if p.chat else "prompt", str(e)) from None
        except ServiceUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a chat template that refuses these messages (jinja2)
            if not p.chat:
                raise
            raise invalid("messages", f"the model's chat template refused these messages: {e}") from None
        return gen

    async def _wait(self, request: Request, endpoint: str, reply: Reply, ticket, events: asyncio.Queue) -> Response:
        """A non-streaming answer: wait for the result; a client that went away cancels its request.

        Text events keep arriving while the answer is generated, so the check for a closed
        connection runs on a clock, not only when nothing arrives."""
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                ev = None
            if ev is not None and ev.kind == "done":
                return JSONResponse(reply.complete(ev.result))
            if ev is not None and ev.kind == "error":
                self.metrics.refused(endpoint, "error")
                return unavailable(ev.text, code=ev.reason).response()
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    ticket.cancel()
                    return Response(status_code=499)

    async def _stream(self, endpoint: str, reply: Reply, parsed: ParsedRequest, ticket, events: asyncio.Queue):
        """Server-sent events: OpenAI chunks, then `data: [DONE]`; an error ends the stream with an
        error object (the openai client raises it). A closed connection cancels the ticket."""
        try:
            if parsed.chat:
                yield {"data": json.dumps(reply.chunk("", first=True))}
            while True:
                ev = await events.get()
                if ev.kind == "text":
                    yield {"data": json.dumps(reply.chunk(ev.text))}
                elif ev.kind == "done":
                    yield {"data": json.dumps(reply.last_chunk(ev.result, parsed.include_usage))}
                    if parsed.include_usage:
                        yield {"data": json.dumps(reply.usage_chunk(ev.result))}
                    yield {"data": "[DONE]"}
                    return
                else:
                    self.metrics.refused(endpoint, "error")
                    yield {"data": json.dumps(unavailable(ev.text, code=ev.reason).body())}
                    return
        finally:
            self.answers_in_flight -= 1
            if not ticket.finished:
                ticket.cancel()  # the client went away mid-stream

    def finished(self, endpoint: str, result: GenerationResult) -> None:
        """After every request that ran (the pipeline thread): metrics and the log line."""
        self.metrics.finished(endpoint, result)
        if self.settings.on_finished is not None:
            self.settings.on_finished(endpoint, result)

    def _denied(self, request: Request) -> Response | None:
        key = self.settings.api_key
        if not key:
            return None
        given = request.headers.get("authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), key.encode()):
            return None
        return ApiError(401, "invalid or missing API key; send the header `Authorization: Bearer KEY` with the key "
                        "the server was started with (--api-key or PIPEINFER_API_KEY)", code="invalid_api_key",
                        type_="authentication_error").response()


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (checked while reading, not only from the header)."""
    too_big = ApiError(413, f"the request body is larger than {human_bytes(limit)}, the server's limit",
                       code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
