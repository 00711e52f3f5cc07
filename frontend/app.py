"""The Starlette application: routes, CORS, API key, OpenAI-shaped errors."""
from __future__ import annotations

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
from ..common.key_set import KeySet
from .admission import Admission
from .admin import Admin
from .anthropic_api import MessagesService, error_body
from .body import parse_json, read_body
from .chat import ChatService
from .completions import CompletionService
from .dashboard import Dashboard, RecentErrors
from .drain import Drain
from .errors import APIError
from .lifecycle import Lifecycle
from .load import measure
from .metrics import CONTENT_TYPE
from .limits import RequestLimits
from .openai_api import models_list
from .preparer import Preparer
from .registry import Registry
from .response_store import ResponseStore
from .responses_api import ResponsesService
from .tokenize_api import TokenizeService
from .embeddings_api import EmbeddingsService
from .security import BrowserPolicy
from .workers import WorkerPool

log = logging.getLogger("pantheon.frontend.app")
access_log = logging.getLogger("pantheon.access")

# the rest needs the API key; routers poll the load routes without one
PUBLIC_PATHS = frozenset({"/", "/health", "/metrics", "/get_load", "/v1/loads"})
# polled: their access lines are DEBUG
QUIET_PATHS = frozenset({"/health", "/metrics", "/get_load", "/v1/loads"})
CORS_ALLOW = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
              (b"access-control-allow-headers",
               b"Authorization, Content-Type, X-Session-Id, X-SMG-Routing-Key, X-Request-Id, "
               b"X-Api-Key, Anthropic-Version, Anthropic-Beta"),
              (b"access-control-max-age", b"600")]
REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")        # visible ASCII, as a client sends


