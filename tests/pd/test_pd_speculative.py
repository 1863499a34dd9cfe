"""P/D with MTP speculation, real processes: a prefill worker and a decode worker both started with
`--speculative-steps 3` (the shipped `tiny` model, trained, with its three MTP layers), against a colocated worker
without speculation and one with. The MTP layers' KV moves with the rest (window-only, like every sliding layer), so the decode
worker drafts from its first steps: greedy outputs are the colocated worker's token for token, drafts are accepted,
and the bytes moved are the transfer rule's over the pools with the MTP layers."""

from __future__ import annotations

import pytest

from llm_backend.kv.transfer import PoolLayout
from llm_backend.models import load_llm
from llm_backend.paged_attention import KVPools
from llm_backend.tokenizer import load_tokenizer
from mimo_epd.testing.servers import scrape
from tests.conftest import start_server
from tests.pd.test_pd_live import ids_request, port, stream

pytestmark = pytest.mark.integration

COMMON = ["--model", "tiny", "--torch-threads", "1", "--http-port", "0", "--kv-cache-tokens", "6000"]
SPEC = ["--speculative-steps", "3", "--no-speculative-auto"]


@pytest.fixture(scope="module")
def fleet():
    encoder = start_server(["--decode-workers", "1"])
    common = COMMON + ["--encoder", encoder.address]
    both = start_server(common, "llm")
    spec = start_server(common + SPEC, "llm")
    pre = start_server(common + SPEC + ["--role", "prefill"], "llm")
    dec = start_server(
        common + SPEC + ["--role", "decode", "--pd-prefill", pre.address, "--pd-local-prefill-tokens", "0"], "llm"
    )
    yield both, spec, pre, dec
    for s in (dec, pre, spec, both):
        assert s.stop() == 0
    encoder.stop()


def test_disaggregated_speculation_equals_colocated_plain_decoding(fleet):
    both, spec, pre, dec = fleet
    model = load_llm("tiny")
    pools = KVPools(model.config, 1, 1)
    plain_full, plain_swa = PoolLayout.of(pools).token_bytes()
    pools.add_sliding_layers(model.model.mtp.kv_config(), 1)
    full_b, swa_b = PoolLayout.of(pools).token_bytes()
    assert swa_b > plain_swa and full_b == plain_full  # the MTP layers' window moves too
    w = model.config.window
    tok = load_tokenizer("tiny")
    # Python-documentation-like text the model was trained on: the MTP layers draft well there
    text = "The json module can serialize Python objects. The json module can parse JSON text into objects. "
    for n, prompt in enumerate([text * 4, "Return a new list containing all items from the iterable in order."]):
        ids = tok.encode(prompt)
        want, _ = stream(both.address, ids_request(ids, 24))
        got, final = stream(dec.address, ids_request(ids, 24))
        colocated, cfinal = stream(spec.address, ids_request(ids, 24))
        assert got == want == colocated and len(got) == 24, n
        # the decode side drafts from the MTP entries the prefill worker computed: as many accepted as a colocated
        # speculating worker, but for its first step (it has no hidden state before its first token: no draft)
        assert final.accepted_prediction_tokens >= cfinal.accepted_prediction_tokens - 3 > 0, n
        assert final.prefill_address == pre.address
        length, prefix = len(ids), final.cached_tokens
        assert final.kv_transfer_bytes == (length - prefix) * full_b + (length - max(prefix, length - 1 - w)) * swa_b
    m = scrape(port(dec))
    assert m["llm_spec_accepted_tokens_total"] > 0 and m["llm_pd_remote_prefills"] >= 2


def test_a_constrained_request_is_constrained_from_its_first_token(fleet):
    """Grammar with P/D and speculation: the prefill worker samples the first token under the request's constraint
    (PrefillRequest.constraint), the decode worker drafts and verifies the rest under it; the output is the
    colocated constrained output token for token, and it matches the constraint."""
    import re

    from mimo_epd.v1 import generator_pb2

    both, spec, pre, dec = fleet
    tok = load_tokenizer("tiny")
    ids = tok.encode("The answer is one of: spam, eggs, ham. The answer is")
    pattern = r" (spam|eggs|ham)[.!]"

    def constrained(address):
        req = ids_request(ids, 16)
        req.sampling.ignore_eos = False
        req.constraint.CopyFrom(generator_pb2.OutputConstraint(regex=pattern))
        return stream(address, req)

    want, _ = constrained(both.address)
    got, final = constrained(dec.address)
    assert got == want and final.prefill_address == pre.address
    text = tok.decode([t for t in got if t not in (tok.eos_token_id,)])
    assert re.fullmatch(pattern, text), text
    free, _ = stream(dec.address, ids_request(ids, 16))
    assert free != got  # the constraint changed the output (the comparison can fail)


