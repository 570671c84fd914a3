"""The step-time model of the speculation controller: seconds of one forward by the tokens in it, measured at
start-up and refreshed online (banyan/spec/controller.py's t(N)). Pure Python, no torch, no clock."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

NEW_BUCKET_FACTOR = 2
"""A step of at least this many times the last bucket's tokens opens a bucket of its own (StepTimeModel._add_bucket):
buckets stay about a power of two apart."""
MAX_RISE = 2.0
"""One observation counts as at most this many times the fit's prediction: a lasting rise is still learned, a step
at a time, but one stalled step cannot move the fit far."""


class StepTimeModel:
    """Seconds of one forward as a function of the tokens in it: piecewise linear through measured buckets.

    Seeded from a start-up measurement [(tokens, seconds), ...]; each bucket then holds an EWMA refreshed by
    `observe`, and a step far past the last bucket opens a new one. Predictions are made non-decreasing in tokens
    (a running max over buckets) so that noise never makes extra tokens look free; below the first bucket the time
    is flat, above the last the last slope goes on.

        seconds
          |                    ,*   <- extrapolated with the last segment's slope
          |         *-------*'
          |   *---*'              * = bucket (tokens_b, EWMA seconds_b); linear in between
          | --*                   <- flat below the first bucket
          +---------------------- tokens
    """

    def __init__(self, points: Sequence[tuple[int, float]], rate: float = 0.1, up_rate: float | None = None):
        """rate: the EWMA weight of an observation below the fit; up_rate: above it (default: rate). A smaller
        up_rate trusts fast steps more than slow ones, as noise on a shared machine only ever adds time."""
        merged: dict[int, list[float]] = {}
        for tokens, seconds in points:
            if tokens < 1 or not seconds > 0:
                raise ValueError(f"a step-time point needs tokens >= 1 and seconds > 0, got ({tokens}, {seconds})")
            merged.setdefault(int(tokens), []).append(float(seconds))
        if len(merged) < 2:
            raise ValueError("a step-time model needs measurements at two or more token counts")
        up_rate = rate if up_rate is None else up_rate
        if not (0.0 < rate <= 1.0 and 0.0 < up_rate <= 1.0):
            raise ValueError(f"rate and up_rate must be in (0, 1], got {rate}, {up_rate}")
        self.tokens = sorted(merged)
        self.seconds = [sum(merged[t]) / len(merged[t]) for t in self.tokens]
        self.rate, self.up_rate = rate, up_rate
        self._refresh()

    def predict(self, num_tokens: int) -> float:
        """Expected seconds of a forward over `num_tokens` tokens."""
        if num_tokens <= self.tokens[0]:
            return self._monotone[0]
        a = min(bisect.bisect_right(self.tokens, num_tokens), len(self.tokens) - 1) - 1
        w = self._weight(a, num_tokens)
        return self._monotone[a] + w * (self._monotone[a + 1] - self._monotone[a])

    def min_slope(self, num_tokens: int) -> float:
        """The least slope of the prediction from `num_tokens` on: predict(n + d) >= predict(n) + d * min_slope(n)."""
        if num_tokens < self.tokens[0]:
            return 0.0
        return self._min_slope[min(bisect.bisect_right(self.tokens, num_tokens), len(self.tokens) - 1) - 1]

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A measured forward. Inside the buckets' range the two neighbours move by the gradient of the squared
        error of the interpolation (on a bucket exactly: that bucket's EWMA); outside it the observation, rescaled
        by the model's own curve, updates the edge bucket."""
        if not seconds > 0:
            return
        seconds = min(seconds, MAX_RISE * self.predict(num_tokens))  # a stall (descheduled, paused) is not a cost
        if num_tokens >= NEW_BUCKET_FACTOR * self.tokens[-1]:
            self._add_bucket(num_tokens)
        last = len(self.tokens) - 1
        if num_tokens <= self.tokens[0] or num_tokens >= self.tokens[last]:
            edge = 0 if num_tokens <= self.tokens[0] else last
            scaled = seconds * self.predict(self.tokens[edge]) / self.predict(num_tokens)
            error = scaled - self.seconds[edge]
            self.seconds[edge] += self._rate(error) * error
        else:
            a = bisect.bisect_right(self.tokens, num_tokens) - 1
            w = self._weight(a, num_tokens)
            error = seconds - ((1 - w) * self.seconds[a] + w * self.seconds[a + 1])
            rate = self._rate(error)
            # a step much faster than the fit could push a bucket to 0 or below (and predict() to 0, a
            # divisor above): one observation at most halves a bucket, so every time stays positive
            self.seconds[a] = max(self.seconds[a] + rate * (1 - w) * error, self.seconds[a] / 2)
            self.seconds[a + 1] = max(self.seconds[a + 1] + rate * w * error, self.seconds[a + 1] / 2)
        self._refresh()

    def _add_bucket(self, num_tokens: int) -> None:
        """A bucket at `num_tokens`, past the last one, seeded with the extrapolation: from here on the slope
        beyond the measured range is learned, not assumed (a start-up measurement cut short by its time budget
        ends at a few tokens, where the slope is often the steepest)."""
        self.seconds.append(self.predict(num_tokens))
        self.tokens.append(num_tokens)
        self._refresh()

    def _rate(self, error: float) -> float:
        return self.up_rate if error > 0 else self.rate

    def _weight(self, a: int, num_tokens: int) -> float:
        return (num_tokens - self.tokens[a]) / (self.tokens[a + 1] - self.tokens[a])

    def _refresh(self) -> None:
        self._monotone, top = [], 0.0
        for seconds in self.seconds:
            top = max(top, seconds)
            self._monotone.append(top)
        # segment a's slope, then the least of segments a.. (the last one's slope goes on past the last bucket)
        slopes = [(self._monotone[a + 1] - self._monotone[a]) / (self.tokens[a + 1] - self.tokens[a])
                  for a in range(len(self.tokens) - 1)]
        self._min_slope = [min(slopes[a:]) for a in range(len(slopes))]
