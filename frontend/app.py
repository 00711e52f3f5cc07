"""The Starlette application: routes, CORS, API key, OpenAI-shaped errors."""
from __future__ import annotations

import hmac
import json
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .admission import Admission
from .admin import Admin
from .chat import ChatService, read_body
from .completions import CompletionService
from .errors import APIError
from .lifecycle import Lifecycle
from .limits import RequestLimits
from .openai_api import models_list
from .registry import Registry
from .workers import WorkerPool

log = logging.getLogger("pantheon.frontend.app")

PUBLIC_PATHS = frozenset({"/", "/health"})      # everything else needs the API key
CORS_HEADERS = [(b"access-control-allow-origin", b"*"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 b"Authorization, Content-Type, X-Session-Id")]


class Guard:
    """ASGI middleware: CORS preflight for any path, then the key check.

    /admin/ routes take the admin key when one is set (else the API key);
    every other non-public route takes the API key.
    """

    def __init__(self, app, api_key: str | None, admin_key: str | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":
            return await self.reply(send, 200, {}, CORS_HEADERS)
        key = (self.admin_key or self.api_key) if scope["path"].startswith("/admin/") \
            else self.api_key
        if key and scope["path"] not in PUBLIC_PATHS and not self.authorized(scope, key):
            err = APIError(401, "invalid or missing key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
            return await self.reply(send, 401, err.body(), [(b"www-authenticate", b"Bearer")])

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + CORS_HEADERS[:1]
            await send(message)
        await self.app(scope, receive, send_with_cors)

    @staticmethod
    def authorized(scope, key: bytes) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)

    @staticmethod
    async def reply(send, status: int, body: dict, headers) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())] + list(headers)})
        await send({"type": "http.response.body", "body": data})


def model_status(model, admission: Admission) -> dict:
    return {"name": model.name, "queued": admission.queued(model),
            "replicas": [{"id": r.model_id, "die": r.die, "state": r.state,
                          "in_flight": r.inflight, "slots": r.slots, "ctx": r.ctx}
                         for r in model.replicas]}


def build_app(registry: Registry, pool: WorkerPool, admission: Admission, admin: Admin,
              api_key: str | None = None, admin_key: str | None = None,
              max_body_bytes: int = 8 << 20, context_cap: bool = True,
              limits: RequestLimits = RequestLimits(), http_admin: bool = True) -> Guard:
    lifecycle = Lifecycle(pool, admission)
    chat = ChatService(registry, lifecycle, max_body_bytes, context_cap, limits)
    completions = CompletionService(registry, lifecycle, max_body_bytes, limits)

    def admin_route(cmd: str):
        async def handle(request: Request):
            args = {}
            if request.method == "POST":
                raw = await read_body(request, max_body_bytes)
                try:
                    args = json.loads(raw or b"{}")
                except ValueError as exc:
                    raise APIError(400, f"request body is not valid JSON: {exc}") from None
                if not isinstance(args, dict):
                    raise APIError(400, "request body must be a JSON object")
            status, body = await admin.call(cmd, args)
            return JSONResponse(body, status_code=status)
        return handle

    async def root(request: Request):
        return JSONResponse({"service": "pantheon", "status": "ok"})

    async def health(request: Request):
        ready = registry.ready_models()
        if not ready:
            err = APIError(503, "no model is ready", type="service_unavailable",
                           code="model_not_ready")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok", "models": [m.name for m in ready],
                             "workers": [w.status() for w in pool.latest()],
                             "replicas": [model_status(m, admission)
                                          for m in registry.models.values()]})

    async def models(request: Request):
        ready = registry.ready_models()
        return JSONResponse(models_list([m.name for m in ready], 0) | {
            "data": [{"id": m.name, "object": "model", "created": m.created,
                      "owned_by": "pantheon", "max_model_len": m.ready()[0].ctx}
                     for m in ready]})

    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        err = APIError(exc.status_code, message, code=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = APIError(500, "internal server error", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    admin_routes = [Route("/admin/models/load", admin_route("load"), methods=["POST"]),
                    Route("/admin/models/unload", admin_route("unload"), methods=["POST"]),
                    Route("/admin/models", admin_route("models")),
                    Route("/admin/dies", admin_route("dies")),
                    Route("/admin/status", admin_route("status"))]
    app = Starlette(
        routes=[Route("/", root), Route("/health", health), Route("/v1/models", models),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                *(admin_routes if http_admin else [])],
        exception_handlers={APIError: api_error, HTTPException: http_error,
                            Exception: server_error})
    return Guard(app, api_key, admin_key)
