"""`sluice probe --html FILE`: the breakdown as a waterfall with the diagnosis beside it, rendered in Chromium.

The probe runs against Sluice in front of a scripted upstream that holds its response head 300 ms (queueing):
the page draws each stage the JSON document measured, with the same figures, the server's own stages from its
`server-timing`, and the queueing finding beside them; Debian's headless Chromium renders it without a console
error (skipping, saying so, where it is absent), and a screenshot is kept under the test's temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.gateway.test_console_browser import browser as browser  # the fixture: headless Chromium
from tests.integration.gateway.test_console_browser import errors_of
from tests.support.gateway import gateway_thread
from tests.support.upstream import Ok, ScriptedUpstream
from tools.probe.command import add_arguments, main


@pytest.fixture()
def probed(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    with ScriptedUpstream(default=Ok(headers_ms=300)) as up:
        config = f"""
backends: {{up: {{type: openai, base_url: "{up.url}/v1", api_key: k}}}}
pool: {{warm_connections: 1}}
models: {{chat: {{backend: up}}}}
"""
        with gateway_thread(config) as gw:
            parser = argparse.ArgumentParser(prog="sluice probe")
            add_arguments(parser)
            html, doc = tmp_path / "probe.html", tmp_path / "probe.json"
            argv = [gw.base_url, "--model", "chat", "--samples", "2", "--probes", "minimal", "--timeout", "10"]
            args = parser.parse_args([*argv, "--json", str(doc), "--html", str(html)])
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(args) == 0
    return json.loads(doc.read_text()), html


def test_the_page_has_the_waterfall_and_the_diagnosis(probed: tuple[dict[str, Any], Path]) -> None:
    doc, html = probed
    text = html.read_text()
    assert "queueing" in {f["code"] for f in doc["findings"]}
    assert 'data-code="queueing"' in text
    floor = doc["targets"][0]["floor"]
    drawn = dict(re.findall(r'data-stage="(\w+)" data-ms="([\d.]+)"', text))
    for stage in ("send", "head", "first_token"):  # the reused connection's rows come after the fresh one's
        assert f'data-stage="{stage}" data-ms="{floor["fresh"][stage]:.3f}"' in text
    timing = doc["targets"][0]["gateway"]["server_timing_p50"]
    assert drawn["upstream"] == f"{timing['upstream']:.3f}"  # the server's own account, as it said it
    assert timing["upstream"] >= 290
    assert "https://" not in text
    assert "http://" not in text.replace(doc["targets"][0]["url"], "")  # nothing fetched: the target's URL only


def test_the_page_renders_in_chromium(probed: tuple[dict[str, Any], Path], browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _, html = probed
    browser.get(html.as_uri())
    finding = browser.find_element(By.CSS_SELECTOR, '.finding[data-code="queueing"]')
    assert finding.is_displayed()
    bars = browser.find_elements(By.CSS_SELECTOR, "tr[data-stage] .bar span")
    assert bars
    assert max(bar.size["width"] for bar in bars) > 100  # the head's wait dominates the drawing
    browser.save_screenshot(str(tmp_path / "probe.png"))
    assert errors_of(browser) == []
