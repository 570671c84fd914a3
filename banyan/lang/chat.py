"""Chat roles as text: each role's prefix and suffix as the model's chat template writes them.

A program's state is text, so `bl.user("hi")` must append exactly what the chat template would render for
that message. The template is probed once per backend with marker contents (`render` renders a list of
messages without a generation prompt):

    render([system: M])            = P_sys M S_sys
    render([system: M0, user: M1]) = P_sys M0 S_sys | P_user M1 S_user        (the same for assistant)
    render([user: M])              = START P_user M S_user                     START: what a template writes
                                                                               when no system message leads
                                                                               (a default system prompt, BOS)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from banyan.lang.errors import LangError
from banyan.lang.ir import ROLES

MARK = "BANYAN_LANG_MARK_{}_"  # letters, digits and _ only: every tokenizer writes them back as they were


class ChatFormatError(LangError):
    """The chat template does not render roles as prefix + content + suffix (banyan.lang cannot use it)."""


@dataclass(frozen=True)
class RoleFormat:
    prefix: dict[str, str]
    suffix: dict[str, str]
    start: str  # written before the first message when it is not a system message

    def begin(self, role: str, first_message: bool) -> str:
        lead = self.start if first_message and role != "system" else ""
        return lead + self.prefix[role]

    def end(self, role: str) -> str:
        return self.suffix[role]


CHAT_API_FORMAT = RoleFormat(
    prefix={"system": "SYSTEM: ", "user": "USER: ", "assistant": "ASSISTANT: "},
    suffix={"system": "\n", "user": "\n", "assistant": "\n"},
    start="",
)
"""How a program's text shows its roles on a backend that sends messages to /v1/chat/completions instead of rendering
the model's template (the server renders it): the text is for reading only, the messages are what the model sees."""


def probe_role_format(render: Callable[[list[dict]], str]) -> RoleFormat:
    """The roles' prefixes and suffixes, from three renders per role (see the module docstring)."""
    m0, m1 = MARK.format(0), MARK.format(1)
    p_sys, s_sys = _split(render([{"role": "system", "content": m0}]), m0)
    prefix, suffix, start = {"system": p_sys}, {"system": s_sys}, None
    for role in ROLES[1:]:
        both = render([{"role": "system", "content": m0}, {"role": role, "content": m1}])
        head, tail = _split(both, m1)
        between = _split(head, m0)[1]
        if not between.startswith(s_sys):
            raise ChatFormatError(f"the chat template writes the system message differently before a {role} one")
        prefix[role], suffix[role] = between[len(s_sys):], tail
        alone = _split(render([{"role": role, "content": m0}]), m0)[0]
        if not alone.endswith(prefix[role]):
            raise ChatFormatError(f"the chat template writes the {role} role differently when it comes first")
        lead = alone[: len(alone) - len(prefix[role])]
        if start is not None and lead != start:
            raise ChatFormatError("the chat template starts a conversation differently by its first role")
        start = lead
    return RoleFormat(prefix, suffix, start or "")


def _split(text: str, mark: str) -> tuple[str, str]:
    if text.count(mark) != 1:
        raise ChatFormatError("the chat template does not write a message's content as given")
    head, tail = text.split(mark)
    return head, tail
