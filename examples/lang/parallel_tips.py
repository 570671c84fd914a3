"""Parallel tips with fork (SGLang's classic): a shared prompt lists the tips, a branch per tip expands
it in parallel (the branches share the prompt's pages), then the expansions are joined into one answer."""

from __future__ import annotations

import banyan.lang as bl

TIPS = ["Eat a balanced diet", "Exercise regularly", "Sleep enough"]


@bl.function
def tips(s, topic: str, max_tokens: int = 48):
    s += bl.system(f"You give short, practical advice about {topic}.")
    s += bl.user("Here are three tips: " + "; ".join(f"{i + 1}. {tip}" for i, tip in enumerate(TIPS)) + ".")
    s += bl.assistant("Good tips.")
    forks = s.fork(len(TIPS))
    for i, f in enumerate(forks):
        f += bl.user(f"Expand tip {i + 1} ({TIPS[i]}) into one sentence.")
        f += bl.assistant(bl.gen("tip", max_tokens=max_tokens))
    forks.join()
    s += bl.user("Put the three tips together.")
    s += bl.assistant("\n".join(f"{i + 1}. {f['tip'].strip()}" for i, f in enumerate(forks)))
    s["tips"] = [f["tip"] for f in forks]
    s["cached"] = [f.get_meta_info("tip")["cached_tokens"] for f in forks]


def main(backend: bl.Backend, max_tokens: int = 48) -> bl.ProgramState:
    state = tips.run(topic="staying healthy", max_tokens=max_tokens, temperature=0.7, backend=backend)
    print(state.messages()[-1]["content"])
    print("prompt tokens each branch found in the prefix cache:", state["cached"])
    return state


if __name__ == "__main__":
    from common import backend_from_args

    main(backend_from_args(__doc__))
