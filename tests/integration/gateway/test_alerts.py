"""The alert rules Sluice ships: config/prometheus/alerts.yml, loaded by config/prometheus.yml and, as the same
groups, by the PrometheusRule of the Kubernetes base; checked and unit-tested with Prometheus's own `promtool`.

alerts_test.yml has, for every alert, series that fire it and series or a moment that do not; a test below
also makes sure no alert is left without its cases and its runbook entry in docs/operations.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "config/prometheus/alerts.yml"
CASES = ROOT / "config/prometheus/alerts_test.yml"
PROMETHEUS = ROOT / "config/prometheus.yml"
OPERATOR = ROOT / "deploy/kubernetes/base/prometheusrule.yaml"
OPERATIONS = ROOT / "docs/operations.md"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def alerts() -> list[str]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def run(*args: str) -> str:
    done = subprocess.run(args, cwd=RULES.parent, capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def test_the_rules_pass_promtool_check() -> None:
    output = run(promtool(), "check", "rules", str(RULES))
    assert f"SUCCESS: {len(alerts())} rules found" in output


def test_prometheus_config_loads_the_rules() -> None:
    output = run(promtool(), "check", "config", str(PROMETHEUS))
    assert "SUCCESS: 1 rule files found" in output


def test_every_alert_fires_and_stays_quiet_in_its_cases() -> None:
    run(promtool(), "test", "rules", str(CASES))


def test_the_cases_can_fail(tmp_path: Path) -> None:
    """A case expecting the wrong model fails: promtool compares what fired, so the cases above mean something."""
    shutil.copy(RULES, tmp_path / RULES.name)
    wrong = CASES.read_text().replace("{severity: page, model: bad}", "{severity: page, model: good}", 1)
    (tmp_path / CASES.name).write_text(wrong)
    done = subprocess.run([promtool(), "test", "rules", CASES.name], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert "SluiceTTFTBudgetBurnFast" in done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = yaml.safe_load(CASES.read_text())["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    names = set(alerts())
    assert names - firing == set(), "alerts no case fires"
    assert names - quiet == set(), "alerts no case keeps quiet"


def test_every_alert_has_its_runbook() -> None:
    text = OPERATIONS.read_text()
    headings = set(re.findall(r"^#### (Sluice\w+)$", text, re.MULTILINE))
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            assert rule["alert"] in headings, f"{rule['alert']}: no runbook in docs/operations.md"
            assert rule["annotations"]["runbook"] == f"docs/operations.md#{rule['alert'].lower()}"


def test_the_kubernetes_rule_has_the_same_groups() -> None:
    shipped = yaml.safe_load(OPERATOR.read_text())
    assert shipped["kind"] == "PrometheusRule"
    assert shipped["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