class RequestLog:
    """ASGI middleware, outermost: the request id, and one access-log line per request.

    An incoming `X-Request-Id` (else a new one) is echoed in the response headers, set
    as the log context of everything this request logs, and carried to the worker. The
    access line says method, route, status, model, tokens, TTFT and total time; the
    prompt only with `--log-prompts`.
    """

    def __init__(self, app, log_prompts: bool = False, errors: RecentErrors | None = None):
        self.app, self.log_prompts, self.errors = app, log_prompts, errors

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        given = dict(scope["headers"]).get(b"x-request-id")
        if given is not None and not REQUEST_ID.fullmatch(given):
            err = APIError(400, "X-Request-Id must be 1 to 128 visible ASCII characters",
                           param="X-Request-Id")
            return await Guard.reply(send, 400, err.body())
        rid = given.decode() if given is not None else f"req-{secrets.token_hex(8)}"
        info = scope.setdefault("pantheon", {})
        info.update(request_id=rid, arrived=started, log_prompts=self.log_prompts)
        status, complete, error_body = [0], [False], [None]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [
                    (b"x-request-id", rid.encode())]
            else:
                if status[0] >= 400 and error_body[0] is None:
                    error_body[0] = message.get("body", b"")    # its code, for the dashboard
                if not message.get("more_body"):
                    complete[0] = True
            await send(message)
        token = logs.request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Starlette re-raises an error its handler already answered (a 500 with an
            # OpenAI body); raised on, uvicorn would drop the kept-alive connection
            # without `Connection: close`, failing the client's next request too.
            if status[0] == 0:
                log.exception("unhandled error on %s", scope["path"])
                err = APIError(500, "internal server error", type="server_error")
                await Guard.reply(send_with_id, 500, err.body(), [(b"connection", b"close")])
            elif not complete[0]:
                raise                             # a response under way: cut it off
        finally:
            # a stream its client abandoned was sent as 200 and is logged as 499
            final = info.get("status") or status[0] or 500
            self.access(scope, info, final, time.monotonic() - started)
            if self.errors is not None and final >= 400 and scope["path"] not in QUIET_PATHS:
                self.errors.add(scope["path"], final, info.get("model"), error_body[0])
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
    """ASGI middleware: the browser policy (Host, cross-site, CORS), then the key check,
    then the body's content type.

    /admin/ routes take the admin key when one is set (else the API key);
    every other non-public route takes the API key. A request with a body must say
    `Content-Type: application/json`: a form or `text/plain` is what a page can send
    without asking (no CORS preflight), so anything else is a 415.
    """

    def __init__(self, app, api_key: str | None, admin_key: str | None = None,
                 metrics_auth: bool = False, browser: BrowserPolicy = BrowserPolicy(None),
                 also_public: frozenset = frozenset()):
        self.app, self.browser = app, browser
        self.api_key = KeySet.of(api_key)         # KeySets: key files are reread on change
        self.admin_key = KeySet.of(admin_key)
        self.public = (PUBLIC_PATHS - {"/metrics"} if metrics_auth else PUBLIC_PATHS) | also_public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, path = dict(scope["headers"]), scope["path"]
        host = headers.get(b"host")
        if not self.browser.host_allowed(host.decode("latin-1") if host else None):
            err = APIError(400, "the Host header names no address this server answers to "
                                "(add it with --allowed-hosts)", param="Host",
                           code="invalid_host")
            return await self.reply(send, 400, err.body())
        if self.browser.cross_site(headers, path):
            err = APIError(403, "cross-site requests are refused" + (
                "" if path.startswith("/admin/") else
                " (an operator allows a page's origin with --cors-origins)"),
                type="permission_error", code="cross_site_refused")
            return await self.reply(send, 403, err.body())
        origin = headers.get(b"origin")
        cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin"),
                (b"access-control-expose-headers", b"X-Request-Id")] \
            if self.browser.cors_allowed(origin and origin.decode("latin-1"), path) else []
        if scope["method"] == "OPTIONS" and cors:
            return await self.reply(send, 204, None, cors + CORS_ALLOW)
        key = (self.admin_key or self.api_key) if path.startswith("/admin/") else self.api_key
        if key and path not in self.public and not self.authorized(headers, key):
            err = APIError(401, "invalid or missing key: send 'Authorization: Bearer KEY' "
                                "(or 'x-api-key: KEY')", code="invalid_api_key")
            return await self.reply(send, 401, shaped(path, err),
                                    [(b"www-authenticate", b"Bearer")] + cors)
        if scope["method"] in ("POST", "PUT", "PATCH") and not is_json(headers):
            err = APIError(415, "the request body must be JSON: send 'Content-Type: "
                                "application/json'", param="Content-Type",
                           code="unsupported_media_type")
            return await self.reply(send, 415, shaped(path, err), cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + cors
            await send(message)
        await self.app(scope, receive, send_with_cors)

    @staticmethod
    def authorized(headers: dict, keys: KeySet) -> bool:
        """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`."""
        header = headers.get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and keys.matches(token.strip()):
            return True
        key = headers.get(b"x-api-key")
        return key is not None and keys.matches(key.strip())

    @staticmethod
    async def reply(send, status: int, body: dict | None, headers=()) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        head = [(b"content-length", str(len(data)).encode())] + list(headers)
        if body is not None:
            head.insert(0, (b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": data})


def shaped(path: str, err: APIError) -> dict:
    """An error body in the shape of the API the path belongs to."""
    return error_body(err) if path.startswith("/v1/messages") else err.body()


def is_json(headers: dict) -> bool:
    """`Content-Type: application/json` (parameters such as charset aside)."""
    kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return kind == b"application/json"


def public(worker: dict) -> dict:
    """A worker's status for /health, which anyone may read: no process ids."""
    return {k: v for k, v in worker.items() if k != "pid"}


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
              http_admin: bool = True,
              browser: BrowserPolicy = BrowserPolicy(None),
              preparer: Preparer | None = None, dashboard: str = "on",
              responses: ResponseStore | None = None,
              pooling: str = "auto") -> RequestLog:
    pool, admission, metrics = lifecycle.pool, lifecycle.admission, lifecycle.metrics
    errors = RecentErrors()
    # the page reads an /admin/ route: none without the HTTP admin routes
    board = Dashboard(registry, admin, pool, admission, metrics, errors,
                      dashboard if http_admin else "off", drain)
    preparer = preparer or Preparer()
    chat = ChatService(registry, lifecycle, max_body_bytes, context_cap, limits, preparer)
    completions = CompletionService(registry, lifecycle, max_body_bytes, limits, preparer)
    messages = MessagesService(chat)
    responses_api = ResponsesService(chat, responses or ResponseStore())
    tokens = TokenizeService(chat)
    embeddings = EmbeddingsService(chat, pooling)

    def admin_route(cmd: str):
        async def handle(request: Request):
            args = {}
            if request.method == "POST":
                args = parse_json(await read_body(request, max_body_bytes), empty={})
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
        # nothing to load at start (--no-preload, or all unloaded since): a worker is
        # enough, each model loads on its first request
        on_request = registry.autoload is not None and registry.autoload.servable() \
            and not registry.models and bool(pool.live())
        if not ready and not on_request:
            err = APIError(503, "no model is ready", type="service_unavailable",
                           code="model_not_ready")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok", "models": [m.name for m in ready],
                             "workers": [public(w.status()) for w in pool.latest()],
                             "replicas": [model_status(m, admission)
                                          for m in registry.models.values()]})

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(m) -> dict:
        """A served model as OpenAI's model object; max_model_len (vLLM's) is the largest
        context among its replicas (a request goes to a replica that holds it)."""
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "pantheon",
                "max_model_len": m.context()}

    def catalog_card(row: dict) -> dict:
        """A catalog row (autoload.listing) as a model object, with its status."""
        return {"object": "model", "owned_by": "pantheon", **row}

    async def models(request: Request):
        if registry.autoload is not None:      # the catalog: loaded, loading, available
            return JSONResponse({"object": "list", "data": [
                catalog_card(row) for row in registry.autoload.listing()]})
        ready = registry.ready_models()
        return JSONResponse(models_list([m.name for m in ready], 0) | {
            "data": [model_card(m) for m in ready]})

    async def model(request: Request):
        name = request.path_params["name"]
        if registry.autoload is not None:
            row = next((r for r in registry.autoload.listing() if r["id"] == name), None)
            if row is not None:
                return JSONResponse(catalog_card(row))
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
                    Route("/admin/models/rescan", admin_route("rescan"), methods=["POST"]),
                    Route("/admin/top", admin_route("top"))]
    app = Starlette(
        routes=[Route("/", root), Route("/health", health), Route("/metrics", prometheus),
                Route("/v1/models", models), Route("/v1/models/{name:path}", model),
                Route("/get_load", get_load), Route("/v1/loads", v1_loads),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/embeddings", embeddings, methods=["POST"]),
                Route("/tokenize", tokens.tokenize, methods=["POST"]),
                Route("/detokenize", tokens.detokenize, methods=["POST"]),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
                Route("/v1/responses", responses_api, methods=["POST"]),
                Route("/v1/responses/input_tokens", responses_api.input_tokens,
                      methods=["POST"]),
                Route("/v1/responses/{id}", responses_api.retrieve, methods=["GET"]),
                Route("/v1/responses/{id}", responses_api.delete, methods=["DELETE"]),
                Route("/v1/responses/{id}/cancel", responses_api.cancel, methods=["POST"]),
                Route("/v1/responses/{id}/input_items", responses_api.input_items,
                      methods=["GET"]),
                *(admin_routes if http_admin else []), *board.routes()],
        exception_handlers={APIError: api_error, HTTPException: http_error,
                            Exception: server_error})
    page_paths = board.public_paths() if board.mode != "off" else frozenset()
    return RequestLog(Guard(app, api_key, admin_key, metrics_auth, browser, page_paths),
                      log_prompts, errors)
