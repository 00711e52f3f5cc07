"""The operator's page: `GET /dashboard` (static HTML, CSS and a script from package data)
and the one JSON document it polls, `GET /admin/dashboard`.

The page holds no data of its own: it asks for the admin key (kept in the tab's
`sessionStorage`), then reads `/admin/dashboard` every 2 s with the key in an
`Authorization` header — the admin routes' own check, so a wrong key is the admin API's
401 and no cookie ever carries it (no CSRF). The document is built from what the frontend
already keeps (the die table, the registry, the metrics window, the admin's last actions,
the last errors): a refresh costs no worker round trip. It never holds prompt text or keys.

`--dashboard on` (the default) serves the page with its load and unload buttons,
`readonly` without them, `off` not at all.
"""
from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .registry import ReplicaState

MODES = ("on", "readonly", "off")
STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
         "/dashboard/app.js": ("dashboard.js", "text/javascript; charset=utf-8"),
         "/dashboard/style.css": ("dashboard.css", "text/css; charset=utf-8")}
# only the page's own script and style; no inline code, no frames, no form posts
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
                "X-Frame-Options": "DENY"}
ERROR_BODY_BYTES = 4096     # an error body past this is not read for its code


class RecentErrors:
    """The last 20 requests answered with an error: status, code, model, route, time —
    never the message (it may quote the request)."""

    def __init__(self, size: int = 20):
        self.rows: deque = deque(maxlen=size)

    def add(self, route: str, status: int, model, body: bytes | None) -> None:
        code = None
        if body and len(body) <= ERROR_BODY_BYTES:
            try:
                error = json.loads(body).get("error")
                code = error.get("code") or error.get("type") if isinstance(error, dict) else None
            except (ValueError, AttributeError):
                pass
        self.rows.append({"time": time.time(), "status": status, "route": route[:100],
                          "model": str(model)[:200] if model else None,
                          "code": str(code)[:64] if code else None})


class Dashboard:
    def __init__(self, registry, admin, pool, admission, metrics, errors: RecentErrors,
                 mode: str = "on", drain=None):
        if mode not in MODES:
            raise ValueError(f"--dashboard must be one of {', '.join(MODES)}, not {mode!r}")
        self.registry, self.admin, self.pool = registry, admin, pool
        self.admission, self.metrics, self.errors = admission, metrics, errors
        self.mode, self.drain = mode, drain
        self.started = time.time()
        self.known: dict[str, str] = {}      # model name → path, of every model served

    def routes(self) -> list[Route]:
        if self.mode == "off":
            return []
        return [*(Route(path, self.static(name, kind)) for path, (name, kind) in FILES.items()),
                Route("/admin/dashboard", self.data)]

    @staticmethod
    def public_paths() -> frozenset:
        """The page's own files: no key (they hold no data)."""
        return frozenset(FILES)

    def static(self, name: str, kind: str):
        body = (STATIC / name).read_bytes()

        async def serve(request: Request):
            return Response(body, media_type=kind, headers=PAGE_HEADERS)
        return serve

    async def data(self, request: Request):
        return JSONResponse(self.snapshot(), headers={"Cache-Control": "no-store"})

    # -- the document ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        now, wall = time.monotonic(), time.time()
        top = self.admin.top()
        busy = {d["die"]: d for d in top["dies"]}
        window = self.metrics.window if self.metrics else None
        dies = []
        for d in self.admin.die_table.snapshot():
            weights = sum(r.weight_bytes for _, r in self.registry.replicas()
                          if r.die == d.die and r.state == ReplicaState.READY)
            row = d.as_json()                    # its "models": each replica and its state
            row.pop("pid", None)
            dies.append({**row, "weight_bytes": weights,
                         "kv_bytes": max(0, d.reserved - weights),
                         "restarts": self.pool.losses.get(d.die, 0),
                         "busy": busy.get(d.die, {}).get("busy", 0),
                         "slots": busy.get(d.die, {}).get("slots", 0)})
        per_model = {m["name"]: m for m in top["models"]}
        models = []
        for model in self.registry.models.values():
            self.known[model.name] = model.path
            generated, prompt, cached = window.totals[model.name] if window else (0, 0, 0)
            replicas = []
            for r in model.replicas:
                if r.state == ReplicaState.LOADING:
                    r.progress = self.pool.progress.get(r.model_id, r.progress)
                replicas.append({"id": r.model_id, "die": r.die, "state": r.state,
                                 "in_flight": r.inflight, "slots": r.slots, "ctx": r.ctx,
                                 "progress": {"done": r.progress[0], "total": r.progress[1]},
                                 "error": r.error or None})
            summary = per_model.get(model.name, {})
            models.append({"name": model.name, "path": model.path, "status": "loaded"
                           if model.ready() else "loading", "replicas": replicas,
                           "busy": summary.get("busy", 0), "slots": summary.get("slots", 0),
                           "running": summary.get("running", 0),
                           "queued": summary.get("queued", 0),
                           "tokens_per_s_1m": summary.get("tokens_per_s_1m", 0.0),
                           "ttft_p50_s_1m": summary.get("ttft_p50_s_1m"),
                           "generated_tokens": generated,
                           "cached_ratio": round(cached / prompt, 4) if prompt else None,
                           "history": window.history(model.name, now) if window else []})
        servable = dict(self.known)        # served since start, and the catalog's
        autoload = getattr(self.registry, "autoload", None)
        if autoload is not None:
            servable.update({e.name: e.path for e in autoload.catalog.entries.values()})
        available = [{"name": name, "path": path, "status": "available"}
                     for name, path in sorted(servable.items())
                     if name not in self.registry.models]
        return {"time": wall, "uptime_s": round(wall - self.started),
                "readonly": self.mode != "on",
                "draining": bool(self.drain and self.drain.draining) or top["draining"],
                "dies": dies, "models": models, "available": available,
                "loading": sorted(self.admin.loading),
                "errors": list(reversed(self.errors.rows)),
                "actions": list(reversed(self.admin.actions))}
