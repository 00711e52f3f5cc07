"""`pantheon models list --url URL`: a running server's catalog, as `GET /v1/models` has it."""
from __future__ import annotations

import sys

import httpx


def rows(models: list[dict]) -> list[str]:
    """One line per served name: name, status, where its replicas are, what it is."""
    width = max([len("name")] + [len(m["id"]) for m in models])
    lines = [f"{'name':<{width}}  {'status':<9}  {'replicas':<16}  source"]
    for m in models:
        where = ",".join(f"{r['die']}" for r in m.get("replicas", [])) or "-"
        source = f"alias of {m['alias_of']}" if m.get("alias_of") else m.get("source", "")
        if m.get("pinned"):
            source += " (pinned)"
        lines.append(f"{m['id']:<{width}}  {m.get('status', 'loaded'):<9}  {where:<16}  "
                     f"{source}")
    return lines


def show(url: str, api_key: str | None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"error ({r.status_code}): {r.text[:500]}", file=sys.stderr)
        return 1
    print("\n".join(rows(r.json()["data"])))
    return 0
