"""The two-die pieces one at a time: split placement's plan (stages sized to the dies'
free budgets), the stage link's frames (bounded headers, sizes checked against shapes,
a tail that survives bad messages) and the micro-batches."""
from pathlib import Path

import numpy as np
import pytest
import zmq

import tiny_models as tm
from pantheon.common import protocol as p
from pantheon.common.model_file import read_config
from pantheon.frontend import split_placement as sp
from pantheon.frontend.dies import DieInfo, PlacementError
from pantheon.worker import stage_link as sl
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span
from pantheon.worker import stage_socket as ss
from pantheon.frontend.workers import LoadError


class Table:
    """The die table's snapshot, as plan() reads it."""

    def __init__(self, *free):
        self.dies = [DieInfo(f"cpu:{i}" if i else "cpu", "cpu", "cpu", True, f, 0, f, f, [],
                             {}) for i, f in enumerate(free)]

    def snapshot(self):
        return self.dies


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tm.write_gguf("qwen35", tmp_path_factory.mktemp("q") / "q.gguf")
    return str(path), read_config(path)


def test_stages_are_sized_to_each_die_free_budget(qwen35):
    path, cfg = qwen35
    n = cfg.n_layers
    whole = sp.stage_bytes(path, cfg, "cpu", 4, 256, "auto", 0, n)
    even = sp.plan(Table(whole, whole), path, cfg, ["cpu", "cpu:1"], None, 4, 256, "auto")
    assert [(s.first_layer, s.end_layer) for s in even] == [(0, n // 2), (n // 2, n)]
    # the second die has little room: it gets the fewest layers that still fit
    small = sp.stage_bytes(path, cfg, "cpu", 4, 256, "auto", n - 1, n)
    lop = sp.plan(Table(whole, small), path, cfg, ["cpu", "cpu:1"], None, 4, 256, "auto")
    assert (lop[1].first_layer, lop[1].end_layer) == (n - 1, n)
    assert lop[1].reserved <= small and lop[0].reserved <= whole
    # auto: the two dies with the most room
    auto = sp.plan(Table(1, whole, whole), path, cfg, None, None, 4, 256, "auto")
    assert {s.die for s in auto} == {"cpu:1", "cpu:2"}


def test_the_embedding_and_head_are_the_first_stage_s_alone(qwen35):
    """Stage 1 answers with final hidden rows, so only stage 0 holds the embedding and the
    head matrix: the plan counts them there, and the workers' weights agree."""
    path, cfg = qwen35
    n = cfg.n_layers
    outside, norm, per = sp.layer_weights(path, "auto", 4, n)
    assert outside > norm == 4 * cfg.d_model
    for k in range(1, n):
        head, tail = (sp.stage_bytes(path, cfg, "cpu", 4, 256, "auto", lo, hi)
                      for lo, hi in ((0, k), (k, n)))
        assert head + tail == sp.stage_bytes(path, cfg, "cpu", 4, 256, "auto", 0, n) + norm
    whole, first, second = (load_engine(path, "cpu", n_slots=1, ctx=32, layers=layers)
                            for layers in ((0, n), (0, 1), (1, n)))
    assert second.model.w.head is None and second.model.w.embed is None
    assert first.model.w.head is not None
    assert first.weight_bytes + second.weight_bytes == whole.weight_bytes + norm
    with pytest.raises(RuntimeError, match="no embedding"):
        second.model.forward([1], [Span(0, 0, 1)])


def test_a_split_that_does_not_fit_is_507_and_bad_requests_400(qwen35):
    path, cfg = qwen35
    table = Table(1 << 20, 1 << 20)
    with pytest.raises(PlacementError) as e:
        sp.plan(table, path, cfg, ["cpu", "cpu:1"], None, 4, 10**7, "auto")
    assert e.value.status == 507 and "does not fit" in str(e.value)
    for dies, split, words in ((["cpu", "gpu"], None, "unknown die"),
                               (["cpu", "cpu"], None, "twice"),
                               (["cpu", "cpu:1", "x"], None, "at most two"),
                               (["cpu", "cpu:1"], [cfg.n_layers], "each stage"),
                               (["cpu", "cpu:1"], [True], "each stage"),
                               (["cpu"], [1], "split needs two dies")):
        with pytest.raises(PlacementError) as e:
            sp.plan(Table(1 << 30, 1 << 30), path, cfg, dies, split, 4, 256, "auto")
        assert e.value.status == 400 and words in str(e.value)


def test_admin_load_takes_two_dies_and_a_split():
    from pantheon.cli import build_parser
    from pantheon.frontend.admin_cli import request_args
    args = build_parser().parse_args(["admin", "load", "/m.gguf", "--dies", "cpu,cpu:1",
                                      "--split", "12", "--link", "tcp"])
    body = request_args(args)
    assert body["dies"] == ["cpu", "cpu:1"] and body["split"] == [12] and body["link"] == "tcp"
    worker = build_parser().parse_args(["worker", "--stage-bind", "0.0.0.0:7100-7109"])
    assert worker.stage_bind == ss.StageBind("0.0.0.0", (7100, 7109))


def test_frames_are_checked_against_their_header():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(sl.array(sl.meta(a), a.tobytes(), 3), a)
    for m, buf in (({"dtype": "float64", "shape": [2, 3]}, a.tobytes()),
                   ({"dtype": "float32", "shape": [2, 3]}, a.tobytes()[:-4]),
                   ({"dtype": "float32", "shape": [2, 4]}, a.tobytes()),
                   ({"dtype": "float32", "shape": [sl.MAX_ROWS + 1, 3]}, b""),
                   ({"dtype": "float32", "shape": "x"}, b"")):
        with pytest.raises(sl.StageError):
            sl.array(m, buf, 3)
    with pytest.raises(sl.StageError):
        sl.unpack(b"\xdd\xff\xff\xff\xff")          # an array claiming 4 G entries
    with pytest.raises(sl.StageError):
        sl.unpack(bytes(sl.HEADER_BYTES + 1))
    with pytest.raises(sl.StageError):
        sl.unpack(sl.pack([1, 2]))                  # not a map with an op


def test_micro_batches_cut_by_tokens_and_a_lone_chunk_in_halves():
    toks = np.arange(40)
    spans = [Span(0, 0, 20), Span(1, 0, 1), Span(2, 0, 1), Span(3, 0, 18)]
    parts = sl.micro_batches(toks, spans)
    assert [len(g) for _, g in parts] == [1, 3] and sum(len(t) for t, _ in parts) == 40
    (t1, g1), (t2, g2) = sl.micro_batches(np.arange(32), [Span(5, 10, 32)])
    assert g1 == [Span(5, 10, 16, False)] and g2 == [Span(5, 26, 16)]
    assert len(sl.micro_batches(np.arange(4), [Span(0, 0, 4)])) == 1


def test_a_tail_survives_bad_messages(tmp_path):
    path = tm.write_gguf("llama", tmp_path / "l.gguf")
    link = f"ipc://{tmp_path}/link"
    tail = sl.TailStage(load_engine(path, "cpu", n_slots=2, ctx=32, layers=(1, 2)),
                        p.Stage(index=1, first_layer=1, end_layer=2, link=link))
    tail.start()
    try:
        taken = zmq.Context.instance().socket(zmq.ROUTER)
        taken.bind("tcp://127.0.0.1:*")
        with pytest.raises(sl.StageError, match="cannot be bound"):   # a port in use
            sl.TailStage(tail.engine, p.Stage(index=1, first_layer=1, end_layer=2,
                                              link=taken.last_endpoint.decode()))
        taken.close(0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(link)
        bad = [[b"\xc1"], [sl.pack({"op": "forward", "seq": 1, "spans": [[9, 0, 1, True, "", 1]],
                                    "x": {"dtype": "float32", "shape": [1, 64]}}), bytes(256)],
               [sl.pack({"op": "forward", "seq": 2, "spans": [[0, 0, 2, True, "", 1]],
                         "x": {"dtype": "float32", "shape": [1, 64]}}), bytes(256)],
               [sl.pack({"op": "restore", "seq": 3, "slot": 0, "handle": 7})],
               [sl.pack({"op": "nope", "seq": 4})]]
        for frames in bad:
            sock.send_multipart(frames)
            assert sock.poll(5000)
            assert sl.unpack(sock.recv_multipart()[0])["op"] == "error"
        link_ = sl.HeadLink(p.Stage(index=0, first_layer=0, end_layer=1, link=link))
        hello, _ = link_.call({"op": "hello"})
        assert hello["truncatable"] and hello["state_bytes"] > 0
        link_.close()
        sock.close(0)
    finally:
        tail.stop()
        tail.join(5)


def test_stage_bind_parses_host_and_port_ranges():
    assert ss.StageBind.parse("10.0.0.5") == ss.StageBind("10.0.0.5", None)
    assert ss.StageBind.parse("0.0.0.0:7100-7109") == ss.StageBind("0.0.0.0", (7100, 7109))
    assert ss.StageBind.parse("[::1]:7100") == ss.StageBind("::1", (7100, 7100))
    assert ss.StageBind.parse(":7100") == ss.StageBind("", (7100, 7100))
    for text in ("10.0.0.5", "0.0.0.0:7100-7109", "[::1]:7100", ":7100", "host-1.lan:9"):
        assert ss.StageBind.parse(text).text() == text      # what serve hands its workers
    for bad in ("h:x", "h:9-3", "h:0", "h:70000", "a b"):
        with pytest.raises(ValueError):
            ss.StageBind.parse(bad)


class Hello:
    def __init__(self, host, key):
        self.host, self.public_key = host, key


class W:
    def __init__(self, die, host, key=""):
        self.die, self.hello = die, Hello(host, key)


class Pool:
    def __init__(self, keyed=False, external=False):
        self.keyed, self.external = keyed, external


def test_the_link_is_ipc_on_one_host_tcp_across_and_curve_with_keys():
    a, b = W("0", "h1/boot", "KA"), W("1", "h1/boot", "KB")
    far = W("1", "h2/boot", "KB")
    assert sp.link_plan(Pool(), a, b) == ("ipc", "", "")
    assert sp.link_plan(Pool(keyed=True), a, far) == ("tcp", "KB", "KA")
    assert sp.link_plan(Pool(keyed=True), a, b, "tcp") == ("tcp", "KB", "KA")
    assert sp.link_plan(Pool(external=True), a, far) == ("tcp", "", "")   # --insecure
    for pool, head, tail, want, words in (
            (Pool(), a, far, "", "keys missing"),            # no keys, no --insecure
            (Pool(keyed=True), W("0", "h1", ""), far, "", "keys missing"),
            (Pool(keyed=True), a, far, "ipc", "one host"),
            (Pool(), W("0", ""), W("1", ""), "", "keys missing")):   # unknown hosts: tcp
        with pytest.raises(LoadError, match=words) as e:
            sp.link_plan(pool, head, tail, want)
        assert e.value.code == sp.LINK_REFUSED


def test_a_tail_socket_fails_fast_without_keys_or_a_free_port():
    stage = p.Stage(index=1, first_layer=1, end_layer=2, link="tcp", server_key="K" * 40,
                    client_key="C" * 40)
    with pytest.raises(ss.StageLinkError, match="keys missing"):
        ss.TailSocket(stage, 1 << 20, ss.StageNet())
    taken = [zmq.Context.instance().socket(zmq.ROUTER) for _ in range(2)]
    taken[0].bind("tcp://127.0.0.1:*")
    port = int(taken[0].last_endpoint.decode().rsplit(":", 1)[1])
    try:
        taken[1].bind(f"tcp://127.0.0.1:{port + 1}")
        plain = p.Stage(index=1, first_layer=1, end_layer=2, link="tcp")
        net = ss.StageNet(bind=ss.StageBind("127.0.0.1", (port, port + 1)))
        with pytest.raises(ss.StageLinkError, match=f"127.0.0.1:{port}-{port + 1}: all in use"):
            ss.TailSocket(plain, 1 << 20, net)
    except zmq.ZMQError:
        pytest.skip("the next port was taken by another process")
    finally:
        for s in taken:
            s.close(0)
    import tempfile                    # a killed worker's folder (a pid no process has)
    orphan = Path(tempfile.mkdtemp(prefix=f"{ss.IPC_PREFIX}{2**22 + 7}-"))
    ipc = ss.TailSocket(p.Stage(index=1, first_layer=1, end_layer=2, link="ipc"), 1 << 20)
    assert not orphan.exists()
    folder = ipc.folder
    assert ipc.address == f"ipc://{folder}/link" and (folder.stat().st_mode & 0o077) == 0
    ipc.close()
    assert not folder.exists()


def test_a_curve_tail_refuses_a_head_with_another_key_at_the_handshake(tmp_path):
    from pantheon.common.keys import KeyPair
    path = tm.write_gguf("llama", tmp_path / "l.gguf")
    server, head, other = (KeyPair(*zmq.curve_keypair()) for _ in range(3))
    tail = sl.TailStage(load_engine(path, "cpu", n_slots=2, ctx=32, layers=(1, 2)),
                        p.Stage(index=1, first_layer=1, end_layer=2, link="tcp",
                                server_key=server.public.decode(),
                                client_key=head.public.decode()),
                        ss.StageNet(server, ss.StageBind("127.0.0.1")))
    tail.start()
    try:
        assert tail.address.startswith("tcp://127.0.0.1:")

        def dial(pair):
            return sl.HeadLink(p.Stage(index=0, first_layer=0, end_layer=1, link=tail.address,
                                       server_key=server.public.decode()), 10,
                               net=ss.StageNet(pair))
        refused = dial(other)
        with pytest.raises(sl.StageError, match="handshake"):   # at once, not after 10 s
            refused.call({"op": "hello"})
        refused.close()
        ok = dial(head)
        assert ok.call({"op": "hello"})[0]["op"] == "hello"
        ok.close()
    finally:
        tail.stop()
        tail.join(5)


@pytest.mark.parametrize("die", ["cpu", "emu:0"])
def test_a_split_forward_gives_the_one_die_logits(tmp_path, die):
    """In one process, on the CPU and on the emulated GPU die: the tail's final rows
    through the head's matrix are the whole model's logits (prefill chunk and decode)."""
    path = tm.write_gguf("llama", tmp_path / "l.gguf")
    link = f"ipc://{tmp_path}/link"
    whole = load_engine(path, die, n_slots=2, ctx=32)
    tail = sl.TailStage(load_engine(path, die, n_slots=2, ctx=32, layers=(1, 2)),
                        p.Stage(index=1, first_layer=1, end_layer=2, link=link))
    tail.start()
    head = load_engine(path, die, n_slots=2, ctx=32, layers=(0, 1))
    link_ = sl.connect_head(head, p.Stage(index=0, first_layer=0, end_layer=1, link=link))
    try:
        for tokens, spans in (([3, 9, 4, 7, 1], [Span(0, 0, 5)]),
                              ([5, 2], [Span(0, 5, 1), Span(1, 0, 1)])):
            want = whole.forward(np.array(tokens), spans)
            got = head.forward(np.array(tokens), spans)
            assert got.shape == want.shape == (len(spans), whole.cfg.vocab_size)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        rows = 3 * 4                       # three rows came back (one, then two), as float32
        assert rows * whole.cfg.d_model <= link_.bytes_in < rows * whole.cfg.vocab_size
    finally:
        link_.close()
        tail.stop()
        tail.join(5)
