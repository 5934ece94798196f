"""The status page in a real headless Chromium, against a tiny real model: the tree, rows, KV bytes, a live restart.

Needs Playwright's Python API (`pip install 'mlx-trio[test]'`) and a
Chromium: the system's (Debian: `apt-get install chromium`, what `make test` does where it
runs as root) or Playwright's own if one was installed.
Skipped where either is missing.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, tiny_engine_config

from mlx_trio.http import ServerConfig

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install 'mlx-trio[test]')")

SYSTEM_CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Generous: a loaded 2-core CI box. The page itself hears of a restart WATCH_EVERY_S after it.
WAIT_MS = 20_000


def _launch(playwright: sync_api.Playwright) -> sync_api.Browser:
    """Playwright's own Chromium if it was installed and starts, else the system's; skip when none starts."""
    candidates = [None] if Path(playwright.chromium.executable_path).is_file() else []
    candidates += [path for name in SYSTEM_CHROMIUMS if (path := shutil.which(name)) is not None]
    failures = []
    for path in candidates:
        try:
            # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
            return playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        except sync_api.Error as exc:  # e.g. a downloaded Chromium without its system libraries
            failures.append(f"{path or 'bundled'}: {str(exc).splitlines()[0]}")
    pytest.skip("no Chromium starts (`apt-get install chromium`)"
                + (f": {'; '.join(failures)}" if failures else ""))


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    with sync_api.sync_playwright() as playwright:
        browser = _launch(playwright)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(tiny_engine_config(), ServerConfig(port=0, enable_fault_injection=True)) as server:
        yield server


class Streams:
    """Keeps `count` streamed completions running until stopped, so the page always has rows."""

    def __init__(self, url: str, count: int = 2) -> None:
        self._url = url
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(count)]

    def __enter__(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S)

    def _loop(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
        with httpx.Client(base_url=self._url, timeout=CLIENT_TIMEOUT_S) as client:
            while not self._stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if self._stop.is_set():
                            break


def test_the_page_shows_the_tree_rows_kv_and_a_restart(browser: sync_api.Browser, server: ServerThread) -> None:
    page = browser.new_page()
    with Streams(server.url):
        page.goto(f"{server.url}/")  # a browser at / lands on the page
        assert page.url.endswith("/status")
        for actor in ("root", "engine", "gpu-lease", "decode-step", "prefill", "admission", "sessions", "http"):
            page.wait_for_selector(f'li[data-actor="{actor}"][data-state="running"]', timeout=WAIT_MS)
        row = page.wait_for_selector('#rows tr[data-request]', timeout=WAIT_MS)
        assert row is not None and row.get_attribute("data-request").startswith("req-")
        # Selectors, not wait_for_function: the page's CSP forbids the eval that would need.
        page.wait_for_selector('#kv-label[data-kv-bytes]:not([data-kv-bytes="0"])', timeout=WAIT_MS)
        # --kv-layout auto on the CPU: padded, and the page says why.
        page.wait_for_selector('#kv-layout[data-layout="padded"]', timeout=WAIT_MS)
        assert "no paged decode kernel on this backend (cpu)" in page.inner_text("#kv-layout")
        assert page.get_attribute('li[data-actor="decode-step"]', "data-restarts") == "0"

        armed = httpx.post(f"{server.url}/v1/admin/faults", json={"actor": "decode-step", "kind": "raise"},
                           timeout=CLIENT_TIMEOUT_S)
        assert armed.status_code == 200
        page.wait_for_selector('li[data-actor="decode-step"][data-restarts="1"].flash', timeout=WAIT_MS)
        assert "restarted" in page.inner_text('li[data-actor="decode-step"] > .node')
        # The button on the page arms the same faults: here, the prefill actor's.
        page.click('li[data-actor="prefill"] > .node button[data-fault="prefill"]')
        page.wait_for_selector('li[data-actor="prefill"][data-restarts="1"]', timeout=WAIT_MS)
        # The http node's button crashes one request's handler: counted there, the server is not restarted.
        page.click('li[data-actor="http"] > .node button[data-fault="http"]')
        page.wait_for_selector('li[data-actor="http"][data-handler-crashes="1"][data-restarts="0"]', timeout=WAIT_MS)
    page.close()


def test_behind_a_key_the_page_asks_for_it(browser: sync_api.Browser) -> None:
    """The page asks for the key, refuses a wrong one, connects with the right one and never shows it."""
    key = "page-test-key"
    with ServerThread(tiny_engine_config(), ServerConfig(port=0, api_key=key)) as server:
        page = browser.new_page()
        page.goto(f"{server.url}/status")
        page.wait_for_selector("#key-form:not([hidden])", timeout=WAIT_MS)
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        page.wait_for_selector("#key-error:has-text('refused')", timeout=WAIT_MS)
        page.fill("#key-input", key)
        page.click("#key-form button")
        page.wait_for_selector('li[data-actor="decode-step"]', timeout=WAIT_MS)
        assert key not in page.content()
        page.close()
