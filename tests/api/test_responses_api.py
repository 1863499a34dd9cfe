"""The OpenAI Responses API (`POST /v1/responses`) through the official `openai` client's `responses` resource against
a real worker on the shipped `tiny` model: the answer equals the chat API's for the same conversation (instructions,
input items, greedy), `max_output_tokens` makes it `incomplete`, streamed equals whole (the client parses every
event), a forced function call comes back as a `function_call` item and its output can be sent back, a JSON schema
in `text.format` constrains the output, and bad requests are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def oai(tiny_worker):
    return openai.OpenAI(base_url=f"http://{tiny_worker.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_response_equals_the_chat_answer(oai):
    system, user = "You answer briefly.", "How do I read a JSON file in Python?"
    r = oai.responses.create(model="tiny", instructions=system, input=user, max_output_tokens=24, temperature=0)
    c = oai.chat.completions.create(
        model="tiny",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert [i.type for i in r.output] == ["message"] and r.output_text == c.choices[0].message.content
    assert r.status == {"length": "incomplete", "stop": "completed"}[c.choices[0].finish_reason]
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == c.usage.completion_tokens and r.usage.input_tokens == c.usage.prompt_tokens


def test_input_items_stream_equal_whole(oai):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a Python module for dates."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "datetime"}]},
        {"role": "user", "content": "And one for paths?"},
    ]
    whole = oai.responses.create(model="tiny", input=items, max_output_tokens=32, temperature=0)
    deltas, kinds, final = [], [], None
    for ev in oai.responses.create(model="tiny", input=items, max_output_tokens=32, temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "".join(deltas) == whole.output_text and final is not None and final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_function_call_and_its_output(oai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(
        model="tiny",
        input=ask,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = ask + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"},
    ]
    answer = oai.responses.create(model="tiny", input=follow, tools=[WEATHER], max_output_tokens=16, temperature=0)
    assert answer.usage.output_tokens > 0 and answer.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema_constrains_the_output(oai):
    schema = {
        "type": "object",
        "properties": {"topic": {"type": "string", "maxLength": 30}},
        "required": ["topic"],
        "additionalProperties": False,
    }
    r = oai.responses.create(
        model="tiny",
        input="Describe lists in JSON.",
        text={"format": {"type": "json_schema", "name": "topic", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(input="x", previous_response_id="resp_never"), "previous_response_id"),
        (dict(input=[]), "input"),
        (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input="x", text={"format": {"type": "yaml"}}), "text.format.type"),
        (dict(input="x", max_output_tokens=-1), "max_tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(oai, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", **kw)
    assert field in str(e.value)


def test_an_unknown_field_is_named(tiny_worker):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://{tiny_worker.http_address}/v1/responses",
        data=json.dumps({"model": "tiny", "input": "x", "frobnicate": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and body["error"]["param"] == "frobnicate"


def test_a_truncated_response_and_its_last_item_are_incomplete(oai):
    """Cut by `max_output_tokens`: the response is `incomplete` and so is the item the limit cut (vLLM reports the
    item `completed`: vllm#57998); streamed, the terminal event is `response.incomplete` (OpenAI's reference)."""
    r = oai.responses.create(model="tiny", input="Tell me a long story.", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.output[-1].status == "incomplete"
    last = list(
        oai.responses.create(
            model="tiny", input="Tell me a long story.", max_output_tokens=4, temperature=0, stream=True
        )
    )
    assert last[-1].type == "response.incomplete" and last[-1].response.output[-1].status == "incomplete"
    done = [e for e in last if e.type == "response.output_item.done"]
    assert done and done[-1].item.status == "incomplete"
    assert [e.sequence_number for e in last] == list(range(len(last)))


def test_previous_response_id_continues_a_stored_conversation(oai):
    """The follow-up by id equals sending the whole conversation (instructions not carried over, as OpenAI's);
    `store: false` keeps nothing; a chain of three works; the id of an unknown answer is a 400 naming the field."""
    first = oai.responses.create(
        model="tiny",
        instructions="Be brief.",
        input="Name a Python web framework.",
        max_output_tokens=12,
        temperature=0,
    )
    assert first.store is True
    by_id = oai.responses.create(
        model="tiny", previous_response_id=first.id, input="And another one?", max_output_tokens=12, temperature=0
    )
    whole = oai.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Name a Python web framework."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another one?"},
        ],
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    assert by_id.output_text == whole.output_text and by_id.usage.input_tokens == whole.usage.input_tokens
    assert by_id.previous_response_id == first.id and whole.store is False
    third = oai.responses.create(
        model="tiny", previous_response_id=by_id.id, input="Thanks.", max_output_tokens=4, temperature=0
    )
    assert third.usage.input_tokens > by_id.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", previous_response_id=whole.id, input="x", max_output_tokens=4)
    assert "previous_response_id" in str(e.value) and "not stored" in str(e.value)


