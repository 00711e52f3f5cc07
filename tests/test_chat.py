"""Context capping (chat.fit_context) with a fake model: which turns go, and how many
renders and encodes it takes (linear in the turns, not cubic)."""
import random
import string
import threading
import time
from types import SimpleNamespace

import pytest

from pantheon.common.default_model import cached_path
from pantheon.common.tokenizer import open_tokenizer
from pantheon.frontend.chat import fit_context
from pantheon.frontend.errors import APIError


class FakeModel:
    """Renders `role:content` lines; one token per character; counts the encodes."""

    def __init__(self, max_token_chars: int = 1):
        self.encodes = 0          # max_token_chars: the bound that spares an encode
        self.tokenizer = SimpleNamespace(encode=self.encode, max_token_chars=max_token_chars)

    def render_text(self, messages, tools=None) -> str:
        return "".join(f"{m['role']}:{m['content']}\n" for m in messages)

    def encode(self, text):
        self.encodes += 1
        return list(range(len(text)))


def conversation(turns: int, long_at: int | None = None) -> list[dict]:
    out = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": "x" * (300 if i == long_at else 1 + i % 3)})
    out.append({"role": "user", "content": "last"})
    return out


def one_at_a_time(model, messages, ctx):
    """The old scan: drop one more of the oldest turns until the prompt fits."""
    keep = max(i for i, m in enumerate(messages) if m["role"] == "user")
    droppable = [i for i, m in enumerate(messages) if m["role"] != "system" and i != keep]
    for n in range(len(droppable) + 1):
        kept = [m for i, m in enumerate(messages) if i not in set(droppable[:n])]
        text = model.render_text(kept)
        if len(text) < ctx:
            return text, n > 0
    return None, True


@pytest.mark.parametrize("bound", [1, 100])
@pytest.mark.parametrize("ctx", [20, 37, 64, 100, 333, 400, 5000])
def test_capping_drops_the_same_turns_as_dropping_one_at_a_time(ctx, bound):
    model, messages = FakeModel(bound), conversation(60, long_at=7)
    want, capped = one_at_a_time(model, messages, ctx)
    if want is None:
        with pytest.raises(APIError) as exc:
            fit_context(model, messages, None, ctx, True)
        assert exc.value.code == "context_length_exceeded"
        return
    ids, text, was_capped = fit_context(model, messages, None, ctx, True)
    assert (text, was_capped, len(ids)) == (want, capped, len(want))
    assert text.startswith("system:be brief\n") and text.endswith("user:last\n")


def test_2048_turns_take_a_logarithmic_number_of_encodes():
    model = FakeModel(max_token_chars=100)       # every probe encodes
    messages = conversation(2047, long_at=5)
    ids, text, capped = fit_context(model, messages, None, 1024, True)
    assert capped and len(ids) < 1024 and "x" * 300 not in text
    assert model.encodes <= 14           # 1 + ceil(log2(2048)); one per dropped turn was 2k


def test_capping_off_or_nothing_to_drop_is_a_400():
    model = FakeModel()
    with pytest.raises(APIError, match="context capping is off"):
        fit_context(model, conversation(10), None, 20, False)
    with pytest.raises(APIError, match="no earlier turn"):
        fit_context(model, [{"role": "user", "content": "y" * 50}], None, 20, True)
    huge = [{"role": "user", "content": "y" * 1_000_000}]        # refused by its length
    with pytest.raises(APIError, match="came to at least 1000006 tokens"):
        fit_context(model, huge, None, 20, True)
    assert model.encodes == 0


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_the_tokenizer_lets_the_event_loop_run_while_it_works():
    """Preparation runs in a thread; a tokenizer call that held the GIL throughout froze
    the event loop anyway (a 3 MB prompt: /health and every stream waited 15 s). Here the
    main thread counts its turns while a 100 kB text is encoded: 1-2 if it got none."""
    tok = open_tokenizer(cached_path())
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters + string.punctuation + " ")
                   for _ in range(100_000))
    done, turns = threading.Event(), 0
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    worker.start()
    while not done.is_set():
        turns += 1
        time.sleep(0.001)
    worker.join()
    assert turns >= 10
