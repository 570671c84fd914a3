"""The soak's check of a whole streamed answer (banyan/bench/soak_traffic.py): it must catch what it claims to."""

from __future__ import annotations

import json

from banyan.bench.soak_traffic import Planned, Traffic, check_stream, greedy_body


def stream(*events: dict, done: bool = True) -> list[str]:
    return [f"data: {json.dumps(e)}" for e in events] + (["data: [DONE]"] if done else [])


def chunk(text: str, finish=None, index=0, logprobs=None) -> dict:
    return {"choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
GREEDY = Planned("/v1/completions", greedy_body("hi") | {"max_tokens": 2}, greedy_key=0)


def test_a_good_stream_passes():
    assert check_stream(GREEDY, stream(chunk("a"), chunk("b", "length"), USAGE), ["ab"]) == ([], None, 2)


def test_what_it_catches():
    cases = {
        "[DONE]": stream(chunk("a"), chunk("b", "length"), USAGE, done=False),
        "not JSON": ["data: {\"choices\": [", "data: [DONE]"],
        "finish_reason": stream(chunk("a"), chunk("b"), USAGE),
        "after its finish_reason": stream(chunk("a", "length"), chunk("b", "length"), USAGE),
        "usage says": stream(chunk("a"), chunk("b", "length"), USAGE | {"usage": {"completion_tokens": 3}}),
        "reference": stream(chunk("a"), chunk("c", "length"), USAGE),
        "no usage": stream(chunk("a"), chunk("b", "length")),
    }
    for expected, lines in cases.items():
        problems, _, _ = check_stream(GREEDY, lines, ["ab"])
        assert any(expected in p for p in problems), (expected, problems)


def test_an_error_event_is_reported_by_its_code():
    lines = stream(chunk("a"), {"error": {"message": "m", "type": "t", "param": None, "code": "engine_dead"}})
    assert check_stream(GREEDY, lines, ["ab"]) == ([], "engine_dead", 0)


def test_structured_outputs_are_held_to_their_spec():
    choice = Planned("/v1/completions", {"n": 1, "max_tokens": 8}, structured="choice")
    usage = USAGE | {"usage": {"completion_tokens": 1}}
    assert check_stream(choice, stream(chunk("maybe", "stop"), usage), [])[0] == []
    assert check_stream(choice, stream(chunk("perhaps", "stop"), usage), [])[0]
    at_max = USAGE | {"usage": {"completion_tokens": 8}}
    assert check_stream(choice, stream(chunk("perh", "length"), at_max), [])[0] == []  # cut short: not judged


def test_the_traffic_is_reproducible_and_mixed():
    a, b = Traffic(3, 0.5), Traffic(3, 0.5)
    plans = [a.next() for _ in range(400)]
    assert [p.body for p in plans] == [b.next().body for _ in range(400)]
    assert {p.path for p in plans} == {"/v1/completions", "/v1/chat/completions"}
    assert {p.structured for p in plans} == {None, "json", "regex", "choice"}
    assert any(p.greedy_key is not None for p in plans) and any(p.body.get("n", 1) > 1 for p in plans)
    assert {p.leave_after_events for p in plans if p.leave_after_events is not None} > {0}
