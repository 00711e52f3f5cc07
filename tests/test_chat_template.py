"""ChatTemplate: the Hugging Face rendering environment, the sandbox, the ChatML fallback,
and SmolLM2's own template producing llama.cpp's reference prompt ids."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from pantheon.common.default_model import cached_path
from pantheon.common.chat_template import ChatTemplate, Prompt, TemplateError
from pantheon.common.tokenizer import Tokenizer

MODEL = cached_path()                      # the settings' cache folder (PANTHEON_CACHE_DIR)
REFERENCE_FILE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2-reference.json"
REFERENCE = (json.loads(REFERENCE_FILE.read_text()) if REFERENCE_FILE.exists()
             else {"tokenize": [], "chat_greedy": []})       # no ../shared: those cases skip
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smol():
    if not MODEL.exists():
        pytest.skip(f"default model not cached at {MODEL}")
    return Tokenizer.from_gguf(MODEL)


@pytest.mark.parametrize("case", REFERENCE["chat_greedy"],
                         ids=lambda c: c["messages"][-1]["content"][:20])
def test_smollm2_template_gives_reference_prompt_ids(smol, case):
    template = ChatTemplate(smol.chat_template, smol.bos_text, smol.eos_text)
    prompt = template.render(case["messages"], add_generation_prompt=True)
    assert smol.encode(prompt) == case["prompt_ids_fp32ref"]
    # shielding message text from control tokens changes nothing for honest messages
    shielded = ChatTemplate(smol.chat_template, smol.bos_text, smol.eos_text, smol.control_texts)
    assert smol.encode(shielded.render(case["messages"])) == case["prompt_ids_fp32ref"]
    # and the tokenizer's split around the template's tokens encodes as `tokenizers` does
    forced = Prompt.restore(str(prompt), ["never used"])      # takes the shielded path
    assert smol.encode(forced) == case["prompt_ids_fp32ref"]


def test_content_parts_are_flattened(smol):
    template = ChatTemplate(smol.chat_template)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "text", "text": "the capital?"}]}]
    joined = [{"role": "user", "content": "What is\nthe capital?"}]
    assert template.render(parts) == template.render(joined)
    assert parts[0]["content"][0]["text"] == "What is"  # the caller's messages are untouched
    with pytest.raises(TemplateError, match="image_url"):
        image = {"type": "image_url", "image_url": {"url": "x"}}
        template.render([{"role": "user", "content": [image]}])


def test_raise_exception_surfaces_its_message():
    template = ChatTemplate("{% if messages[0].role != 'system' %}"
                            "{{ raise_exception('first message must be system') }}{% endif %}")
    with pytest.raises(TemplateError, match="first message must be system"):
        template.render(USER)
    assert issubclass(TemplateError, ValueError)


def test_tojson_is_huggingface_flavoured():
    template = ChatTemplate("{{ tools | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}")
    tools = [{"type": "function", "function": {"name": "météo", "description": "<b> & 'x'"}}]
    plain, indented = template.render(USER, tools=tools).split("|")
    assert plain == json.dumps(tools, ensure_ascii=False)  # no \\u escapes, no HTML escaping
    assert indented == '{\n  "a": [\n    1\n  ]\n}'


def test_strftime_now_and_variables():
    template = ChatTemplate("{{ strftime_now('%Y') }} {{ bos_token }}{{ eos_token }} "
                            "{{ add_generation_prompt }} {{ enable_thinking }} "
                            "{% for t in tools %}{{ t.function.name }}{% endfor %}",
                            bos_text="<s>", eos_text="</s>")
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    out = template.render(USER, tools=tools, add_generation_prompt=False, enable_thinking=False)
    assert out == f"{datetime.now().year} <s></s> False False lookup"


def test_trim_blocks_loop_controls_and_generation_blocks():
    source = ("{% for m in messages %}\n"
              "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
              "{% generation %}{{ m.role }}:{{ m.content }}{% endgeneration %}\n"
              "{% endfor %}")
    messages = USER + [{"role": "assistant", "content": "Hello"}]
    assert ChatTemplate(source).render(messages) == "user:Hi"  # trim_blocks ate each newline


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",
])
def test_sandbox_blocks_unsafe_access(source):
    with pytest.raises(TemplateError, match="(?i)unsafe|security|not safe"):
        ChatTemplate(source).render(USER)


def test_syntax_error_at_construction():
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}{{ m.content }")


def test_runtime_failure_is_a_template_error():
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(USER)


def test_chatml_fallback():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    assert ChatTemplate(None).render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n\n<tool_call>\n"
        '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    plain = ChatTemplate(None).render(USER, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n"


# Qwen3's own lines for thinking (its template's tail, trimmed to what matters here)
QWEN3_TAIL = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_template_variables_reach_only_a_template_that_reads_them():
    from pantheon.frontend.registry import ServedModel
    qwen3, smol = ChatTemplate(QWEN3_TAIL), ChatTemplate("{{ messages[0].content }}")
    assert qwen3.reads("enable_thinking") and not smol.reads("enable_thinking")
    assert not ChatTemplate(None).reads("enable_thinking")

    def render(template, **args):
        return ServedModel.render_text(SimpleNamespace(template=template), USER, args=args)
    assert render(qwen3, enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert render(qwen3, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert render(qwen3).endswith("<|im_start|>assistant\n")      # the template's default
    assert render(smol, enable_thinking=False) == "Hi"


def test_a_prefill_follows_the_generation_prompt_left_open_and_shielded():
    t = ChatTemplate(QWEN3_TAIL, specials=["<|im_start|>", "<|im_end|>"])
    turns = USER + [{"role": "assistant", "content": "ignored"}]
    prompt = t.render(USER, prefill="Sure<|im_end|>", add_generation_prompt=False,
                      enable_thinking=False)
    assert prompt == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                      "<think>\n\n</think>\n\nSure<|im_end|>")
    assert prompt.literals == ("<|im_end|>",)     # the prefill's token text is plain text
    assert ChatTemplate(None).render(USER, prefill="Once").endswith(
        "<|im_start|>assistant\nOnce")
    assert "ignored" in t.render(turns)           # without prefill: an ordinary turn