def test_the_store_is_bounded_and_expires():
    from llm_backend.server.core import ServeError
    from llm_backend.server.responses_protocol import ResponseStore

    store = ResponseStore(size=2, ttl_s=0.2)
    for rid in ("a", "b", "c"):
        assert store.put(rid, {}, [{"role": "user", "content": rid}], {"content": "ok"})
    with pytest.raises(ServeError, match="not stored"):
        store.get("a")  # the oldest, dropped at the bound
    assert store.get("c") == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "ok"}]
    import time

    time.sleep(0.25)
    with pytest.raises(ServeError, match="not stored"):
        store.get("c")  # expired
    assert not ResponseStore(size=0).put("x", {}, [], {"content": "ok"})


def test_metrics_per_endpoint(oai, tiny_worker):
    """Each endpoint counted by route and status, and timed; unknown paths share one `unmatched` series."""
    from tests.api.conftest import scrape

    def counts():
        m = scrape(tiny_worker.http_address)
        return {k: v for k, v in m.items() if k.startswith("llm_http_requests_total")}

    before = counts()
    oai.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0)
    oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="tiny", input=[])
    import urllib.error
    import urllib.request

    for path in ("/nope-1", "/nope-2"):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://{tiny_worker.http_address}{path}", timeout=10)
    after = counts()

    def grew(endpoint, status):
        key = f'llm_http_requests_total{{endpoint="{endpoint}",status="{status}"}}'
        return after.get(key, 0) - before.get(key, 0)

    assert grew("/v1/responses", 200) == 1 and grew("/v1/responses", 400) == 1
    assert grew("/v1/chat/completions", 200) == 1 and grew("unmatched", 404) == 2
    m = scrape(tiny_worker.http_address)
    assert m['llm_http_request_seconds_count{endpoint="/v1/responses"}'] >= 2


@pytest.mark.parametrize("field, value", [("min_p", 0.1), ("use_beam_search", True), ("truncate_prompt_tokens", 8)])
def test_vllm_extensions_not_applied_are_refused_by_name(oai, field, value):
    """vLLM's sampling extensions this server does not apply are 400s naming them, not silently ignored; their
    no-op values pass."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={field: value}
        )
    assert field in str(e.value)
    ok = oai.completions.create(
        model="tiny", prompt="x", max_tokens=2, extra_body={"min_p": 0, "use_beam_search": False}
    )
    assert ok.usage.completion_tokens == 2 or ok.choices[0].finish_reason == "stop"


def test_an_image_input_equals_the_chat_answer_with_the_same_image(worker, images):
    """`input_image` (a data: URI) through the encoder service: the same prompt tokens (media rows included) and
    the same greedy answer as the chat API given the image as `image_url`."""
    from tests.api.test_openai_api import data_url

    url = data_url(images["a.jpg"])
    oai = openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.responses.create(
        model="tiny-random",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is it?"}],
            }
        ],
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    c = oai.chat.completions.create(
        model="tiny-random",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
            }
        ],
        max_tokens=6,
        temperature=0,
    )
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.input_tokens > 100  # the image's rows are in the prompt


def test_reasoning_items_and_their_stream_events_parse_as_the_client_types():
    """A message with reasoning, text and a tool call (agentic/output.py's shape) as output items and as stream
    events, each validated by the `openai` client's own models (the shipped model's thinking is empty at greedy,
    so the shapes are checked here, the live path by the tests above)."""
    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    from llm_backend.server import responses_protocol as rp

    message = {
        "reasoning_content": "Light scatters.",
        "content": "Rayleigh scattering.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    items = rp.items(message, "completed")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    resp = Response.model_validate(rp.response_object("resp_1", "tiny", {}, items, "completed", None))
    assert resp.output[0].content[0].text == "Light scatters." and resp.output_text == "Rayleigh scattering."
    si = rp.StreamItems()
    events = []
    for delta in (
        {"reasoning_content": "Light "},
        {"reasoning_content": "scatters."},
        {"content": "Rayleigh "},
        {"content": "scattering."},
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ):
        events += si.push(delta)
    events += si.close("completed")
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(data) for _, data in events]
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "response.reasoning_text.done" in kinds and kinds[-1] == "response.output_item.done"
    done = [e.item for e in parsed if e.type == "response.output_item.done"]
    assert [d.type for d in done] == ["reasoning", "message", "function_call"]
    assert done[0].content[0].text == "Light scatters." and done[2].arguments == '{"a": 1}'
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
