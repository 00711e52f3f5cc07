"""The emitter: how a reply is cut into pieces never changes what it says.

Each case is a full reply and its expected result, written by hand. The reply
is fed whole, cut at every boundary into two pieces, character by character,
and at random cuts; every feeding must give exactly the expected result.
"""
import random

import pytest
from pantheon.frontend.emitter import Emitter, Event, joined


def R(content="", reasoning="", tools=()):
    return {"content": content, "reasoning": reasoning, "tools": list(tools)}


CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'

# (id, reply text, Emitter kwargs, expected joined result)
CASES = [
    ("empty", "", {}, R()),
    ("plain", "Hello, world!", {}, R("Hello, world!")),
    ("plain-trailing-space", "Hello\n\n", {}, R("Hello\n\n")),
    ("plain-leading-space", "  Hi  there ", {}, R("  Hi  there ")),
    # stop strings
    ("stop", "Hello END world", {"stop": ["END"]}, R("Hello ")),
    ("stop-earliest-wins", "abc xyz def", {"stop": ["def", "xyz"]}, R("abc ")),
    ("stop-prefix-of-stop", "xxabcd", {"stop": ["abc", "ab"]}, R("xx")),
    ("stop-self-overlap", "xabaababy", {"stop": ["abab"]}, R("xaba")),
    ("stop-aab", "aaab", {"stop": ["aab"]}, R("a")),
    ("stop-overlapping-candidates", "xabce", {"stop": ["abcd", "bce"]}, R("xa")),
    ("stop-at-start", "STOPnothing", {"stop": ["STOP"]}, R()),
    ("stop-never-completes", "abc ab", {"stop": ["abd"]}, R("abc ab")),
    ("stop-empty-ignored", "abc", {"stop": [""]}, R("abc")),
    ("stop-whitespace", "one\n\ntwo", {"stop": ["\n\n"]}, R("one")),
    # reasoning
    ("think-then-content", "<think>Let me think.</think>The answer is 4.", {},
     R("The answer is 4.", "Let me think.")),
    ("think-prefilled", "hmm</think>\n\nYes.", {"think": True}, R("\n\nYes.", "hmm")),
    ("think-prefilled-unclosed", "still thinking", {"think": True}, R("", "still thinking")),
    ("think-later-in-content", "A <think>r</think> B", {}, R("A  B", "r")),
    ("stray-end-think-in-content", "a</think>b", {}, R("a</think>b")),
    ("tool-tag-in-reasoning", "<think>a <tool_call>b</tool_call> c</think>d", {},
     R("d", "a <tool_call>b</tool_call> c")),
    # tool calls
    ("one-tool", f"<tool_call>{CALL}</tool_call>", {}, R(tools=[CALL])),
    ("two-tools", "<tool_call>A</tool_call>\n<tool_call>B</tool_call>\n", {}, R(tools=["A", "B"])),
    ("content-then-tool", "Let me check.\n\n<tool_call>A</tool_call>", {},
     R("Let me check.", tools=["A"])),
    ("content-after-tool", "<tool_call>A</tool_call>\nDone.\n", {}, R("\nDone.\n", tools=["A"])),
    ("think-then-tools", "<think>plan</think>\n\n<tool_call>{}</tool_call>\n<tool_call>[]</tool_call>  \n",
     {}, R("", "plan", ["{}", "[]"])),
    ("prefilled-think-tool", "plan</think>\n\n<tool_call>X</tool_call>", {"think": True},
     R("", "plan", ["X"])),
    ("empty-tool", "<tool_call></tool_call>", {}, R(tools=[""])),
    ("think-tag-in-tool", "<tool_call><think>x</think></tool_call>", {}, R(tools=["<think>x</think>"])),
    ("stray-end-tool", "a</tool_call>b", {}, R("a</tool_call>b")),
    ("unclosed-tool", "Sure <tool_call>{bad", {}, R("Sure <tool_call>{bad")),
    ("unclosed-after-closed", '<tool_call>A</tool_call>\n<tool_call>{"name": ', {},
     R('\n<tool_call>{"name": ', tools=["A"])),
    ("unclosed-partial-end-tag", "<tool_call>A</tool_ca", {}, R("<tool_call>A</tool_ca")),
    ("tools-off", "<tool_call>A</tool_call>\n", {"tools": False}, R("<tool_call>A</tool_call>\n")),
    ("tools-off-think-still-on", "<think>r</think><tool_call>A</tool_call>", {"tools": False},
     R("<tool_call>A</tool_call>", "r")),
    # markers that look alike, overlap, or are prefixes
    ("lookalikes", "<thinking> is not <think/> nor <tool_callx> or <tool_call", {},
     R("<thinking> is not <think/> nor <tool_callx> or <tool_call")),
    ("double-bracket", "<<think>>x</think>>", {}, R("<>", ">x")),
    ("marker-after-partial", "<thin<think>r</thin</think>c", {}, R("<thinc", "r</thin")),
    ("tool-after-partial", "<tool_<tool_call>X</tool_</tool_call>", {}, R("<tool_", tools=["X</tool_"])),
    # parallel_tool_calls: several calls in one turn, or (false) the reply ends at the first
    ("calls-parallel", "Sure <tool_call>A</tool_call>\n<tool_call>B</tool_call>\n", {},
     R("Sure", tools=["A", "B"])),
    ("calls-one-only", "Sure <tool_call>A</tool_call>\n<tool_call>B</tool_call> more",
     {"max_calls": 1}, R("Sure", tools=["A"])),
    ("calls-one-unclosed", "<tool_call>A", {"max_calls": 1}, R("<tool_call>A")),
    ("calls-one-none", "no call", {"max_calls": 1}, R("no call")),
    ("partial-marker-at-end", "abc<thi", {}, R("abc<thi")),
    ("partial-end-think-at-end", "r</thi", {"think": True}, R("", "r</thi")),
    # stop strings inside reasoning, tools, and markers
    ("stop-in-reasoning", "<think>abc STOP def</think>content", {"stop": ["STOP"]}, R("", "abc ")),
    ("stop-in-prefilled-reasoning", "abc STOP</think>x", {"think": True, "stop": ["STOP"]}, R("", "abc ")),
    ("stop-cuts-tool", '<tool_call>{"a": 1}STOP</tool_call>', {"stop": ["STOP"]},
     R('<tool_call>{"a": 1}')),
    ("stop-after-tool", "<tool_call>A</tool_call>\nSTOP<tool_call>B</tool_call>", {"stop": ["STOP"]},
     R(tools=["A"])),
    ("stop-is-think-marker", "reason</think>answer", {"think": True, "stop": ["</think>"]},
     R("", "reason")),
    ("stop-is-tool-marker", "hi <tool_call>x</tool_call>", {"stop": ["<tool_call>"]}, R("hi ")),
    ("stop-inside-marker", "x<think>!r</think>c", {"stop": ["k>!"]}, R("x<thin")),
    ("stop-inside-end-marker", "r</think>c", {"think": True, "stop": ["ink>"]}, R("", "r</th")),
    ("stop-begins-in-marker-carry", "a<thxb", {"stop": ["<thx"]}, R("a")),
    ("stop-tail-overlaps-marker", "a<think>zz", {"stop": ["k>zz"]}, R("a<thin")),
    ("stop-tail-overlaps-marker-miss", "a<think>zy", {"stop": ["k>zz"]}, R("a", "zy")),
    ("stop-prefix-of-marker", "a <tool_call>x</tool_call>", {"stop": ["<to"]}, R("a ")),
    ("stop-spans-marker", "r</think>\n\nFinal answer", {"think": True, "stop": ["</think>\n\nFinal"]},
     R("", "r")),
    ("stop-spans-marker-miss", "r</think>\n\nFin", {"think": True, "stop": ["</think>\n\nFinal"]},
     R("\n\nFin", "r")),
    ("stop-longer-than-marker-prefix", "<think>a</think>b", {"stop": ["<think>a</think>c"]}, R("b", "a")),
    # multi-byte characters and emoji
    ("unicode", "Grüße 🌍 <think>思考🤔</think>答え: 42 🎉", {}, R("Grüße 🌍 答え: 42 🎉", "思考🤔")),
    ("emoji-stop", "go 🚦 🛑 stop", {"stop": ["🛑"]}, R("go 🚦 ")),
    ("emoji-stop-prefix", "👨‍👩‍👧 family 👨‍👩", {"stop": ["👨‍👩‍👦"]}, R("👨‍👩‍👧 family 👨‍👩")),
    ("unicode-tool", "<tool_call>{\"q\": \"café ☕\"}</tool_call>", {}, R(tools=['{"q": "café ☕"}'])),
    ("unicode-whitespace", "<tool_call>A</tool_call>\u3000\u00a0\n", {}, R(tools=["A"])),
]


