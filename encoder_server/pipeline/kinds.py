"""Media kinds: what differs between an image, a video and an audio item on their way through the stages.

A `MediaKind` says, for items of its modality: how the item's options are checked on arrival (`prepare`,
which also returns the part of the content key the options contribute), what shapes the embedding besides
the bytes (`key_parts`: the model id and the preprocessing/feature fingerprint), how many bytes an item may
have (`max_bytes`), and where its bytes go once fetched (`route`). `KINDS` is the registry the stages look a
modality up in; a new kind is one class here and a path for its `route`.
"""

from __future__ import annotations

import grpc

from ..errors import ItemError, invalid
from .jobs import Job, Next


class MediaKind:
    name = ""
    route = Next.DECODE

    def prepare(self, stages, job: Job) -> str:
        """Checks the item's options; returns the content key's `extra` part."""
        return ""

    def key_parts(self, stages) -> tuple[str, str]:
        return stages.model_id, stages.fingerprint

    def max_bytes(self, config) -> int | None:
        return None  # --max-item-bytes


class ImageKind(MediaKind):
    name = "image"


class VideoKind(MediaKind):
    name = "video"
    route = Next.VIDEO

    def prepare(self, stages, job: Job) -> str:
        try:
            job.sampling = stages.video_sampling(job.request)
        except ValueError as e:
            raise invalid(str(e)) from None
        return f"video:{job.sampling.fingerprint()}"

    def max_bytes(self, config) -> int | None:
        return config.max_video_bytes


class AudioKind(MediaKind):
    name = "audio"
    route = Next.AUDIO

    def prepare(self, stages, job: Job) -> str:
        if not stages.audio_model_id:
            raise ItemError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server has no audio tower (its model has no audio_config; see --audio-model)",
            )
        return "audio"

    def key_parts(self, stages) -> tuple[str, str]:
        return stages.audio_model_id, stages.audio_fingerprint

    def max_bytes(self, config) -> int | None:
        return config.max_audio_bytes


KINDS: dict[str, MediaKind] = {k.name: k for k in (ImageKind(), VideoKind(), AudioKind())}


def kind_of(modality: str) -> MediaKind:
    try:
        return KINDS[modality]
    except KeyError:
        raise ItemError(grpc.StatusCode.UNIMPLEMENTED, f"modality {modality} is not supported by this server") from None
