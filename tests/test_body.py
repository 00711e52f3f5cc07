"""Request bodies (frontend/body.py): JSON objects only, bounded depth, no surrogates."""
import json

import pytest

from pantheon.frontend.body import MAX_JSON_DEPTH, parse_json
from pantheon.frontend.errors import APIError


@pytest.mark.parametrize("raw, param", [
    (rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\uDFFFb"}]}]}',
     "messages[0].content[0].text"),
    (rb'{"prompt": ["ok", "\udc00"]}', "prompt[1]"),
    (rb'{"stop": "\ud83d"}', "stop"),                         # half a pair
    (rb'{"response_format": {"json_schema": {"\ud800": 1}}}',
     "response_format.json_schema.\\ud800"),                  # a key
    (b'{"user": "\xed\xa0\x80"}', "user"),                    # CESU-8 bytes
])
def test_an_unpaired_surrogate_is_a_400_naming_the_field(raw, param):
    with pytest.raises(APIError) as exc:
        parse_json(raw)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, param, "invalid_unicode")
    json.dumps(err.body(), ensure_ascii=False).encode()       # the answer itself encodes


def test_a_surrogate_pair_is_one_character_and_fine():
    assert parse_json(rb'{"content": "\ud83d\ude00"}') == {"content": "\U0001F600"}


def nested(depth: int) -> bytes:
    return b'{"a": ' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def test_nesting_past_the_bound_is_a_400_however_deep():
    assert parse_json(nested(MAX_JSON_DEPTH))
    for depth in (MAX_JSON_DEPTH + 1, 5000, 200_000):
        with pytest.raises(APIError) as exc:
            parse_json(nested(depth))
        assert exc.value.status == 400 and "nests more than" in exc.value.message
    with pytest.raises(APIError):
        parse_json(b"[" * 100_000)


def test_only_an_object_and_an_empty_body_where_allowed():
    assert parse_json(b"", empty={}) == {}
    for raw in (b"", b"[]", b"3", b"{nope"):
        with pytest.raises(APIError):
            parse_json(raw)
