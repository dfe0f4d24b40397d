"""mkdocs hook: the pages made from the code and from other files, so that none of them can drift.

* ``index.md``: the README, with its ``docs/`` links made relative to the site;
* ``reference/flags.md``: every ``serve`` option, from its one declaration
  (``loader_service/config/options.py``): flag, TOML key, variable, default, meaning;
* ``reference/metrics.md``: every Prometheus metric and every field of a ``status`` body, from the
  body's one declaration (``protocol/status.py``);
* ``design/notes.md``: every named note (``NOTE [ ... ]``) defined in the product and where;
* ``operations/deploy.md`` and ``benchmarks/rerun.md``: ``deploy/README.md`` and
  ``benchmarks/README.md``, which live beside what they describe.
"""

from __future__ import annotations

import re
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
OPENS = re.compile(r'^\s*(?:""")?NOTE \[ ([^\]]+?) \](?:$|:(.*)$)')
PRODUCT = ("protocol", "loader_service", "gpu_worker")


COMMITTED = {
    "reference/flags.md": "flags_page",
    "reference/metrics.md": "metrics_page",
    "design/notes.md": "notes_page",
}
"""Pages made from the code and also kept in docs/, so that their links work where the Markdown is
read on a code host; ``tests/unit/test_docs.py`` fails when one differs from what the code gives
(``python docs/hooks/generated.py`` writes them again)."""
SITE_LINKS = {"](../deploy/README.md)": "](operations/deploy.md)"}
"""Links that lead to a file beside what it describes on a code host, and to its page on the site."""
STAMP = "<!-- Generated from the code by docs/hooks/generated.py: edit the code, then run it. -->\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, content in pages().items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, **_: Any) -> str:
    for source, site in SITE_LINKS.items():
        markdown = markdown.replace(source, site)
    return markdown


def pages() -> dict[str, str]:
    """The pages generated for the site alone (``COMMITTED`` ones are files in docs/)."""
    return {
        "index.md": (REPO / "README.md").read_text().replace("](docs/", "]("),
        "operations/deploy.md": (REPO / "deploy" / "README.md").read_text(),
        "benchmarks/rerun.md": (REPO / "benchmarks" / "README.md").read_text(),
    }


def committed_pages() -> dict[str, str]:
    return {uri: STAMP + globals()[make]() for uri, make in COMMITTED.items()}


def write_committed() -> None:
    for uri, content in committed_pages().items():
        path = REPO / "docs" / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {path.relative_to(REPO)}")


def flags_page() -> str:
    from loader_service.config.options import OPTIONS

    lines = [
        "# serve flags",
        "",
        "Every option of `loader-service serve`, generated from its one declaration",
        "(`loader_service/config/options.py`). Each is also a TOML key (the name with underscores) and",
        "an environment variable (`DATAFERRY_` and the key in capitals); flags win over the variables,",
        "which win over the file ([Run the service](../serving.md)). `[feeds.NAME]` tables take the",
        "options marked *per feed*.",
        "",
        "| flag | default | meaning |",
        "| --- | --- | --- |",
    ]
    for o in OPTIONS.values():
        meaning = _cell(o.help.rstrip(".")) + "."
        if o.choices:
            meaning += f" One of {', '.join(f'`{c}`' for c in o.choices)}."
        if o.per_feed:
            meaning += " *Per feed.*"
        meaning += f" <br>`{o.name}`, `{o.env}`"
        forms = f"`{o.flag}`" + (f"<br>`--no-{o.flag[2:]}`" if o.type is bool else "")
        lines.append(f"| {forms} | {_default(o.default)} | {meaning} |")
    lines += ["", "Beside its options, `serve` takes:", "", "| flag | meaning |", "| --- | --- |"]
    for flag, meaning in _other_serve_flags():
        lines.append(f"| `{flag}` | {_cell(meaning.rstrip('.'))}. |")
    return "\n".join(lines) + "\n"


