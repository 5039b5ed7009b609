import io

from PIL import Image

from mcp_code_sandbox.images import fit_image


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
