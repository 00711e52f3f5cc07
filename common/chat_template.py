"""Chat messages -> prompt text, through the model's own Jinja chat template.

Models ship their prompt format as a Hugging Face style Jinja template; rendering it the
way `transformers.apply_chat_template` does (same environment options and helpers) is what
makes a prompt look like the model's training data. Templates come from model files we do
not control, so they run in Jinja's immutable sandbox.

Special tokens come only from the template: the text of a control token (`<|im_start|>`)
inside a message, a tool or a template argument is swapped for a placeholder before
rendering and restored after, and the `Prompt` that comes back tells the tokenizer which
spans those were, so that it encodes them as plain text. A user cannot forge a turn.
"""
from __future__ import annotations

import json
import re
from datetime import datetime

import jinja2
import jinja2.meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


# where a control token's text stood in the caller's data (U+E000, its number, U+E001)
PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


class Prompt(str):
    """Rendered prompt text that knows where the caller's data spelt a control token.

    `shielded` is the text with each such spot a placeholder and `literals[i]` what the
    i-th placeholder stands for; with no literals the text holds no forged token at all."""

    shielded: str
    literals: tuple[str, ...]

    @classmethod
    def restore(cls, shielded: str, literals: list[str]) -> "Prompt":
        def back(m: re.Match) -> str:
            i = int(m[1])
            return literals[i] if i < len(literals) else m[0]
        prompt = cls(PLACEHOLDER.sub(back, shielded) if literals else shielded)
        prompt.shielded, prompt.literals = shielded, tuple(literals)
        return prompt


class Shield:
    """Swaps the text of control tokens in untrusted data for numbered placeholders. The
    placeholder's own first character is shielded too, so no data can spell one."""

    def __init__(self, specials):
        texts = sorted({t for t in specials if t} | {"\ue000"}, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts)))

    def __call__(self, value, literals: list[str]):
        if isinstance(value, str):
            return self.pattern.sub(lambda m: self.hold(m[0], literals), value)
        if isinstance(value, dict):
            return {self(k, literals): self(v, literals) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v, literals) for v in value]
        return value

    @staticmethod
    def hold(text: str, literals: list[str]) -> str:
        literals.append(text)
        return f"\ue000{len(literals) - 1}\ue001"


class TemplateError(ValueError):
    """A chat template failed to compile or render (including its own `raise_exception`)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's `tojson`: plain `json.dumps`, unlike Jinja's HTML-escaping builtin."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}` renders its body. Hugging Face uses it to mark
    assistant tokens for training masks; templates that carry it must still compile here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _flatten(message: dict) -> dict:
    """OpenAI content parts -> one string, so templates that concatenate strings work."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TemplateError(f"content part of type {kind!r} is not supported; only text")
        texts.append(part.get("text", ""))
    return {**message, "content": "\n".join(texts)}


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    """ChatML for models without a template; tool turns follow the Hermes/Qwen convention."""
    out = []
    for m in messages:
        role, content = m.get("role", "user"), m.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call)
            args = fn.get("arguments")
            if isinstance(args, str):  # OpenAI sends a JSON string; Hermes shows the object
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            payload = _tojson({"name": fn.get("name"), "arguments": args})
            content += f"\n<tool_call>\n{payload}\n</tool_call>"
        out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class ChatTemplate:
    """Renders chat messages with one model's template (or ChatML when it has none)."""

    def __init__(self, source: str | None, bos_text: str = "", eos_text: str = "",
                 specials=()):
        """`specials`: the tokenizer's control-token texts (Tokenizer.control_texts), which
        messages may hold only as text; without them the data is rendered as given."""
        self.source = source
        self._shield = Shield(specials) if specials else None
        self._bos, self._eos = bos_text, eos_text
        self._template = None
        self.variables: frozenset[str] = frozenset()   # the names the template reads
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, _GenerationBlock])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self._template = env.from_string(source)
                self.variables = frozenset(jinja2.meta.find_undeclared_variables(
                    env.parse(source)))
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateError(f"chat template syntax error (line {exc.lineno}): "
                                    f"{exc.message}") from exc

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` (e.g. Qwen3's enable_thinking)."""
        return name in self.variables

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True, prefill: str | None = None,
               **extra) -> Prompt:
        """The prompt text; `extra` reaches the template as variables (e.g. enable_thinking).
        `prefill`: the start of the reply (an assistant prefill), after the generation
        prompt and left open (no end of turn), so the model continues it."""
        messages = [_flatten(m) for m in messages]
        literals: list[str] = []
        if self._shield is not None:
            messages, tools, extra, prefill = self._shield((messages, tools, extra, prefill),
                                                           literals)
        if prefill is not None:
            add_generation_prompt = True
        if self._template is None:
            text = _chatml(messages, add_generation_prompt)
        else:
            try:
                text = self._template.render(messages=messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=self._bos, eos_token=self._eos, **extra)
            except TemplateError:
                raise
            except Exception as exc:  # third-party code: any failure is the template's error
                raise TemplateError(f"chat template failed: {type(exc).__name__}: "
                                    f"{exc}") from exc
        return Prompt.restore(text + (prefill or ""), literals)
