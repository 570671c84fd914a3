"""Embeddings: LLM.embed and POST /v1/embeddings, checked against transformers' last hidden states on the same weights.

An embedding is the model's last hidden state (after the final norm) pooled over the input (the last token's by
default, the mean where a sentence-transformers config says so), optionally truncated (Matryoshka models only),
L2-normalised. Each input is a prefill-only request through the ordinary scheduler: chunked, preemptible, its
pages freed when it ends.
"""

from __future__ import annotations

import base64
import functools
import json
import struct

import openai
import pytest
import torch
import transformers

from banyan import LLM
from banyan.errors import InvalidParameterError
from banyan.pooling_params import PoolingParams
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow
ADMIN_KEY = "admin-embeddings-0001"
F32 = "float32"  # K/V pages as the reference keeps them (a CPU's default for a float32 model is float16)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps the KV cache in pages.", "héllo 東京"]


@functools.cache
def base_model(model_dir):
    return transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(model_dir, ids: list[int], pooling: str = "last", dimensions: int | None = None) -> torch.Tensor:
    """transformers' embedding of `ids`: the base model's last_hidden_state pooled, truncated, normalised."""
    model = base_model(model_dir)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].double()  # [len, hidden]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector[:dimensions], dim=0)


def close(got: list[float], want: torch.Tensor) -> bool:
    return len(got) == len(want) and torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=2e-5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_embed")
    write_model_dir(path, "llama", seed=11)
    return path


@pytest.fixture(scope="module")
def llm(llama_dir):
    # a budget of 8 tokens a step: every input is chunked; 24 pages of 4 tokens: batches preempt
    return LLM(str(llama_dir), num_threads=1, block_size=4, num_pages=24, kv_cache_dtype=F32, max_num_batched_tokens=8)


def integrity_clean(llm) -> bool:
    llm.engine.kv.check_integrity()
    return llm.engine.kv.stats().num_in_use == 0 and not llm.engine.has_unfinished_requests()


# -- offline ------------------------------------------------------------------------------------------
def test_llm_embed_equals_transformers_last_token_chunked_and_preempted(llm, llama_dir):
    tokenizer = llm.get_tokenizer()
    prompts = TEXTS * 3  # 9 requests of up to 17 tokens over 24 pages: some are preempted and recomputed
    outputs = llm.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(t) for t in prompts]
    for text, out in zip(prompts, outputs):
        assert close(out.outputs.embedding, reference(llama_dir, tokenizer.encode(text)))
    assert integrity_clean(llm)


def test_llm_embed_takes_token_ids_and_interleaves_with_generation(llm, llama_dir):
    from banyan import SamplingParams

    ids = llm.get_tokenizer().encode(TEXTS[1])
    llm.engine.add_request("gen-0", ids, SamplingParams(temperature=0, max_tokens=5))  # running beside the embeddings
    (out,) = llm.embed([ids], use_tqdm=False)
    assert close(out.outputs.embedding, reference(llama_dir, ids))
    llm.engine.abort_requests(["gen-0"])
    assert integrity_clean(llm)


def test_dimensions_need_a_matryoshka_model(llm):
    with pytest.raises(InvalidParameterError) as e:
        llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    assert e.value.param == "dimensions"
    assert integrity_clean(llm)  # refused before anything was queued


def test_sentence_transformers_mean_pooling_and_matryoshka_truncation(tmp_path):
    write_model_dir(tmp_path, "llama", seed=12)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(tmp_path), num_threads=1, block_size=4, num_pages=24, kv_cache_dtype=F32, max_num_batched_tokens=8)
    ids = llm.get_tokenizer().encode(TEXTS[0])
    full, short = llm.embed([ids, ids], [PoolingParams(), PoolingParams(dimensions=16)], use_tqdm=False)
    assert close(full.outputs.embedding, reference(tmp_path, ids, "mean"))
    assert close(short.outputs.embedding, reference(tmp_path, ids, "mean", dimensions=16))
    with pytest.raises(InvalidParameterError, match="one of 16, 32, 64"):
        llm.embed(ids, PoolingParams(dimensions=20), use_tqdm=False)
    last = LLM(str(tmp_path), num_threads=1, block_size=4, num_pages=24, kv_cache_dtype=F32, pooling="last")  # --pooling wins
    assert close(last.embed(ids, use_tqdm=False)[0].outputs.embedding, reference(tmp_path, ids, "last"))
    assert integrity_clean(llm)


# -- over HTTP ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llama_dir):
    proc = start_server(llama_dir, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "64",
                        "--admin-api-key", ADMIN_KEY, "--kv-cache-dtype", F32)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_openai_client_embeds_one_text(client, llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    result = client.embeddings.create(model="tiny", input=TEXTS[0])  # the client asks for base64 and decodes it
    ids = tokenizer.encode(TEXTS[0])
    assert result.object == "list" and result.model == "tiny" and len(result.data) == 1
    assert close(result.data[0].embedding, reference(llama_dir, ids))
    assert result.usage.prompt_tokens == result.usage.total_tokens == len(ids)


def test_every_input_shape_gives_the_same_embeddings(client, llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = [tokenizer.encode(t) for t in TEXTS]
    by_text = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    one_ids = client.embeddings.create(model="tiny", input=ids[2], encoding_format="float")
    assert [d.index for d in by_text.data] == [0, 1, 2]
    for i, want in enumerate(ids):
        assert close(by_text.data[i].embedding, reference(llama_dir, want))
        assert by_ids.data[i].embedding == pytest.approx(by_text.data[i].embedding, abs=1e-6)  # batches round apart
    assert one_ids.data[0].embedding == pytest.approx(by_text.data[2].embedding, abs=1e-6)
    assert by_text.usage.prompt_tokens == sum(map(len, ids))


def test_base64_is_little_endian_float32(server, client):
    import httpx

    body = {"model": "tiny", "input": TEXTS[1], "encoding_format": "base64"}
    raw = httpx.post(f"{server.base_url}/v1/embeddings", json=body).json()["data"][0]["embedding"]
    floats = base64.b64decode(raw)
    decoded = list(struct.unpack(f"<{len(floats) // 4}f", floats))
    expected = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float").data[0].embedding
    assert decoded == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": [1, -2]}, "input[1]"),
    ({"input": [10**6]}, "input"),  # beyond the vocabulary
    ({"input": "x " * 200}, "input"),  # beyond --max-model-len 64
    ({"input": "hi", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_an_openai_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_the_server_still_generates_after_embeddings(client):
    out = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_clients_that_leave_and_bad_requests_leak_no_page(server):
    import httpx

    # the most inputs a request may have, each 51 tokens of the 64 allowed: ~40 ms of work on a fast CPU (200
    # inputs and a 30 ms read timeout came back in time there)
    body = {"model": "tiny", "input": [TEXTS[0] * 3] * 256, "encoding_format": "float"}
    for _ in range(3):  # they give up 10 ms into the read: their inputs are aborted in the core
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=httpx.Timeout(30.0, read=0.01))
    httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "ok"}).raise_for_status()  # served after them
    kv = httpx.get(f"{server.base_url}/admin/kv", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert kv["integrity"] == "ok" and kv["num_in_use"] == 0 and kv["num_running"] == kv["num_waiting"] == 0, kv
