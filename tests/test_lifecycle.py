"""The request lifecycle with a fake worker pool and a fake ASGI connection: no
processes. Admission → start → stream or collect → release, whatever ends it."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from pantheon.common import protocol as p
from pantheon.frontend.admission import Admission
from pantheon.frontend.chat import seeded
from pantheon.frontend.emitter import Emitter
from pantheon.frontend.errors import APIError
from pantheon.frontend.lifecycle import Choice, Job, Lifecycle
from pantheon.frontend.openai_api import (ChatRenderer, CompletionRenderer,
                                          parse_chat_request, parse_completion_request)
from pantheon.frontend.registry import Replica, ReplicaState
from pantheon.frontend.workers import RequestStream, WorkerLost

EOS = 0
WORDS = {1: "Hello", 2: " world", 3: "!", EOS: ""}


class Detok:
    def push(self, token):
        return WORDS[token]

    def flush(self):
        return ""


TOKENIZER = SimpleNamespace(eot_ids=frozenset({EOS}), detokenizer=Detok,
                            token_str=lambda t: WORDS[t])


class FakePool:
    """Answers every Generate with `script` (lists of token ids per message, the last
    finishing with `finish`); records what was sent, aborted and released."""

    def __init__(self, script=((1,), (2, 3), (EOS,)), finish="stop", fail_at=None):
        self.script, self.finish, self.fail_at = script, finish, fail_at
        self.started, self.aborted, self.released = [], [], []
        self.ids = iter(range(1000))

    def new_request_id(self):
        return f"req-{next(self.ids)}"

    async def generate(self, worker, msg):
        if self.fail_at is not None and len(self.started) == self.fail_at:
            raise WorkerLost("gone")
        self.started.append(msg)
        stream = RequestStream(msg.request_id, worker)
        for j, ids in enumerate(self.script):
            last = j == len(self.script) - 1
            stream.queue.put_nowait(p.Tokens(msg.request_id, list(ids),
                                             self.finish if last else None, len(msg.prompt)))
        return stream

    def abort_soon(self, request_id):
        if any(m.request_id == request_id for m in self.started):   # as the pool: only
            self.aborted.append(request_id)                            # what it runs

    def release(self, request_id):
        self.released.append(request_id)


def model(slots=4, replicas=1):
    reps = [Replica(f"m#{i}", f"cpu:{i}", ReplicaState.READY, slots=slots, ctx=64,
                    worker=SimpleNamespace(pressure=0, slow=False, die=f"cpu:{i}"))
            for i in range(replicas)]
    return SimpleNamespace(name="m", replicas=reps, ready=lambda: reps, tokenizer=TOKENIZER,
                           config=SimpleNamespace(vocab_size=1000))


class Connection:
    """An ASGI connection: what was sent; `disconnect` makes receive() report the client
    gone (else it waits)."""

    def __init__(self, disconnect_after: int | None = None):
        self.messages, self.disconnect_after = [], disconnect_after
        self.gone = asyncio.Event()
        self.request = SimpleNamespace(receive=self.receive, scope={"type": "http"})

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.messages.append(message)
        if self.disconnect_after is not None and len(self.messages) >= self.disconnect_after:
            self.gone.set()
            await asyncio.sleep(0)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages
                        if m["type"] == "http.response.body")

    def events(self) -> list:
        return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
                for line in self.body().decode().split("\n\n") if line]


def chat_job(m, n=1, stream=True, **fields):
    req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "n": n, "stream": stream, **fields}).encode())
    choices = [Choice([5, 6, 7], seeded(req.sampling, req.sampling.seed, i), 8,
                      Emitter(req.stop)) for i in range(n)]
    return Job(m, choices, stream, ChatRenderer("chatcmpl-x", 1, "m", TOKENIZER, req, n),
               req.session_id, req.include_usage)


def run(pool, job, conn=None):
    conn = conn or Connection()
    life = Lifecycle(pool, Admission())

    async def go():
        await life.run(conn.request, conn.send, job)
    asyncio.run(go())
    return conn


def test_a_stream_sends_role_deltas_finish_usage_done_and_releases_the_slot():
    pool, m = FakePool(), model()
    conn = run(pool, chat_job(m, stream_options={"include_usage": True},
                              return_token_ids=True))
    events = conn.events()
    assert conn.messages[0]["status"] == 200
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["prompt_token_ids"] == [5, 6, 7]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == "Hello world!"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    ids = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert ids == [1, 2, 3, EOS]                         # each chunk: the ids it adds
    assert events[-2]["usage"]["completion_tokens"] == 4 and events[-1] == "[DONE]"
    assert m.replicas[0].inflight == 0 and pool.released == ["req-0"] and not pool.aborted


def test_n_choices_start_on_one_replica_and_collect_into_one_body():
    pool, m = FakePool(), model(slots=8, replicas=2)
    conn = run(pool, chat_job(m, n=4, stream=False, seed=7, return_token_ids=True))
    body = json.loads(conn.body())
    assert {msg.model_id for msg in pool.started} == {"m#0"}     # the whole group, one replica
    assert [msg.sampling.seed for msg in pool.started] == [7, 8, 9, 10]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello world!"] * 4
    assert [c["token_ids"] for c in body["choices"]] == [[1, 2, 3, EOS]] * 4
    assert body["prompt_token_ids"] == [5, 6, 7] and body["usage"]["completion_tokens"] == 16
    assert [r.inflight for r in m.replicas] == [0, 0] and m.replicas[0].served == 4


def test_a_client_that_leaves_mid_stream_aborts_the_worker_and_frees_the_slot():
    pool, m = FakePool(script=((1,),) * 50, finish="length"), model()
    pool.script = list(pool.script)

    async def slow_generate(worker, msg, orig=pool.generate):
        stream = await orig(worker, msg)
        stream.queue = asyncio.Queue()            # nothing arrives: the client leaves first
        return stream
    pool.generate = slow_generate
    conn = run(pool, chat_job(m), Connection(disconnect_after=2))
    assert pool.aborted == ["req-0"] and m.replicas[0].inflight == 0


def test_a_failed_start_releases_every_slot_and_aborts_what_started():
    pool, m = FakePool(fail_at=1), model()
    with pytest.raises(APIError) as info:
        run(pool, chat_job(m, n=3))
    assert info.value.status == 503 and info.value.code == "worker_lost"
    assert m.replicas[0].inflight == 0 and pool.aborted == ["req-0"]


def test_an_error_after_the_first_byte_is_an_sse_error_then_done():
    pool, m = FakePool(), model()

    async def failing(worker, msg):
        stream = RequestStream(msg.request_id, worker)
        stream.queue.put_nowait(p.Error("boom", code="internal", request_id=msg.request_id))
        return stream
    pool.generate = failing
    events = run(pool, chat_job(m)).events()
    assert events[-2]["error"]["message"] == "boom" and events[-1] == "[DONE]"
    assert m.replicas[0].inflight == 0


def test_completions_render_cmpl_ids_echo_and_token_ids():
    pool, m = FakePool(), model()
    req = parse_completion_request(json.dumps({"prompt": [5, 6], "echo": True,
                                               "return_token_ids": True}).encode())
    job = Job(m, [Choice([5, 6], req.sampling, 8, Emitter(reasoning=False, tools=False))],
              False, CompletionRenderer("cmpl-x", 1, "m", TOKENIZER, req, 1, ["<p>"]))
    body = json.loads(run(pool, job).body())
    (choice,) = body["choices"]
    assert body["object"] == "text_completion" and body["id"] == "cmpl-x"
    assert choice["text"] == "<p>Hello world!" and choice["finish_reason"] == "stop"
    assert choice["prompt_token_ids"] == [5, 6] and choice["token_ids"] == [1, 2, 3, EOS]


class CountingPool(FakePool):
    """FakePool that records the replica's slots in use at each start."""

    def __init__(self, replica, **kw):
        super().__init__(**kw)
        self.replica, self.in_use = replica, []

    async def generate(self, worker, msg):
        self.in_use.append(self.replica.inflight)
        return await super().generate(worker, msg)


