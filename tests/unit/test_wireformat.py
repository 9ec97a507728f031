"""The wire format a call states and the server's check of it (``wire/wireformat.py``)."""

from __future__ import annotations

from typing import Any

from hypertrain.common.digest import DIGEST_FORMAT
from hypertrain.wire import wireformat
from hypertrain.wire.wireformat import FORMAT_KEY, STATE_FORMAT, WIRE_FORMAT, format_refusal


class Context:
    """What ``format_refusal`` reads of a servicer context."""

    def __init__(self, *metadata: tuple[str, Any]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata


def test_the_wire_format_names_the_digest_format_this_build_uses() -> None:
    # A new digest format is a new wire format: bump both, and say so in DIGEST_FORMATS.
    assert wireformat.DIGEST_FORMATS[WIRE_FORMAT] == DIGEST_FORMAT


def test_only_this_builds_format_stated_once_passes() -> None:
    assert format_refusal(Context(("other", "x"), (FORMAT_KEY, str(WIRE_FORMAT)))) is None
    none = format_refusal(Context())
    assert none is not None and "states no wire format" in none and FORMAT_KEY in none
    assert f"this server speaks wire format {WIRE_FORMAT}" in none
    older = format_refusal(Context((FORMAT_KEY, "1")))
    assert older is not None and older.startswith("the caller speaks wire format 1;")
    twice = format_refusal(Context((FORMAT_KEY, "2"), (FORMAT_KEY, "2")))
    assert twice is not None and "wire format 2, 2;" in twice  # one value, not a list


def test_a_stated_value_is_shown_bounded_and_printable() -> None:
    odd = format_refusal(Context((FORMAT_KEY, "2" * 40), (FORMAT_KEY, b"\x00\xff-bin")))
    assert odd is not None
    assert f"'{'2' * 16}'" in odd and "'??-bin'" in odd, odd  # cut to 16, quoted when odd


class Details:
    method = "/hypertrain.v1.Relay/Status"
    timeout = 5.0
    metadata = (("x-trace", "1"),)
    credentials = None
    wait_for_ready = None
    compression = None


def test_every_kind_of_call_states_the_format_beside_its_own_metadata() -> None:
    seen: list[Any] = []

    def continuation(details: Any, request: Any) -> str:
        seen.append(details)
        return "call"

    for intercept in (
        STATE_FORMAT.intercept_unary_unary,
        STATE_FORMAT.intercept_unary_stream,
        STATE_FORMAT.intercept_stream_unary,
        STATE_FORMAT.intercept_stream_stream,
    ):
        assert intercept(continuation, Details(), object()) == "call"  # the call as it is
    for details in seen:
        assert details.metadata == (("x-trace", "1"), (FORMAT_KEY, str(WIRE_FORMAT)))
        assert (details.method, details.timeout) == (Details.method, Details.timeout)
