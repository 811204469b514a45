"""The retry loop every Sleuth HTTP client shares (retrieval/retry.py): the backoff's waits, Retry-After and its
cap, what counts as retryable, the total deadline, blocking and asyncio. The clients' own tests
(tests/test_backends_openai.py, test_web_search.py, test_retrieval_server.py) run it against fake servers."""

from __future__ import annotations

import asyncio

import pytest

from retrieval.retry import (
    Backoff,
    RetriesExhausted,
    Retry,
    RetryPolicy,
    acall,
    call,
    retry_after_s,
    retryable_status,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_obeys_retry_after_up_to_its_cap_and_counts_retries():
    b = Backoff(RetryPolicy(retries=3, backoff_s=0.5, max_retry_after_s=60.0))
    assert [b.next_wait(), b.next_wait(), b.next_wait(5.0), b.next_wait()] == [0.5, 1.0, 5.0, None]
    assert b.failures == 4 and not b.past_deadline
    b = Backoff(RetryPolicy(retries=2, backoff_s=0.5, max_retry_after_s=60.0))
    assert b.next_wait(100.0) == 60.0 and b.next_wait(0.1) == 1.0  # capped; a short Retry-After: the backoff
    assert Backoff(RetryPolicy(retries=0)).next_wait() is None  # no retry: the first failure is the last


def test_the_deadline_stops_a_wait_that_would_end_past_it():
    for deadline, waits in ((3.0, [1.0, 2.0]), (2.9, [1.0, None])):
        clock = Clock()
        b = Backoff(RetryPolicy(retries=10, backoff_s=1.0, deadline_s=deadline), clock)
        got = [b.next_wait()]
        clock.now += 1.0  # the first wait passed; the second would end at 1 + 2 = 3 s after the start
        got.append(b.next_wait())
        assert got == waits and b.past_deadline == (waits[-1] is None)
    with pytest.raises(ValueError, match="deadline_s > 0"):
        RetryPolicy(deadline_s=0)


def test_call_retries_retryable_failures_and_raises_others_at_once():
    outcomes = [Retry("HTTP 503: busy"), Retry("HTTP 429: slow down", retry_after_s=3.0), "done"]
    slept, seen = [], []

    def attempt():
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert call(attempt, RetryPolicy(retries=3, backoff_s=0.5), seen.append, slept.append) == "done"
    assert slept == seen == [0.5, 3.0]

    calls = []

    def refused():
        calls.append(1)
        raise ValueError("HTTP 400: bad request")

    with pytest.raises(ValueError, match="HTTP 400"):
        call(refused, RetryPolicy(retries=3), sleep=slept.append)
    assert calls == [1]

    with pytest.raises(RetriesExhausted, match=r"3 attempts \(out of retries\): HTTP 500: down") as e:
        call(lambda: (_ for _ in ()).throw(Retry("HTTP 500: down")), RetryPolicy(retries=2, backoff_s=0.0),
             sleep=lambda s: None)
    assert e.value.attempts == 3 and e.value.last.reason == "HTTP 500: down" and not e.value.deadline


def test_acall_is_call_for_coroutines():
    tries = []

    async def attempt():
        tries.append(1)
        if len(tries) < 3:
            raise Retry("ConnectError: refused")
        return len(tries)

    assert asyncio.run(acall(attempt, RetryPolicy(retries=2, backoff_s=0.0))) == 3
    tries.clear()
    with pytest.raises(RetriesExhausted, match="2 attempts"):
        asyncio.run(acall(attempt, RetryPolicy(retries=1, backoff_s=0.0)))


def test_what_counts_as_retryable_and_how_retry_after_reads():
    assert [retryable_status(s) for s in (200, 400, 404, 428, 429, 430, 499, 500, 503)] == [
        False, False, False, False, True, False, False, True, True]
    assert retry_after_s("3") == 3.0 and retry_after_s("0.25") == 0.25 and retry_after_s("100") == 60.0
    assert retry_after_s("100", cap_s=5.0) == 5.0
    for junk in (None, "", "-1", "nan", "inf", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert retry_after_s(junk) == 0.0
