"""The repeat check's pattern finds exactly the fields the gateway decides on."""

from __future__ import annotations

import orjson

from gateway.server.request import DECIDED, DECIDED_KEYS, repeated


def test_the_pattern_names_every_deciding_field_and_no_other() -> None:
    body = orjson.dumps({name: 1 for name in (*DECIDED, "models", "nn", "max_tokens_x", "user", "tools")})
    assert sorted(DECIDED_KEYS.findall(body)) == sorted(name.encode() for name in DECIDED)


def test_a_repeat_at_the_top_level_is_found_and_a_nested_one_is_not() -> None:
    twice = b'{"model":"a","messages":[],"seed" : 1, "seed":2}'
    assert repeated(twice, orjson.loads(twice)) == "seed"
    nested = b'{"model":"a","messages":[{"content":"x"}],"metadata":{"model":"b","model":"c"}}'
    assert repeated(nested, orjson.loads(nested)) is None
