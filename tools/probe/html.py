"""`sluice probe --html FILE`: the probe's breakdown as a waterfall per target, with its diagnosis beside it.

One self-contained page (inline CSS, no script, nothing fetched), made from the same JSON document `--json` writes
and the same text the probe prints (kept at the bottom). Each target's first token is drawn twice, on a new
connection and on a reused one: DNS, TCP connect, TLS, sending the request, the wait for the response head, and the
head to the first token, laid end to end as the client measured them (p50 of the minimal streamed cell). Where the
server said where its time went (`server-timing`, a Sluice gateway), the wait for the head is drawn again as the
server's stages. The findings for the target stand beside its waterfall.
"""

from __future__ import annotations

from html import escape
from typing import Any

from tools.probe.report import FLOOR_ROWS

# Whose time each stage of the floor is: the network's, the server's, or the model's.
KIND = {"dns": "net", "tcp": "net", "tls": "net", "send": "net", "head": "server", "first_token": "model"}
STYLE = """
body { font: 13px/1.45 system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin: 22px 0 6px; }
.target { display: grid; grid-template-columns: minmax(560px, 3fr) minmax(300px, 2fr); gap: 18px; }
table { border-collapse: collapse; width: 100%; }
td, th { padding: 2px 6px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; width: 70px; }
td.bar { width: 100%; }
.bar div { position: relative; height: 14px; background: #f1f1f1; }
.bar span { position: absolute; top: 1px; height: 12px; border-radius: 2px; min-width: 1px; }
.net { background: #7b3fbf; } .server { background: #e8902a; }
.model { background: #17803d; } .gw { background: #2f6fdf; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; vertical-align: middle; }
.finding { border-left: 4px solid #c0262d; padding: 4px 10px; margin: 6px 0; background: #fff6f6; }
.ok { border-left: 4px solid #17803d; padding: 4px 10px; background: #f4fbf6; }
pre { background: #f7f7f7; padding: 10px; overflow: auto; font-size: 12px; }
.muted { color: #777; }
"""


def page(report: dict[str, Any], text: str) -> str:
    """The HTML page of a probe's report (`Report.as_json()`) and its printed text."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>sluice probe</title><style>{STYLE}</style></head><body>",
        "<h1>sluice probe: where the first token's time goes</h1>",
        '<p class="legend">the time of<span class="net"></span>the network and the client'
        '<span class="server"></span>the server, before its response head<span class="model"></span>'
        'the model, head to first token<span class="gw"></span>the server\'s own stages (server-timing)</p>',
    ]
    if report.get("failure"):
        parts.append(f'<p class="finding">the run stopped: {escape(str(report["failure"]))}</p>')
    findings = report.get("findings", [])
    for target in report.get("targets", []):
        parts.append(_target(target, [f for f in findings if f.get("target") == target.get("name")]))
    comparison = [f for f in findings if f.get("target") == "comparison"]
    if comparison:
        parts.append("<h2>direct against through the gateway</h2>")
        parts.extend(_finding(f) for f in comparison)
    parts.append(f"<h2>the probe's text report</h2><pre>{escape(text)}</pre></body></html>")
    return "\n".join(parts) + "\n"


def _target(target: dict[str, Any], findings: list[dict[str, Any]]) -> str:
    name = escape(str(target.get("name", "")))
    floor = target.get("floor") or {}
    rows: list[str] = []
    for connection in ("fresh", "reused"):
        stages = floor.get(connection) or {}
        rows.append(_waterfall(f"{connection} connection", stages))
    gateway = target.get("gateway")
    if gateway:
        rows.append(_server(gateway, floor.get("reused") or {}))
    dominant = floor.get("dominant")
    side = [f"<p>dominant: <b>{escape(str(dominant))}</b></p>" if dominant else ""]
    side += [_finding(f) for f in findings] or ['<p class="ok">no problem found: no known cause fits these figures</p>']
    title = f"<h2>{name}: {escape(str(target.get('url', '')))} · model {escape(str(target.get('model', '')))}</h2>"
    return f'{title}<div class="target" data-target="{name}"><div>{"".join(rows)}</div><div>{"".join(side)}</div></div>'


def _waterfall(title: str, stages: dict[str, float | None]) -> str:
    steps = [(key, label, stages.get(key)) for key, label in FLOOR_ROWS if key in KIND]
    end = sum(ms for _, _, ms in steps if ms) or 1.0
    rows = [
        f'<tr><th colspan="3">{escape(title)} <span class="muted">(p50, ms since the request started)</span></th></tr>'
    ]
    at = 0.0
    for key, label, ms in steps:
        if ms is None:
            continue
        rows.append(_row(key, label, KIND[key], at, ms, end))
        at += ms
    ttft = stages.get("ttft")
    if ttft is not None:
        rows.append(f'<tr data-stage="ttft"><td>time to first token</td><td class="num">{ttft:.2f}</td><td></td></tr>')
    return f"<table>{''.join(rows)}</table>"


def _server(gateway: dict[str, Any], reused: dict[str, float | None]) -> str:
    """The wait for the head, as the server accounted for it, on the same scale as the reused connection."""
    timing: dict[str, float] = gateway.get("server_timing_p50") or {}
    end = sum(ms for key, ms in reused.items() if key in KIND and ms) or 1.0
    at = reused.get("send") or 0.0
    cell = escape(str(gateway.get("cell", "")))
    rows = [f'<tr><th colspan="3">the server\'s account of its wait <span class="muted">({cell}, p50)</span></th></tr>']
    for stage, ms in timing.items():
        kind = "server" if stage in ("upstream", "pool") else "gw"
        rows.append(_row(stage, stage, kind, at, ms, end))
        at += ms
    outside = gateway.get("outside_ms")
    if outside is not None:
        rows.append(f'<tr><td class="muted">outside the server</td><td class="num">{outside:.2f}</td><td></td></tr>')
    return f"<table>{''.join(rows)}</table>"


def _row(key: str, label: str, kind: str, at: float, ms: float, end: float) -> str:
    left, width = 100.0 * at / end, 100.0 * ms / end
    bar = f'<div><span class="{kind}" style="left:{left:.3f}%;width:{width:.3f}%"></span></div>'
    return (
        f'<tr data-stage="{escape(key)}" data-ms="{ms:.3f}"><td>{escape(label)}</td>'
        f'<td class="num">{ms:.2f}</td><td class="bar">{bar}</td></tr>'
    )


def _finding(finding: dict[str, Any]) -> str:
    return (
        f'<div class="finding" data-code="{escape(str(finding.get("code", "")))}">'
        f'<b>{escape(str(finding.get("cause", "")))}</b> <span class="muted">({escape(str(finding.get("stage", "")))})'
        f"</span><br>{escape(str(finding.get('summary', '')))}<br><i>{escape(str(finding.get('advice', '')))}</i></div>"
    )
