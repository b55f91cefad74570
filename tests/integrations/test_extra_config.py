"""An engine's extra config for kvstore is read strictly (kvstore/integrations/extra.py):
a key nobody reads, or a value of the wrong kind, is a ValueError naming it."""

from __future__ import annotations

import math
import re

import pytest

from kvstore.integrations.extra import check_keys, count, flag, seconds, text

OWNER = "test connector"


def test_unknown_keys_are_named_with_what_is_read():
    check_keys(OWNER, {"address": "x", "allocator": "y"}, {"address"}, {"allocator"})
    with pytest.raises(ValueError) as refused:
        check_keys(OWNER, {"adress": "x", "io_timeout": 1, "address": "y"}, {"address"})
    message = str(refused.value)
    assert message.startswith("test connector: unknown key(s) 'adress', 'io_timeout'")
    assert "kvstore reads address" in message


@pytest.mark.parametrize(
    ("read", "value", "want"),
    [
        (seconds, "2.5", 2.5),
        (seconds, 1, 1.0),
        (count, "30000", 30000),
        (count, 7.0, 7),
        (flag, "Off", False),
        (flag, " yes ", True),
        (flag, 1, True),
        (flag, False, False),
        (text, None, ""),
        (text, "a:1", "a:1"),
    ],
)
def test_a_value_of_the_right_kind_is_read(read, value, want):
    assert read(OWNER, "k", value) == want


@pytest.mark.parametrize(
    ("read", "value"),
    [
        (seconds, "fast"),
        (seconds, 0),
        (seconds, -1),
        (seconds, math.inf),
        (seconds, "nan"),
        (seconds, True),
        (seconds, None),
        (count, 0),
        (count, 1.5),
        (count, "many"),
        (count, True),
        (flag, "flase"),
        (flag, 2),
        (flag, None),
        (text, 50051),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_its_key(read, value):
    with pytest.raises(
        ValueError, match=rf"^test connector: k must be .*got {re.escape(repr(value))}$"
    ):
        read(OWNER, "k", value)


def test_a_count_past_its_bound_is_refused_naming_the_bound():
    assert count(OWNER, "k", 600_000, most=600_000) == 600_000
    with pytest.raises(ValueError, match=r"k must be a whole number above 0 and at most 600000"):
        count(OWNER, "k", 600_001, most=600_000)
