"""Request ids end to end, access lines, JSON logs, and no prompt text unless asked."""
import json
import re
import time

import httpx
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

SECRET = "purple elephant"
CHAT = {"model": "m", "messages": [{"role": "user", "content": f"Describe a {SECRET}."}],
        "max_tokens": 4}


def whole_log(srv: Server, until: str = "") -> str:
    """The server's whole log, once it holds `until` (access lines follow the reply)."""
    deadline = time.monotonic() + 10
    while True:
        with open(srv.log.name, errors="replace") as fh:
            text = fh.read()
        if until in text or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_request_ids_reach_the_worker_and_json_lines_carry_them():
    env = {"PANTHEON_LOG_FORMAT": "json", "PANTHEON_LOG_LEVEL": "DEBUG"}
    with Server("--slots", "2", "--ctx", "256", env=env) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                       headers={"X-Request-Id": "trace-42"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                          json={**CHAT, "stream": True}) as s:
            made = s.headers["x-request-id"]
            assert made.startswith("req-") and len(made) > 8
            s.read()
        bad = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                         headers={"X-Request-Id": "x" * 200}, timeout=30)
        assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert ok.status_code == 200                 # nothing was disturbed
        log = whole_log(srv, '"request_id": "%s", "method"' % ok.headers["x-request-id"])
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert len(records) > 10
        assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
        mine = [r for r in records if r.get("request_id") == "trace-42"]
        access = [r for r in mine if r["logger"] == "pantheon.access"]
        assert len(access) == 1
        line = access[0]
        assert line["method"] == "POST" and line["route"] == "/v1/chat/completions"
        assert line["status"] == 200 and line["model"] == "SmolLM2-135M-Instruct"
        assert line["prompt_tokens"] > 5 and line["completion_tokens"] == 4
        assert line["cached_tokens"] >= 0 and 0 < line["ttft_s"] <= line["total_s"]
        worker = [r["message"] for r in mine if r["logger"] == "pantheon.worker"]
        assert any("queued on" in m for m in worker) and any("finished" in m for m in worker)
        assert any(r.get("request_id") == made and r["logger"] == "pantheon.access"
                   for r in records)
        assert SECRET not in log


@pytest.fixture(scope="module")
def text_logs():
    """A server writing text log lines, prompts included."""
    with Server("--slots", "2", "--ctx", "256", "--log-prompts") as srv:
        yield srv


def access_line(srv: Server, request_id: str) -> dict:
    """The key=value fields of a request's (text) access line."""
    (line,) = [x for x in whole_log(srv, f"pantheon.access [{request_id}]").splitlines()
               if f"pantheon.access [{request_id}]" in x]
    return dict(re.findall(r"(\w+)=(\S+)", line)) | {"line": line}


def test_log_prompts_puts_the_prompt_in_the_access_line(text_logs):
    r = httpx.post(text_logs.url + "/v1/chat/completions", json=CHAT,
                   headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert r.status_code == 200
    line = access_line(text_logs, "trace-7")["line"]
    assert SECRET in line and "status=200" in line and "completion_tokens=4" in line


def test_a_stream_its_client_abandoned_is_logged_as_499_with_the_tokens_sent(text_logs):
    body = {**CHAT, "max_tokens": 200, "stream": True, "logit_bias": {"2": -100, "0": -100}}
    with httpx.stream("POST", text_logs.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "gone-1"}) as s:
        assert s.status_code == 200
        for i, _ in enumerate(s.iter_lines()):
            if i == 8:                 # a few tokens in, the client leaves
                break
    fields = access_line(text_logs, "gone-1")
    assert fields["status"] == "499"
    assert 1 <= int(fields["completion_tokens"]) < 200


def test_cached_tokens_are_counted_once_per_request(text_logs):
    """n=2 choices share one prompt: the access line's cached tokens are the prompt's,
    never the sum over choices (which exceeded the prompt on a warm cache)."""
    body = {**CHAT, "n": 2, "max_tokens": 2}
    for rid in ("cache-1", "cache-2"):
        r = httpx.post(text_logs.url + "/v1/chat/completions", json=body, timeout=60,
                       headers={"X-Request-Id": rid})
        assert r.status_code == 200
        fields = access_line(text_logs, rid)
        assert int(fields["cached_tokens"]) <= int(fields["prompt_tokens"])
        usage = r.json()["usage"]
        assert int(fields["cached_tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert int(fields["cached_tokens"]) > 0            # the second one found its prefix
