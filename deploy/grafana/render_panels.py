"""Render panels of the Grafana dashboard from a Prometheus server's data, where Grafana cannot run.

    python deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 --minutes 30 \\
        --out dashboard.png --var job=loader --panel "Trainer wait share" --panel "Load, busy and demand"

Each panel's queries are those of ``dataferry-dashboard.json`` with its variables filled in
(``--var NAME=VALUE``; ``$__rate_interval`` is ``--rate-interval``), asked of Prometheus's range
API and drawn with matplotlib (``pip install matplotlib``, the ``bench`` extra). A plot, not Grafana:
the legends, units, thresholds and dashed lines of the dashboard, nothing else. The operations page's
picture is made this way by ``tests/integration/test_prometheus.py`` (DATAFERRY_DASHBOARD_PNG).
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("dataferry-dashboard.json")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries (rows left out, those inside collapsed rows included)."""
    found: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            found += [p for p in panel.get("panels", []) if p.get("targets")]
        elif panel.get("targets"):
            found.append(panel)
    return found


def fill(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with each ``$name`` or ``${name}`` replaced; KeyError names one not given."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no value for the dashboard variable ${name} in {expr!r}")
        return variables[name]

    return VARIABLE.sub(value, expr)


def default_variables(rate_interval: str = "1m") -> dict[str, str]:
    """The dashboard's variables with every value selected (their ``allValue``)."""
    return {"job": ".+", "instance": ".+", "datasource": "", "__rate_interval": rate_interval}


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format filled in from a series' labels."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), fmt)


def query_range(
    prometheus: str, expr: str, start: float, end: float, step: float, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The matrix ``expr`` gives over [start, end]: ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=timeout) as reply:
        body = json.loads(reply.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def render(
    prometheus: str,
    out: Path,
    start: float,
    end: float,
    titles: Sequence[str] = (),
    variables: Mapping[str, str] | None = None,
    dashboard: Mapping[str, Any] | None = None,
    columns: int = 2,
) -> list[str]:
    """Draw the panels named ``titles`` (all that query, when empty) into the PNG ``out``; return
    the titles drawn. ``variables`` fill the queries' ``$name`` (``default_variables`` when None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    board = load_dashboard() if dashboard is None else dashboard
    chosen = panels(board)
    if titles:
        by_title = {p["title"]: p for p in chosen}
        missing = [t for t in titles if t not in by_title]
        if missing:
            raise KeyError(f"no panel titled {missing} in the dashboard; it has {sorted(by_title)}")
        chosen = [by_title[t] for t in titles]
    values = default_variables() if variables is None else variables
    step = max(1.0, (end - start) / 600)
    rows = (len(chosen) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(7.5 * columns, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, chosen, strict=False):
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        dashed = [
            re.compile(o["matcher"]["options"])
            for o in panel.get("fieldConfig", {}).get("overrides", [])
            if o.get("matcher", {}).get("id") == "byRegexp"
            and any(p.get("id") == "custom.lineStyle" for p in o.get("properties", []))
        ]
        colors: dict[str, Any] = {}  # with dashed series: one colour per name less its last word
        for target in panel["targets"]:
            for series in query_range(prometheus, fill(target["expr"], values), start, end, step):
                name = legend(target.get("legendFormat", ""), series["metric"])
                times = [float(t) - start for t, _ in series["values"]]
                points = [float(v) for _, v in series["values"]]
                style = "--" if any(p.fullmatch(name) for p in dashed) else "-"
                key = name.rsplit(" ", 1)[0] if dashed else name
                (line,) = ax.plot(times, points, style, label=name, linewidth=1.4, color=colors.get(key))
                colors.setdefault(key, line.get_color())
        for step_ in defaults.get("thresholds", {}).get("steps", []):
            if step_.get("value") is not None:
                ax.axhline(step_["value"], color=step_.get("color", "red"), linestyle=":", linewidth=1)
        unit = defaults.get("unit", "short")
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.set_ylabel("seconds")
        if "min" in defaults:
            ax.set_ylim(bottom=defaults["min"])
        if "max" in defaults:
            ax.set_ylim(top=defaults["max"] * 1.02)
        ax.set_title(panel["title"], fontsize=11, loc="left")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best", ncol=2 if len(ax.lines) > 4 else 1)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [p["title"] for p in chosen]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="its base URL")
    parser.add_argument("--minutes", type=float, default=30.0, help="the span drawn, up to now")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    parser.add_argument("--panel", action="append", default=[], help="a panel's title (repeat; default: all)")
    parser.add_argument("--var", action="append", default=[], help="NAME=VALUE for a dashboard variable")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = parser.parse_args(argv)
    variables = default_variables(args.rate_interval)
    for item in args.var:
        name, _, value = item.partition("=")
        variables[name] = value
    end = time.time()
    drawn = render(
        args.prometheus,
        args.out,
        end - 60 * args.minutes,
        end,
        args.panel,
        variables,
        load_dashboard(args.dashboard),
    )
    print(f"{args.out}: {len(drawn)} panels")


if __name__ == "__main__":
    main()
