"""Latency math on per-request timings, in seconds (reported in milliseconds).

    sent          first chunk                 chunk k            last chunk
     |── TTFT ──────►|◄── ITL ──►|  ...  |◄── ITL ──►|
     |◄──────────────────────── E2E ───────────────────────►|
    TPOT = (E2E - TTFT) / (output_tokens - 1): the mean time per token after the first.
ITL is measured between streamed chunks; a chunk may carry several tokens, so ITL and TPOT differ.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    """One request of a serving run (times in seconds from the request being sent)."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks as numpy does."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 of seconds, in milliseconds."""
    ms = [v * 1000 for v in values]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "median": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        slos[name] = float(value)
    return slos


def meets_slos(timing: RequestTiming, slos: dict[str, float]) -> bool:
    """A successful request whose every SLO metric is within its limit (a 1-token reply has no TPOT)."""
    if not timing.success:
        return False
    for name, limit_ms in slos.items():
        value = getattr(timing, name)
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def summarize(timings: Sequence[RequestTiming], duration: float, slos: dict[str, float] | None = None) -> dict:
    """The serving report: counts, rates, and latency distributions over the successful requests."""
    done = [t for t in timings if t.success]
    output_tokens = sum(t.output_tokens for t in done)
    prompt_tokens = sum(t.prompt_tokens for t in done)
    summary = {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": prompt_tokens / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": distribution_ms([t.ttft for t in done]),
        "tpot_ms": distribution_ms([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": distribution_ms([gap for t in done for gap in t.itl]),
        "e2el_ms": distribution_ms([t.e2el for t in done]),
    }
    if slos:
        good = sum(meets_slos(t, slos) for t in timings)
        summary["goodput_slos_ms"] = dict(slos)
        summary["goodput"] = good / duration
    return summary


def samples_ms(timings: Sequence[RequestTiming]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E, and ITL's 0th..100th percentiles (there are too many gaps to
    keep), in milliseconds: what a latency CDF is drawn from."""
    done = [t for t in timings if t.success]
    gaps = [gap for t in done for gap in t.itl]
    return {
        "ttft_ms": [round(t.ttft * 1000, 3) for t in done],
        "tpot_ms": [round(t.tpot * 1000, 3) for t in done if t.tpot is not None],
        "e2el_ms": [round(t.e2el * 1000, 3) for t in done],
        "itl_ms_percentiles": [round(percentile(gaps, q) * 1000, 3) for q in range(101)] if gaps else [],
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
