"""Static export of the dashboard: one self-contained HTML file (the page's CSS and JS inlined,
the run's events embedded as JSON) for a finished run, to attach to a bug report.

``minirt events --html FILE`` writes every event of the run; ``minirt trace ID --html FILE``
writes the events from that request's first to its last (plus the config events the views need)
and opens on its life. Nothing in the file is fetched from anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from minirt.eventlog import matches, read_events
from minirt.http.dashboard.page import STATIC

SCRIPTS = ("state.js", "pool.js", "views.js", "charts.js", "panels.js", "dashboard.js")
# the file may run its own inline code and nothing else: no request leaves it
CSP = (
    '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
    "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">"
)


def _inline_json(data: Any) -> str:
    """JSON safe inside a <script> element: no ``</`` and no ``<!--`` can end or open anything."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def render_html(events: list[dict[str, Any]], title: str, focus: str | None = None) -> str:
    """The dashboard page with ``events`` embedded; ``focus`` opens that request's life."""
    page = (STATIC / "dashboard.html").read_text(encoding="utf-8")
    css_tag = '<link rel="stylesheet" href="dashboard/static/dashboard.css">'
    if css_tag not in page:
        raise RuntimeError(f"{STATIC / 'dashboard.html'} lost its stylesheet tag {css_tag!r}")
    css = (STATIC / "dashboard.css").read_text(encoding="utf-8")
    page = page.replace(css_tag, f"{CSP}\n<style>\n{css}</style>")
    meta = {"title": title, "focus": focus, "events": len(events)}
    data = (
        f'<script type="application/json" id="minirt-export">{_inline_json(meta)}</script>\n'
        f'<script type="application/json" id="minirt-events">{_inline_json(events)}</script>\n'
    )
    for i, name in enumerate(SCRIPTS):
        tag = f'<script src="dashboard/static/{name}"></script>'
        if tag not in page:
            raise RuntimeError(f"{STATIC / 'dashboard.html'} lost its script tag {tag!r}")
        js = (STATIC / name).read_text(encoding="utf-8")
        if "</script" in js.lower():
            raise RuntimeError(f"{name} contains '</script', which cannot be inlined")
        page = page.replace(tag, (data if i == 0 else "") + f"<script>\n{js}</script>")
    return page


def request_window(events: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """The events from ``request_id``'s first to its last, plus every config event: what the
    views need to show that request beside what ran with it. Empty if it has no event."""
    mine = [e for e in events if matches(e, request_id, None)]
    if not mine:
        return []
    t0, t1 = mine[0].get("ts", 0.0), mine[-1].get("ts", 0.0)
    return [
        e
        for e in events
        if t0 <= e.get("ts", 0.0) <= t1 or str(e.get("event", "")).endswith(".config")
    ]


def export_html(run_dir: str | Path, out: str | Path, request_id: str | None = None) -> int:
    """Write the export; returns an exit code (1 with a message when there is nothing to show)."""
    run = Path(run_dir)
    if not (run / "events").is_dir():
        print(f"no events under {run}/events (is --run-dir right?)", file=sys.stderr)
        return 1
    events = read_events(run)
    if request_id is not None:
        events = request_window(events, request_id)
        if not events:
            print(f"no events for request {request_id} under {run}", file=sys.stderr)
            return 1
        title = f"request {request_id} · {run}"
    else:
        title = f"run {run}"
    html = render_html(events, title, request_id)
    Path(out).write_text(html, encoding="utf-8")
    print(f"wrote {out} ({len(events)} events, {len(html) // 1024} KiB)", file=sys.stderr)
    return 0
