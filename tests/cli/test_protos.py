"""The committed gRPC stubs are what `make protos` generates from protos/ today."""

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_generated_stubs_are_current(tmp_path):
    protos = sorted(str(p.relative_to(Path(ROOT, "protos"))) for p in Path(ROOT, "protos").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            os.path.join(ROOT, "protos"),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    stale = [str(g) for g in generated if not filecmp.cmp(tmp_path / g, Path(ROOT, g), shallow=False)]
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_stubs_import_and_describe_the_contract():
    from mimo_epd.v1 import encoder_pb2, encoder_pb2_grpc

    svc = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"]
    assert [m.name for m in svc.methods] == ["Encode", "Transfer"]
    item = encoder_pb2.MediaItem(url="http://x/y.jpg", modality=encoder_pb2.VIDEO, content_hash="ab")
    assert item.WhichOneof("source") == "url"
    fields = {f.name for f in encoder_pb2.ItemEmbedding.DESCRIPTOR.fields}
    assert fields == {
        "content_key",
        "embedding",
        "grid_thw",
        "num_tokens",
        "cache_hit",
        "timings",
        "timestamps_s",
        "video",
        "audio",
        "window_tokens",
        "end_s",
        "held",
    }
    assert {f.name for f in encoder_pb2.HeldRows.DESCRIPTOR.fields} == {"encoder", "id", "bytes"}
    assert hasattr(encoder_pb2_grpc, "EncoderStub")
