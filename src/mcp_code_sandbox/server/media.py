"""Fit images into the per-image budget of a tool result (Pillow; run in a worker thread).

Images come from hostile code: a file may claim to be a PNG and be anything, or be a
decompression bomb (a few kilobytes that declare 100,000 x 100,000 pixels), or simply be
big enough to keep a CPU busy for seconds. So:

- Only PNG, JPEG, GIF and WebP are opened: no other Pillow plugin ever sees the bytes
  (EPS, for one, would hand them to Ghostscript).
- ``Image.open`` reads the header only. An image is decoded only when its pixel count is
  at most :data:`MAX_PIXELS`, far below Pillow's own bomb limit (89 megapixels); a JPEG is
  first put in draft mode, which decodes it at 1/2, 1/4 or 1/8 scale, so a big photo
  costs what its preview needs. A bigger image is not decoded at all: its file is still
  listed and linked, only the preview is skipped (``None``).
- An image within the byte budget and the pixel cap goes back as it is, never decoded
  here; a bigger one is reduced to :data:`MAX_SIDE` pixels on its long side (``reduce``
  first, cheaply, then a proper resample) and re-encoded until it fits.

Pillow's ``DecompressionBombWarning`` (an error where warnings are errors, as in the
tests) and ``DecompressionBombError`` mean the same as our own cap: no preview. So does
any other failure to read the bytes.
"""

from __future__ import annotations

import io
import math

from PIL import Image

__all__ = ["FORMATS", "MAX_PIXELS", "MAX_SIDE", "fit_image"]

#: Most pixels ever decoded for one preview (4096 x 4096, 64 MiB as RGBA).
MAX_PIXELS = 4096 * 4096
#: Long side of a re-encoded preview: models see images scaled to about this anyway.
MAX_SIDE = 2048
#: The formats we open, with the MIME type a result gives them.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
#: MIME types of what those formats' plugins may return (a JPEG with several pictures
#: in it comes back as MPO).
_MIME = {**FORMATS, "MPO": "image/jpeg"}


def fit_image(data: bytes, mime_type: str, max_bytes: int) -> tuple[bytes, str] | None:
    """Return ``(bytes, mime)`` at most ``max_bytes`` long, or ``None`` when no preview can
    be made within the caps. ``mime_type`` is what the caller believes; the header decides.
    """
    # The bytes are hostile and Pillow's plugins fail in many ways on crafted input
    # (OSError, SyntaxError, struct.error, ...; the bomb warning where warnings are
    # errors): whatever it is, there is no preview, and the run's result stands.
    try:
        image = _open(data)
    except Exception:
        return None
    with image:
        mime = _MIME.get(str(image.format))
        if mime is None:
            return None
        if len(data) <= max_bytes and image.width * image.height <= MAX_PIXELS:
            return data, mime
        if mime == "image/jpeg":
            image.draft("RGB", _bounded(image.size, MAX_SIDE))
        if image.width * image.height > MAX_PIXELS:
            return None
        try:
            image.load()
            return _shrink(image, max_bytes)
        except Exception:
            return None


def _open(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    if image.width < 1 or image.height < 1:
        image.close()
        raise ValueError("an image without pixels")
    return image


def _bounded(size: tuple[int, int], side: int) -> tuple[int, int]:
    """``size`` scaled down (never up) so that its long side is at most ``side``."""
    width, height = size
    scale = min(1.0, side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def _shrink(image: Image.Image, max_bytes: int) -> tuple[bytes, str] | None:
    if image.mode not in ("RGB", "RGBA", "L", "LA"):
        image = image.convert("RGBA")  # palette and odd modes resample badly
    if max(image.size) > MAX_SIDE:
        # reducing_gap: a cheap box reduce() to about 3x the target, then LANCZOS.
        image = image.resize(
            _bounded(image.size, MAX_SIDE), Image.Resampling.LANCZOS, reducing_gap=3.0
        )
    scale = 1.0
    for _ in range(8):
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        resized = image if scale == 1.0 else image.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        resized.save(out, format="PNG")
        if out.tell() <= max_bytes:
            return out.getvalue(), "image/png"
        out = io.BytesIO()
        resized.convert("RGB").save(out, format="JPEG", quality=85)
        if out.tell() <= max_bytes:
            return out.getvalue(), "image/jpeg"
        scale *= max(0.3, min(0.9, math.sqrt(max_bytes / out.tell()) * 0.9))
    return None
