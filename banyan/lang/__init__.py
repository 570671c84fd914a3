"""banyan.lang: LLM programs with SGLang's names (`import banyan.lang as bl`).

    @bl.function
    def tips(s, topic):
        s += bl.user(f"Give two tips about {topic}.")
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += bl.assistant(bl.gen(f"tip{i}", max_tokens=32))
        forks.join()

    bl.set_default_backend(bl.Engine())          # or bl.RuntimeEndpoint(url), bl.OpenAICompatible(base_url, model)
    state = tips.run(topic="sleep", temperature=0)

Importing this package loads no torch: bl.Engine loads the engine when it is built; the HTTP backends
never do. See docs/lang.md.
"""

from banyan.lang.backend import Backend, GenResult, SelectResult
from banyan.lang.chat import ChatFormatError, RoleFormat
from banyan.lang.engine_backend import Engine
from banyan.lang.errors import BackendError, BackendUnavailableError, LangError, ProgramUsageError
from banyan.lang.http_backends import OpenAICompatible, RuntimeEndpoint
from banyan.lang.ir import (
    assistant, assistant_begin, assistant_end, gen, select, system, system_begin, system_end, user, user_begin,
    user_end,
)
from banyan.lang.program import Program, function, get_default_backend, set_default_backend
from banyan.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend", "BackendError", "BackendUnavailableError", "ChatFormatError", "Engine", "ForkGroup", "GenResult",
    "LangError", "OpenAICompatible", "Program", "ProgramState", "ProgramUsageError", "RoleFormat",
    "RuntimeEndpoint", "SelectResult", "assistant", "assistant_begin", "assistant_end", "function", "gen",
    "get_default_backend", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
    "user_begin", "user_end",
]
