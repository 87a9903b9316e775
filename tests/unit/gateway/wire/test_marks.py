"""Usage members found by bytes.find and a brace count: the spans the regex they replaced found, and more."""

from __future__ import annotations

import re
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.wire.marks import last_usage, usages

# The pattern usages() replaced: a usage object with at most one level of nested objects.
REGEX = re.compile(rb'"usage":\s*(\{(?:[^{}]|\{[^{}]*\})*\})')

counts = st.integers(min_value=0, max_value=10**9)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
details = st.dictionaries(names, counts, max_size=3)
usage_objects = st.dictionaries(names, st.one_of(counts, details), max_size=5)
spaces = st.sampled_from(["", " ", "\n", " \t "])


def spans(data: bytes) -> list[bytes]:
    return [data[opening:closing] for _, opening, closing in usages(data)]


@given(st.lists(st.tuples(usage_objects, spaces, st.text(max_size=30)), max_size=4))
def test_the_regex_spans_for_usage_as_upstreams_send_it(parts: list[tuple[dict[str, Any], str, str]]) -> None:
    data = b"".join(
        b'data: {"choices":[],"text":%b,"usage":%b%b}\n\n' % (orjson.dumps(text), space.encode(), orjson.dumps(usage))
        for usage, space, text in parts
    )
    assert spans(data) == [match.group(1) for match in REGEX.finditer(data)]
    assert [orjson.loads(span) for span in spans(data)] == [usage for usage, _, _ in parts]


def test_deeper_objects_null_and_unfinished_usage() -> None:
    data = b'{"usage":{"a":{"b":{"c":1}}},"x":1} "usage": null "usage" :{} "usage":{"open":{"x":1}'
    assert spans(data) == [b'{"a":{"b":{"c":1}}}']
    assert spans(b'"usage":') == []
    assert spans(b'"usage":   {') == []


@given(st.lists(st.tuples(usage_objects, spaces, st.text(max_size=30)), max_size=4))
def test_the_last_usage_is_the_last_one_found(parts: list[tuple[dict[str, Any], str, str]]) -> None:
    data = (
        b"".join(
            b'data: {"text":%b,"usage":%b%b}\n\n' % (orjson.dumps(text), space.encode(), orjson.dumps(usage))
            for usage, space, text in parts
        )
        + b'data: {"usage":null}\n\n'
    )
    found = [(opening, closing) for _, opening, closing in usages(data)]
    assert last_usage(data) == (found[-1] if found else None)
