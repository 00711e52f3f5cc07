"""`pantheon bench engine --dies cpu,cpu`: a replica split across two CPU dies (one core
each, stages in two processes joined by the stage link) against the same model on one
die with both cores.

Rounds alternate: one die, then two, then one die on one core, each in fresh processes
pinned as `serve --spawn-workers cpu,cpu` pins its workers (one core per die; the one-die
run gets both). Against one core, two dies show the overlap alone: ~1x if the stages ran
in turn, up to 2x when both dies work all the time.
Prints one JSON object: per arrangement the median aggregate decode tokens/s at each
batch size (after 64-token prompts), the two-die / one-die ratios, and the link's cost:
bytes a decode step moves each way per sequence, and the median round trip of a frame
that size (the head's hidden state out, the final row back) over the ipc link the stages
run on and over a loopback tcp link with CURVE (what two hosts would use, less the wire).

The split (`--split K`, the second stage's first layer) defaults to the k that evens the
two stages' multiply-adds, the first stage's counting the head matrix (it samples): for
SmolLM2 layer 11 of 30. (The placement without `split` evens the dies' memory instead,
the KV included: layer 14 for SmolLM2 with 8 slots of 4,096 positions.) The busy figures
say whether the cut is even: at layer 15 the first stage was busy all the time and the
second 0.69 of it (batch 8 0.81x), at layer 11 both 0.91-0.99 (0.86-0.91x).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..common import protocol as p


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def child(role: str, model: str, argv: list[str], core_list: list[int],
          tcp: dict | None = None) -> subprocess.Popen:
    # the kernels take as many threads as the process has cores (its affinity)
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.bench.two_die", role, model,
                             *argv], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, core_list))
    proc.stdin.write(json.dumps(tcp or {}) + "\n")     # the tcp link's keys: never on argv
    proc.stdin.flush()
    return proc


def tcp_link() -> dict:
    """A loopback tcp address and two fresh CURVE pairs for the second link's figure."""
    import zmq
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    return {"link": f"tcp://127.0.0.1:{port}", "server": [k.decode() for k in server],
            "client": [k.decode() for k in client]}


def balanced_split(model: str) -> int:
    """The k whose stages [0, k) + the head and [k, L) have the most even parameter
    counts (a decode step's multiply-adds)."""
    from ..common.model_file import read_config
    from ..common.weight_format import tensor_list
    from ..frontend.split_placement import LAYER
    n = read_config(model).n_layers
    per, head = [0] * n, 0
    for name, _kind, shape in tensor_list(model):
        size = int(np.prod(shape))
        m = LAYER.search(name)
        if m and int(m.group(1)) < n:
            per[int(m.group(1))] += size if len(shape) > 1 else 0
        elif name in ("output.weight", "token_embd.weight") and len(shape) > 1:
            head = size          # the tied embedding's lookup costs nothing: one matrix
    return min(range(1, n), key=lambda k: max(head + sum(per[:k]), sum(per[k:])))


def run_round(model: str, batches: str, steps: int, quantize: str, split: int,
              one_core: bool = False) -> dict:
    have = cores()
    if not split:                        # 0: the model on one die
        out = child("one", model, [batches, str(steps), quantize],
                    have[:1] if one_core else have).communicate()[0]
        return json.loads(out)
    folder = tempfile.mkdtemp(prefix="pantheon-bench-link-")
    link = f"ipc://{folder}/link"
    tcp = tcp_link()
    tail = child("tail", model, [batches, str(steps), quantize, link, str(split)],
                 have[-1:], tcp)
    try:
        out = child("head", model, [batches, str(steps), quantize, link, str(split)],
                    have[:1], tcp).communicate()[0]
    finally:
        tail.kill()
        tail.wait()
    return json.loads(out)


def cpu_seconds(engine) -> tuple[float, float]:
    """This process's CPU seconds and, for a split replica's head, the tail's."""
    link = getattr(engine, "link", None)
    tail = link.call({"op": "stats"})[0]["cpu_s"] if link is not None else 0.0
    return time.process_time(), tail


def scheduled_rate(engine, batch: int, steps: int, prompt_len: int = 64,
                   busy: dict | None = None) -> float:
    """Aggregate decode tokens/s of `batch` greedy streams through the replica's own
    scheduler (a split replica's lanes overlap there), after their prompts; `busy` gets
    each process's CPU seconds over the timed steps per wall second (stage 0's, the
    tail's)."""
    from ..worker.sampler import SamplingParams
    from ..worker.scheduler import Request
    sched = engine.scheduler
    rng = np.random.default_rng(batch)
    for i in range(batch):
        prompt = rng.integers(3, engine.cfg.vocab_size, prompt_len).tolist()
        sched.add(Request(f"b{batch}-{i}-{time.monotonic_ns()}", prompt,
                          SamplingParams(temperature=0), max_tokens=10**6))
    while any(s.feed and s.state.value == "prefill" for s in sched.slots):
        sched.step()
    for _ in range(4):
        sched.step()
    cpu0, t0, made = cpu_seconds(engine), time.perf_counter(), 0
    for _ in range(steps):
        made += sum(len(o.tokens) for o in sched.step())
    seconds = time.perf_counter() - t0
    cpu1 = cpu_seconds(engine)
    if busy is not None:            # and CPU milliseconds a step (a loaded host's too)
        busy[str(batch)] = ([round((b - a) / seconds, 3) for a, b in zip(cpu0, cpu1)]
                            + [round((b - a) * 1e3 / steps, 2) for a, b in zip(cpu0, cpu1)])
    for req_id in list(sched.by_id):
        sched.abort(req_id)
    while sched.step():                    # what the abort left in flight
        pass
    return made / seconds


