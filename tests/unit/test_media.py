import io
from typing import Any

import pytest
from PIL import Image

from mcp_code_sandbox.server.media import MAX_PIXELS, MAX_SIDE, fit_image


def _png(w: int, h: int, noisy: bool = True) -> bytes:
    import os

    img = (
        Image.frombytes("RGB", (w, h), os.urandom(w * h * 3))
        if noisy
        else Image.new("RGB", (w, h), "white")
    )
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def test_small_images_pass_through() -> None:
    data = _png(10, 10)
    assert fit_image(data, "image/png", 1024 * 1024) == (data, "image/png")


def test_large_images_are_downscaled_under_budget() -> None:
    data = _png(1200, 900)
    assert len(data) > 1024 * 1024
    fitted = fit_image(data, "image/png", 200 * 1024)
    assert fitted is not None
    assert len(fitted[0]) <= 200 * 1024
    assert Image.open(io.BytesIO(fitted[0])).width < 1200


def test_garbage_claiming_to_be_png_is_dropped() -> None:
    assert fit_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 5000, "image/png", 100) is None


def test_decompression_bomb_is_dropped() -> None:
    img = Image.new("1", (20000, 20000))  # 400 megapixels, tiny file
    out = io.BytesIO()
    img.save(out, format="PNG")
    assert fit_image(out.getvalue(), "image/png", 100) is None


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds one row of data: what an
    attacker sends to make a server allocate and decode a huge image."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey
    idat = zlib.compress(b"\0" * (width + 1))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every image Pillow decodes (``load``), by format: observed, not replaced."""
    from PIL import ImageFile

    seen: list[str] = []
    original = ImageFile.ImageFile.load

    def load(self: ImageFile.ImageFile) -> Any:
        seen.append(str(self.format))
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


@pytest.mark.parametrize("budget", [100, 10 * 1024 * 1024])
def test_huge_declared_size_is_refused_without_decoding(loads: list[str], budget: int) -> None:
    data = _png_header_only(7900, 7900)  # 62 MP: under Pillow's bomb limit, over our cap
    assert len(data) < 100_000  # small enough to pass through, were it not for the cap
    assert fit_image(data, "image/png", budget) is None
    assert loads == []


def test_just_over_the_cap_is_refused_just_under_is_not(loads: list[str]) -> None:
    over = _png_header_only(MAX_PIXELS // 1000 + 1, 1000)
    assert fit_image(over, "image/png", 100) is None
    assert loads == []
    under = _png(2000, 1500)  # 3 MP of noise, over the byte budget: decoded and reduced
    fitted = fit_image(under, "image/png", 300_000)
    assert fitted is not None and "PNG" in loads


def test_bomb_warning_is_a_refusal_not_a_crash() -> None:
    # 100 MP: Pillow warns (an error here: pytest's filterwarnings = error).
    img = Image.new("1", (10000, 10000))
    out = io.BytesIO()
    img.save(out, format="PNG")
    assert fit_image(out.getvalue(), "image/png", 100) is None


def test_big_jpeg_is_decoded_in_draft_mode() -> None:
    # 24 MP, over the decode cap: only JPEG's draft mode (decoding at 1/2 scale) gets a
    # preview out of it.
    img = Image.linear_gradient("L").resize((6000, 4000)).convert("RGB")
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=95)
    assert MAX_PIXELS < 6000 * 4000
    fitted = fit_image(out.getvalue(), "image/jpeg", 50_000)
    assert fitted is not None
    data, mime = fitted
    assert len(data) <= 50_000 and mime in ("image/png", "image/jpeg")
    assert max(Image.open(io.BytesIO(data)).size) <= MAX_SIDE


def test_a_chart_comes_back_as_it_is_or_reduced() -> None:
    from PIL import ImageDraw

    chart = Image.new("RGB", (1600, 1200), "white")
    draw = ImageDraw.Draw(chart)
    for x in range(0, 1600, 40):
        draw.line([(x, 1200 - x // 2), (x + 40, 1200 - (x + 40) // 2)], fill="blue", width=3)
    out = io.BytesIO()
    chart.save(out, format="PNG")
    data = out.getvalue()
    assert fit_image(data, "image/png", 1024 * 1024) == (data, "image/png")
    big = chart.resize((4000, 3000))
    out = io.BytesIO()
    big.save(out, format="PNG")
    fitted = fit_image(out.getvalue(), "image/png", 100_000)
    assert fitted is not None and len(fitted[0]) <= 100_000
    assert max(Image.open(io.BytesIO(fitted[0])).size) <= MAX_SIDE


def test_only_the_four_formats_are_opened() -> None:
    img = Image.new("RGB", (10, 10), "red")
    for fmt in ("BMP", "TIFF", "EPS"):
        out = io.BytesIO()
        img.save(out, format=fmt)
        assert fit_image(out.getvalue(), "image/png", 1024 * 1024) is None, fmt


def test_the_header_decides_the_type() -> None:
    img = Image.new("RGB", (10, 10), "red")
    out = io.BytesIO()
    img.save(out, format="JPEG")
    assert fit_image(out.getvalue(), "image/png", 1024 * 1024) == (out.getvalue(), "image/jpeg")
