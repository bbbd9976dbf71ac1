"""The Starlette app: routes of the OpenAI-compatible API and the service endpoints.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings`` (a server
started with ``--runner pooling``), ``POST /v1/responses`` (and ``GET`` /
``DELETE /v1/responses/{id}``: ``responses``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``. Bodies are validated
by the pydantic models of ``schemas``; every refusal is an ``ApiError`` in OpenAI's shape.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from actors.runtime.liveness import host_id, process_alive
from actors.runtime.ping import ping
from messages.common import Pong
from minirt.client import RequestError
from minirt.http.anthropic.routes import messages_routes
from minirt.http.errors import ApiError, invalid
from minirt.http.gate import Gate
from minirt.http.openai.convert import chat_messages, plan_chat, plan_completion
from minirt.http.openai.embeddings import plan_embedding
from minirt.http.openai.respond import JSON, PlanResponse, error_response
from minirt.http.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from minirt.http.responses.routes import responses_routes
from minirt.http.responses.store import ResponseStore
from minirt.http.server import Server, in_flight, read_body, unique_id

HEALTH_TIMEOUT_S = 2.0  # an actor busy under load may take a moment to answer
ACTORS = ("tokenizer", "scheduler", "kv_manager", "executor")


def build_app(server: Server) -> Gate:
    async def run_plan(request: Request, kind: str) -> Any:
        rid = request.state.request_id
        base = unique_id(server, rid)
        pooling = server.runner == "pooling"
        if (kind == "embedding") != pooling:
            raise ApiError(
                400,
                "this server was started with --runner pooling: it answers POST /v1/embeddings only"
                if pooling
                else "embeddings need a server started with --runner pooling; this one generates",
                code="runner",
            )
        if kind == "embedding":
            emb = await read_body(request, EmbeddingRequest, server.body_timeout_s)
            plan = plan_embedding(emb, server.model, base, server.pooler)
        elif kind == "chat":
            chat = await read_body(request, ChatCompletionRequest, server.body_timeout_s)
            plan = plan_chat(chat, server.model, base)
        else:
            comp = await read_body(request, CompletionRequest, server.body_timeout_s)
            plan = plan_completion(comp, server.model, base)
        info = request.state.info
        info.update(kind=kind, stream=plan.stream, n=len(plan.choices))
        return in_flight(server, base, PlanResponse(plan, server.model, server.upstream, rid, info))

    async def completions(request: Request) -> Any:
        return await run_plan(request, "completion")

    async def chat_completions(request: Request) -> Any:
        return await run_plan(request, "chat")

    async def embeddings(request: Request) -> Any:
        return await run_plan(request, "embedding")

    async def models(request: Request) -> JSON:
        m = server.model
        card = {
            "id": m.served_name,
            "object": "model",
            "created": server.created,
            "owned_by": "minirt",
            "root": m.path,
            "parent": None,
            "max_model_len": m.max_model_len,
        }
        cards = [card]
        if m.lora:  # each adapter served, its base as parent (vLLM's)
            listing = await lora_op("list")
            cards += [
                {**card, "id": a.name, "root": a.path, "parent": m.served_name}
                for a in listing.adapters
            ]
        return JSON({"object": "list", "data": cards})

    async def lora_op(op: str, name: str = "", path: str = "") -> Any:
        async with server.upstream.use() as client:
            try:
                return await client.lora(op, name, path)
            except RequestError as e:
                status = 404 if op == "unload" and "no adapter" in e.message else 400
                raise ApiError(status, e.message, param=e.field, code="lora") from None

    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = await read_body(request, LoadLoraAdapterRequest, server.body_timeout_s)
        await lora_op("load", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await read_body(request, UnloadLoraAdapterRequest, server.body_timeout_s)
        await lora_op("unload", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    last_pong: dict[str, Pong] = {}  # each actor's latest answer: its pid and host

    def silent(name: str) -> str:
        """An actor that did not answer: ``suspect`` while its process lives on this host
        (stopped, starved, busy: requests wait for it), else ``down``."""
        was = last_pong.get(name)
        here = was is not None and was.host == host_id() and process_alive(was.pid)
        return "suspect" if here else "down"

    async def health(request: Request) -> JSON:
        status: dict[str, dict[str, Any]] = {}

        async def probe(name: str) -> None:
            pong = await ping(server.endpoints[name], timeout=HEALTH_TIMEOUT_S, curve=server.curve)
            if pong is not None:
                last_pong[name] = pong
            state = "ok" if pong is not None else silent(name)
            ready = bool(pong and pong.ready)
            status[name] = {"alive": state != "down", "ready": ready, "state": state}

        async with trio.open_nursery() as nursery:
            for name in ACTORS:
                nursery.start_soon(probe, name)
        missing = [
            n if status[n]["state"] == "down" else f"{n} (suspect: not answering, process alive)"
            for n in ACTORS
            if status[n]["state"] != "ok"
        ]
        if status["scheduler"]["state"] == "ok" and not status["scheduler"]["ready"]:
            missing.append("scheduler (not admitting)")
        if not server.upstream.alive and status["tokenizer"]["state"] == "ok":
            missing.append("tokenizer (no client connection)")
        body: dict[str, Any] = {"status": "ok" if not missing else "unavailable", "actors": status}
        if missing:
            body["missing"] = missing
        return JSON(body, status_code=200 if not missing else 503)

    async def metrics(request: Request) -> Response:
        text = b""
        if server.runtime_metrics is not None:
            with trio.move_on_after(HEALTH_TIMEOUT_S):
                text = await server.runtime_metrics()
        return Response(
            text + server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def version_(request: Request) -> JSON:
        try:
            v = version("minirt")
        except PackageNotFoundError:
            v = "unknown"
        return JSON({"version": v})

    async def server_info(request: Request) -> JSON:
        # sglang-router asks for this when it registers a worker (docs/scale-out.md) and lists
        # the model under this name. No model_path: the router would try to load a tokenizer
        # from it (from Hugging Face when the path is not on the router's host).
        m = server.model
        return JSON({"served_model_name": m.served_name, "max_model_len": m.max_model_len})

    async def tokenize(request: Request) -> JSON:
        req = await read_body(request, TokenizeRequest, server.body_timeout_s)
        m = server.model
        m.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("prompt", "exactly one of prompt and messages must be given")
        if req.messages is not None:
            text = m.tokenizer.apply_chat_template(
                [{"role": x.role, "content": x.content} for x in chat_messages(req.messages)],
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
            )
            ids = list(m.tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(
                m.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
            )
        return JSON({"count": len(ids), "max_model_len": m.max_model_len, "tokens": ids})

    async def detokenize(request: Request) -> JSON:
        req = await read_body(request, DetokenizeRequest, server.body_timeout_s)
        m = server.model
        m.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < m.vocab_size]
        if bad:
            raise invalid(
                "tokens", f"tokens: id {bad[0]} outside the vocabulary [0, {m.vocab_size})"
            )
        return JSON({"prompt": str(m.tokenizer.decode(req.tokens))})

    async def tokenizer_info(request: Request) -> JSON:
        # vLLM's GET /tokenizer_info: lm-evaluation-harness's API backends tokenize through
        # the server when it answers this, so an evaluation needs no local copy of the model.
        tok = server.model.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = None if value is None else str(value)
        info["chat_template"] = getattr(tok, "chat_template", None)
        info["model_max_length"] = server.model.max_model_len
        return JSON(info)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        request.state.info["error"] = exc.code or exc.type
        return error_response(exc)

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(
                ApiError(404, f"no route {request.method} {request.url.path}", code="not_found")
            )
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    async def on_bug(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, "internal server error", code="internal_error"))

    routes: list[BaseRoute] = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version_, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
    store = None
    if server.run_dir:
        store = ResponseStore(
            Path(server.run_dir) / "responses",
            server.responses_max_count,
            server.responses_max_bytes,
            server.log,
        )
    routes += responses_routes(server, store)
    routes += messages_routes(server)
    own_auth: tuple[str, ...] = ()
    if server.run_dir:
        try:
            from minirt.http.dashboard.page import dashboard_routes
        except ImportError:  # the dashboard is optional
            pass
        else:  # its page and event stream check the key themselves (cookie, ?key=, header)
            routes += dashboard_routes(server.run_dir, server.api_key or None)
            own_auth = ("/dashboard",)
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: on_api_error,
            HTTPException: on_http_exception,
            Exception: on_bug,
        },
    )
    return Gate(app, server.log, server.metrics, server.api_key, own_auth)