def rates(engine, batches: list[int], steps: int, busy: dict | None = None) -> dict:
    return {str(b): scheduled_rate(engine, b, steps, busy=busy) for b in batches}


def role_main(argv: list[str]) -> int:
    from ..worker.engine import load_engine
    from ..worker import stage_link
    role, model, batches, steps, quantize = argv[:5]
    batches_l, steps_i = [int(b) for b in batches.split(",")], int(steps)
    n_slots = max(batches_l)
    if role == "one":
        engine = load_engine(model, "cpu", n_slots=n_slots, ctx=512, quantize=quantize)
        print(json.dumps({"decode_tok_s": rates(engine, batches_l, steps_i)}))
        return 0
    link, k = argv[5], int(argv[6])
    tcp = json.loads(sys.stdin.readline() or "{}")
    from ..common.keys import KeyPair
    from ..common.model_file import read_config
    from ..worker.stage_socket import StageNet
    n = read_config(model).n_layers
    if role == "tail":
        engine = load_engine(model, "cpu", n_slots=n_slots, ctx=512, quantize=quantize,
                             layers=(k, n))
        tail = stage_link.TailStage(engine, p.Stage(index=1, first_layer=k, end_layer=n,
                                                    link=link))
        if tcp:                      # a second link, for its round trip only
            stage_link.TailStage(engine, p.Stage(
                index=1, first_layer=k, end_layer=n, link=tcp["link"],
                server_key=tcp["server"][0], client_key=tcp["client"][0]),
                StageNet(KeyPair(*(x.encode() for x in tcp["server"])))).start()
        tail.run()
        return 0
    engine = load_engine(model, "cpu", n_slots=n_slots, ctx=512, quantize=quantize,
                         layers=(0, k))
    deadline = time.monotonic() + 120
    while True:                      # the tail is loading: wait for its answer
        try:
            link_ = stage_link.connect_head(engine, p.Stage(index=0, first_layer=0,
                                                            end_layer=k, link=link), 5)
            break
        except stage_link.StageError:
            if time.monotonic() > deadline:
                raise
    busy: dict = {}
    out = {"decode_tok_s": rates(engine, batches_l, steps_i, busy), "busy": busy}
    d = engine.cfg.d_model
    hidden = np.zeros((1, d), dtype=np.float32)

    def round_trip(over) -> float:
        rtts = []
        for _ in range(50):
            t0 = time.perf_counter()
            over.call({"op": "echo", "reply_bytes": d * 4}, hidden.data)
            rtts.append(time.perf_counter() - t0)
        return round(float(np.median(rtts)) * 1e6, 1)
    out["link"] = {"bytes_out_per_seq": d * 4, "bytes_back_per_seq": d * 4,
                   "round_trip_us": round_trip(link_), "round_trips_per_step": 2}
    if tcp:
        curve = stage_link.HeadLink(
            p.Stage(index=0, first_layer=0, end_layer=k, link=tcp["link"],
                    server_key=tcp["server"][0]), 10,
            net=StageNet(KeyPair(*(x.encode() for x in tcp["client"]))))
        out["link"]["round_trip_tcp_curve_us"] = round_trip(curve)
        curve.close()
    print(json.dumps(out))
    return 0


def median_of(rounds: list[dict]) -> dict:
    keys = rounds[0]["decode_tok_s"]
    return {b: round(float(np.median([r["decode_tok_s"][b] for r in rounds])), 1) for b in keys}


def main(args) -> int:
    dies = [d for d in args.dies.split(",") if d]
    if len(dies) != 2 or any(d != "cpu" and not d.startswith("cpu:") for d in dies):
        print("error: --dies takes two CPU dies, e.g. cpu,cpu", file=sys.stderr)
        return 2
    if len(cores()) < 2:
        print("error: two CPU dies need two cores", file=sys.stderr)
        return 2
    batches = args.batches if args.batches != "1,4,8" else "1,8"
    from ..common.model_file import read_config
    n = read_config(args.model).n_layers
    split = args.split if getattr(args, "split", None) is not None else balanced_split(args.model)
    if not 1 <= split < n:
        print(f"error: --split takes 1..{n - 1} (the model has {n} layers)", file=sys.stderr)
        return 2
    one, two, single = [], [], []
    for _ in range(max(1, getattr(args, "rounds", 1))):
        one.append(run_round(args.model, batches, args.steps, args.quantize, 0))
        two.append(run_round(args.model, batches, args.steps, args.quantize, split))
        single.append(run_round(args.model, batches, args.steps, args.quantize, 0, True))
    a, b, c = median_of(one), median_of(two), median_of(single)
    load1, load5, load15 = os.getloadavg()
    print(json.dumps({"model": os.path.basename(str(args.model)), "split": split,
                      "one_die_decode_tok_s": a, "two_die_decode_tok_s": b,
                      "ratio": {k: round(b[k] / a[k], 3) for k in a},
                      # the overlap alone: each stage has one core, as this run has
                      "one_die_one_core_decode_tok_s": c,
                      "ratio_vs_one_core": {k: round(b[k] / c[k], 3) for k in c},
                      # over the timed steps, medians of the rounds: CPU seconds per wall
                      # second (1.0: busy all the time) of the head and of the tail, then
                      # their CPU milliseconds per step (a step: one lane's micro-batch)
                      "busy": {k: [round(float(np.median([r["busy"][k][i] for r in two])), 3)
                                   for i in range(4)] for k in two[0]["busy"]},
                      "link": two[-1]["link"], "rounds": len(one),
                      "load_average": [load1, load5, load15]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(role_main(sys.argv[1:]))
