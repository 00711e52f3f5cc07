"""One sequence running on one replica: token ids from a worker → text events.

Token ids → incremental detokenizer → emitter (reasoning, content, tool-call
blocks, stop strings) → events. Both OpenAI endpoints build their answers from
these events (openai_api's renderers); `n` > 1 is several Generations side by
side on one replica (lifecycle.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..common import limits as wire
from ..common import protocol as p
from .admission import Admission
from .emitter import Emitter, Event
from .errors import APIError
from .registry import Replica, ServedModel
from .workers import WorkerLost, WorkerPool


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list          # [[token id, logprob], ...]


class Generation:
    def __init__(self, pool: WorkerPool, admission: Admission, model: ServedModel,
                 replica: Replica, prompt: list[int], sampling: p.Sampling, max_tokens: int,
                 emitter: Emitter, session_id: str | None = None, grammar: str | None = None,
                 logprobs: int = -1, figures=None, arrived: float | None = None,
                 trace: str = "", salt: str = "", pooling: str = "",
                 prediction: list[int] | None = None):
        self.pool, self.admission, self.model, self.replica = pool, admission, model, replica
        self.prompt, self.max_tokens, self.emitter = prompt, max_tokens, emitter
        self.request_id = pool.new_request_id()
        self.msg = p.Generate(self.request_id, replica.model_id if replica else "", prompt,
                              sampling, max_tokens, sorted(model.tokenizer.eot_ids),
                              session_id, grammar, logprobs, trace[:wire.MAX_ID_CHARS], salt,
                              pooling, prediction or [])
        self.detok = model.tokenizer.detokenizer()
        self.cached_tokens = 0
        self.embedding: list[float] = []     # an embedding request's pooled state
        self.proposed = self.accepted = 0      # speculation's tokens: verified, accepted
        self.token_ids: list[int] = []     # every id the worker generated, end token included
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.stream = None
        self.failure: Exception | None = None    # set by fail()
        # metrics.ModelMetrics; `arrived` (the request's) when this sequence reports TTFT
        self.figures, self.arrived = figures, arrived
        self.first_at: float | None = None
        self.last_at = 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    # the HTTP field each wire field comes from, for a refusal's `param`
    PARAMS = {"grammar": "response_format", "session_id": "session_id",
              "logit_bias": "logit_bias"}

    def refusal(self) -> APIError | None:
        """The 400 for a Generate the worker's decoder would refuse (the wire's limits,
        token ids in the vocabulary): nothing the edge accepts is refused downstream."""
        found = p.oversized(self.msg)
        if found is not None:
            return APIError(400, found[1], param=self.PARAMS.get(found[0]),
                            code="limit_exceeded")
        try:
            self.msg.sampling.check(self.model.config.vocab_size)
        except ValueError as exc:
            return APIError(400, str(exc), param="logit_bias" if "logit_bias" in str(exc)
                            else None)
        return None

    def bind(self, replica: Replica) -> None:
        """A choice built without a slot (lifecycle runs a request's choices a few at a
        time) got one on `replica`; close() gives it back."""
        self.replica, self.msg.model_id = replica, replica.model_id

    async def start(self) -> None:
        if (refused := self.refusal()) is not None:
            self.close()
            raise refused
        try:
            self.stream = await self.pool.generate(self.replica.worker, self.msg)
        except p.ProtocolError as exc:             # past a limit msgpack or the link has
            self.close()
            raise APIError(400, str(exc), code="limit_exceeded") from None
        except WorkerLost as exc:
            self.close()
            raise worker_lost(exc) from exc
        if self.failure is not None:              # failed while the request was sent
            self.stream.queue.put_nowait(self.failure)

    async def events(self):
        """Events to send, as they settle; sets finish_reason at the end."""
        eot = self.model.tokenizer.eot_ids
        while self.finish_reason is None:
            try:
                msg = await self.stream.next()
            except WorkerLost as exc:
                raise worker_lost(exc) from exc
            if isinstance(msg, p.Error):
                status = 400 if msg.code == "bad_request" else 500
                raise APIError(status, msg.message, type="server_error" if status == 500
                               else "invalid_request_error", code=msg.code)
            self.cached_tokens = msg.cached_tokens
            if msg.embedding:
                self.embedding = msg.embedding
            if msg.proposed:
                self.proposed += msg.proposed
                self.accepted += msg.accepted
                if self.figures is not None:
                    self.figures.speculated(msg.proposed, msg.accepted)
            if msg.tokens and self.figures is not None:
                self.timed(len(msg.tokens))
            for i, token in enumerate(msg.tokens):
                self.token_ids.append(token)
                if i < len(msg.logprobs):
                    lp, top = msg.logprobs[i]
                    self.logprobs.append(TokenLogprob(token, lp, top))
                if token in eot:
                    continue
                for event in self.emitter.push(self.detok.push(token)):
                    yield event
                if self.emitter.stopped:      # free the worker's slot at once
                    self.finish_reason = "stop"
                    self.pool.abort_soon(self.request_id)
                    return
            if msg.finish == "abort":
                raise APIError(503, "the model was unloaded while this request ran",
                               type="service_unavailable", code="model_unloaded")
            if msg.finish:
                for event in self.emitter.push(self.detok.flush()) + self.emitter.finish():
                    yield event
                self.finish_reason = "stop" if self.emitter.stopped else msg.finish

    def timed(self, n: int) -> None:
        """`n` tokens arrived now: TTFT (the first time) or an inter-token gap."""
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            if self.arrived is not None:
                self.figures.first_token(now - self.arrived, now)
        else:
            self.figures.itl.observe((now - self.last_at) / n)
        self.last_at = now
        self.figures.tokens(n, now)

    def fail(self, error: Exception) -> None:
        """End this generation with `error` (raised from events()) wherever it is."""
        self.failure = error
        if self.stream is not None and self.finish_reason is None:
            self.stream.queue.put_nowait(error)

    def close(self) -> None:
        """Idempotent: abort the worker's side if unfinished, release the replica's slot."""
        if self.replica is None:
            return
        self.admission.release(self.model, self.replica)
        self.replica = None
        if self.finish_reason is None:
            self.pool.abort_soon(self.request_id)
        else:
            self.pool.release(self.request_id)


def worker_lost(exc: Exception) -> APIError:
    return APIError(503, str(exc), type="service_unavailable", code="worker_lost")


__all__ = ["Event", "Generation", "TokenLogprob", "worker_lost"]