def test_an_image_prompt_with_speculation_equals_colocated(fleet):
    """Images through P/D and speculation: the MTP layers embed the image rows as the target does (on both roles),
    and the output is the colocated worker's."""
    from mimo_epd.v1 import encoder_pb2, generator_pb2
    from tests.conftest import encode_image, textured

    both, spec, pre, dec = fleet
    img = encode_image(textured(200, 300, seed=5), "JPEG")
    req = generator_pb2.GenerateRequest(
        prompt="Describe the picture:",
        media=[encoder_pb2.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=16, ignore_eos=True),
    )
    want, fw = stream(both.address, req)
    got, fg = stream(dec.address, req)
    assert got == want and fg.media_tokens == fw.media_tokens > 0 and fg.prefill_address == pre.address


def test_sampling_controls_through_p_d(fleet):
    """The first token is sampled on the prefill worker: the request's sampling controls go with the room
    (PrefillRequest), so a penalised / biased request is the colocated one token for token from its first token."""
    import json
    import urllib.request

    both, spec, pre, dec = fleet
    ids = load_tokenizer("tiny").encode("1 2 3 4 5 6")

    def complete(server, **kw):
        body = {"prompt": ids, "max_tokens": 12, "temperature": 0, **kw}
        req = urllib.request.Request(
            f"http://{server.http_address}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    plain = complete(both)
    first = load_tokenizer("tiny").encode(plain)[0] if plain else 0
    kw = dict(repetition_penalty=1.4, presence_penalty=1.0, logit_bias={str(first): -50}, min_tokens=12)
    want = complete(both, **kw)
    assert complete(dec, **kw) == want != plain
    m = scrape(port(dec))
    assert m["llm_pd_remote_prefills"] >= 1


def test_an_audio_prompt_with_speculation_equals_colocated(fleet, tmp_path):
    """Audio through P/D and speculation: the prefill worker encodes the clip again (its rows at the same
    placeholder positions), the decode worker drafts over them; the answer is the colocated one."""
    import base64

    import openai

    from mimo_epd.testing.audio_gen import make_test_audio

    both, spec, pre, dec = fleet
    make_test_audio(str(tmp_path / "a.wav"), 2.0, seed=3)
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode((tmp_path / "a.wav").read_bytes()).decode(), "format": "wav"},
    }
    messages = [{"role": "user", "content": [{"type": "text", "text": "Transcribe:"}, part]}]

    def ask(server):
        client = openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key="unused", max_retries=0)
        return client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )

    want, got = ask(both), ask(dec)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > 40  # the clip's rows are in both prompts
    assert scrape(port(dec))["llm_pd_remote_prefills"] >= 1


def test_sampled_outputs_through_p_d_and_speculation_have_colocated_plain_distribution(fleet):
    """Speculative sampling is lossless in distribution, not draw for draw: 64 seeded, sampled requests through P/D
    with speculation against the same 64 on the colocated worker without it. The first token is sampled on the
    prefill worker from the same seed, so it is the same draw; for the later positions, how often the sample is the
    greedy token is the same proportion in both (a two-proportion z-test; a biased verifier, e.g. one that kept a
    draft without the rejection test, moves it by far more than the bound)."""
    import math

    both, spec, pre, dec = fleet
    tok = load_tokenizer("tiny")
    text = "The json module can serialize Python objects. The json module can parse JSON text into objects. "
    ids = tok.encode(text * 3)  # text the model was trained on: confident enough for the statistic to inform
    greedy, _ = stream(both.address, ids_request(ids, 4))
    hits = {"plain": 0, "pd": 0}
    n, positions = 64, (1, 2, 3)
    for seed in range(n):
        outs = {}
        for name, srv in (("plain", both), ("pd", dec)):
            req = ids_request(ids, 4)
            req.sampling.temperature, req.sampling.seed, req.sampling.has_seed = 0.8, seed, True
            outs[name], _ = stream(srv.address, req)
            hits[name] += sum(outs[name][j] == greedy[j] for j in positions)
        assert outs["pd"][0] == outs["plain"][0], seed  # the first token: the prefill worker's draw, same seed
    p1, p2 = hits["plain"] / (n * len(positions)), hits["pd"] / (n * len(positions))
    pooled = (hits["plain"] + hits["pd"]) / (2 * n * len(positions))
    z = (p1 - p2) / math.sqrt(max(pooled * (1 - pooled) * 2 / (n * len(positions)), 1e-12))
    assert 0.05 < pooled < 0.95, pooled  # the statistic carries information at this temperature
    assert abs(z) < 4, (p1, p2, z)
