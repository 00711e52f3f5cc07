"""GET /dashboard: the page's headers and its JSON (httpx), then the page itself in a
headless Chromium driven by Selenium: sign in, see the real die and model, watch the token
count move, unload and load back through the buttons, a wrong key shown as such."""
from __future__ import annotations

import shutil
import struct
import time
import zlib
from pathlib import Path

import httpx
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")]
API, ADMIN = "api-key-for-the-page", "admin-key-for-the-page"
SECRET = "zebra-marmalade-7731"                # a prompt's text: never in the dashboard's JSON


@pytest.fixture(scope="module")
def server():
    with Server("--ctx", "512", "--slots", "2", "--admin-key", ADMIN, api_key=API) as srv:
        yield srv


def board(srv, key=ADMIN) -> httpx.Response:
    return httpx.get(srv.url + "/admin/dashboard", timeout=10,
                     headers={"Authorization": f"Bearer {key}"} if key else {})


def test_the_page_is_served_with_a_strict_policy_and_its_data_takes_the_admin_key(server):
    page = httpx.get(server.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert '<script src="/dashboard/app.js"' in page.text and "<script>" not in page.text
    for path in ("/dashboard/app.js", "/dashboard/style.css"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200
    for key in (None, API, "wrong"):                     # the admin routes' own check
        r = board(server, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API}"},
                   json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                     headers={"Authorization": f"Bearer {API}"},
                     json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": -1})
    assert bad.status_code == 400
    r = board(server)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    assert SECRET not in r.text and API not in r.text and ADMIN not in r.text
    data = r.json()
    (die,) = data["dies"]
    assert die["die"] == "cpu" and die["state"] == "ready" and die["restarts"] == 0
    assert 0 < die["weight_bytes"] < die["used_bytes"] <= die["budget_bytes"]
    assert die["weight_bytes"] + die["kv_bytes"] == die["used_bytes"]
    (model,) = data["models"]
    assert model["status"] == "loaded" and model["generated_tokens"] >= 3
    assert model["replicas"][0]["slots"] == 2 and model["replicas"][0]["ctx"] == 512
    assert len(model["history"]) == 60 and model["history"][-1]["tokens_per_s"] > 0
    errors = {(e["status"], e["code"]) for e in data["errors"]}
    assert (400, bad.json()["error"]["code"] or bad.json()["error"]["type"]) in errors
    assert (401, "invalid_api_key") in errors
    assert data["readonly"] is False


@pytest.mark.parametrize("mode", ["readonly", "off"])
def test_a_readonly_page_has_no_buttons_and_an_off_one_is_not_there(mode, tmp_path):
    """(And the catalog's models not loaded are listed, to be loaded from the page.)"""
    import tiny_models as tm
    tm.write_gguf("llama", tmp_path / "tiny-llama.gguf")
    with Server("--ctx", "256", "--slots", "1", "--dashboard", mode,
                "--model-dir", str(tmp_path)) as srv:
        page = httpx.get(srv.url + "/dashboard", timeout=10)
        data = httpx.get(srv.url + "/admin/dashboard", timeout=10)
        if mode == "off":
            assert page.status_code == 404 and data.status_code == 404
        else:
            assert page.status_code == 200 and data.json()["readonly"] is True
            available = {m["name"]: m["path"] for m in data.json()["available"]}
            assert available["tiny-llama"] == str(tmp_path / "tiny-llama.gguf")


def test_a_bad_dashboard_mode_is_refused_at_start():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "pantheon.cli", "serve", "--dashboard", "maybe"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'maybe'" in out.stderr


# -- the page in a real browser ---------------------------------------------------------

def chromium():
    """(browser, driver) paths of the system Chromium, or skip saying what is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no system Chromium and chromedriver (Debian: apt install chromium "
                    "chromium-driver; make test installs them where apt can)")
    pytest.importorskip("selenium", reason="selenium not installed (pip install -e '.[test]')")
    return browser, driver


@pytest.fixture
def browser(tmp_path):
    path, driver_path = chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = path
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver_path), options=options)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


def wait(drv, what, timeout=30):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(drv, timeout, poll_frequency=0.2).until(lambda d: what(d))


def cell_text(drv, selector) -> str:
    """The element's rendered text, read in one script call (the page redraws its tables
    every 2 s: an element found in one call may be gone by the next)."""
    return drv.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';",
        selector)


def click(drv, selector) -> None:
    """Click the button as it is now (one script call, for the same reason)."""
    assert drv.execute_script(
        "const e = document.querySelector(arguments[0]); if (!e || e.disabled) return false;"
        " e.click(); return true;", selector), f"no enabled {selector}"


def png_is_not_blank(png: bytes) -> bool:
    """The screenshot holds more than one colour (PNG decoded with zlib: 8-bit RGB(A))."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, channels = 8, b"", 0, 4
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        chunk = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, _, depth, color = struct.unpack(">IIBB", chunk[:10])
            channels = {2: 3, 6: 4}[color]
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + width * channels
    pixels = {raw[i:i + channels] for row in range(0, len(raw), stride * 37)
              for i in range(row + 1, row + stride, channels * 13)}
    return len(pixels) > 3


def test_the_page_in_chromium_shows_the_server_and_drives_it(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    drv = browser
    drv.get(server.url + "/dashboard")
    wait(drv, lambda d: d.find_element(By.ID, "login").is_displayed())
    drv.find_element(By.ID, "key").send_keys("not-the-key")
    drv.find_element(By.CSS_SELECTOR, "#login-form button").click()
    wait(drv, lambda d: "refused (401)" in d.find_element(By.ID, "login-error").text)
    assert drv.execute_script("return sessionStorage.getItem('pantheon.adminKey')") is None

    drv.find_element(By.ID, "key").send_keys(ADMIN)
    drv.find_element(By.ID, "api-key").send_keys(API)
    drv.find_element(By.CSS_SELECTOR, "#login-form button").click()
    name = "SmolLM2-135M-Instruct"
    row = f'#models tr[data-model="{name}"]'
    wait(drv, lambda d: "loaded" in cell_text(d, row))
    assert "ready" in cell_text(drv, '#dies tr[data-die="cpu"]')
    assert "cpu" in cell_text(drv, '#dies tr[data-die="cpu"]')
    assert ADMIN not in drv.current_url and not drv.get_cookies()

    before = int(cell_text(drv, row + " td.tokens"))     # a request moves the count
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API}"},
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                         "logit_bias": {"2": -100, "0": -100}})
    assert r.status_code == 200, r.text
    wait(drv, lambda d: int(cell_text(d, row + " td.tokens") or 0) >= before + 4)

    drv.find_element(By.ID, "try-prompt").clear()          # the try-it box streams a reply
    drv.find_element(By.ID, "try-prompt").send_keys("Say hello.")
    drv.find_element(By.CSS_SELECTOR, "#try-form button").click()
    wait(drv, lambda d: d.find_element(By.ID, "try-reply").text.strip() != "")

    drv.execute_script("window.scrollTo(0, 0)")
    png = drv.get_screenshot_as_png()
    (tmp_path / "dashboard.png").write_bytes(png)
    assert png_is_not_blank(png)

    # a phone's screen: nothing wider than it (the tables scroll inside themselves)
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True})
    wait(drv, lambda d: d.execute_script("return window.innerWidth") == 390, timeout=10)
    wider = drv.execute_script("""const w = window.innerWidth, out = [];
        for (const e of document.querySelectorAll('body *')) {
          const r = e.getBoundingClientRect(), box = e.closest('table');
          if (r.right > w + 1 && !(box && box !== e && box.getBoundingClientRect().right <= w + 1))
            out.push(e.tagName + '#' + e.id + '.' + e.className);
        }
        return [document.documentElement.scrollWidth, out];""")
    assert wider[0] <= 390 and not wider[1], wider
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    # the dark scheme follows the system's
    background = "return getComputedStyle(document.body).backgroundColor"
    light = drv.execute_script(background)
    drv.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    dark = drv.execute_script(background)
    assert light == "rgb(255, 255, 255)" and dark == "rgb(20, 24, 29)", (light, dark)

    click(drv, row + " button")                                      # Unload
    wait(drv, lambda d: "available" in cell_text(d, row))
    assert [m["name"] for m in board(server).json()["models"]] == []
    click(drv, row + " button")                                      # Load it back
    wait(drv, lambda d: "loaded" in cell_text(d, row), timeout=90)
    actions = [(a["action"], a["status"]) for a in board(server).json()["actions"]]
    assert actions[:2] == [("load", 200), ("unload", 200)]
    assert "load" in cell_text(drv, "#actions tbody tr")
