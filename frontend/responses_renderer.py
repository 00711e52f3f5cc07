"""The Responses API's answer: the emitter's events as output items (`reasoning`,
`message`, `function_call`) and, streamed, as the typed events (`response.created`, ...,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its sequence number. The whole response is built by the
very same steps with the events thrown away, so a streamed response equals a whole one.
"""
from __future__ import annotations

import json
import time
import uuid

from .errors import APIError
from .openai_api import Renderer
from .tools import parse_tool_calls, tool_call_text


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(gen, reasoning_tokens: int) -> dict:
    prompt, out = len(gen.prompt), gen.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + out}


class ResponsesRenderer(Renderer):
    """The emitter's events as output items; streamed, as typed events (each body a list
    of event dicts). One item is open at a time (reasoning or message); a tool call is a
    whole function_call item at once. `finished(response, assistant turn)` is called with
    the final response."""

    def __init__(self, rid: str, model, req, echo: dict, finished=None):
        super().__init__(rid, int(time.time()), model.name, model.tokenizer, req, 1)
        self.echo, self.finished = echo, finished
        self.output: list[dict] = []       # items so far; the open one is the last
        self.open: str | None = None       # "reasoning" | "message", streaming
        self.seq = 0

    def response(self, status: str, gen=None) -> dict:
        reasoning = "".join(c["text"] for item in self.output if item["type"] == "reasoning"
                            for c in item["content"])
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": list(self.output),
                "error": None, "incomplete_details":
                    {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage(gen, len(self.tok.encode(reasoning, add_bos=False))
                               if reasoning else 0) if gen is not None else None,
                **self.echo}

    # -- framing -------------------------------------------------------------

    def frame(self, events: list[dict]) -> bytes:
        out = []
        for event in events:
            event["sequence_number"] = self.seq
            self.seq += 1
            data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            out.append(f"event: {event['type']}\ndata: {data}\n\n")
        return "".join(out).encode("utf-8")

    def failure(self, err: APIError) -> bytes:
        return self.frame([{"type": "error", "code": err.code or err.type,
                            "message": err.message, "param": err.param}])

    def end(self) -> bytes:
        return b""                      # response.completed (or .incomplete) was the last

    # -- the steps, shared by streamed and whole ------------------------------

    def opening(self, gens) -> list:
        skeleton = self.response("in_progress")
        return [[{"type": "response.created", "response": skeleton},
                 {"type": "response.in_progress", "response": skeleton}]]

    def close_item(self) -> list[dict]:
        if self.open is None:
            return []
        item, index, kind = self.output[-1], len(self.output) - 1, self.open
        self.open = None
        if kind == "reasoning":
            text = item["content"][0]["text"]
            return [{"type": "response.reasoning_text.done", "item_id": item["id"],
                     "output_index": index, "content_index": 0, "text": text},
                    {"type": "response.output_item.done", "output_index": index, "item": item}]
        item["status"] = "completed"
        part = item["content"][0]
        return [{"type": "response.output_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def open_item(self, kind: str) -> list[dict]:
        out = self.close_item()
        self.open, index = kind, len(self.output)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(item)
            return out + [{"type": "response.output_item.added", "output_index": index,
                           "item": item | {"content": []}}]
        item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                  "annotations": []}]}
        self.output.append(item)
        return out + [{"type": "response.output_item.added", "output_index": index,
                       "item": item | {"content": []}},
                      {"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}]

    def text(self, kind: str, text: str) -> list[dict]:
        out = self.open_item(kind) if self.open != kind else []
        item, index = self.output[-1], len(self.output) - 1
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        delta = {"type": name, "item_id": item["id"], "output_index": index,
                 "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return out + [delta]

    def calls(self, text: str) -> list[dict] | None:
        parsed = parse_tool_calls([text], self.req.tools)
        if not parsed:
            return None
        out = self.close_item()
        for call in parsed:
            index, fn = len(self.output), call["function"]
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                    "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}
            self.output.append(item)
            out += [{"type": "response.output_item.added", "output_index": index,
                     "item": item | {"arguments": "", "status": "in_progress"}},
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                     "output_index": index, "delta": fn["arguments"]},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"],
                     "output_index": index, "name": fn["name"], "arguments": fn["arguments"]},
                    {"type": "response.output_item.done", "output_index": index, "item": item}]
        return out

    def event(self, i: int, gen, event) -> list[dict]:
        if event.kind == "reasoning":
            return self.text("reasoning", event.text)
        if event.kind == "tool":
            found = self.calls(event.text)
            if found is not None:
                return found
            return self.text("message", tool_call_text(event.text))   # malformed: as text
        return self.text("message", event.text)

    def closing(self, i: int, gen) -> list[dict]:
        out = self.close_item()
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        response = self.response(status, gen)
        if self.finished is not None:
            self.finished(response, self.turn())
        return out + [{"type": f"response.{status}", "response": response}]

    def whole(self, gens, results) -> dict:
        for event in results[0]:
            self.event(0, gens[0], event)
        return self.closing(0, gens[0])[-1]["response"]

    def turn(self) -> dict:
        """This response's output as the assistant turn a follow-up continues from."""
        text = "".join(item["content"][0]["text"] for item in self.output
                       if item["type"] == "message")
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        turn = {"role": "assistant", "content": text or (None if calls else "")}
        return turn | ({"tool_calls": calls} if calls else {})
