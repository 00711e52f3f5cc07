"""One replica across two dies: placing its two stages, loading and unloading them.

A replica whose model does not fit one die is split into two contiguous layer ranges
(worker/stage_link.py runs them): stage 0, layers [0, k) with the embedding, the head
matrix and the scheduler, on the first die (the replica's `die`: requests are routed
there); stage 1, layers [k, L) and the output norm, on the second. `dies: [a, b]` asks
for it; `split: [k]` chooses k, else k is the one that fills both dies' free budgets
most evenly. Each stage counts its weights (the tensors outside the layers are stage
0's, but the output norm, which both hold) plus its layers' share of KV and recurrent
state. Auto-placement splits only when no single die fits.

The stage link (worker/stage_socket.py) is chosen here, per load: ipc (a folder of stage
1's own, mode 0700) when both workers run on one host (their hellos' host identities
match), tcp otherwise (stage 1's worker binds its `--stage-bind` address and its Loaded
names it); `"link": "tcp"` asks for tcp on one host too. A tcp link is CURVE when the
fleet has keys (`serve --keys`): stage 1 serves with its worker's key, stage 0 dials with
its own, and stage 1 lets in that one key; without keys a tcp link needs `serve
--insecure`, as a keyless external worker does. Stage 1 is loaded first (it binds the
link), then stage 0 (it connects and warms through it); a stage that fails (a port in
use, keys missing, a refused handshake) leaves nothing loaded on either die. If either
die's worker is lost, the replica leaves routing (the head's step fails at once: its link
closes) and both stages are loaded again once both dies are back. Unload frees both.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

from ..common import protocol as p
from ..common.host_identity import same_host
from ..common.model_file import ModelConfig
from ..common.kv_cache import KVCacheTypes
from ..common.weight_format import held_as, kv_itemsize, tensor_list
from .dies import ADMIT_CTX_GUESS, DieTable, PlacementError
from .registry import ReplicaState
from .workers import LoadError, WorkerLost

log = logging.getLogger("pantheon.frontend.split")

LAYER = re.compile(r"(?:^|\.)(?:blk|layers|h)\.(\d+)\.")
LINK_REFUSED = "link_refused"     # a LoadError's code: this fleet cannot make that link


@dataclass
class StagePlan:
    die: str
    first_layer: int
    end_layer: int
    reserved: int            # bytes admitted on its die
    link: str = ""           # the stage link's address, as stage 1 bound it (while loaded)
    curve: bool = False      # the link is CURVE

    def as_json(self) -> dict:
        return {"die": self.die, "layers": [self.first_layer, self.end_layer],
                "reserved_bytes": self.reserved,
                **({"link": self.link, "curve": self.curve} if self.link else {})}


def tail_id(model_id: str) -> str:
    """Stage 1's replica id on its worker."""
    return f"{model_id}.stage1"


def layer_weights(path: str, quantize: str, itemsize: int,
                  n_layers: int) -> tuple[int, int, list]:
    """(bytes outside the layers, of them the output norm's, bytes per layer) as a die
    would hold them."""
    outside, norm, per = 0, 0, [0] * n_layers
    for name, kind, shape in tensor_list(path):
        held = held_as(kind, shape, quantize, itemsize)
        m = LAYER.search(name)
        if m and int(m.group(1)) < n_layers:
            per[int(m.group(1))] += held
        else:
            outside += held
            norm += held if name.startswith("output_norm.") else 0
    return outside, norm, per


def stage_bytes(path: str, cfg: ModelConfig, kind: str, slots: int, ctx: int, quantize: str,
                lo: int, hi: int, kv_types: KVCacheTypes = KVCacheTypes()) -> int:
    """One stage's weights (its layers; the embedding and head on stage 0, the output
    norm on both) and state."""
    itemsize = 4 if kind == "cpu" else 2
    outside, norm, per = layer_weights(str(path), quantize, itemsize, cfg.n_layers)
    shared = outside if lo == 0 else norm
    kv = kv_itemsize(path, kind, quantize, kv_types)
    guess = ctx or min(cfg.context_length, ADMIT_CTX_GUESS)
    state = sum(slots * (guess * b.mixer.bytes_per_token(kv) + b.mixer.bytes_per_slot())
                for b in cfg.blocks[lo:hi])
    return shared + sum(per[lo:hi]) + state


