"""Every wire message round-trips; bad bytes are refused with ProtocolError."""
import tracemalloc

import msgpack
import pytest

from pantheon.common import limits as lim
from pantheon.common import protocol as p

SAMPLES = [
    p.Hello("cpu", "cpu", "cpu", 8 << 30, 4 << 30, 8, pid=123, models=["m-1"]),
    p.Hello("cpu", "cpu", "cpu", 8 << 30, 4 << 30, 8, pid=5, models=["m-1"],
            replicas=[p.Resident("m-1", "/models/a.gguf", 8, 4096, 538_000_000, 1 << 20)],
            running=["req-ab-1"]),
    p.Hello("0", "cuda", "Tesla K80", 12 << 30, 11 << 30, 8),
    p.Heartbeat("cpu:1", active=3, waiting=1, mem_total=1, mem_free=0, host_mem_free=5,
                pressure=2),
    p.Heartbeat("cpu", 1, 0, 1, 1, 1, 0, pid=42, step_s=7.25),
    p.Heartbeat("0", 2, 0, 1, 1, 1, 0, pid=42, replicas=[p.ReplicaLoad("m-1", 2, 8, 300, 32768)],
                step_counts=[0] * 5 + [7] + [0] * 12, step_sum=0.31),
    p.Ping(),
    p.Loaded("m-1", "smol", 8, 4096, 49152, 538_000_000, 377_000_000, 2.5),
    p.LoadFailed("m-2", "no such file"),
    p.LoadFailed("m-3", "tensor w holds NaN or Inf", p.BAD_MODEL_FILE),
    p.LoadFailed("m-2", "Out of memory allocating 1,024 bytes", p.OUT_OF_MEMORY),
    p.LoadProgress("m-2", 3, 30),
    p.Hello("cpu:1", "cpu", "cpu", 8 << 30, 4 << 30, 8, budget=2 << 30),
    p.Unloaded("m-1"),
    p.Tokens("r1", [1, 2, 3]),
    p.Tokens("r1", [], finish="length", prompt_tokens=10, completion_tokens=4, cached_tokens=2),
    p.Error("bad", request_id="r9"),
    p.Error("worse"),
    p.Stopping("cpu"),
    p.Load("m-1", "/models/a.gguf", "a"),
    p.Load("m-1", "/models/a.gguf", "a", slots=4, ctx=2048, prefill_chunk=64),
    p.Unload("m-1"),
    p.Generate("r1", "m-1", [1, 2, 3], p.Sampling(), 16),
    p.Generate("r2", "m-1", list(range(5000)),
               p.Sampling(0.7, 40, 0.9, 0.05, 1.1, 0.5, 0.2, {7: -100.0, 8: 2.5}, 2**62),
               128, stop_ids=[2], session_id="s"),
    p.Generate("r3", "m-1", [1], p.Sampling(0.0), 8, grammar='{"grammars": []}', logprobs=2),
    p.Generate("r4", "m-1", [1], p.Sampling(), 8, trace="client-id-7"),
    p.Generate("r5", "m-1", [1], p.Sampling(), 8, session_id="s" * 256, cache_salt="k1"),
    p.Accepted("r5"),
    p.Tokens("r3", [5], logprobs=[[-0.5, [[5, -0.5], [7, -1.25]]]]),
    p.Outputs([]),
    p.Outputs([p.Tokens("r1", [7]), p.Tokens("r2", [], finish="stop", prompt_tokens=3,
                                             completion_tokens=9, cached_tokens=1),
               p.Tokens("r3", [5], logprobs=[[-0.5, [[5, -0.5]]]])]),
    p.Abort("r1"),
    p.Shutdown(),
    p.AdminRequest("load", {"path": "/m.gguf", "dies": ["cpu:1"], "ctx": 512}, "tok"),
    p.AdminRequest("dies"),
    p.AdminReply(200, {"dies": [{"die": "cpu", "models": []}]}),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert p.decode(p.encode(msg)) == msg


def test_every_kind_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(p.MESSAGES.values())


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    raw = msgpack.packb({"v": p.PROTOCOL, "k": "abort", "request_id": "x", "later": [1]})
    assert p.decode(raw) == p.Abort("x")
    raw = msgpack.packb({"v": p.PROTOCOL, "k": "tokens", "request_id": "x", "tokens": []})
    assert p.decode(raw) == p.Tokens("x", [])


def raw(**body):
    return msgpack.packb({"v": p.PROTOCOL, **body})


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "undecodable"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"k": "abort", "request_id": "x"}), "protocol version"),
    (msgpack.packb({"v": 99, "k": "abort", "request_id": "x"}), "protocol version"),
    (raw(k="launch_missiles"), "unknown message kind"),
    (raw(k="abort"), "lacks field 'request_id'"),
    (raw(k="abort", request_id=5), "Abort.request_id: expected str"),
    (raw(k="tokens", request_id="x", tokens=[1, "2"]), "Tokens.tokens"),
    (raw(k="tokens", request_id="x", tokens=[True]), "Tokens.tokens"),
    (raw(k="outputs", outputs=[{"request_id": "x", "tokens": ["1"]}]), "Tokens.tokens"),
    (raw(k="outputs", outputs=[{"tokens": [1]}]), "lacks field 'request_id'"),
    (raw(k="outputs", outputs={"x": 1}), "Outputs.outputs"),
    (raw(k="generate", request_id="r", model_id="m", prompt=[1], sampling=[], max_tokens=1),
     "Generate.sampling"),
    (raw(k="generate", request_id="r", model_id="m", prompt=[1],
         sampling={"logit_bias": {"a": 1.0}}, max_tokens=1), "Sampling.logit_bias"),
    (raw(k="generate", request_id="r", model_id="m", prompt=[1],
         sampling={"temperature": "hot"}, max_tokens=1), "Sampling.temperature"),
    (raw(k="heartbeat", die="cpu", active=1.5, waiting=0, mem_total=0, mem_free=0,
         host_mem_free=0, pressure=0), "Heartbeat.active"),
    (msgpack.packb({"v": p.PROTOCOL, "k": "abort", "request_id": b"bytes"}, use_bin_type=True),
     "undecodable"),
])
def test_bad_messages_are_refused(data, message):
    with pytest.raises(p.ProtocolError, match=message):
        p.decode(data)


