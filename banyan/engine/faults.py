"""Fault injection for the reliability tests: used only when the core starts with --fault, never otherwise.

    raise-after-steps=N            the N-th step raises (a fatal engine error)
    sleep-after-steps=N:SECONDS    the N-th step sleeps first (a wedged engine)
    sleep-every-step=SECONDS       every step sleeps first (a slow engine: step times known from below)
    grammar-raise-after-tokens=N   each constrained request's grammar fails once it has N output tokens
    sleep-while-loading=SECONDS    the core sleeps before it loads the model
    exit-at-start                  the core exits with status 1 as it starts, before importing banyan (a core
                                   that fails at start-up; handled in ipc/core_launch.py, which imports no banyan)
    fail-restarts=N                data parallel (ipc/dp_client.py): the first N cores started in place of a dead
                                   replica get exit-at-start; the first cores start without a fault

A fault is a hook the engine calls before each step (`Engine.before_step`). The grammar fault marks
the request's matcher failed, as the scheduler's guard does when the grammar library raises
(`matcher.error`): the request ends with finish_reason "error" on its next token, the others carry
on. Nothing is patched.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from banyan.engine.engine import Engine

logger = logging.getLogger(__name__)

EXIT_AT_START = "exit-at-start"  # the spelling core_launch.py checks for (it cannot import this module)
GRAMMAR_FAULT = "the grammar library failed: injected grammar library fault"


class Fault:
    def __init__(self, kind: str, step: int, seconds: float = 0.0):
        self.kind = kind  # "raise" | "sleep" | "slow" | "grammar" | "load"
        self.step = step  # grammar: output tokens
        self.seconds = seconds
        self.num_steps = 0  # steps begun

    @classmethod
    def parse(cls, spec: str) -> Fault:
        name, _, value = spec.partition("=")
        if name == "raise-after-steps":
            return cls("raise", int(value))
        if name == "sleep-after-steps":
            step, _, seconds = value.partition(":")
            return cls("sleep", int(step), float(seconds))
        if name == "sleep-every-step":
            return cls("slow", 0, float(value))
        if name == "grammar-raise-after-tokens":
            return cls("grammar", int(value))
        if name == "sleep-while-loading":
            return cls("load", 0, float(value))
        raise ValueError(f"unknown fault {spec!r}")

    def while_loading(self) -> None:
        if self.kind == "load":
            logger.warning("injected fault: sleeping %.1f s while loading", self.seconds)
            time.sleep(self.seconds)

    def __call__(self, engine: Engine) -> None:
        """Before each step."""
        self.num_steps += 1
        if self.kind == "grammar":
            for request in engine.scheduler.running:
                if request.matcher is not None and request.num_output_tokens >= self.step:
                    request.matcher.error = request.matcher.error or GRAMMAR_FAULT
        elif self.num_steps == self.step and self.kind == "raise":
            raise RuntimeError(f"injected fault at step {self.num_steps}")
        elif self.num_steps == self.step and self.kind == "sleep":
            logger.warning("injected fault: sleeping %.1f s in step %d", self.seconds, self.num_steps)
            time.sleep(self.seconds)
        elif self.kind == "slow" and engine.has_unfinished_requests():
            time.sleep(self.seconds)


def replacement_faults(fault: str | None) -> tuple[str | None, Iterator[str | None]]:
    """A data-parallel server's --fault: (the fault of the first cores, the fault of each core started in place of a
    dead replica, in order). fail-restarts=N fails the first N replacements; any other fault goes to every core."""
    name, _, value = (fault or "").partition("=")
    if name != "fail-restarts":
        return fault, itertools.repeat(fault)
    return None, itertools.chain([EXIT_AT_START] * int(value), itertools.repeat(None))