def plan(table: DieTable, path: str, cfg: ModelConfig, dies: list[str] | None,
         split: list | None, slots: int, ctx: int, quantize: str,
         kv: KVCacheTypes = KVCacheTypes()) -> list[StagePlan]:
    """The two stages of a split replica; PlacementError 400 for a bad request, 507 when
    it does not fit. `dies` None: the two live dies with the most free budget."""
    if split is not None and (dies is None or len(dies) != 2):
        raise PlacementError(400, "split needs two dies: give \"dies\": [a, b]")
    live = {d.die: d for d in table.snapshot() if d.alive}
    known = {d.die for d in table.snapshot()}
    if dies is not None:
        if len(dies) > 2:
            raise PlacementError(400, f"a replica spans at most two dies, got {len(dies)}")
        if len(set(dies)) != len(dies):
            raise PlacementError(400, f"die {dies[0]!r} is named twice")
        for d in dies:
            if d not in known:
                raise PlacementError(400, f"unknown die {d!r}; known: "
                                     f"{', '.join(sorted(known)) or 'none'}")
            if d not in live:
                raise PlacementError(507, f"die {d!r} has no live worker")
        pair = [live[d] for d in dies]
    else:
        if len(live) < 2:
            raise PlacementError(507, "no second die to split across")
        pair = sorted(live.values(), key=lambda d: -d.free_budget)[:2]
    n = cfg.n_layers
    if n < 2:
        raise PlacementError(400, "a model of one layer cannot be split")
    if split is not None:
        if (len(split) != 1 or not isinstance(split[0], int) or isinstance(split[0], bool)
                or not 1 <= split[0] <= n - 1):
            raise PlacementError(400, f"split must be [k], the first layer of the second "
                                 f"stage, with 1 <= k <= {n - 1} (the model has {n} layers): "
                                 f"each stage needs a layer")
        ks = [split[0]]
    else:
        ks = list(range(1, n))

    def need(k):
        return (stage_bytes(path, cfg, pair[0].kind, slots, ctx, quantize, 0, k, kv),
                stage_bytes(path, cfg, pair[1].kind, slots, ctx, quantize, k, n, kv))

    options = []
    for k in ks:
        a, b = need(k)
        if a <= pair[0].free_budget and b <= pair[1].free_budget:
            options.append((max(a / max(pair[0].free_budget, 1),
                                b / max(pair[1].free_budget, 1)), k, a, b))
    if not options:
        k = ks[len(ks) // 2]
        a, b = need(k)
        raise PlacementError(507, f"the replica does not fit across dies {pair[0].die} and "
                             f"{pair[1].die}: split at layer {k} its stages need "
                             f"{a / 2**20:.0f} MiB and {b / 2**20:.0f} MiB; free: "
                             f"{pair[0].free_budget / 2**20:.0f} MiB and "
                             f"{pair[1].free_budget / 2**20:.0f} MiB")
    _, k, a, b = min(options)
    return [StagePlan(pair[0].die, 0, k, a), StagePlan(pair[1].die, k, n, b)]


def apply(replica, stages: list[StagePlan]) -> None:
    replica.die, replica.reserved = stages[0].die, stages[0].reserved
    replica.stages = stages


async def load(placer, model, replica, worker) -> None:
    """Load both stages (the tail first: it binds the link), as Placer.load does one."""
    stages: list[StagePlan] = replica.stages
    live = {w.die: w for w in placer.pool.live()}
    tail_worker = live.get(stages[1].die)
    if tail_worker is None:                  # its second die is not back yet
        replica.state, replica.worker = ReplicaState.PLACED, None
        placer.change.set()
        return
    try:
        what, server_key, client_key = link_plan(placer.pool, worker, tail_worker,
                                                 replica.want_link)
    except LoadError as exc:
        replica.state, replica.error, replica.error_code = ReplicaState.FAILED, str(exc), exc.code
        log.error("loading %s across dies %s and %s refused: %s", model.name, worker.die,
                  tail_worker.die, exc)
        placer.count(model.name, "failed", reason=replica.reason)
        placer.change.set()
        return
    keys = dict(server_key=server_key, client_key=client_key)
    base = dict(path=replica.path or model.path, name=model.name,
                slots=replica.want_slots or placer.slots, ctx=replica.want_ctx or placer.ctx,
                prefill_chunk=placer.prefill_chunk,
                quantize=replica.want_quantize or placer.quantize,
                activations=replica.want_activations or placer.activations,
                kv_cache_k=replica.want_kv.over(placer.kv_cache).k,
                kv_cache_v=replica.want_kv.over(placer.kv_cache).v)
    tail_msg = p.Load(model_id=tail_id(replica.model_id), **base,
                      stage=p.Stage(index=1, first_layer=stages[1].first_layer,
                                    end_layer=stages[1].end_layer, link=what, **keys))
    loaded = None
    try:
        async with placer.upload_lock:
            if not worker.alive or not tail_worker.alive:
                raise WorkerLost("worker gone before its turn to load")
            log.info("loading %s (%s) across dies %s (layers 0-%d) and %s (layers %d-%d)",
                     model.name, replica.model_id, worker.die, stages[0].end_layer - 1,
                     tail_worker.die, stages[1].first_layer, stages[1].end_layer - 1)
            await quiet_unload(placer.pool, worker, replica.model_id)   # stale stages, if any
            await quiet_unload(placer.pool, tail_worker, tail_id(replica.model_id))
            tail = await placer.pool.load(tail_worker, tail_msg)
            try:
                if not tail.link:
                    raise LoadError("the second stage's worker named no stage link address "
                                    "(an older worker?)", p.STAGE_LINK)
                head_msg = p.Load(
                    model_id=replica.model_id, **base,
                    spec=replica.want_spec if replica.want_spec is not None else placer.spec,
                    stage=p.Stage(index=0, first_layer=0, end_layer=stages[0].end_layer,
                                  link=tail.link, **keys))
                loaded = await placer.pool.load(worker, head_msg)
            except BaseException:
                await quiet_unload(placer.pool, tail_worker, tail_id(replica.model_id))
                raise
    except LoadError as exc:
        replica.state, replica.error, replica.error_code = ReplicaState.FAILED, str(exc), exc.code
        log.error("loading %s across dies %s and %s failed: %s", model.name, worker.die,
                  tail_worker.die, exc)
        placer.count(model.name, "failed", reason=replica.reason)
        return
    except (WorkerLost, asyncio.TimeoutError) as exc:
        replica.state, replica.error = ReplicaState.PLACED, str(exc)
        log.warning("loading %s across dies interrupted: %s", model.name, exc)
        placer.count(model.name, "interrupted", reason=replica.reason)
        return
    finally:
        replica.progress = placer.pool.progress.pop(replica.model_id, replica.progress)
        placer.pool.progress.pop(tail_id(replica.model_id), None)
        placer.change.set()
    stages[1].link, stages[1].curve = tail.link, bool(server_key)
    replica.state, replica.worker = ReplicaState.READY, worker
    replica.loads += 1
    stages[0].reserved = loaded.weight_bytes + loaded.kv_bytes
    stages[1].reserved = tail.weight_bytes + tail.kv_bytes
    replica.reserved, replica.weight_bytes = stages[0].reserved, loaded.weight_bytes
    replica.slots, replica.ctx, replica.error = loaded.slots, loaded.ctx, ""
    replica.spec = loaded.spec
    placer.pool.changed()
    placer.change.set()
    log.info("%s ready across dies %s and %s (stage link %s%s): %d slots x %d ctx, loaded "
             "in %.1f s + %.1f s", model.name, worker.die, tail_worker.die, tail.link,
             ", CURVE" if server_key else "", loaded.slots, loaded.ctx, tail.load_s,
             loaded.load_s)
    placer.count(model.name, "loaded", loaded.load_s + tail.load_s, replica.reason)


def link_plan(pool, head, tail, want: str = "") -> tuple[str, str, str]:
    """(what stage 1 binds: "ipc" or "tcp", the server key, the client key) for a split
    across the workers `head` and `tail`; LoadError(LINK_REFUSED) when this fleet cannot
    make the link asked for."""
    one_host = same_host(head.hello.host, tail.hello.host)
    what = want or ("ipc" if one_host else "tcp")
    if what == "ipc":
        if not one_host:
            raise LoadError(f"an ipc stage link needs both dies on one host; dies {head.die} "
                            f"and {tail.die} run on different hosts (use tcp)", LINK_REFUSED)
        return "ipc", "", ""
    if getattr(pool, "keyed", False):                # the fleet has keys: CURVE
        missing = [w.die for w in (head, tail) if not w.hello.public_key]
        if missing:
            raise LoadError(f"keys missing: a tcp stage link in a fleet with --keys is CURVE, "
                            f"and the worker of die {', '.join(missing)} announced no public "
                            f"key (start it with --keys DIR)", LINK_REFUSED)
        return "tcp", tail.hello.public_key, head.hello.public_key
    if not getattr(pool, "external", False):
        raise LoadError(f"keys missing: a tcp stage link between dies {head.die} and "
                        f"{tail.die} would carry activations unauthenticated and in clear; "
                        "start the fleet with --keys DIR (CURVE), or serve --insecure",
                        LINK_REFUSED)
    log.warning("--insecure: the stage link between dies %s and %s is tcp without keys",
                head.die, tail.die)
    return "tcp", "", ""


async def quiet_unload(pool, worker, model_id: str) -> None:
    if worker is None or not worker.alive:
        return
    try:
        await pool.unload(worker, model_id)
    except (WorkerLost, asyncio.TimeoutError) as exc:
        log.warning("unloading %s from die %s: %s", model_id, worker.die, exc)


async def unload_tail(pool, replica) -> None:
    """Unload's second half: stage 1 on its die."""
    if getattr(replica, "stages", None):
        live = {w.die: w for w in pool.live()}
        await quiet_unload(pool, live.get(replica.stages[1].die), tail_id(replica.model_id))
        replica.stages[1].link = ""


class SplitWatch:
    """Keeps split replicas whole: a lost second die takes the replica out of routing
    (its head is unloaded); a die that joins brings back the replicas it completes."""

    def __init__(self, placer):
        self.placer = placer
        placer.pool.on_lost.append(self.lost)
        placer.pool.on_join.append(self.joined)

    def split_replicas(self):
        return [(m, r) for m, r in self.placer.registry.replicas() if getattr(r, "stages", None)]

    def lost(self, worker) -> None:
        for model, replica in self.split_replicas():
            if replica.stages[1].die != worker.die or replica.state == ReplicaState.UNLOADING:
                continue
            head, replica.stages[1].link = replica.worker, ""    # its link went with it
            if replica.state in (ReplicaState.READY, ReplicaState.LOADING):
                log.warning("%s lost its second stage (die %s): out of routing until it "
                            "is back", replica.model_id, worker.die)
                replica.state, replica.worker = ReplicaState.PLACED, None
                self.placer.pool.changed()
                self.placer.change.set()
            if head is not None and head.alive:
                self.placer.spawn(quiet_unload(self.placer.pool, head, replica.model_id))

    def joined(self, worker) -> None:
        live = {w.die: w for w in self.placer.pool.live()}
        for model, replica in self.split_replicas():
            if (replica.stages[1].die == worker.die and replica.die in live
                    and replica.state in (ReplicaState.PLACED, ReplicaState.FAILED)):
                self.placer.start_load(model, replica, live[replica.die])


def place(placer, model, replica, dies: list[str] | None, why: str = "") -> None:
    """Plan and record a split placement for a startup replica (PlacementError if not)."""
    stages = plan(placer.dies, model.path, model.config, dies, None,
                  replica.want_slots or placer.slots, replica.want_ctx or placer.ctx,
                  replica.want_quantize or placer.quantize,
                  replica.want_kv.over(placer.kv_cache))
    apply(replica, stages)
    replica.placement = why or f"split across dies {stages[0].die} and {stages[1].die}"


def fallback(placer, model, replica, exc: Exception) -> bool:
    """No single die fits a startup replica: split it across two if two fit."""
    if (not isinstance(exc, PlacementError) or exc.status != 507 or replica.want_dies
            or placer.draft_of(model, replica) is not None):
        return False
    try:
        place(placer, model, replica, None)
    except PlacementError:
        return False
    replica.placement = (f"no single die has room ({exc}); split across dies "
                         f"{replica.stages[0].die} and {replica.stages[1].die}")
    log.info("%s: %s", model.name, replica.placement)
    return True
