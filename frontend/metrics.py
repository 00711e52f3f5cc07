"""`GET /metrics`: the cluster's figures in the Prometheus text format (prometheus-client).

Two kinds of figures:
- request figures, counted by the frontend as requests run (histograms and counters
  with vLLM's shapes and bucket edges, under `pantheon:`);
- live figures, read at scrape time from what the frontend already holds: the admission
  queues, the replicas' in-flight counts and every worker's last heartbeat (its slots,
  KV, memory and step-time histogram). Nothing is asked of a worker at scrape time, and
  a worker adds nothing per token to its step loop: its heartbeat carries its counters.

The three load signals routers and gateways read keep vLLM's names:
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ..common import protocol as p
from .registry import ReplicaState

log = logging.getLogger("pantheon.frontend.metrics")

# vLLM's bucket edges (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
FINISH_REASONS = ("stop", "length", "tool_calls", "abort")
WINDOW_S = 60.0                    # `pantheon admin top`'s figures: the last minute
HISTORY_S, BUCKET_S = 600.0, 10.0  # the dashboard's sparklines: 10 minutes in 10 s steps

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()          # no `_created` series beside every counter (as vLLM)


class Window:
    """Per model, the last minute: generated tokens per second, and TTFT samples; the
    last ten minutes in 10 s buckets (tokens, TTFTs) for the dashboard; running totals
    of generated, prompt and cached tokens."""

    def __init__(self):
        self.seconds: dict[str, deque] = defaultdict(deque)   # [second, tokens]
        self.ttfts: dict[str, deque] = defaultdict(deque)     # (time, seconds)
        self.buckets: dict[str, deque] = defaultdict(deque)   # [start, tokens, [ttfts]]
        self.totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def bucket(self, model: str, now: float) -> list:
        q, start = self.buckets[model], now - now % BUCKET_S
        if not q or q[-1][0] != start:
            q.append([start, 0, []])
            while q[0][0] <= start - HISTORY_S:
                q.popleft()
        return q[-1]

    def history(self, model: str, now: float) -> list[dict]:
        """Oldest first: per 10 s step, tokens per second and the median TTFT (None
        where no request started)."""
        start = now - now % BUCKET_S
        have = {b[0]: b for b in self.buckets.get(model, ())}
        out = []
        for i in range(int(HISTORY_S / BUCKET_S) - 1, -1, -1):
            t = start - i * BUCKET_S
            _, n, ttfts = have.get(t, (t, 0, []))
            span = now - t if t == start else BUCKET_S
            ttfts = sorted(ttfts)
            out.append({"ago_s": round(now - t), "tokens_per_s": round(n / max(span, 1.0), 2),
                        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4) if ttfts else None})
        return out

    def prompts(self, model: str, prompt: int, cached: int) -> None:
        totals = self.totals[model]
        totals[1] += prompt
        totals[2] += cached

    def tokens(self, model: str, n: int, now: float) -> None:
        self.totals[model][0] += n
        self.bucket(model, now)[1] += n
        q, second = self.seconds[model], int(now)
        if q and q[-1][0] == second:
            q[-1][1] += n
        else:
            q.append([second, n])
            while q and q[0][0] <= second - WINDOW_S:
                q.popleft()

    def ttft(self, model: str, seconds: float, now: float) -> None:
        self.bucket(model, now)[2].append(seconds)
        q = self.ttfts[model]
        q.append((now, seconds))
        while q and q[0][0] <= now - WINDOW_S:
            q.popleft()

    def summary(self, model: str, now: float) -> dict:
        tokens = sum(n for second, n in self.seconds.get(model, ()) if second > now - WINDOW_S)
        ttfts = sorted(s for t, s in self.ttfts.get(model, ()) if t > now - WINDOW_S)
        return {"tokens_per_s_1m": round(tokens / WINDOW_S, 2),
                "ttft_p50_s_1m": round(ttfts[len(ttfts) // 2], 4) if ttfts else None,
                "requests_1m": len(ttfts)}


class Metrics:
    """The frontend's request figures, and the registry `/metrics` renders."""

    def __init__(self):
        self.prom = CollectorRegistry(auto_describe=True)
        model = ["model_name"]

        def histogram(name, doc, buckets, labels=model):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.prom)

        def counter(name, doc, labels=model):
            return Counter(name, doc, labels, registry=self.prom)
        self.ttft = histogram("pantheon:time_to_first_token_seconds",
                              "Time from a request's arrival to its first token.", TTFT_BUCKETS)
        self.itl = histogram("pantheon:inter_token_latency_seconds",
                             "Time between successive tokens of a sequence.", ITL_BUCKETS)
        self.e2e = histogram("pantheon:e2e_request_latency_seconds",
                             "Time from a request's arrival to its last byte.", REQUEST_BUCKETS)
        self.queue = histogram("pantheon:request_queue_time_seconds",
                               "Time a request waited for its slots.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("pantheon:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = counter("pantheon:generation_tokens",
                                         "Tokens generated, counted as they arrive.")
        self.success = counter("pantheon:request_success", "Sequences that finished.",
                               model + ["finished_reason"])
        self.prefix_queries = counter("pantheon:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("pantheon:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (not computed).")
        self.rejected = counter("pantheon:requests_rejected",
                                "Requests refused before they ran, by status and reason.",
                                model + ["status", "reason"])
        self.failed = counter("pantheon:request_failure",
                              "Requests that failed after they were admitted, by reason.",
                              model + ["reason"])
        self.loads = counter("pantheon:model_loads", "Replica loads, by outcome and reason "
                             "(start, request, admin).", model + ["outcome", "reason"])
        self.unloads = counter("pantheon:model_unloads", "Replica unloads, by reason (idle, "
                               "evicted, admin).", model + ["reason"])
        self.load_seconds = histogram("pantheon:model_load_seconds",
                                      "Seconds a successful replica load took on its worker.",
                                      LOAD_BUCKETS)
        # speculative decoding, by vLLM's names: steps that verified a proposal, tokens
        # proposed, tokens accepted; and how many were accepted per such step
        self.spec_drafts = counter("vllm:spec_decode_num_drafts",
                                   "Speculative proposals verified (one a sequence a step).")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Tokens proposed by speculation and verified.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Proposed tokens the model accepted.")
        self.spec_per_step = histogram("pantheon:spec_decode_accepted_per_step",
                                       "Proposed tokens accepted in one verification step.",
                                       tuple(range(17)))
        self.window = Window()

    def watch(self, registry, pool, admission, lifecycle, drain=None) -> None:
        """Add the live figures, read at scrape time from these objects."""
        self.prom.register(LiveFigures(registry, pool, admission, lifecycle, drain))

    def for_model(self, name: str) -> "ModelMetrics":
        return ModelMetrics(self, name)

    def render(self) -> bytes:
        return generate_latest(self.prom)


class ModelMetrics:
    """One model's children of the request figures, looked up once per request."""

    __slots__ = ("name", "ttft", "itl", "e2e", "queue", "generated", "window", "root", "spec")

    def __init__(self, metrics: Metrics, name: str):
        self.root, self.name, self.window = metrics, name, metrics.window
        self.ttft, self.itl = metrics.ttft.labels(name), metrics.itl.labels(name)
        self.e2e, self.queue = metrics.e2e.labels(name), metrics.queue.labels(name)
        self.generated = metrics.generation_tokens.labels(name)
        self.spec = None                 # its speculation children, on its first proposal

    def tokens(self, n: int, now: float) -> None:
        """`n` tokens of a sequence arrived (one worker message)."""
        self.generated.inc(n)
        self.window.tokens(self.name, n, now)

    def speculated(self, proposed: int, accepted: int) -> None:
        """One step verified `proposed` tokens of a sequence, `accepted` of them passed."""
        if self.spec is None:
            root = self.root
            self.spec = (root.spec_drafts.labels(self.name),
                         root.spec_draft_tokens.labels(self.name),
                         root.spec_accepted.labels(self.name), root.spec_per_step.labels(self.name))
        drafts, tokens, passed, per_step = self.spec
        drafts.inc()
        tokens.inc(proposed)
        passed.inc(accepted)
        per_step.observe(accepted)

    def first_token(self, ttft: float, now: float) -> None:
        self.ttft.observe(ttft)
        self.window.ttft(self.name, ttft, now)

    def finished(self, prompt: int, cached: int, reasons: list[str]) -> None:
        root = self.root
        self.window.prompts(self.name, prompt, cached)
        root.prompt_tokens.labels(self.name).inc(prompt)
        root.prefix_queries.labels(self.name).inc(prompt)
        root.prefix_hits.labels(self.name).inc(cached)
        for reason in reasons:
            root.success.labels(self.name, reason).inc()

    def rejected(self, status: int, reason: str) -> None:
        self.root.rejected.labels(self.name, str(status), reason or "error").inc()

    def failed(self, reason: str) -> None:
        self.root.failed.labels(self.name, reason or "error").inc()


class LiveFigures:
    """A prometheus-client collector: gauges and per-die figures, read when scraped."""

    def __init__(self, registry, pool, admission, lifecycle, drain):
        self.registry, self.pool, self.admission = registry, pool, admission
        self.lifecycle, self.drain = lifecycle, drain
        self.warned: set[str] = set()

    def describe(self):
        return []            # families vary with the fleet: nothing checked at register

    def collect(self):
        yield from self.model_figures()
        yield from self.die_figures()
        draining = GaugeMetricFamily("pantheon:draining", "1 while the server drains.")
        draining.add_metric([], 1.0 if self.drain is not None and self.drain.draining else 0.0)
        yield draining

    def model_figures(self):
        label = ["model_name"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Sequences running on the model's replicas.", labels=label)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Requests waiting in the model's admission queue.",
                                    labels=label)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                               "Fraction of the model's KV positions held by running "
                               "sequences (0-1).", labels=label)
        loads = self.replica_loads()
        for model in list(self.registry.models.values()):
            running.add_metric([model.name], sum(r.inflight for r in model.replicas))
            waiting.add_metric([model.name], self.admission.queued(model))
            held = [loads[r.model_id] for r in model.replicas if r.model_id in loads]
            capacity = sum(x.kv_capacity for x in held)
            kv.add_metric([model.name], sum(x.kv_tokens for x in held) / capacity
                          if capacity else 0.0)
        yield from (running, waiting, kv)

    def replica_loads(self) -> dict[str, p.ReplicaLoad]:
        out = {}
        for worker in self.pool.live():
            if worker.heartbeat is not None:
                out.update((x.model_id, x) for x in worker.heartbeat.replicas)
        return out

    def die_figures(self):
        label = ["die"]
        up = GaugeMetricFamily("pantheon:worker_up", "1 while the die's worker is live.",
                               labels=label)
        restarts = CounterMetricFamily("pantheon:worker_restarts",
                                       "Times a new worker process joined for the die.",
                                       labels=label)
        used = GaugeMetricFamily("pantheon:die_memory_used_bytes",
                                 "Bytes of the die's budget its replicas hold.", labels=label)
        budget = GaugeMetricFamily("pantheon:die_memory_budget_bytes",
                                   "Bytes models may use on the die.", labels=label)
        rss = GaugeMetricFamily("pantheon:worker_resident_bytes",
                                "Resident bytes of the die's worker process (its real use "
                                "of host memory).", labels=label)
        busy = GaugeMetricFamily("pantheon:die_busy_slots",
                                 "Slots of the die running a sequence.", labels=label)
        slots = GaugeMetricFamily("pantheon:die_slots", "Slots of the die's replicas.",
                                  labels=label)
        steps = HistogramMetricFamily("pantheon:step_seconds",
                                      "Seconds of the die's scheduler steps (since its worker "
                                      "started).", labels=label)
        reserved: dict[str, int] = defaultdict(int)
        ready_slots: dict[str, int] = defaultdict(int)
        for _, replica in self.registry.replicas():
            if replica.die is not None:
                reserved[replica.die] += replica.reserved
                if replica.state == ReplicaState.READY:
                    ready_slots[replica.die] += replica.slots
            for stage in (replica.stages or [])[1:]:    # a split replica's second stage
                reserved[stage.die] += stage.reserved
        for w in self.pool.latest():
            beat = w.heartbeat
            up.add_metric([w.die], 1.0 if w.alive else 0.0)
            restarts.add_metric([w.die], max(0, self.pool.joins.get(w.die, 1) - 1))
            used.add_metric([w.die], reserved.get(w.die, 0))
            budget.add_metric([w.die], w.hello.budget or w.hello.mem_total)
            if beat is not None and beat.rss:
                rss.add_metric([w.die], beat.rss)
            live = beat.replicas if beat is not None and w.alive else []
            busy.add_metric([w.die], sum(x.busy for x in live))
            slots.add_metric([w.die], ready_slots.get(w.die, 0) if w.alive else 0)
            if beat is not None and beat.step_counts:
                buckets = self.step_buckets(w.die, beat.step_counts)
                if buckets is not None:
                    steps.add_metric([w.die], buckets, beat.step_sum)
        yield from (up, restarts, used, budget, rss, busy, slots, steps)

    def step_buckets(self, die: str, counts: list[int]):
        """Cumulative (edge, count) pairs, or None for a heartbeat whose histogram is
        malformed (logged once per die)."""
        if len(counts) != len(p.STEP_BUCKETS) + 1 or any(c < 0 for c in counts):
            if die not in self.warned:
                self.warned.add(die)
                log.warning("dropped the step-time histogram of die %s: %d buckets, expected "
                            "%d", die, len(counts), len(p.STEP_BUCKETS) + 1)
            return None
        out, total = [], 0
        for edge, count in zip((*map(str, p.STEP_BUCKETS), "+Inf"), counts):
            total += count
            out.append((edge, total))
        return out

