"""`POST /tokenize` and `POST /detokenize` (vLLM's), and prompt counting for the other
edges (`/v1/messages/count_tokens`, `/v1/responses/input_tokens`).

A chat conversation is rendered exactly as `/v1/chat/completions` renders it (its
validation, tools and template), so `count` equals that request's `prompt_tokens`; a raw
`prompt` is tokenized as `/v1/completions` tokenizes one.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..common import limits as wire
from ..common.chat_template import TemplateError
from .body import parse_json, read_body
from .errors import APIError
from .openai_api import chat_request, render_options
from .tools import prepare_conversation


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def render(model, req, generation_prompt: bool = True) -> str:
    """A validated ChatRequest's prompt text, as chat renders it (a preparer thread)."""
    messages, tools = prepare_conversation(req.messages, req.tools, req.tool_choice,
                                           model.tokenizer.chat_template)
    try:
        if generation_prompt or req.prefill is not None:
            return model.render_text(messages, tools, **render_options(req))
        return model.template.render(messages, tools=tools, add_generation_prompt=False,
                                     **{k: v for k, v in req.template_args.items()
                                        if model.template.reads(k)})
    except TemplateError as exc:
        raise APIError(400, f"the chat template refused the conversation: {exc}",
                       param="messages") from exc


def count_prompt(model, req) -> int:
    """The prompt's tokens, template and tools included (a preparer thread)."""
    return len(model.tokenizer.encode(render(model, req)))


def _flag(data: dict, name: str, default):
    value = data.get(name, default)
    if value is not None and not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean")
    return value


def tokenize(model, data: dict, limits) -> dict:
    """A /tokenize body → {count, max_model_len, tokens[, token_strs]} (a preparer thread)."""
    strs = _flag(data, "return_token_strs", False)
    if "messages" in data:
        if "prompt" in data:
            raise _bad("prompt", "send either prompt or messages, not both")
        req = chat_request({k: data.get(k) for k in ("messages", "tools", "tool_choice")},
                           None, limits)
        text = render(model, req, _flag(data, "add_generation_prompt", True))
        ids = model.tokenizer.encode(text, add_bos=_flag(data, "add_special_tokens", None))
    elif isinstance(data.get("prompt"), str):
        ids = model.tokenizer.encode(data["prompt"],
                                     add_bos=_flag(data, "add_special_tokens", None))
    else:
        raise _bad("prompt", "prompt (a string) or messages (a chat conversation) is required")
    out = {"count": len(ids), "max_model_len": model.context(), "tokens": ids}
    if strs:
        out["token_strs"] = [model.tokenizer.token_str(t) for t in ids]
    return out


def detokenize(model, data: dict) -> dict:
    ids = data.get("tokens")
    vocab = model.config.vocab_size
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise _bad("tokens", f"tokens must be a list of token ids in [0, {vocab})")
    if len(ids) > wire.MAX_PROMPT_TOKENS:
        raise _bad("tokens", f"tokens may have at most {wire.MAX_PROMPT_TOKENS} entries")
    return {"prompt": model.tokenizer.decode(ids)}


class TokenizeService:
    def __init__(self, chat):
        self.chat = chat

    async def run(self, request: Request, fn, *args) -> JSONResponse:
        chat = self.chat
        body = await read_body(request, chat.max_body_bytes)
        deadline = chat.preparer.deadline()
        data = await chat.preparer.run(deadline, parse_json, body, size=len(body))
        if data.get("model") is not None and not isinstance(data["model"], str):
            raise _bad("model", "model must be a string")
        model = await chat.registry.want(data.get("model"))   # a catalog model loads
        return JSONResponse(await chat.preparer.run(deadline, fn, model, data, *args,
                                                    size=len(body)))

    async def tokenize(self, request: Request) -> JSONResponse:
        return await self.run(request, tokenize, self.chat.limits)

    async def detokenize(self, request: Request) -> JSONResponse:
        return await self.run(request, detokenize)