def test_size_limit(monkeypatch):
    monkeypatch.setattr(p, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(p.encode(p.Generate("r", "m", list(range(100)), p.Sampling(), 1)))


def test_encode_refuses_foreign_objects():
    with pytest.raises(TypeError):
        p.encode({"k": "abort"})


def test_a_step_of_eight_requests_decodes_in_one_pass(monkeypatch):
    """A step's Outputs is read by one msgpack pass, whatever it carries (a pass per field
    lookup once cost ~8x the decode time: the speed itself is the benchmark's)."""
    msg = p.Outputs([p.Tokens(f"req-ab-{i}", [1000 + i], prompt_tokens=40,
                              completion_tokens=i) for i in range(8)])
    data = p.encode(msg)
    calls = []
    real = p.msgpack.unpackb
    monkeypatch.setattr(p.msgpack, "unpackb", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert p.decode(data) == msg
    assert len(calls) == 1


def raw_generate(**fields) -> bytes:
    body = {"v": p.PROTOCOL, "k": "generate", "request_id": "r7", "model_id": "m",
            "prompt": [1], "sampling": {}, "max_tokens": 2, **fields}
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("fields, named", [
    ({"session_id": "s" * (lim.MAX_SESSION_ID_CHARS + 1)}, "session_id"),
    ({"session_id": "s" * (5 << 20)}, "max_str_len"),            # past msgpack's own bound
    ({"sampling": {"logit_bias": {i: 1.0 for i in range(lim.MAX_LOGIT_BIAS + 1)}}},
     "logit_bias"),
    ({"sampling": {"logit_bias": {i: 1.0 for i in range(65_537)}}}, "max_map_len"),
    ({"grammar": "g" * (lim.MAX_GRAMMAR_CHARS + 1)}, "grammar"),
    ({"cache_salt": "c" * (lim.MAX_ID_CHARS + 1)}, "cache_salt"),
])
def test_fields_past_their_limit_are_refused_and_the_request_id_still_read(fields, named):
    data = raw_generate(**fields)
    with pytest.raises(p.ProtocolError, match=named):
        p.decode(data)
    assert p.peek_request_id(data) == "r7"           # so the worker can say which one


def test_the_request_id_is_read_only_when_safe():
    assert p.peek_request_id(b"\xc1") is None
    assert p.peek_request_id(msgpack.packb([1, 2])) is None
    assert p.peek_request_id(raw_generate(request_id="x" * 300)) is None
    assert p.peek_request_id(raw_generate(request_id=5)) is None


def test_encode_refuses_what_the_peer_would_refuse():
    with pytest.raises(p.ProtocolError, match="session_id"):
        p.encode(p.Generate("r", "m", [1], p.Sampling(), 1, session_id="s" * 257))
    with pytest.raises(p.ProtocolError, match="cannot encode"):     # not an OverflowError
        p.encode(p.Generate("r", "m", [1], p.Sampling(logit_bias={2**64: 1.0}), 1))
    assert p.oversized(p.Generate("r", "m", [1], p.Sampling(logit_bias={1: 1.0}), 1)) is None


@pytest.mark.parametrize("bomb, limits", [
    (b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000, lim.LINK),  # empty maps
    (b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x90" * 2_000_000, lim.LINK),  # arrays
    (b"\xdd" + (60 << 20).to_bytes(4, "big") + b"\x80" * (60 << 20), lim.LINK),  # too long
    ((b"\xdc" + (1000).to_bytes(2, "big")) * 1000, lim.ADMIN),       # deep, preallocated
    (b"\xdc" + (1000).to_bytes(2, "big") + b"\x80" * 1000 + b"\x80" * 5000, lim.ADMIN),
])
def test_a_msgpack_bomb_is_refused_before_it_is_built(bomb, limits):
    """msgpack bounds each length but neither depth nor the count of containers: one byte
    per empty map on the wire is ~64 bytes decoded. The container count is bounded too."""
    tracemalloc.start()
    try:
        with pytest.raises(p.ProtocolError):
            p.decode(bomb, limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak


def test_the_admin_limits_are_tighter():
    status = p.encode(p.AdminRequest("status"))
    assert p.decode(status, lim.ADMIN) == p.AdminRequest("status")
    with pytest.raises(p.ProtocolError):
        p.decode(p.encode(p.AdminRequest("load", {"dies": list(range(2000))})), lim.ADMIN)
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(b"\x80" * (lim.MAX_ADMIN_MESSAGE_BYTES + 1), lim.ADMIN)
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(p.ProtocolError, match="nest"):
        p.decode(p.encode(p.AdminRequest("load", {"dies": deep})), lim.ADMIN)


def test_what_the_frontend_reads_from_workers_is_bounded_tighter():
    """The frontend reads the worker port before a peer's hello is judged: no prompt-sized
    arrays come that way, so none are built."""
    step = p.Outputs([p.Tokens(f"r{i}", [i], logprobs=[[-0.5, [[i, -0.5]] * 20]])
                      for i in range(256)])
    assert p.decode(p.encode(step), lim.FROM_WORKER) == step
    with pytest.raises(p.ProtocolError, match="max_array_len"):
        p.decode(p.encode(p.Generate("r", "m", list(range(70_000)), p.Sampling(), 1)),
                 lim.FROM_WORKER)
