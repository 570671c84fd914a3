"""LoRA over HTTP, with the official client: adapters selected by `model`, listed with their parent, loaded and
unloaded at run time under the admin key; an unknown adapter is a 404 and a bad adapter file a 400 naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from banyan import LLM, LoRARequest, SamplingParams
from tests.factories import write_model_dir
from tests.lora_factories import write_adapter
from tests.server_process import start_server

ADMIN, USER = "admin-key-lora", "user-key-lora"
PROMPT = [5, 17, 33, 90, 100, 7, 8, 9]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = write_model_dir(root / "model", "llama", seed=1)
    write_adapter(root / "sql", base, rank=8, seed=1)
    write_adapter(root / "chat", base, rank=4, targets=["q_proj", "v_proj"], seed=2)
    write_adapter(root / "late", base, rank=8, targets=["o_proj", "down_proj"], seed=3)
    server = start_server(root / "model", "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--lora-modules", f"sql={root / 'sql'}", f"chat={root / 'chat'}",
                          "--api-key", USER, "--admin-api-key", ADMIN)
    try:
        yield root, server
    finally:
        server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER, max_retries=0)


def admin(server, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def expected_texts(root, adapters: list[str | None]) -> list[str]:
    """The same greedy completions offline (the engine in process), for each adapter or the base model."""
    llm = LLM(str(root / "model"), block_size=4, num_threads=1, enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [None if a is None else LoRARequest(a, i + 1, str(root / a)) for i, a in enumerate(adapters)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(adapters), params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].text for o in outputs]


def completion(server, model: str):
    return client(server).completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})


def test_models_lists_the_adapters_with_their_parent(served):
    root, server = served
    cards = {m.id: m for m in client(server).models.list().data}
    assert cards["base"].parent is None
    assert cards["sql"].parent == "base" and cards["sql"].root == str(root / "sql")
    assert cards["chat"].parent == "base"


def test_requests_select_an_adapter_by_model_name(served):
    root, server = served
    responses = [completion(server, name) for name in ("sql", "chat", "base")]
    assert [r.model for r in responses] == ["sql", "chat", "base"]
    texts = [r.choices[0].text for r in responses]
    assert texts == expected_texts(root, ["sql", "chat", None])
    assert len(set(texts)) == 3
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text  # stats reach the server a few times a second
    assert 'banyan:lora_resident_adapters{model_name="base"}' in metrics
    assert 'banyan:lora_adapter_loads_total{model_name="base"}' in metrics


def test_an_unknown_adapter_is_a_404(served):
    _, server = served
    with pytest.raises(openai.NotFoundError) as info:
        completion(server, "no-such-adapter")
    assert info.value.body["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time_under_the_admin_key(served):
    root, server = served
    body = {"lora_name": "late", "lora_path": str(root / "late")}
    assert admin(server, "/v1/load_lora_adapter", body, key=USER).status_code == 403
    response = admin(server, "/v1/load_lora_adapter", body)
    assert response.status_code == 200, response.text
    assert completion(server, "late").model == "late"
    assert any(m.id == "late" and m.parent == "base" for m in client(server).models.list().data)
    assert admin(server, "/v1/load_lora_adapter", body).json()["error"]["code"] == "lora_name_in_use"
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        completion(server, "late")
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404


def test_bad_adapter_files_are_refused_with_the_reason(served, tmp_path):
    root, server = served
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    response = admin(server, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(tmp_path)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_lora_adapter" and "pickle" in error["message"]
    write_adapter(tmp_path / "big", _hf(root), rank=16)
    response = admin(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path / "big")})
    assert response.status_code == 400 and "exceeds --max-lora-rank 8" in response.json()["error"]["message"]
    assert completion(server, "sql").model == "sql"  # the server serves on


def _hf(root):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(root / "model"))


def test_lora_modules_without_enable_lora_is_refused_at_start(served):
    root, _ = served
    done = subprocess.run([sys.executable, "-m", "banyan.cli", "serve", "--model", str(root / "model"),
                           "--lora-modules", f"sql={root / 'sql'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "needs --enable-lora" in done.stdout + done.stderr