def metrics_page() -> str:
    from dataclasses import fields

    from protocol import status

    path = status.paths()
    lines = [
        "# Metrics and the status body",
        "",
        "What `loader-service status --json` returns and what `serve --metrics-port` exports, generated",
        "from the body's one declaration (`protocol/status.py`, NOTE [ Status contract ]). A histogram",
        "is stored as its `_bucket`, `_sum` and `_count`. Where a trainer's sessions make one series,",
        "*per trainer* says how (NOTE [ Trainer series ]). In the body, `null` stands for none.",
        "[Operations](../operations.md) tells what to watch them for.",
        "",
        "## Metrics",
        "",
        "| metric | kind | labels | meaning | in the body |",
        "| --- | --- | --- | --- | --- |",
    ]
    for cls, metric in status.metrics():
        labels = ", ".join(status.labels_of(path[cls], metric))
        key = next(status.key_of(f) for f in fields(cls) if status.metric_of(f) is metric)
        where = ".".join(_record_key(path[cls][i], path[cls][i + 1]) for i in range(len(path[cls]) - 1))
        meaning = _cell(metric.help.rstrip(".")) + "."
        if metric.combine is not None:
            meaning += f" *Per trainer: {COMBINED[metric.combine]}.*"
        at = f"{where}.{key}" if where else key
        stored = metric.name + ("_total" if metric.kind == "counter" else "")
        lines.append(f"| `{stored}` | {metric.kind} | {labels} | {meaning} | `{at}` |")
    lines += ["", "Observed as they happen rather than read from the body:", ""]
    lines += ["| metric | kind | labels | meaning | exported by |", "| --- | --- | --- | --- | --- |"]
    observed = {
        status.READY_WAIT: "`serve --metrics-port`",
        status.BATCH_WAIT: "`gpu-worker run --metrics-port`",
    }
    for histogram, by in observed.items():
        lines.append(
            f"| `{histogram.name}` | {histogram.kind} | {histogram.by} | {_cell(histogram.help)} | {by} |"
        )
    lines += ["", "## The status body", ""]
    for cls in status.records():
        lines += [f"### {cls.__name__}", "", _cell(" ".join((cls.__doc__ or "").split())), ""]
        lines += ["| key | type | meaning | metric |", "| --- | --- | --- | --- |"]
        for f in fields(cls):
            declared = status.metric_of(f)
            named = "" if declared is None else f"`{declared.name}`"
            kind = _cell(re.sub(r"tuple\[(\w+), \.\.\.\]", r"list[\1]", str(f.type)))
            lines.append(f"| `{status.key_of(f)}` | `{kind}` | {_cell(status.meaning_of(f))} | {named} |")
        lines.append("")
    return "\n".join(lines)


COMBINED = {
    "sum": "its sessions summed",
    "largest": "the largest of its sessions",
    "counted": "counted on over its sessions",
}


def _record_key(above: type, part: type) -> str:
    """The key of ``above`` under which ``part`` hangs (``feeds[]`` for rows)."""
    from dataclasses import fields

    from protocol import status

    for f in fields(above):
        if status.part_of(f) is part:
            return status.key_of(f) + ("[]" if str(f.type).startswith("tuple") else "")
    raise LookupError(f"{part.__name__} is no part of {above.__name__}")


def _other_serve_flags() -> list[tuple[str, str]]:
    """``serve``'s flags that are no option of the config (``--config``, ``--dry-run``...), as
    ``serve --help`` has them."""
    from loader_service.config.options import OPTIONS
    from loader_service.tools.cli import command_parser

    known = {o.flag for o in OPTIONS.values()}
    return [
        (action.option_strings[-1], action.help or "")
        for action in command_parser("serve")._actions
        if action.option_strings and action.option_strings[-1] not in known and action.dest != "help"
    ]


def _default(value: Any) -> str:
    if value is MISSING:
        return "required"
    if value is False:
        return "off"
    if value is True:
        return "on"
    if value in ("", 0, None, ()):
        return "" if value in ("", None, ()) else "`0`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def notes_page() -> str:
    lines = [
        "# Named notes",
        "",
        "The invariants the code keeps are written once, as a named note in the module that keeps them,",
        "and cited by name (`NOTE [ Slot lifecycle ]`) wherever code relies on them; a test keeps every",
        "cited note defined ([Contributing](../contributing.md)). Here: each note, where it is, and its",
        "first line.",
        "",
        "| note | where | first line |",
        "| --- | --- | --- |",
    ]
    for name, where, first in sorted(_notes(), key=lambda n: n[0].lower()):
        lines.append(f"| {name} | `{where}` | {_cell(first)} |")
    return "\n".join(lines) + "\n"


def _notes() -> list[tuple[str, str, str]]:
    """(name, file, first line) of each note's definition. Where a docstring paragraph opens with a
    note's name in several places, the definition is the one whose text follows indented (a
    block under the name), else one at the top of a module; the others are citations."""
    best: dict[str, tuple[int, str, str]] = {}
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            text = path.read_text().splitlines()
            for i, line in enumerate(text):
                m = OPENS.match(line)
                opens = line.lstrip().startswith('"""') or i == 0 or _opens_paragraph(text[i - 1])
                if m is None or not opens:
                    continue
                after = next((t for t in text[i + 1 : i + 3] if t.strip()), "")
                score = 2 if _indent(after) > _indent(line) else 1 if _indent(line) == 0 else 0
                first = (m.group(2) or "").strip() or after.strip()
                if m.group(1) not in best or score > best[m.group(1)][0]:
                    best[m.group(1)] = (score, str(path.relative_to(REPO)), first)
    return [(name, where, first) for name, (_, where, first) in best.items()]


def _opens_paragraph(previous: str) -> bool:
    """Blank, or a docstring's opening quotes alone."""
    return not previous.strip() or previous.strip() in ('"""', 'r"""')


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip().lstrip('"'))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(REPO))
    write_committed()
