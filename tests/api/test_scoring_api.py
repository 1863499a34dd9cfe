"""Completions for scoring, as lm-evaluation-harness's `local-completions` model sends them, against a real worker
on the shipped `tiny` model through the `openai` client: a list of token-id prompts, `echo` with `logprobs` and
`max_tokens` 0 or 1, vLLM's `prompt_logprobs`; the prompt logprobs against transformers' own forward of the same
checkpoint; lists of prompts answered as the single prompts are; the limits refused by field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from llm_backend.tokenizer import load_tokenizer
from tests.api.conftest import scrape as scrape_http
from tests.conftest import start_server
from tests.llm.test_tiny_model import hf_tiny

pytestmark = pytest.mark.integration

TEXTS = [
    "The json module can serialize Python objects.",
    "Return a new list containing all items from the iterable.",
]


@pytest.fixture(scope="module")
def worker():
    s = start_server(
        ["--model", "tiny", "--http-port", "0", "--torch-threads", "1", "--max-prompts-per-request", "8"], "llm"
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer("tiny")
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts):
    """transformers' log-softmax at every prompt position, per prompt."""
    hf = hf_tiny(tmp_path_factory.mktemp("hf"))
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            lp = torch.log_softmax(hf(x, attention_mask=torch.ones_like(x)).logits[0].float(), -1)
            out.append(lp)
    return out


def post(worker, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{worker.http_address}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_echo_with_max_tokens_0_scores_a_batch_like_transformers(client, prompts, reference):
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    tok = load_tokenizer("tiny")
    for ids, c, ref in zip(prompts, r.choices, reference):
        lp = c.logprobs
        assert c.text == tok.decode(ids) and len(lp.tokens) == len(ids) == len(lp.token_logprobs)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [float(ref[k - 1, ids[k]]) for k in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
        for k in range(1, len(ids)):  # the top-1 entry is transformers' most likely token there
            (best,) = lp.top_logprobs[k].values()
            assert best == pytest.approx(float(ref[k - 1].max()), abs=2e-4) and best >= lp.token_logprobs[k] - 1e-6


def test_lm_eval_loglikelihood_shape(client, prompts):
    """lm-evaluation-harness's loglikelihood request: max_tokens 1, echo, logprobs 1; it reads token_logprobs and
    top_logprobs of the continuation positions [ctxlen:-1]."""
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0)
    for ids, c in zip(prompts, r.choices):
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[-1] is not None
        # the generated token is greedy: its logprob is the top one (what lm-eval's is_greedy compares)
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)
        # and a prompt position whose token is not the most likely one reads as not greedy
        assert any(t < max(top.values()) - 1e-3 for t, top in zip(lp.token_logprobs[1:-1], lp.top_logprobs[1:-1]))
    assert r.usage.completion_tokens == 2


def test_a_list_of_prompts_answers_each_as_alone(client):
    many = client.completions.create(model="tiny", prompt=TEXTS + ["def main():"], max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, text in enumerate(TEXTS + ["def main():"]):
        one = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0)
        assert many.choices[i].text == one.choices[0].text
    assert many.usage.completion_tokens == 18


def test_vllm_prompt_logprobs(worker, prompts, reference):
    body = post(worker, "/v1/completions", {"prompt": prompts[0], "max_tokens": 1, "prompt_logprobs": 2})
    entries = body["choices"][0]["prompt_logprobs"]
    ids, ref = prompts[0], reference[0]
    assert entries[0] is None and len(entries) == len(ids)
    for k in range(1, len(ids)):
        e = entries[k]
        assert e[str(ids[k])]["logprob"] == pytest.approx(float(ref[k - 1, ids[k]]), abs=2e-4)
        ranked = sorted((v["rank"], int(t)) for t, v in e.items() if v["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] == int(ref[k - 1].argmax())


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ["x"] * 9, "max_tokens": 1}, "prompt"),
        ({"prompt": ["x", 5], "max_tokens": 1}, "prompt[1]"),
        ({"prompt": ["x", "y"], "max_tokens": 1, "stream": True}, "stream"),
        ({"prompt": "x", "max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 1, "logprobs": 99}, "logprobs"),
    ],
)
def test_scoring_limits_are_400s_naming_the_field(worker, body, param):
    with pytest.raises(urllib.error.HTTPError) as e:
        post(worker, "/v1/completions", body)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == param, err


