"""Property test of the request checks: no JSON body makes `parse` fail other than with a 4xx
RequestError."""

from __future__ import annotations

import json
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from xpyd.proxy.validation import RequestError, parse

pytestmark = pytest.mark.unit

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


@hypothesis.settings(max_examples=300, deadline=None, database=None)
@hypothesis.given(body=st.dictionaries(st.sampled_from(["model", "prompt", "messages", "max_tokens", "stream",
                                                        "stream_options", "n", "temperature", "x"]), JSON_VALUES),
                  endpoint=st.sampled_from(["completions", "chat"]))
def test_parse_never_fails_other_than_with_a_request_error(body: dict[str, Any], endpoint: Any) -> None:
    try:
        parsed = parse(json.dumps(body).encode(), endpoint)
    except RequestError as error:
        assert 400 <= error.status < 500
    else:
        assert parsed.prompt_tokens >= 1
