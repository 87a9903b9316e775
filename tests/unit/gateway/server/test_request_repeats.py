"""The repeat check finds a deciding field given twice at the top level, and only there."""

from __future__ import annotations

import orjson
import pytest

from gateway.server.request import DECIDED, QUOTED, repeated


def test_every_deciding_field_is_looked_for_by_its_quoted_name() -> None:
    assert [name for name, _ in QUOTED] == list(DECIDED)
    assert all(quoted == orjson.dumps(name) for name, quoted in QUOTED)


@pytest.mark.parametrize("name", DECIDED)
def test_each_deciding_field_given_twice_is_found(name: str) -> None:
    twice = b'{"model":"a","messages":[],"%s" : 1, "%s":2}' % (name.encode(), name.encode())
    assert repeated(twice, orjson.loads(twice)) == name


def test_a_repeat_at_the_top_level_is_found_and_a_nested_one_is_not() -> None:
    twice = b'{"model":"a","messages":[],"seed" : 1, "seed":2}'
    assert repeated(twice, orjson.loads(twice)) == "seed"
    nested = b'{"model":"a","messages":[{"content":"x"}],"metadata":{"model":"b","model":"c"}}'
    assert repeated(nested, orjson.loads(nested)) is None
    as_value = b'{"model":"model","messages":[{"role":"user","content":"seed"}],"seed":1}'
    assert repeated(as_value, orjson.loads(as_value)) is None
    other = b'{"model":"a","messages":[],"user":1,"user":2}'  # not a field the gateway decides on
    assert repeated(other, orjson.loads(other)) is None
