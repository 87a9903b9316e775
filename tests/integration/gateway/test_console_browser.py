"""The latency console in a real browser: Debian's headless Chromium, driven through its chromedriver by Selenium.

Nothing downloads a browser: the test uses /usr/bin/chromium and /usr/bin/chromedriver (`apt-get install chromium
chromium-driver`, as .ci/run does) and skips, saying so, where they are absent. The page loads without a console
error, lists a request sent a moment earlier, and its waterfall names the stages the response's `server-timing`
named, with the same durations. A screenshot of each run is kept under the test's temporary directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.gateway.test_console import BASE, send, timing_of
from tests.support.gateway import gateway_thread

# As root in a container: no sandbox; and nothing that reaches out (updates, sync, component downloads).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1400,1300",
)
WAIT_S = 20.0


def programs() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium is not installed (apt-get install chromium chromium-driver)")
    return browser, driver


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[Any]:
    chromium, chromedriver = programs()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path given: Selenium runs it as is and never looks for (or fetches) another.
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def errors_of(driver: Any) -> list[dict[str, Any]]:
    """The page's console errors (and warnings): a script error, a refused fetch, a CSP violation."""
    return [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def test_the_console_shows_a_request_and_its_waterfall(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    with gateway_thread(BASE) as gw:
        send(gw, "other", stream=True)
        rid, timing = send(gw, "chat")
        browser.get(gw.url + "/console")
        wait = WebDriverWait(browser, WAIT_S)
        row = wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, f'tr.req[data-id="{rid}"]')))
        row.click()
        wait.until(seen.text_to_be_present_in_element((By.ID, "wf-title"), rid))
        stages = browser.find_elements(By.CSS_SELECTOR, "#wf tr.stage")
        shown = [(s.get_attribute("data-stage"), s.get_attribute("data-dur")) for s in stages]
        overhead = browser.find_element(By.ID, "wf-overhead").get_attribute("data-dur")
        assert [*shown, ("overhead", overhead)] == timing_of(timing)
        for stage in stages:  # each duration is on the page as text, not only in an attribute
            assert stage.get_attribute("data-dur") in stage.text
        assert browser.find_element(By.ID, "wf-timing").text == timing
        marks = [m.get_attribute("data-mark") for m in browser.find_elements(By.CSS_SELECTOR, "#wf tr.mark")]
        assert marks == ["response head", "first token", "last byte"]
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#percentiles tbody tr")))
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#chart polyline, #chart circle")))
        assert "up" in browser.find_element(By.CSS_SELECTOR, '#backends tr[data-backend="sim"]').text
        # A filter narrows the list in the page.
        browser.find_element(By.CSS_SELECTOR, '#filters input[name="model"]').send_keys("other")
        wait.until(seen.invisibility_of_element_located((By.CSS_SELECTOR, f'tr.req[data-id="{rid}"]')))
        assert browser.find_element(By.ID, "error").text == ""
        browser.save_screenshot(str(tmp_path / "console.png"))
        assert (tmp_path / "console.png").stat().st_size > 10_000
        assert errors_of(browser) == []


def test_a_waterfall_opens_from_its_link(browser: Any, tmp_path: Path) -> None:
    """/console#request=ID opens that request's waterfall: a link to paste from an access log line."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    with gateway_thread(BASE) as gw:
        rid, timing = send(gw, "chat", stream=True)
        wait = WebDriverWait(browser, WAIT_S)
        browser.get(gw.url + "/console")  # the request is recorded once the page lists it
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, f'tr.req[data-id="{rid}"]')))
        browser.get(f"{gw.url}/console#request={rid}")
        browser.refresh()
        wait.until(seen.text_to_be_present_in_element((By.ID, "wf-timing"), timing))
        browser.save_screenshot(str(tmp_path / "console-link.png"))
        assert errors_of(browser) == []


def test_with_an_admin_token_the_page_asks_for_it(browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    config = BASE + "listen: {host: 0.0.0.0}\nadmin: {token: s3cret-admin}\n"
    with gateway_thread(config) as gw:
        rid, _ = send(gw)
        browser.get(gw.url + "/console")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(seen.visibility_of_element_located((By.ID, "token")))
        assert "admin token" in browser.find_element(By.ID, "error").text
        assert browser.find_elements(By.CSS_SELECTOR, "tr.req") == []  # nothing shown without it
        browser.find_element(By.ID, "token").send_keys("s3cret-admin")
        browser.find_element(By.ID, "tokenset").click()
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, f'tr.req[data-id="{rid}"]')))
        refused = [e for e in errors_of(browser) if "401" not in e["message"]]
        assert refused == []  # the refusals before the token was given, and nothing else