@pytest.mark.parametrize("stream", [False, True])
def test_n_16_on_a_4_slot_replica_holds_at_most_half_its_slots(stream):
    m = model(slots=4)
    pool = CountingPool(m.replicas[0])
    conn = run(pool, chat_job(m, n=16, stream=stream, seed=1))
    assert len(pool.started) == 16 and max(pool.in_use) <= 2     # half of 4, at any time
    assert sorted(msg.sampling.seed for msg in pool.started) == list(range(1, 17))
    if stream:
        ends = [c["index"] for e in conn.events()[:-1] for c in e["choices"]
                if c["finish_reason"]]
        assert sorted(ends) == list(range(16))
    else:
        body = json.loads(conn.body())
        assert [c["message"]["content"] for c in body["choices"]] == ["Hello world!"] * 16
    assert m.replicas[0].inflight == 0 and len(pool.released) == 16


def test_a_later_choice_queues_behind_a_request_that_came_first():
    async def go():
        m = model(slots=2)                     # share: 1 slot per request
        admission = Admission()
        first = await admission.acquire(m, None, 1)
        other = asyncio.ensure_future(admission.acquire(m, None, 2))   # waits: 1 free
        await asyncio.sleep(0)
        later = asyncio.ensure_future(admission.acquire(m, None, 1, admitted=True))
        await asyncio.sleep(0)
        assert not later.done()                # a free slot, but `other` is first in line
        admission.release(m, first)
        assert (await other) is first and not later.done()
        admission.release(m, first)
        admission.release(m, first)
        assert (await later) is first
    asyncio.run(go())


def test_later_choices_stay_on_the_first_choices_replica_while_it_has_room():
    m = model(slots=4, replicas=2)
    pool = FakePool()
    run(pool, chat_job(m, n=4, stream=False, seed=3))
    assert [msg.model_id for msg in pool.started] == ["m#0"] * 4
    assert [r.inflight for r in m.replicas] == [0, 0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_a_later_choice_leaves_no_slot_behind(stream):
    pool, m, conn = FakePool(), model(slots=2), Connection()      # one choice at a time

    async def generate(worker, msg, orig=pool.generate):
        got = await orig(worker, msg)
        if len(pool.started) == 2:               # the second choice: hangs; client leaves
            got.queue = asyncio.Queue()
            conn.gone.set()
        return got
    pool.generate = generate
    run(pool, chat_job(m, n=4, stream=stream), conn)
    assert len(pool.started) == 2 and m.replicas[0].inflight == 0
    assert pool.aborted == ["req-1"] and pool.released == ["req-0"]
