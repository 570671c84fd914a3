"""Tree of thought: fork several first steps, let the model judge each with a select, expand the
promising ones with a second fork, and answer from the best path."""

from __future__ import annotations

import banyan.lang as bl


@bl.function
def tree_of_thought(s, question: str, width: int = 2, max_tokens: int = 32):
    s += bl.user(question)
    s += bl.assistant_begin() + "Let me think step by step.\n"
    firsts = s.fork(width)  # the first steps, generated in parallel
    for first in firsts:
        first += "Step 1: " + bl.gen("step", max_tokens=max_tokens, stop=["\n"]) + "\n"
        first += "Is this step correct? " + bl.select("verdict", choices=["yes", "no"]) + "\n"
    firsts.join()
    kept = [first for first in firsts if first["verdict"] == "yes"] or list(firsts)
    seconds = [first.fork(width) for first in kept]  # each promising step expanded, all in parallel
    for group in seconds:
        for second in group:
            second += "Step 2: " + bl.gen("step", max_tokens=max_tokens, stop=["\n"]) + "\n"
            second += "Confidence: " + bl.select("confidence", choices=["high", "medium", "low"])
    for group in seconds:
        group.join()
    paths = [second for group in seconds for second in group]
    rank = {"high": 2, "medium": 1, "low": 0}
    best = max(paths, key=lambda p: rank[p["confidence"]])
    s += best.text()[len(s.text()):] + "\nAnswer: " + bl.gen("answer", max_tokens=max_tokens)
    s += bl.assistant_end()
    s["num_paths"] = len(paths)


def main(backend: bl.Backend, max_tokens: int = 32) -> bl.ProgramState:
    state = tree_of_thought.run(question="A farmer has 3 cows and buys 2 more. How many cows now?",
                                max_tokens=max_tokens, temperature=0.8, backend=backend)
    print(state.messages()[-1]["content"])
    print("paths explored:", state["num_paths"])
    return state


if __name__ == "__main__":
    from common import backend_from_args

    main(backend_from_args(__doc__))
