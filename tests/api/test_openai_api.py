"""The OpenAI-compatible API of a real LLM worker on a loopback port, through the official `openai` client:
chat (plain and streamed) equal to the offline engine on the rendered prompt, images by data: and http URL,
a video, completions, models, usage with cached tokens, logprobs, stop strings, multi-byte text streamed
exactly as returned whole, the SGLang-style endpoints and the metrics."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request

import openai
import pytest

from llm_backend.server.chat_template import load_chat_template
from tests.api.conftest import scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from llm_backend import LLM

    return LLM("tiny-random")


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def get_json(worker, path: str):
    with urllib.request.urlopen(f"http://{worker.http_address}{path}", timeout=60) as r:
        return r.status, json.loads(r.read())


def post_json(worker, path: str, body: dict):
    req = urllib.request.Request(
        f"http://{worker.http_address}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


MESSAGES = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Say something."}]


def test_chat_equals_offline_engine_and_stream_equals_whole(client, offline):
    from llm_backend import SamplingParams

    r = client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, max_tokens=10, extra_body={"ignore_eos": True}
    )
    text = r.choices[0].message.content
    prompt = offline.tokenizer.encode(load_chat_template("tiny-random").render(MESSAGES, add_generation_prompt=True))
    want = offline.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=10, ignore_eos=True))[
        0
    ]
    assert text == want.text
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == len(prompt) + 10 and r.object == "chat.completion" and r.model == "tiny-random"

    chunks = list(
        client.chat.completions.create(
            model="tiny-random",
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= len(prompt) - 1  # the same prompt again


def test_usage_reports_cached_tokens_of_a_shared_prefix(client):
    system = {"role": "system", "content": "You answer questions about the shared document. " * 8}
    first = client.chat.completions.create(
        model="tiny-random", max_tokens=2, messages=[system, {"role": "user", "content": "First question?"}]
    )
    second = client.chat.completions.create(
        model="tiny-random", max_tokens=2, messages=[system, {"role": "user", "content": "A different question?"}]
    )
    shared = len("<|system|>\n" + system["content"] + "\n<|user|>\n") + 1  # + BOS
    assert first.usage.prompt_tokens_details.cached_tokens < shared
    assert second.usage.prompt_tokens_details.cached_tokens >= shared


def test_image_by_data_url_and_by_http_url(client, images, media):
    def ask(url, **kw):
        return client.chat.completions.create(
            model="tiny-random",
            max_tokens=3,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe:"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
            **kw,
        )

    inline = ask(data_url(images["a.jpg"]))
    text_only = client.chat.completions.create(
        model="tiny-random",
        max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe:"}]}],
    )
    # 200x300 -> 196x308 -> grid 14x22 -> 77 LLM tokens, placed after BOS
    assert inline.usage.prompt_tokens == text_only.usage.prompt_tokens + 77
    fetched = ask(media.url("a.jpg"))
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    assert fetched.usage.prompt_tokens_details.cached_tokens >= 77  # the same bytes: the same placeholder prefix
    other = ask(media.url("b.jpg"))
    assert other.usage.prompt_tokens_details.cached_tokens <= 1  # a different image never shares it
    streamed = list(
        client.chat.completions.create(
            model="tiny-random",
            max_tokens=3,
            stream=True,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": media.url("a.jpg")}},
                        {"type": "text", "text": "Describe:"},
                    ],
                }
            ],
        )
    )
    assert sum(1 for c in streamed if c.choices and c.choices[0].finish_reason) == 1


def test_video_by_data_url(client, tmp_path):
    from mimo_epd.testing.video_gen import make_test_video

    path = tmp_path / "v.mp4"
    make_test_video(str(path), 1.0, width=128, height=96, fps=8, noise=0)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    r = client.chat.completions.create(
        model="tiny-random",
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
    )
    text_only = client.chat.completions.create(
        model="tiny-random", max_tokens=1, messages=[{"role": "user", "content": "What happens?"}]
    )
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens  # the video's embedding rows


def test_completions_text_and_token_ids(client, offline):
    from llm_backend import SamplingParams

    r = client.completions.create(
        model="tiny-random", prompt="The quick brown fox", max_tokens=12, extra_body={"ignore_eos": True}
    )
    want = offline.generate(["The quick brown fox"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert r.choices[0].text == want.text and r.object == "text_completion"
    assert r.usage.prompt_tokens == len("The quick brown fox") + 1 and r.usage.completion_tokens == 12
    ids = offline.tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(model="tiny-random", prompt=ids, max_tokens=12, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want.text
    streamed = list(
        client.completions.create(
            model="tiny-random",
            prompt="The quick brown fox",
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_models(client, worker):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]
    status, card = get_json(worker, "/v1/models/tiny-random")
    assert status == 200 and card["max_model_len"] > 0


def test_multibyte_output_streams_exactly_as_returned_whole(client, worker):
    prompt = "héllo wörld 日本語 🙂"
    kw = dict(
        model="tiny-random", prompt=prompt, max_tokens=120, temperature=1.0, seed=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw).choices[0].text
    streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert "".join(streamed) == whole
    assert any(ord(ch) > 127 and ch != "\ufffd" for ch in whole)  # real multi-byte characters came out
    native = json.loads(
        post_json(
            worker,
            "/generate",
            {
                "text": prompt,
                "sampling_params": {"max_new_tokens": 120, "temperature": 1.0, "sampling_seed": 0, "ignore_eos": True},
            },
        )
    )
    assert native["text"] == whole
    assert bytes(t for t in native["output_ids"] if t < 256).decode("utf-8", errors="replace") == whole


def test_stop_strings_span_tokens_and_are_excluded(client):
    kw = dict(
        model="tiny-random",
        prompt="Once upon a time",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    start = next(i for i in range(2, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]  # three characters: at least three tokens
    cut = full[: full.index(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 60
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(client, offline):
    from llm_backend import SamplingParams

    out = offline.generate(["abc"], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_token_ids
    stop_id = out[3]
    r = client.completions.create(
        model="tiny-random", prompt="abc", max_tokens=8, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    k = out.index(stop_id)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == offline.tokenizer.decode(out[:k])  # the stop token's own text is left out


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-random",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the top choice
        assert entry.bytes is not None
    streamed = list(
        client.chat.completions.create(
            model="tiny-random",
            messages=MESSAGES,
            max_tokens=4,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    lps = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_sglang_style_worker_endpoints(worker):
    for path in ("/get_model_info", "/model_info"):
        status, info = get_json(worker, path)
        assert status == 200 and info["model_path"] == "tiny-random" and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        status, info = get_json(worker, path)
        assert status == 200 and info["dp_size"] == 1 and info["context_length"] > 0
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/v1/models"):
        text = json.dumps(get_json(worker, path)[1])  # names, never this machine's paths, to anonymous clients
        assert os.sep + "tmp" not in text and os.path.dirname(os.path.abspath(__file__)) not in text, (path, text)
        assert "/work/" not in text and "site-packages" not in text, (path, text)
    assert get_json(worker, "/health")[0] == 200
    assert get_json(worker, "/health_generate")[0] == 200
    whole = json.loads(
        post_json(worker, "/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    )
    assert len(whole["output_ids"]) == 5 and whole["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    by_ids = json.loads(
        post_json(
            worker,
            "/generate",
            {"input_ids": [256, 97, 98, 99], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}},
        )
    )
    assert by_ids["output_ids"] == whole["output_ids"] and by_ids["meta_info"]["cached_tokens"] >= 3
    events = [
        ln[len("data: ") :]
        for ln in post_json(
            worker,
            "/generate",
            {"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}},
        ).splitlines()
        if ln.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == whole["text"] and last["meta_info"]["finish_reason"]["type"] == "length"


def test_metrics(client, worker):
    before = scrape(worker.http_address)
    client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = scrape(worker.http_address)
    assert after["llm_time_to_first_token_seconds_count"] == before["llm_time_to_first_token_seconds_count"] + 1
    assert after["llm_inter_token_latency_seconds_count"] == before["llm_inter_token_latency_seconds_count"] + 4
    assert after["llm_e2e_request_latency_seconds_count"] == before["llm_e2e_request_latency_seconds_count"] + 1
    assert after["llm_generation_tokens_total"] == before["llm_generation_tokens_total"] + 5
    assert after["llm_cached_tokens_total"] > before["llm_cached_tokens_total"]  # MESSAGES ran before
    assert after["llm_prompt_tokens_total"] > before["llm_prompt_tokens_total"]
    assert after["llm_requests_running"] == 0 and after["llm_requests_waiting"] == 0
    assert after["llm_kv_full_total_slots"] == 6000 and after["llm_kv_swa_total_slots"] == 1500
    assert 0 < after["llm_kv_full_used_slots"] <= 6000 and after["llm_prefix_cache_hit_tokens_total"] > 0


def test_tokenize_and_detokenize(worker):
    """vLLM's /tokenize and /detokenize: text with and without special tokens, chat messages rendered as
    /v1/chat/completions renders them (the count equals that request's prompt_tokens, an image's rows included),
    token strings, the round trip, and ids outside the vocabulary refused by field."""
    t = json.loads(post_json(worker, "/tokenize", {"prompt": "abc", "return_token_strs": True}))
    assert t["tokens"] == [256, 97, 98, 99] and t["count"] == 4 and t["max_model_len"] > 0
    assert t["token_strs"][1:] == ["a", "b", "c"]
    bare = json.loads(post_json(worker, "/tokenize", {"prompt": "abc", "add_special_tokens": False}))
    assert bare["tokens"] == [256, 97, 98, 99] and bare["token_strs"] is None  # the byte tokenizer: BOS always
    assert json.loads(post_json(worker, "/detokenize", {"tokens": [97, 98, 99]})) == {"prompt": "abc"}
    chat = json.loads(post_json(worker, "/tokenize", {"model": "tiny-random", "messages": MESSAGES}))
    done = json.loads(post_json(worker, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}))
    assert chat["count"] == done["usage"]["prompt_tokens"] == len(chat["tokens"])
    no_gen = json.loads(post_json(worker, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}))
    assert no_gen["count"] < chat["count"] and chat["tokens"][: no_gen["count"]] == no_gen["tokens"]
    for path, body, param in (
        ("/detokenize", {"tokens": [97, -1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            post_json(worker, path, body)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == param, err
    with pytest.raises(urllib.error.HTTPError) as e:
        post_json(worker, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert e.value.code == 404


def test_tokenize_counts_an_images_rows(worker, images):
    """A chat with an image: /tokenize encodes it (its rows are placeholder ids past the vocabulary, their strings
    null) and counts what the chat completion counts."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(images["a.jpg"])}},
                {"type": "text", "text": "?"},
            ],
        }
    ]
    t = json.loads(post_json(worker, "/tokenize", {"messages": messages, "return_token_strs": True}))
    done = json.loads(post_json(worker, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    assert t["count"] == done["usage"]["prompt_tokens"]
    rows = [i for i, s in enumerate(t["token_strs"]) if s is None]
    assert rows and all(t["tokens"][i] >= 258 for i in rows)
