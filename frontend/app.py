"""The Starlette application: routes, CORS, API key, OpenAI-shaped errors."""
from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..common import logs
from .admission import Admission
from .admin import Admin
from .chat import ChatService, read_body
from .completions import CompletionService
from .drain import Drain
from .errors import APIError
from .lifecycle import Lifecycle
from .load import measure
from .metrics import CONTENT_TYPE
from .limits import RequestLimits
from .openai_api import models_list
from .registry import Registry
from .workers import WorkerPool

log = logging.getLogger("pantheon.frontend.app")
access_log = logging.getLogger("pantheon.access")

# the rest needs the API key; routers poll the load routes without one
PUBLIC_PATHS = frozenset({"/", "/health", "/metrics", "/get_load", "/v1/loads"})
# polled: their access lines are DEBUG
QUIET_PATHS = frozenset({"/health", "/metrics", "/get_load", "/v1/loads"})
CORS_HEADERS = [(b"access-control-allow-origin", b"*"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 b"Authorization, Content-Type, X-Session-Id, X-SMG-Routing-Key, "
                 b"X-Request-Id"),
                (b"access-control-expose-headers", b"X-Request-Id")]
REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")        # visible ASCII, as a client sends


class RequestLog:
    """ASGI middleware, outermost: the request id, and one access-log line per request.

    An incoming `X-Request-Id` (else a new one) is echoed in the response headers, set
    as the log context of everything this request logs, and carried to the worker. The
    access line says method, route, status, model, tokens, TTFT and total time; the
    prompt only with `--log-prompts`.
    """

    def __init__(self, app, log_prompts: bool = False):
        self.app, self.log_prompts = app, log_prompts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        given = dict(scope["headers"]).get(b"x-request-id")
        if given is not None and not REQUEST_ID.fullmatch(given):
            err = APIError(400, "X-Request-Id must be 1 to 128 visible ASCII characters",
                           param="X-Request-Id")
            return await Guard.reply(send, 400, err.body(), CORS_HEADERS[:1])
        rid = given.decode() if given is not None else f"req-{secrets.token_hex(8)}"
        info = scope.setdefault("pantheon", {})
        info.update(request_id=rid, arrived=started, log_prompts=self.log_prompts)
        status = [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [
                    (b"x-request-id", rid.encode())]
            await send(message)
        token = logs.request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # a stream its client abandoned was sent as 200 and is logged as 499
            self.access(scope, info, info.get("status") or status[0] or 500,
                        time.monotonic() - started)
            logs.request_id.reset(token)

    @staticmethod
    def access(scope, info: dict, status: int, seconds: float) -> None:
        level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
        if not access_log.isEnabledFor(level):
            return
        fields = {"method": scope["method"], "route": scope["path"], "status": status}
        for key in ("model", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_s"):
            if key in info:
                fields[key] = info[key]
        fields["total_s"] = round(seconds, 4)
        if "prompt" in info:
            fields["prompt"] = info["prompt"]
        access_log.log(level, "request", extra={"fields": fields})


class Guard:
    """ASGI middleware: CORS preflight for any path, then the key check.

    /admin/ routes take the admin key when one is set (else the API key);
    every other non-public route takes the API key.
    """

    def __init__(self, app, api_key: str | None, admin_key: str | None = None,
                 metrics_auth: bool = False):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None
        self.public = PUBLIC_PATHS - {"/metrics"} if metrics_auth else PUBLIC_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":
            return await self.reply(send, 200, {}, CORS_HEADERS)
        key = (self.admin_key or self.api_key) if scope["path"].startswith("/admin/") \
            else self.api_key
        if key and scope["path"] not in self.public and not self.authorized(scope, key):
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


def build_app(registry: Registry, lifecycle: Lifecycle, admin: Admin,
              api_key: str | None = None, admin_key: str | None = None,
              max_body_bytes: int = 8 << 20, context_cap: bool = True,
              drain: Drain | None = None, metrics_auth: bool = False,
              log_prompts: bool = False, limits: RequestLimits = RequestLimits(),
              http_admin: bool = True) -> RequestLog:
    pool, admission, metrics = lifecycle.pool, lifecycle.admission, lifecycle.metrics
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
        if drain is not None and drain.draining:
            return JSONResponse({"status": "draining", "running": lifecycle.running},
                                status_code=503, headers={"Retry-After": "5"})
        ready = registry.ready_models()
        if not ready:
            err = APIError(503, "no model is ready", type="service_unavailable",
                           code="model_not_ready")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok", "models": [m.name for m in ready],
                             "workers": [w.status() for w in pool.latest()],
                             "replicas": [model_status(m, admission)
                                          for m in registry.models.values()]})

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(m) -> dict:
        """A served model as OpenAI's model object; max_model_len (vLLM's) is the largest
        context among its replicas (a request goes to a replica that holds it)."""
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "pantheon",
                "max_model_len": m.context()}

    async def models(request: Request):
        ready = registry.ready_models()
        return JSONResponse(models_list([m.name for m in ready], 0) | {
            "data": [model_card(m) for m in ready]})

    async def model(request: Request):
        name = request.path_params["name"]
        found = next((m for m in registry.ready_models() if m.name == name), None)
        if found is None:
            raise APIError(404, f"The model {name!r} does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(found))

    async def get_load(request: Request):
        return JSONResponse(measure(registry, admission).get_load())

    async def v1_loads(request: Request):
        return JSONResponse(measure(registry, admission).v1_loads())

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
                    Route("/admin/status", admin_route("status")),
                    Route("/admin/top", admin_route("top"))]
    app = Starlette(
        routes=[Route("/", root), Route("/health", health), Route("/metrics", prometheus),
                Route("/v1/models", models), Route("/v1/models/{name:path}", model),
                Route("/get_load", get_load), Route("/v1/loads", v1_loads),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                *(admin_routes if http_admin else [])],
        exception_handlers={APIError: api_error, HTTPException: http_error,
                            Exception: server_error})
    return RequestLog(Guard(app, api_key, admin_key, metrics_auth), log_prompts)