def test_sampling_controls_through_the_api_equal_the_engine(client):
    """presence / frequency / repetition penalties, logit_bias (string keys, as JSON has them) and min_tokens
    (vLLM's extension, in extra_body) reach the engine: the answer is the offline engine's with the same controls."""
    from llm_backend import LLM, SamplingParams

    tok = load_tokenizer("tiny")
    ids = tok.encode("1 2 3 4 5 6")
    top = LLM("tiny").generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1))[0]
    bias = {str(top.output_token_ids[0]): -50}
    r = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=12,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias=bias,
        extra_body={"repetition_penalty": 1.4, "min_tokens": 12, "ignore_eos": False},
    )
    sp = SamplingParams(
        max_tokens=12,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.4,
        logit_bias=((top.output_token_ids[0], -50.0),),
        min_tokens=12,
    )
    want = LLM("tiny").generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    assert r.choices[0].text == tok.decode(want.output_token_ids) and r.usage.completion_tokens == 12
    assert want.output_token_ids[0] != top.output_token_ids[0]


def test_n_samples_share_the_prompt_and_seeds_make_them_reproducible(client, worker):
    """n = 3 with a seed: three choices, sample i seeded with seed + i (the same request again gives the same
    three; another seed other ones); the prompt is prefilled once: the later samples hit it in the prefix cache."""
    prompt = "The json module can serialize Python objects and parse"
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    c = client.completions.create(**{**kw, "seed": 8})
    texts = [x.text for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2] and texts == [x.text for x in b.choices]
    assert texts != [x.text for x in c.choices] and len(set(texts)) > 1
    for i in range(3):  # sample i is the single request seeded seed + i
        one = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=8 + i)
        assert one.choices[0].text == c.choices[i].text
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=1.0, n=2, seed=3
    )
    assert [x.index for x in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12
    fresh = "A fresh prompt nobody has sent before, long enough to fill a few pages of the cache. " * 3
    before = scrape_http(worker.http_address)["llm_prefix_cache_hit_tokens_total"]
    r = client.completions.create(model="tiny", prompt=fresh, max_tokens=4, temperature=1.0, n=4, seed=1)
    hits = scrape_http(worker.http_address)["llm_prefix_cache_hit_tokens_total"] - before
    assert r.usage.prompt_tokens_details.cached_tokens <= 1  # sample 0 prefilled it (a BOS page aside)
    assert hits >= 3 * (r.usage.prompt_tokens - 1 - 16)  # each later sample found it cached (up to a page)


def test_n_samples_stream_interleaved_and_equal_the_whole_answer(client):
    """`stream` with n = 3: every chunk names its choice, each choice's text equals the non-streamed answer's of the
    same seed, each ends with its own finish reason, and the one usage chunk counts the prompt once."""
    prompt = "The json module can serialize Python objects and parse"
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=7)
    whole = client.completions.create(**kw)
    texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for c in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        usage = c.usage or usage
    assert [texts[i] for i in range(3)] == [x.text for x in whole.choices] and sorted(finishes) == [0, 1, 2]
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens
    msgs = [{"role": "user", "content": prompt}]
    chat_whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=1.0, n=2, seed=3)
    got = {0: "", 1: ""}
    for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=1.0, n=2, seed=3, stream=True
    ):
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
    assert [got[0], got[1]] == [x.message.content for x in chat_whole.choices]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "best_of": 4}, stream=True)
    assert "best_of" in str(e.value)


def test_best_of_returns_the_most_likely(client):
    prompt = "Return a new list containing"
    many = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, n=4, seed=5, logprobs=0
    )
    best = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, best_of=4, seed=5, logprobs=0
    )
    scores = [sum(x.logprobs.token_logprobs) for x in many.choices]
    assert best.choices[0].text == many.choices[scores.index(max(scores))].text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_sample_limits(worker, body, param):
    with pytest.raises(urllib.error.HTTPError) as e:
        post(worker, "/v1/completions", body)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == param, err


def test_sampling_controls_over_grpc_equal_http(worker, client):
    """gRPC's SamplingOptions carry the same controls: the same greedy tokens as the HTTP request; bad values are
    INVALID_ARGUMENT naming the field."""
    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    ids = load_tokenizer("tiny").encode("1 2 3 4 5 6")
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address))
    opts = generator_pb2.SamplingOptions(
        max_tokens=10, presence_penalty=1.0, repetition_penalty=1.4, min_tokens=10, logit_bias={22: -50.0}
    )
    got = []
    for msg in stub.Generate(generator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=opts), timeout=60):
        if msg.HasField("delta"):
            got += list(msg.delta.token_ids)
    body = post(
        worker,
        "/v1/completions",
        {
            "prompt": ids,
            "max_tokens": 10,
            "temperature": 0,
            "presence_penalty": 1.0,
            "repetition_penalty": 1.4,
            "min_tokens": 10,
            "logit_bias": {"22": -50},
            "logprobs": 0,
        },
    )
    assert len(got) == 10 and 22 not in got
    assert body["choices"][0]["text"] == load_tokenizer("tiny").decode(got)
    bad = generator_pb2.SamplingOptions(max_tokens=4, frequency_penalty=3.0)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=bad), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "frequency_penalty" in e.value.details()


