"""JPEG draft decode: when the smart_resize target is at most half the source in both dimensions, a JPEG
is decoded directly at the largest DCT scale (1/2, 1/4, 1/8) whose result is still at least the target,
then resized as usual (docs/decoding.md gives the measured bound on the difference from a full decode)."""

from __future__ import annotations

from ..preprocess import PreprocessConfig, target_size
from .probe import Probe


def draft_size(probe: Probe, preprocess: PreprocessConfig | None) -> tuple[int, int] | None:
    """The size to decode down to, (w, h) in the stored orientation (what PIL's `draft` takes), or None for a
    full decode: not a JPEG, no preprocessing to aim at, MiMo's processor, or a target above half the source."""
    if probe.format != "JPEG" or preprocess is None or preprocess.exact_floats:
        return None  # MiMo's processor resizes the whole image's pixels: a draft's would differ
    oh, ow = probe.oriented_size
    try:
        th, tw = target_size(oh, ow, preprocess)
    except ValueError:
        return None  # refused by the resize rules: the resize reports it
    if th * 2 > oh or tw * 2 > ow:
        return None
    return (th, tw) if probe.swapped else (tw, th)


def dct_scale(size: tuple[int, int], draft: tuple[int, int] | None) -> int:
    """The DCT scale denominator PIL's JPEG `draft` picks for stored `size` (w, h): the largest of 8/4/2/1 not
    above the ratio. The turbo backend asks libjpeg-turbo for the same one, so both give the same pixels."""
    if not draft:
        return 1
    ratio = min(size[0] // max(draft[0], 1), size[1] // max(draft[1], 1))
    return next(s for s in (8, 4, 2, 1) if ratio >= s)
