"""Fit images into the per-image budget of a tool result (Pillow, off the event loop).

Images come from hostile code: a file may claim to be a PNG and be anything, or be a
decompression bomb. Anything Pillow cannot read safely is dropped (the file is still
linked), never passed through unchecked when it is over budget.
"""

from __future__ import annotations

import io
import math
import warnings

from PIL import Image

__all__ = ["MAX_PIXELS", "fit_image"]

#: Larger images are refused outright (a bomb guard; 64 megapixels is a big photo).
MAX_PIXELS = 64_000_000
_DIRECT = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})


def fit_image(data: bytes, mime_type: str, max_bytes: int) -> tuple[bytes, str] | None:
    """Return ``(bytes, mime)`` at most ``max_bytes`` long, or ``None`` if it cannot be."""
    if mime_type in _DIRECT and len(data) <= max_bytes:
        return data, mime_type
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_PIXELS:
                return None
            image.load()
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None
    return _shrink(image, max_bytes)


def _shrink(image: Image.Image, max_bytes: int) -> tuple[bytes, str] | None:
    if image.mode not in ("RGB", "RGBA", "L", "LA", "P"):
        image = image.convert("RGBA")
    scale = 1.0
    for _ in range(8):
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        resized = image if scale == 1.0 else image.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        resized.save(out, format="PNG", optimize=True)
        if out.tell() <= max_bytes:
            return out.getvalue(), "image/png"
        out = io.BytesIO()
        resized.convert("RGB").save(out, format="JPEG", quality=85)
        if out.tell() <= max_bytes:
            return out.getvalue(), "image/jpeg"
        scale *= max(0.3, min(0.9, math.sqrt(max_bytes / out.tell()) * 0.9))
    return None
