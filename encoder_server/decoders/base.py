"""What every decoder takes and returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .probe import Probe


class Stage(enum.Enum):
    """How far along the pixels of a `Decoded` are."""

    DECODED = "decoded"  # HxWx3 uint8 at the source size (or a JPEG draft scale of it)
    RESIZED = "resized"  # HxWx3 uint8 at the smart_resize target
    PATCHES = "patches"  # resized and cut into uint8 still-image patches [patches, 3*P*P]


@dataclass
class Decoded:
    pixels: Any  # numpy uint8 array, or a torch tensor on the device for the GPU decode path
    source_size: tuple[int, int]  # (h, w) after EXIF orientation, before any draft/resize
    draft_scale: int = 1  # 1 = full decode; 2/4/8 = JPEG decoded at that reduced DCT scale
    stage: Stage = Stage.DECODED

    @classmethod
    def of(cls, probe: "Probe", pixels, drafted: bool) -> "Decoded":
        """Freshly decoded pixels of `probe`'s image; `drafted`: decoded at a reduced DCT scale (JPEG draft)."""
        if not drafted:  # full size: the decoded shape is the source size
            return cls(pixels, (int(pixels.shape[0]), int(pixels.shape[1])), 1, Stage.DECODED)
        source = probe.oriented_size  # drafts are JPEG-only, whose orientation the probe read
        return cls(pixels, source, max(1, round(source[0] / int(pixels.shape[0]))), Stage.DECODED)

    @property
    def resized(self) -> bool | str:
        """The former spelling of `stage`: False, True, or "patches". Prefer `stage`."""
        return {Stage.DECODED: False, Stage.RESIZED: True, Stage.PATCHES: "patches"}[self.stage]


@dataclass(frozen=True)
class DecodeRequest:
    probe: "Probe"  # the header, opened once for this image (see probe.py)
    draft_size: tuple[int, int] | None = None  # (w, h) in stored orientation: JPEG may decode down to it
    rgbx: bool = False  # the turbo path may return HxWx4 (RGB + padding), which PIL wraps without a copy
    device: str | None = None  # a torch device: the pixels come back as a tensor there (GPU decode path)


class Decoder(Protocol):
    name: str

    def decode(self, data: bytes, request: DecodeRequest) -> Decoded:
        """Decodes `data` to oriented RGB pixels (stage DECODED). Raises `errors.DecodeError` for bad input."""
        ...