def test_a_failed_batch_frees_everything(worker, prompts):
    """A prompt list whose second prompt is refused (a token outside the vocabulary): every prompt is prepared
    before any starts, so the answer is a 400 naming it and no KV slot is held by a request afterwards."""
    with pytest.raises(urllib.error.HTTPError) as e:
        post(worker, "/v1/completions", {"prompt": [prompts[0], [1, 10**6]], "max_tokens": 64})
    assert e.value.code == 400 and "outside the vocabulary" in json.loads(e.value.read())["error"]["message"]
    import time

    for _ in range(50):
        m = scrape_http(worker.http_address)
        if m["llm_kv_full_request_slots"] == 0 and m["llm_kv_swa_request_slots"] == 0:
            break
        time.sleep(0.1)
    assert m["llm_kv_full_request_slots"] == 0 and m["llm_kv_swa_request_slots"] == 0


def test_grpc_n_samples_and_prompt_logprobs_equal_http(worker, client, prompts, reference):
    """gRPC `sampling.n`: the samples' deltas interleaved and marked, one final each, every sample equal to the
    HTTP API's `n` sample of the same seed (seed + i); the prompt prefilled once (the later samples' prompts come
    from the prefix cache); `sampling.prompt_logprobs` equal to transformers' log-softmax at each prompt position;
    n over the limit is INVALID_ARGUMENT naming `sampling.n`."""
    import grpc

    from mimo_epd.v1 import generator_pb2, generator_pb2_grpc

    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address))
    ids = prompts[0]
    opts = generator_pb2.SamplingOptions(
        max_tokens=8, temperature=0.9, seed=11, has_seed=True, n=3, prompt_logprobs=True, ignore_eos=True
    )
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = {}
    for msg in stub.Generate(generator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=opts), timeout=60):
        if msg.HasField("delta"):
            tokens[msg.delta.index] += list(msg.delta.token_ids)
        else:
            finals[msg.final.index] = msg.final
    assert sorted(finals) == [0, 1, 2]
    http = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0.9, seed=11, n=3, extra_body={"ignore_eos": True}
    )
    tok = load_tokenizer("tiny")
    assert [tok.decode(tokens[i]) for i in range(3)] == [c.text for c in http.choices]
    assert all(len(tokens[i]) == finals[i].completion_tokens == 8 for i in range(3))
    assert finals[1].cached_tokens > 0 and finals[2].cached_tokens > 0  # the prompt's KV from the first sample
    lp = list(finals[0].prompt_logprobs)
    want = [float(reference[0][j, ids[j + 1]]) for j in range(len(ids) - 1)]
    assert len(lp) == len(want) and max(abs(a - b) for a, b in zip(lp, want)) < 1e-3
    too_many = generator_pb2.SamplingOptions(max_tokens=2, n=1000)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=too_many), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in e.value.details()


def test_a_streamed_n_whose_client_leaves_frees_every_sample(worker):
    """A streamed n = 4 request whose client closes the connection after the first chunks: every sample is
    cancelled and no KV slot stays held by a request (the pools' request counts back to idle)."""
    import http.client
    import time

    host, port = worker.http_address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "The json module can", "max_tokens": 1500, "n": 4, "stream": True, "ignore_eos": True}
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.read(400)  # a few chunks, then the client goes away
    c.close()
    left = time.monotonic()
    for _ in range(100):
        m = scrape_http(worker.http_address)
        if (
            m["llm_kv_full_request_slots"] == 0
            and m["llm_kv_swa_request_slots"] == 0
            and m["llm_requests_running"] == 0
        ):
            break
        time.sleep(0.1)
    assert m["llm_kv_full_request_slots"] == 0 and m["llm_kv_swa_request_slots"] == 0 and m["llm_requests_running"] == 0
    assert time.monotonic() - left < 5  # cancelled, not run to the end (4 x 1500 tokens take far longer here)
