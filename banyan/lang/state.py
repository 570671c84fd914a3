"""ProgramState: the `s` of a program. Its text, chat messages, named variables and their meta info.

`s += expr` queues the expression on the state's own worker thread and returns at once, so a program's
branches (`s.fork(n)`) generate in parallel; reading (`s["name"]`, `s.text()`) waits for what it needs.
A failure in the worker (a backend error) is kept: the expressions after it are skipped, readers raise it,
and `state.error()` returns it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from banyan.lang import ir
from banyan.lang.backend import Backend, GenCall, SelectCall
from banyan.lang.errors import ProgramUsageError

_END = object()  # the end of a state's text stream


class ProgramState:
    def __init__(self, backend: Backend, defaults: ir.SamplingOptions, *, stream: bool = False):
        self.backend = backend
        self.defaults = defaults
        self._text = ""
        self._messages: list[dict[str, str]] = []
        self._role: tuple[str, int] | None = None  # the open role, and where its content begins in the text
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict] = {}
        self._computed = 0  # characters of the text the backend has computed (its pages are cached)
        self._error: BaseException | None = None
        self._pending = 0
        self._changed = threading.Condition()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="banyan-lang")
        self._stream: queue.Queue | None = queue.Queue() if stream else None
        self.children: list[ProgramState] = []

    # -- what a program writes ------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self.submit(ir.as_expr(expr))
        return self

    def submit(self, expr: ir.Expr) -> None:
        with self._changed:
            self._pending += 1
        self._worker.submit(self._run, expr)

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    # -- what a program reads --------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        """The variable's value, once the gen or select that sets it ran; raises the state's error if it failed."""
        with self._changed:
            self._changed.wait_for(lambda: name in self._vars or self._error is not None or self._pending == 0)
            if name in self._vars:
                return self._vars[name]
            if self._error is not None:
                raise self._error
        raise ProgramUsageError(f"no variable {name!r} in the program state (names: {sorted(self._vars)})")

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_meta_info(self, name: str) -> dict | None:
        """SGLang's meta info of the gen or select named `name`: prompt_tokens, completion_tokens, cached_tokens,
        finish_reason; for a select, each option's normalised log-probability."""
        self.get_var(name)
        return self._meta.get(name)

    def text(self) -> str:
        self._check_sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages written so far (roles that ended)."""
        self._check_sync()
        return [dict(m) for m in self._messages]

    def error(self) -> BaseException | None:
        """None, or what made the program fail (a backend error, or the exception the program raised)."""
        self.sync()
        return self._error

    def sync(self) -> None:
        """Wait until every queued expression ran (or was skipped after an error)."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending == 0)

    def _check_sync(self) -> None:
        self.sync()
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"ProgramState(text={self.text()!r})" if self._error is None else f"ProgramState(error={self._error!r})"

    # -- fork ------------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ForkGroup:
        """`size` copies of this state that continue independently (in parallel); the prefix they share is
        computed once, before they start, so each branch finds it in the prefix cache."""
        if not isinstance(size, int) or size < 1:
            raise ProgramUsageError(f"fork needs a positive number of branches, got {size!r}")
        self._check_sync()
        if size > 1:
            self._warm_prefix()
        branches = []
        for _ in range(size):
            branch = ProgramState(self.backend, self.defaults, stream=False)
            branch._text, branch._role, branch._computed = self._text, self._role, self._computed
            branch._messages, branch._vars, branch._meta = list(self._messages), dict(self._vars), dict(self._meta)
            branches.append(branch)
        self.children.extend(branches)
        return ForkGroup(branches)

    def _warm_prefix(self) -> None:
        if self._text and len(self._text) > self._computed:
            self.backend.cache_prefix(self._text)
            self._computed = len(self._text)

    # -- streaming --------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is written (a program run with stream=True); `var_name`: only that gen's text.
        The pieces joined equal text() (or the variable's value)."""
        if self._stream is None:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        while True:
            item = self._stream.get()
            if item is _END:
                self._stream.put(_END)  # later iterators end too
                break
            name, piece = item
            if var_name is None or name == var_name:
                yield piece
        if self._error is not None:
            raise self._error

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """text_iter for asyncio: the waiting happens in a thread, never on the event loop."""
        pieces = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, next, pieces, _END)
            if piece is _END:
                return
            yield piece

    def end_stream(self) -> None:
        if self._stream is not None:
            self._stream.put(_END)

    def close(self) -> None:
        """Stop the worker threads of this state and of its branches (after what is queued ran)."""
        for child in self.children:
            child.close()
        self._worker.shutdown(wait=False)

    # -- the worker thread ------------------------------------------------------------------------
    def _run(self, expr: ir.Expr) -> None:
        try:
            if self._error is None:
                for item in expr.items if isinstance(expr, ir.Sequence) else [expr]:
                    self._execute(item)
        except BaseException as e:  # kept with the state; readers raise it
            self._error = e
        finally:
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

    def _execute(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.Text):
            self._append(expr.text)
        elif isinstance(expr, ir.Gen):
            self._gen(expr)
        elif isinstance(expr, ir.Select):
            self._select(expr)
        elif isinstance(expr, ir.RoleBegin):
            self._begin_role(expr.role)
        elif isinstance(expr, ir.RoleEnd):
            self._end_role(expr.role)
        else:
            raise ProgramUsageError(f"cannot append {type(expr).__name__}")

    def _append(self, text: str, var_name: str | None = None, streamed: bool = False) -> None:
        self._text += text
        if self._stream is not None and text and not streamed:
            self._stream.put((var_name, text))

    def _set(self, name: str | None, value: Any, meta: dict) -> None:
        if name is None:
            return
        with self._changed:
            self._vars[name], self._meta[name] = value, meta
            self._changed.notify_all()

    def _gen(self, expr: ir.Gen) -> None:
        call = GenCall(_call_name("gen", expr.name), self._text, expr.sampling.over(self.defaults), expr.regex,
                       expr.json_schema, self._conversation(f"gen({expr.name!r})"))
        on_text = None
        if self._stream is not None:
            on_text = lambda piece: self._stream.put((expr.name, piece))  # noqa: E731
        result = self.backend.generate(call, on_text)
        self._append(result.text, expr.name, streamed=on_text is not None)
        self._computed = len(self._text)
        self._set(expr.name, result.text, result.meta)

    def _select(self, expr: ir.Select) -> None:
        self._warm_prefix()
        call = SelectCall(_call_name("select", expr.name), self._text, expr.choices,
                          self._conversation(f"select({expr.name!r})"))
        result = self.backend.select(call)
        chosen = expr.choices[result.index]
        self._append(chosen, expr.name)
        self._computed = len(self._text)
        self._set(expr.name, chosen, result.meta)

    def _conversation(self, what: str) -> list[dict] | None:
        """For a backend that sends messages: the messages so far and the open assistant turn (its text so far, which
        the model continues); None for any other backend, or for a program without roles (it sends text)."""
        if (self._role is None and not self._messages) or not self.backend.sends_messages:
            return None
        if self._role is None or self._role[0] != "assistant":
            raise ProgramUsageError(f"{what} outside an assistant turn: on the chat completions API only the assistant "
                                    "generates; put it inside bl.assistant(...)")
        return [*map(dict, self._messages), {"role": "assistant", "content": self._text[self._role[1]:]}]

    def _begin_role(self, role: str) -> None:
        if self._role is not None:
            raise ProgramUsageError(f"{role} begins inside {self._role[0]}: end a role before the next")
        self._append(self.backend.role_format().begin(role, first_message=not self._messages))
        self._role = (role, len(self._text))

    def _end_role(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            raise ProgramUsageError(f"{role} ends but {self._role[0] if self._role else 'no role'} is open")
        self._messages.append({"role": role, "content": self._text[self._role[1]:]})
        self._role = None
        self._append(self.backend.role_format().end(role))


class ForkGroup(list):
    """The branches of one fork (a list of states); join() waits for all of them."""

    def join(self) -> None:
        """Wait for every branch; raises the first branch's error, if any failed."""
        for branch in self:
            branch.sync()
        for branch in self:
            if branch._error is not None:
                raise branch._error

    def __iadd__(self, expr: Any) -> ForkGroup:
        """Append the same expression (or one per branch, given a list) to every branch."""
        exprs = expr if isinstance(expr, list) else [expr] * len(self)
        for branch, e in zip(self, exprs, strict=True):
            branch += e
        return self


def _call_name(kind: str, name: str | None) -> str:
    return f"{kind}({name!r})" if name is not None else f"{kind}()"