def feed(pieces, **kw):
    em = Emitter(**kw)
    events = []
    for p in pieces:
        got = em.push(p)
        if em.stopped:
            assert em.push("more text") == []
        events += got
    events += em.finish()
    assert em.finish() == []
    assert all(isinstance(e, Event) and e.kind in ("content", "reasoning", "tool") for e in events)
    assert all(e.text for e in events if e.kind != "tool")
    return joined(events)


def splits(text, seed):
    """Every 2-cut, char by char, and a few seeded random multi-cuts."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,kw,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_any_cutting_gives_the_expected_result(text, kw, expected):
    for i, pieces in enumerate(splits(text, seed=len(text))):
        assert feed(pieces, **kw) == expected, (i, pieces)


def test_random_replies_are_cut_independent():
    """Random soups of marker fragments: whole == any cutting (no hand-made expectation)."""
    rng = random.Random(1234)
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "<tool_",
             "think>", "k>", ">", "a", "b", " ", "\n", "é", "🤔", "ST", "OP", "STOP"]
    for n in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        kw = {"think": rng.random() < 0.3, "tools": rng.random() < 0.8,
              "max_calls": rng.choice([None, None, 1]),
              "stop": rng.choice([[], ["STOP"], ["k><", "b\n"], ["<tool_call>a"], ["</think>b"]])}
        whole = feed([text], **kw)
        for pieces in list(splits(text, seed=n))[1:]:
            assert feed(pieces, **kw) == whole, (text, kw, pieces)


def test_text_is_released_as_soon_as_it_is_settled():
    em = Emitter(stop=["END"], tools=False)
    assert em.push("Hello") == [Event("content", "Hello")]
    assert em.push(" E") == [Event("content", " ")]          # "E" may start "END"
    assert em.push("x <thi") == [Event("content", "Ex ")]      # "<thi" may start "<think>"
    assert em.push("nk>why") == [Event("reasoning", "why")]
    assert em.push("</think>ok EN") == [Event("content", "ok ")]
    assert em.push("D and more") == []
    assert em.stopped
    assert em.push("later") == [] and em.finish() == []


def test_content_whitespace_waits_for_what_follows_it():
    em = Emitter()
    assert em.push("Hi \n") == [Event("content", "Hi")]
    assert em.push(" \nthere\n") == [Event("content", " \n \nthere")]
    assert em.finish() == [Event("content", "\n")]      # no tool block: kept


def test_tool_event_arrives_when_the_block_closes():
    em = Emitter()
    assert em.push("<tool_call>{\"a\"") == []
    assert em.push(": 1}</tool_") == []
    assert em.push("call>\n") == [Event("tool", '{"a": 1}')]
    assert em.push("<tool_call>B</tool_call>") == [Event("tool", "B")]  # "\n" dropped
    assert em.finish() == []


def test_stop_flushes_what_came_before_it_in_the_same_push():
    em = Emitter(stop=["STOP"], think=True)
    assert em.push("r</think>c<tool_call>x STOP y") == [
        Event("reasoning", "r"), Event("content", "c<tool_call>x ")]
    assert em.stopped


def test_finish_is_idempotent_and_ends_the_reply():
    em = Emitter()
    assert em.push("abc<") == [Event("content", "abc")]
    assert em.finish() == [Event("content", "<")]
    assert em.finish() == []
    assert em.push("more") == []
    assert not em.stopped


def test_a_single_call_stops_the_reply():
    em = Emitter(max_calls=1)
    assert em.push("<tool_call>A</tool") == []
    assert em.push("_call> tail") == [Event("tool", "A")] and em.stopped and em.done
    assert em.push("more") == [] and em.finish() == []


def test_positional_stop_like_the_old_api():
    em = Emitter(["\n"])
    assert joined(em.push("line one\nline two") + em.finish()) == R("line one")
    assert em.stopped


def test_reasoning_off_keeps_think_tags_as_text():
    from pantheon.frontend.emitter import Emitter, joined
    e = Emitter(["END"], tools=False, reasoning=False)
    events = e.push("a<think>b</think>c") + e.push("dEND") + e.finish()
    assert joined(events) == {"content": "a<think>b</think>cd", "reasoning": "", "tools": []}
