"""The request guard every Sleuth HTTP server shares (retrieval/http_guard.py): the API key, the body bound, the
JSON nesting and integer-digit limits, each on both sides of its bound. The servers' own hostile-client tests
(tests/test_server_hardening.py, test_retrieval_server.py, test_serve.py, test_proxy.py) run it end to end."""

from __future__ import annotations

import asyncio

import pytest

from retrieval.http_guard import GuardError, RequestGuard, asgi_body


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def _read(guard: RequestGuard, *parts: bytes, length=None) -> bytes:
    return asyncio.run(guard.read_body(_chunks(*parts), length))


def test_the_api_key_is_required_when_set_and_an_empty_one_is_open():
    for open_guard in (RequestGuard(None), RequestGuard("")):
        assert open_guard.open
        open_guard.check_auth(None)
        open_guard.check_auth("Bearer anything")
    keyed = RequestGuard("s3cret")
    assert not keyed.open
    keyed.check_auth("Bearer s3cret")
    keyed.check_auth(b"Bearer s3cret")  # an ASGI header's bytes
    for wrong in (None, "", "Bearer s3cre", "Bearer s3cret ", "bearer s3cret", "s3cret", b"Bearer x"):
        with pytest.raises(GuardError, match=r"missing or wrong API key") as e:
            keyed.check_auth(wrong)
        assert (e.value.status, e.value.kind) == (401, "authentication_error")


def test_the_body_bound_holds_for_a_declared_and_a_streamed_length():
    guard = RequestGuard(max_body_bytes=10)
    guard.check_length(10)
    guard.check_length("10")
    guard.check_length(b"chunked")  # no number: left to the body's own count
    for declared in (11, "11", b"11"):
        with pytest.raises(GuardError, match=r"request body of 11 bytes exceeds the size limit; the limit is 10 "
                                             r"\(max_body_bytes\)") as e:
            guard.check_length(declared)
        assert e.value.status == 413
    assert _read(guard, b"12345", b"67890") == b"1234567890"
    with pytest.raises(GuardError, match=r"over 10 bytes sent\); the limit is 10") as e:
        _read(guard, b"12345", b"67890", b"1")
    assert e.value.status == 413
    with pytest.raises(GuardError, match="of 11 bytes"):  # refused before a chunk is read
        _read(guard, b"1", length=b"11")


def test_json_nesting_limit_on_both_sides():
    guard = RequestGuard(max_depth=3)
    assert guard.parse_json(b"[[[1]]]") == [[[1]]]
    assert guard.parse_json(b'{"a": {"b": [1, 2]}}') == {"a": {"b": [1, 2]}}
    assert guard.parse_json(b'{"q": "[[[[[[{{{{"}') == {"q": "[[[[[[{{{{"}  # brackets in a string do not nest
    assert guard.parse_json(b"[[1], [2], [3], [4]]") == [[1], [2], [3], [4]]  # many brackets, depth 2
    for deep in (b"[[[[1]]]]", b'{"a": {"b": {"c": {}}}}', b"[[1], [[[2]]]]"):
        with pytest.raises(GuardError, match=r"nested too deeply \(the limit is 3 levels\)") as e:
            guard.parse_json(deep)
        assert e.value.status == 400
    with pytest.raises(GuardError, match="nested too deeply"):  # past the decoder's recursion limit too
        RequestGuard().parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_integer_digit_limit_on_both_sides():
    guard = RequestGuard(max_int_digits=3)
    assert guard.parse_json(b'{"topk": 999, "seed": -999, "t": 1.5e3}') == {"topk": 999, "seed": -999, "t": 1500.0}
    for big in (b'{"topk": 1000}', b"[-1000]"):
        with pytest.raises(GuardError, match=r"not valid JSON for this server: an integer of 4 digits; the limit is "
                                             r"3 digits \(max_int_digits\)") as e:
            guard.parse_json(big)
        assert e.value.status == 400
    with pytest.raises(GuardError, match="an integer of 5000 digits"):  # past Python's own 4,300 as well
        RequestGuard().parse_json(b"1" * 5000)


def test_malformed_bodies_and_non_objects_are_400s_that_say_why():
    guard = RequestGuard()
    for bad, why in ((b"{not json", "Expecting property name"), (b"\xff\xfe\x00", "not valid JSON"), (b"", "Expecting value")):
        with pytest.raises(GuardError, match="request body is not valid JSON") as e:
            guard.parse_json(bad)
        assert why in e.value.message and e.value.status == 400
    assert guard.parse_object(b'{"queries": []}') == {"queries": []}
    with pytest.raises(GuardError, match=r"^request body must be a JSON object with 'queries'$"):
        guard.parse_object(b"[1]", " with 'queries'")


def test_an_asgi_body_ends_with_the_last_chunk_and_a_disconnect_is_a_400():
    def receive_of(*msgs):
        it = iter(msgs)

        async def receive():
            return next(it)

        return receive

    async def body(receive):
        return [c async for c in asgi_body(receive)]

    got = asyncio.run(body(receive_of({"type": "http.request", "body": b"ab", "more_body": True},
                                      {"type": "http.request", "body": b"c"})))
    assert got == [b"ab", b"c"]
    with pytest.raises(GuardError, match="client disconnected before sending the whole body"):
        asyncio.run(body(receive_of({"type": "http.request", "body": b"ab", "more_body": True},
                                    {"type": "http.disconnect"})))
