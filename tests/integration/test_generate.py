"""gRPC Generate end to end: streaming equals the offline engine, an image through a real encoder,
and cancellation freeing the KV."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from llm_backend import LLM, SamplingParams
from mimo_epd.v1 import encoder_pb2, generator_pb2, generator_pb2_grpc
from tests.conftest import ROOT, encode_image, start_server, textured

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def encoder():
    s = start_server(["--decode-workers", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def worker(encoder):
    s = start_server(
        # tiny-random: the byte tokenizer, the prompt lengths below count bytes
        [
            "--model",
            "tiny-random",
            "--encoder",
            encoder.address,
            "--kv-cache-tokens",
            "6000",
            "--swa-cache-tokens",
            "1500",
        ],
        subcommand="llm",
    )
    yield s
    assert s.stop() == 0


def stream(address, req, timeout=120):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(address))
    tokens, final = [], None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.HasField("delta"):
            tokens += list(msg.delta.token_ids)
        else:
            final = msg.final
    return tokens, final


def test_streaming_equals_offline_engine(worker):
    req = generator_pb2.GenerateRequest(
        prompt="The quick brown fox", sampling=generator_pb2.SamplingOptions(max_tokens=12)
    )
    tokens, final = stream(worker.address, req)
    want = LLM("tiny-random").generate(["The quick brown fox"], SamplingParams(max_tokens=12))[0].output_token_ids
    assert tokens == want
    assert final.completion_tokens == 12 and final.prompt_tokens == len("The quick brown fox") + 1
    assert final.ttft_ms > 0 and final.finish_reason == "length"
    again, final2 = stream(worker.address, req)
    assert again == tokens and final2.cached_tokens > 0  # the prompt is in the radix cache now


def test_image_through_the_encoder(worker):
    img = encode_image(textured(200, 300, seed=3), "JPEG")
    req = generator_pb2.GenerateRequest(
        prompt="Describe:",
        media=[encoder_pb2.MediaItem(data=img)],
        sampling=generator_pb2.SamplingOptions(max_tokens=6),
    )
    tokens, final = stream(worker.address, req)
    assert len(tokens) == 6
    # 200x300 -> 196x308 -> grid 14x22 -> 77 LLM tokens
    assert final.media_tokens == 77 and final.prompt_tokens == 77 + len("Describe:") + 1
    _, again = stream(worker.address, req)
    assert again.cached_tokens >= 77  # the same image gives the same placeholder ids: a prefix hit
    other = encode_image(textured(200, 300, seed=4), "JPEG")
    _, diff = stream(
        worker.address,
        generator_pb2.GenerateRequest(
            prompt="Describe:",
            media=[encoder_pb2.MediaItem(data=other)],
            sampling=generator_pb2.SamplingOptions(max_tokens=2),
        ),
    )
    assert diff.cached_tokens <= 1  # a different image never shares the placeholder prefix (BOS at most)


def test_cancellation_frees_the_kv(worker):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address))
    call = stub.Generate(
        generator_pb2.GenerateRequest(prompt="x" * 50, sampling=generator_pb2.SamplingOptions(max_tokens=5000)),
        timeout=300,
    )
    next(call)  # the request is running
    call.cancel()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any("aborted: freeing" in ln for ln in worker.stderr_lines):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the cancelled request was not aborted: " + "".join(worker.stderr_lines[-10:]))
    tokens, final = stream(
        worker.address,
        generator_pb2.GenerateRequest(prompt="still serving", sampling=generator_pb2.SamplingOptions(max_tokens=3)),
    )
    assert len(tokens) == 3


def test_errors(worker):
    stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address))
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(generator_pb2.GenerateRequest(prompt_token_ids=[10**6]), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A negative id (int32 on the wire) is refused the same way, by field and position, with no traceback.
    for ids, stop, field in (([1, -1], [], "prompt_token_ids[1] = -1"), ([1, 2], [3, -(2**31)], "stop_token_ids[1]")):
        with pytest.raises(grpc.RpcError) as ei:
            req = generator_pb2.GenerateRequest(
                prompt_token_ids=ids, sampling=generator_pb2.SamplingOptions(max_tokens=2, stop_token_ids=stop)
            )
            list(stub.Generate(req, timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details(), ei.value
    assert not any("Traceback" in ln or "OverflowError" in ln for ln in worker.stderr_lines)
    with pytest.raises(grpc.RpcError) as ei:
        list(
            stub.Generate(
                generator_pb2.GenerateRequest(prompt="x", media=[encoder_pb2.MediaItem(data=b"junk")]), timeout=30
            )
        )
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "item 0" in ei.value.details()


def test_cli_generate_with_image(worker, tmp_path):
    f = tmp_path / "a.jpg"
    f.write_bytes(encode_image(textured(120, 160, seed=5), "JPEG"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "generate",
            "--server",
            worker.address,
            "--prompt",
            "hi",
            "--image",
            str(f),
            "--max-tokens",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (
        '"completion_tokens": 4' in r.stderr and '"media_tokens": 24' in r.stderr
    )  # 120x160 -> 112x168 -> 8x12 patches


def test_stop_strings_and_ignore_eos_over_grpc(worker):
    sampling = dict(max_tokens=24, ignore_eos=True, temperature=0.9, seed=5, has_seed=True)
    base = generator_pb2.GenerateRequest(prompt="Stop here", sampling=generator_pb2.SamplingOptions(**sampling))
    chunks = []
    for msg in generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address)).Generate(base, timeout=120):
        if msg.HasField("delta"):
            chunks.append(msg.delta.text)
        else:
            assert msg.final.finish_reason == "length" and msg.final.completion_tokens == 24
    text = "".join(chunks)
    stop = text[5:7]  # two characters from the middle of the unconstrained text
    assert len(stop) == 2
    req = generator_pb2.GenerateRequest(
        prompt="Stop here", sampling=generator_pb2.SamplingOptions(**sampling, stop=[stop])
    )
    got, final = [], None
    for msg in generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address)).Generate(req, timeout=120):
        if msg.HasField("delta"):
            got.append(msg.delta.text)
        else:
            final = msg.final
    assert final.finish_reason == "stop"
    assert "".join(got) == text[: text.index(stop)]  # the stop string and what follows are not part of the text
    with pytest.raises(grpc.RpcError) as e:
        list(
            generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(worker.address)).Generate(
                generator_pb2.GenerateRequest(prompt="x", sampling=generator_pb2.SamplingOptions(stop=[""])), timeout=60
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in e.value.details()
