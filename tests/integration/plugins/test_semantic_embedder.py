"""The test embedding server: all-MiniLM-L6-v2 in numpy, checked against properties the real model has."""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

from tests.support.embedder import DIMENSIONS, MAX_TOKENS, EmbeddingServer, MiniLM, decode_base64

PARAPHRASES = [
    ("How do I boil an egg?", "What's the way to hard-boil an egg?"),
    ("What is the capital of France?", "Which city is France's capital?"),
    ("How can I reverse a list in Python?", "What is the way to reverse a Python list?"),
]
UNRELATED = [
    ("How do I boil an egg?", "The quarterly tax filing deadline is in April."),
    ("What is the capital of France?", "My bicycle chain keeps slipping."),
    ("How can I reverse a list in Python?", "Tips for growing tomatoes on a balcony"),
]


def cosine(model: MiniLM, a: str, b: str) -> float:
    va, vb = model.embed([a, b])
    return float(va @ vb)


def test_vectors_have_unit_norm(embedding_model: MiniLM) -> None:
    vectors = embedding_model.embed(["a", "Hello there, how are you?", "x " * 400])
    assert vectors.shape == (3, DIMENSIONS)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_paraphrases_are_near_and_unrelated_texts_far(embedding_model: MiniLM) -> None:
    near = [cosine(embedding_model, a, b) for a, b in PARAPHRASES]
    far = [cosine(embedding_model, a, b) for a, b in UNRELATED]
    assert min(near) > 0.75, near
    assert max(far) < 0.25, far


def test_embedding_is_deterministic(embedding_model: MiniLM) -> None:
    text = ["Summarise the French revolution in three sentences."]
    assert np.array_equal(embedding_model.embed(text), embedding_model.embed(text))


def test_a_batch_gives_what_each_text_gives_alone(embedding_model: MiniLM) -> None:
    # Inputs of very different lengths: padding must not leak into any vector.
    texts = ["hi", "How do I boil an egg?", "word " * 60, "What is the capital of France, and why is it there?"]
    batch = embedding_model.embed(texts)
    single = np.stack([embedding_model.embed([t])[0] for t in texts])
    np.testing.assert_allclose(batch, single, atol=1e-5)


def test_inputs_are_read_up_to_256_tokens_not_128(embedding_model: MiniLM) -> None:
    # The package's tokenizer.json truncates at 128: words past token 128 must still change the vector,
    # and words past token 256 must not.
    base = " ".join(f"topic{i % 7} apples" for i in range(60))  # well over 128 tokens, under 256
    assert 128 < embedding_model.count_tokens([base]) < MAX_TOKENS
    extended = base + " and finally a long note about submarines and volcanoes"
    assert cosine(embedding_model, base, extended) < 0.9999
    long = " ".join(["pear"] * 300)  # 302 tokens: cut at 256
    assert embedding_model.count_tokens([long]) == MAX_TOKENS
    longer = long + " submarines volcanoes"
    np.testing.assert_allclose(embedding_model.embed([long]), embedding_model.embed([longer]), atol=1e-6)


def test_server_speaks_openai_embeddings(embedder: EmbeddingServer, embedding_model: MiniLM) -> None:
    texts = ["How do I boil an egg?", "What is the capital of France?"]
    expected = embedding_model.embed(texts)
    floats = httpx.post(f"{embedder.base_url}/embeddings", json={"model": "mini", "input": texts}).json()
    assert floats["object"] == "list"
    assert floats["model"] == "mini"
    assert [d["index"] for d in floats["data"]] == [0, 1]
    np.testing.assert_allclose(np.array([d["embedding"] for d in floats["data"]]), expected, atol=1e-6)
    tokens = embedding_model.count_tokens(texts)
    assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = httpx.post(
        f"{embedder.base_url}/embeddings", json={"model": "mini", "input": texts[0], "encoding_format": "base64"}
    ).json()
    assert len(packed["data"]) == 1
    # The same one text embedded alone, bit for bit: base64 carries the float32s unchanged (a batch of two pads
    # differently, and BLAS may then round its last bits otherwise).
    np.testing.assert_array_equal(decode_base64(packed["data"][0]["embedding"]), embedding_model.embed(texts[:1])[0])


def test_the_official_sdk_reads_it(embedder: EmbeddingServer, embedding_model: MiniLM) -> None:
    client = openai.OpenAI(base_url=embedder.base_url, api_key="unused", max_retries=0)
    result = client.embeddings.create(model="mini", input=["How do I boil an egg?"])  # base64 on the wire
    assert embedder.requests[-1]["encoding_format"] == "base64"
    np.testing.assert_allclose(result.data[0].embedding, embedding_model.embed(["How do I boil an egg?"])[0], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi"}, "model"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [1, 2]}, "input"),
        ({"model": "m", "input": ""}, "input"),
        ({"model": "m", "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "hi", "dimensions": 64}, "dimensions"),
    ],
)
def test_bad_requests_get_openai_errors(embedder: EmbeddingServer, body: dict[str, object], param: str) -> None:
    response = httpx.post(f"{embedder.base_url}/embeddings", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_delay_knob_slows_every_answer(embedder: EmbeddingServer) -> None:
    quick = time.perf_counter()
    httpx.post(f"{embedder.base_url}/embeddings", json={"model": "m", "input": "hi"}).raise_for_status()
    quick = time.perf_counter() - quick
    embedder.delay_s = 0.4
    slow = time.perf_counter()
    httpx.post(f"{embedder.base_url}/embeddings", json={"model": "m", "input": "hi"}).raise_for_status()
    slow = time.perf_counter() - slow
    assert slow >= 0.4
    assert slow > quick


def test_dead_mode_accepts_and_never_answers(embedder: EmbeddingServer) -> None:
    embedder.dead = True
    started = time.perf_counter()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{embedder.base_url}/embeddings", json={"model": "m", "input": "hi"}, timeout=0.5)
    assert time.perf_counter() - started >= 0.5
    assert embedder.requests[-1]["input"] == "hi"  # it was accepted and read, not refused
    embedder.dead = False
    httpx.post(f"{embedder.base_url}/embeddings", json={"model": "m", "input": "hi"}).raise_for_status()
