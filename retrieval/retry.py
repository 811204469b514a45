"""The one retry loop of Sleuth's HTTP clients (the retrieval server's client, web search, the OpenAI-compatible
backend): exponential backoff, ``Retry-After``, what counts as retryable, and a total deadline.

A request is one ``attempt()`` function that returns its result, raises :class:`Retry` when the failure may
pass (a connection error, a timeout, HTTP 429 or 5xx: :func:`retryable_status`), or raises anything else to
fail at once (a 4xx is the caller's fault: the same request would fail again). :func:`call` (blocking) and
:func:`acall` (asyncio) run it up to ``1 + retries`` times; before retry ``i`` (from 1) they wait
``backoff_s * 2**(i - 1)`` seconds, or longer when the failed answer's ``Retry-After`` asks it (capped at
``max_retry_after_s``). With a ``deadline_s``, no wait runs past that many seconds after the first attempt
started. When the attempts are used up (or the deadline is reached) :class:`RetriesExhausted` says how many
were made and why the last one failed; each client turns it into its own error.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: most seconds a ``Retry-After`` answer is obeyed for
RETRY_AFTER_CAP_S = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` after the first attempt, the first wait ``backoff_s`` (seconds, doubling each retry), the
    longest ``Retry-After`` obeyed ``max_retry_after_s``, and ``deadline_s``: no wait runs past that many
    seconds after the first attempt (``None``: no deadline)."""

    retries: int = 3
    backoff_s: float = 0.5
    max_retry_after_s: float = RETRY_AFTER_CAP_S
    deadline_s: float | None = None

    def __post_init__(self):
        if self.retries < 0 or self.backoff_s < 0 or (self.deadline_s is not None and self.deadline_s <= 0):
            raise ValueError(f"a retry policy needs retries >= 0, backoff_s >= 0 and deadline_s > 0, got {self}")


class Retry(Exception):
    """Raised by an attempt whose failure may pass: ``reason`` (said in the final error) and the
    ``retry_after_s`` the answer asked for (0: none)."""

    def __init__(self, reason: str, retry_after_s: float = 0.0):
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


class RetriesExhausted(Exception):
    """Every attempt failed: ``attempts`` made, ``last`` the :class:`Retry` of the last one; ``deadline``:
    stopped by the policy's deadline before the retries were used up."""

    def __init__(self, attempts: int, last: Retry, deadline: bool = False):
        why = "the deadline passed" if deadline else "out of retries"
        super().__init__(f"{attempts} attempts ({why}): {last.reason}")
        self.attempts, self.last, self.deadline = attempts, last, deadline


def retryable_status(status: int) -> bool:
    """Whether an HTTP status may pass if the request is sent again: 429 (rate limited) or a 5xx."""
    return status == 429 or status >= 500


def retry_after_s(value: str | None, cap_s: float = RETRY_AFTER_CAP_S) -> float:
    """Seconds a 429/5xx answer's ``Retry-After: <seconds>`` asks the client to wait, at most ``cap_s`` (the
    HTTP-date form, a missing header and junk read as 0)."""
    try:
        s = float(value) if value else 0.0
    except ValueError:
        return 0.0
    return min(max(s, 0.0), cap_s) if math.isfinite(s) else 0.0


class Backoff:
    """The waits of one request under ``policy`` (:func:`call` / :func:`acall`; a loop of its own may use it
    directly). ``clock`` is monotonic seconds."""

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock, self.failures = policy, clock, 0
        self.start = clock()
        self.past_deadline = False

    def next_wait(self, retry_after: float = 0.0) -> float | None:
        """Count a failed attempt; the seconds to wait before the next one, or ``None`` when none is left (the
        retries are used up, or the wait would end past the deadline: :attr:`past_deadline`)."""
        p = self.policy
        self.failures += 1
        if self.failures > p.retries:
            return None
        wait = max(p.backoff_s * 2 ** (self.failures - 1), min(retry_after, p.max_retry_after_s))
        if p.deadline_s is not None and self.clock() + wait - self.start > p.deadline_s:
            self.past_deadline = True
            return None
        return wait


def call(attempt: Callable[[], T], policy: RetryPolicy, on_retry: Callable[[float], None] | None = None,
         sleep: Callable[[float], None] = time.sleep) -> T:
    """``attempt()``'s result, retried as the module docstring says; ``on_retry(wait_s)`` before each wait.
    Raises :class:`RetriesExhausted`, or what ``attempt`` raises other than :class:`Retry`."""
    backoff = Backoff(policy)
    while True:
        try:
            return attempt()
        except Retry as r:
            wait = backoff.next_wait(r.retry_after_s)
            if wait is None:
                raise RetriesExhausted(backoff.failures, r, backoff.past_deadline) from None
        if on_retry is not None:
            on_retry(wait)
        sleep(wait)


async def acall(attempt: Callable[[], Awaitable[T]], policy: RetryPolicy,
                on_retry: Callable[[float], None] | None = None) -> T:
    """:func:`call` for a coroutine function ``attempt`` (waits with ``asyncio.sleep``)."""
    backoff = Backoff(policy)
    while True:
        try:
            return await attempt()
        except Retry as r:
            wait = backoff.next_wait(r.retry_after_s)
            if wait is None:
                raise RetriesExhausted(backoff.failures, r, backoff.past_deadline) from None
        if on_retry is not None:
            on_retry(wait)
        await asyncio.sleep(wait)
