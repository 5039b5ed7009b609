"""``/ui`` in a real browser: Debian's chromium, headless, driven by Selenium through
Debian's chromedriver (the system's browser; nothing is downloaded), against the real
HTTP server with real bwrap sandboxes. Signs in through the form, reads the pages, closes
a session with its button, and checks the screenshots it keeps under the test's temp dir
(their paths are printed: ``pytest -s`` shows them)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageStat
from selenium.webdriver.remote.webdriver import WebDriver

from mcp_code_sandbox.settings import Settings

from .tenants import client_as, structured
from .ui_harness import ALICE, BOB, ROOT, ui_server

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if not missing:
        return
    why = f"{', '.join(missing)} missing: apt-get install chromium chromium-driver"
    if os.environ.get("CI"):  # .ci/run installs them (scripts/install.sh --dev)
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # as root in a container; the page is our own
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: WebDriver, path: Path, must_show: list[str]) -> None:
    """Keep a screenshot at ``path`` and check it: a PNG of the window's size that is not
    one flat colour, taken while the page says each of ``must_show``."""
    body = driver.find_element("tag name", "body").text
    for text in must_show:
        assert text in body, (text, body)
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    print(f"screenshot: {path}")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.width >= 800 and image.height >= 600, image.size
    stat = ImageStat.Stat(image)
    assert max(stat.stddev) > 10, "a blank screenshot"
    assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20


def arrived(driver: WebDriver, path: str) -> None:
    """Wait until the page at ``path`` is loaded: a click that submits a form returns
    before its navigation (and the redirect after it) has ended."""
    from selenium.webdriver.support.wait import WebDriverWait

    def there(d: WebDriver) -> bool:
        loaded = d.execute_script("return document.readyState") == "complete"
        return loaded and d.current_url.endswith(path)

    WebDriverWait(driver, 30, poll_frequency=0.1).until(there, f"never got to {path}")


def sign_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(f"{base}/ui")
    arrived(driver, "/ui/login")
    field = driver.find_element("id", "token")
    field.send_keys(token)
    driver.find_element("id", "sign-in").click()
    arrived(driver, "/ui")


def session_rows(driver: WebDriver) -> dict[str, str]:
    """Session id → owner, as the Sessions table shows them."""
    rows = driver.find_elements("css selector", "#sessions tr.session")
    return {
        row.find_element("css selector", "td.sid").text: row.find_element(
            "css selector", "td.owner"
        ).text
        for row in rows
    }


async def test_the_operator_view_in_chromium(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    _require_browser()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            code = "open('data.csv', 'w').write('x' * 5000); print(6*7)"
            ok = structured(
                await alice.call_tool("run_code", {"session_id": "alice-nb", "code": code})
            )
            assert ok["stdout"] == "42\n"
            await alice.call_tool("run_code", {"session_id": "alice-nb", "code": "1/0"})
            await bob.call_tool("run_code", {"session_id": "bob-report", "code": "x = 1"})

            with browser(tmp_path / "alice-profile") as driver:
                sign_in(driver, base, ALICE)
                assert session_rows(driver) == {"alice-nb": "alice"}
                sizes = driver.find_element("css selector", "#sessions tr.session").text
                assert "4.9 KiB" in sizes  # the workspace's data.csv
                runs = driver.find_element("id", "runs").text
                assert "ZeroDivisionError" in runs and "python" in runs and "ok" in runs
                screenshot(
                    driver, shots / "alice.png", ["signed in as alice", "alice-nb", "Recent runs"]
                )
                # The login is a cookie the page's scripts cannot read, and not the token.
                cookies = driver.get_cookies()
                assert [c["httpOnly"] for c in cookies] == [True]
                assert ALICE not in str(cookies) and ALICE not in driver.page_source
                # Signing out ends the login on the server: the cookie it held, replayed
                # from elsewhere, opens nothing.
                copied = {c["name"]: c["value"] for c in cookies}
                driver.find_element("css selector", "form.who button").click()
                arrived(driver, "/ui/login")
                replayed = httpx.get(f"{base}/ui", cookies=copied)
                assert replayed.status_code == 303, replayed.text

            with browser(tmp_path / "root-profile") as driver:
                sign_in(driver, base, ROOT)
                assert session_rows(driver) == {"alice-nb": "alice", "bob-report": "bob"}
                screenshot(
                    driver, shots / "admin.png", ["admin: every owner", "bob-report", "Warm pool"]
                )
                row = next(
                    r
                    for r in driver.find_elements("css selector", "#sessions tr.session")
                    if r.find_element("css selector", "td.sid").text == "bob-report"
                )
                row.find_element("css selector", "button.danger").click()
                arrived(driver, "/ui?notice=closed")
                assert session_rows(driver) == {"alice-nb": "alice"}
                screenshot(driver, shots / "after-close.png", ["The session was closed"])

            gone = await bob.call_tool("list_files", {"session_id": "bob-report"})
            assert gone.is_error and "session_not_found" in str(gone.content)
            still = await alice.call_tool("list_files", {"session_id": "alice-nb"})
            assert not still.is_error
    assert sorted(p.name for p in shots.iterdir()) == ["admin.png", "after-close.png", "alice.png"]
