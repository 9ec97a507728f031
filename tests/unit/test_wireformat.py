"""The wire format a call states and the server's check of it (``wire/wireformat.py``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from hypertrain.common.digest import DIGEST_FORMAT
from hypertrain.wire import wireformat
from hypertrain.wire.wireformat import FORMAT_KEY, WIRE_FORMAT, Stating, format_refusal


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


class Call:
    """A multicallable that records what it was called with."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, dict[str, Any]]] = []

    def __call__(self, request: Any, **kw: Any) -> str:
        self.seen.append(("call", request, kw))
        return "answer"

    def with_call(self, request: Any, **kw: Any) -> str:
        self.seen.append(("with_call", request, kw))
        return "answer"

    def future(self, request: Any, **kw: Any) -> str:
        self.seen.append(("future", request, kw))
        return "answer"


def test_every_way_of_calling_states_the_format_beside_its_own_metadata() -> None:
    inner = Call()
    stub = Stating(inner)
    assert stub("r", timeout=5) == "answer"
    assert stub.with_call("r", metadata=(("x-trace", "1"),)) == "answer"
    assert stub.future("r", timeout=1, wait_for_ready=True) == "answer"
    stated = (FORMAT_KEY, str(WIRE_FORMAT))
    assert [(how, kw["metadata"]) for how, _, kw in inner.seen] == [
        ("call", (stated,)),
        ("with_call", (("x-trace", "1"), stated)),
        ("future", (stated,)),
    ]
    assert inner.seen[0][2]["timeout"] == 5 and inner.seen[2][2]["wait_for_ready"] is True


CLOSED = """
import grpc
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import relay_stub
from hypertrain.wire.tls import PLAINTEXT

channel = PLAINTEXT.channel("127.0.0.1:9", "")
stub = relay_stub(channel)
channel.close()
try:
    stub.Status(pb.StatusRequest(), timeout=1)
except ValueError as e:
    print("refused:", e)
"""


def test_a_stub_called_after_its_channel_closed_raises_and_does_not_crash() -> None:
    """A daemon closing its peer while a thread starts its first call (an island stopping
    in its first sync): the call raises.  (A channel interceptor made the method at the
    call, and that crashed the process with SIGSEGV in grpc 1.85.)"""
    done = subprocess.run(
        [sys.executable, "-c", CLOSED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused:" in done.stdout and "closed channel" in done.stdout, done.stdout
