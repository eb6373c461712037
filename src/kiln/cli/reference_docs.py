"""The documentation site's reference pages, generated from the code so they cannot drift.

Four pages, each from the one place its subject is defined: every RLJob field from the pydantic
API models (through the same structural schema the CRD is made of, so the page and
`kubectl explain` agree), every command and flag from the CLI parsers (`kiln.cli.main.COMMANDS`
and each module's `register`), every metric from `kiln.metrics`, and every alert, with its
runbook, from the chart's PrometheusRule as `helm template` renders it with the chart's
defaults.

They are made at build time: `mkdocs.yml` names this file as a hook, and `on_files` adds the
pages to the site as `reference/*.md`. Nothing generated is committed, so a change to the spec,
a command, a metric or an alert is in the next build without a regeneration step that many
people editing those at once would forget; `tests/unit/test_docs_reference.py` checks the pages
name every field, flag, metric and alert, and `tests/unit/test_docs_site.py` builds the site
with `--strict` (which also fails when an alert's runbook section is missing).

    .venv/bin/python -m kiln.cli.reference_docs --out DIR   # write the pages to read them as files
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kiln"
HEADER = "<!-- Generated at build time by kiln.cli.reference_docs from {source}. -->"


def prose(text: Any) -> str:
    """Help text as markdown: outside code spans, `<name>` placeholders are shown, not taken
    for HTML tags."""
    parts = str(text).split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;")
                    for i, p in enumerate(parts)).strip()


def cell(text: Any) -> str:
    """One markdown table cell: a single line of prose, its pipes escaped outside code spans."""
    parts = prose(str(text).replace("\n", " ")).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts)).strip()


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- RLJob fields ---------------------------------------------------------------------------

def _type_of(node: dict[str, Any]) -> str:
    if "enum" in node:
        kind = " or ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    elif node.get("x-kubernetes-int-or-string"):
        kind = "integer or string"
    elif node.get("type") == "array":
        kind = f"list of {_type_of(node.get('items', {}))}"
    elif node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        kind = f"map of {_type_of(node['additionalProperties'])}"
    else:
        kind = node.get("type", "any")
    bounds = [f"{sym} {node[key]}" for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                     ("maximum", "<="), ("exclusiveMaximum", "<"),
                                                     ("minLength", "length >="), ("maxLength", "length <="),
                                                     ("minItems", "items >="), ("maxItems", "items <="))
              if key in node]
    if bounds:
        kind += f" ({', '.join(bounds)})"
    if node.get("nullable"):
        kind += ", or null"
    return kind


def _default_of(node: dict[str, Any], required: bool) -> str:
    if "default" in node:
        return f"`{json.dumps(node['default'])}`"
    return "required" if required else ""


def schema_fields(node: dict[str, Any], path: str, required: bool = False) -> list[tuple[str, dict, bool]]:
    """Every field under `node`, depth first, as (path, schema, required)."""
    out = [(path, node, required)]
    needed = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        out += schema_fields(child, f"{path}.{name}", name in needed)
    if isinstance(node.get("items"), dict) and node["items"].get("properties"):
        out += schema_fields(node["items"], f"{path}[]")[1:]
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        out += schema_fields(extra, f"{path}.<name>")[1:]
    return out


def _annotation(annotation: Any) -> str:
    """A field's Python type, as a manifest author reads it."""
    import types
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    if origin is typing.Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is typing.Annotated:
        return _annotation(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_annotation(a) for a in args))
    if origin in (list, tuple):
        return f"list of {_annotation(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_annotation(args[1])}"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def model_fields(model: Any, prefix: str) -> dict[str, Any]:
    """Every pydantic field under `model` by its manifest path; what the structural schema folds
    away (a field that is a string or an object, kept as `x-kubernetes-preserve-unknown-fields`)
    is still here."""
    import typing

    from pydantic import BaseModel

    def models(annotation: Any) -> list[tuple[str, Any]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [("", annotation)]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin in (list, tuple):
            return [("[]" + s, m) for a in args for s, m in models(a)]
        if origin is dict:
            return [(".<name>" + s, m) for s, m in models(args[1])]
        return [pair for a in args for pair in models(a)]

    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        path = f"{prefix}.{f.alias or name}"
        out[path] = f
        for suffix, sub in models(f.annotation):
            out.update(model_fields(sub, path + suffix))
    return out


def rljob_page() -> str:
    from kiln.api.crd import openapi_schema
    from kiln.api.spec import API_GROUP, API_VERSION, KIND, RLJobSpec, RLJobStatus

    parts = [HEADER.format(source="the pydantic models of `kiln.api` (`RLJobSpec`, `RLJobStatus`)"),
             "# RLJob fields",
             f"Every field of the `{KIND}` resource (`apiVersion: {API_GROUP}/{API_VERSION}`), with its "
             "type, default and description, as the CRD (`kiln crd`) and `kiln validate` read them. "
             "Field names are camelCase in manifests; `path[]` is an element of a list and "
             "`path.<name>` an entry of a map. `kubectl explain rljob.spec...` prints the same "
             "descriptions on a cluster."]
    for top, model in (("spec", RLJobSpec), ("status", RLJobStatus)):
        schema = openapi_schema(model)
        parts.append(f"## {top}\n\n{cell(schema.get('description', ''))}")
        needed = set(schema.get("required", []))
        infos = model_fields(model, top)
        for name, child in schema.get("properties", {}).items():
            rows = []
            for p, n, r in schema_fields(child, f"{top}.{name}", name in needed):
                kind = _type_of(n) if "type" in n or "enum" in n else _annotation(infos[p].annotation)
                rows.append([f"`{p}`", kind, _default_of(n, r), n.get("description", "")])
                # fields of an object the schema keeps as free-form (a string-or-object field)
                if n.get("x-kubernetes-preserve-unknown-fields") and not n.get("properties"):
                    for sub, f in infos.items():
                        if sub.startswith(p + ".") or sub.startswith(p + "[]"):
                            default = "" if f.is_required() or f.default is None else f"`{json.dumps(f.default)}`"
                            rows.append([f"`{sub}`", _annotation(f.annotation), default, f.description or ""])
            parts.append(f"### {top}.{name}\n\n" + table(["field", "type", "default", "description"], rows))
    return "\n\n".join(parts) + "\n"


# --- commands and flags ---------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.option_strings:
            name = ", ".join(f"`{o}`" for o in a.option_strings)
            if a.nargs != 0:
                name += f" `{a.metavar or a.dest.upper()}`"
        else:
            name = f"`{a.metavar or a.dest}`" if not isinstance(a.metavar, tuple) else f"`{a.dest}`"
        default = "" if a.default in (None, argparse.SUPPRESS, False) or a.nargs == 0 else f"`{a.default}`"
        choices = f" (one of {', '.join(f'`{c}`' for c in a.choices)})" if a.choices else ""
        help_ = (a.help or "").replace("%(default)s", str(a.default)).replace("%(prog)s", parser.prog)
        rows.append([name, default, help_ + choices])
    return rows


def _command_section(name: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    # argparse wraps usage at the terminal's width; a fixed one keeps the page the same anywhere.
    os.environ["COLUMNS"] = "100"
    usage = parser.format_usage().strip().removeprefix("usage: ")
    out = [f"{'#' * level} kiln {name}", f"```text\n{usage}\n```"]
    if parser.description:
        out.append(prose(parser.description))
    rows = _option_rows(parser)
    if rows:
        out.append(table(["argument", "default", "meaning"], rows))
    for sub_name, sub in _subparsers(parser).items():
        out += _command_section(f"{name} {sub_name}", sub, min(level + 1, 4))
    return out


def cli_page() -> str:
    from kiln.cli.main import COMMANDS, command_parser

    parts = [HEADER.format(source="the CLI parsers (`kiln.cli.main.COMMANDS` and each command's `register`)"),
             "# Commands",
             "Every `kiln` command with every argument, as `kiln COMMAND --help` prints them. The "
             "[CLI conventions](../guides/cli-conventions.md) say what they share (the job "
             "positional, exit codes, quantities, `--set` overrides).",
             table(["command", "what it does"], [[f"[`kiln {n}`](#kiln-{n})", h] for n, (_, h) in COMMANDS.items()])]
    for name in COMMANDS:
        parser = _subparsers(command_parser(name))[name]
        parts += _command_section(name, parser, 2)
    return "\n\n".join(parts) + "\n"


# --- metrics --------------------------------------------------------------------------------

def metrics_page() -> str:
    from kiln import metrics as m

    def rows(ms) -> list[list[str]]:
        return [[f"`{x.name}`", f"`{x.series}`" if x.series else "", x.kind if x.series else "",
                 ", ".join(f"`{lab}`" for lab in x.labels), x.unit,
                 x.help + (" (RL steps only)" if x.rl_only else "")] for x in ms]

    head = ["name", "Prometheus series", "kind", "labels", "unit", "meaning"]
    return "\n\n".join([
        HEADER.format(source="`kiln.metrics`"),
        "# Metrics",
        "Every metric Kiln reports, defined once in `src/kiln/metrics.py`. A step metric's name is "
        "its key in `metrics.jsonl`, its column in the run report and its tracker tag "
        "(`train/<name>` in TensorBoard and W&B); a metric with a Prometheus series is exported "
        "under that series by the process that measures it (the trainer, rollout, sandbox, "
        "weight-sync, buffer, the operator). The Grafana dashboards and the [alerts](alerts.md) "
        "use the series names.",
        "## Trainer step metrics\n\nOne record per optimizer step (`StepMetrics`).\n\n" + table(head, rows(m.STEP.values())),
        "## Derived step metrics\n\nComputed from a step's fields.\n\n" + table(head, rows(m.DERIVED.values())),
        "## Service series\n\nThe services', the sandboxes' and the operator's series.\n\n" + table(head, rows(m.SERIES.values())),
        "## Evaluation\n\n" + table(head, rows([m.PASS_AT_K])),
        "## What the stage driver tracks\n\nBesides the trainer's `train/<name>`, the stage "
        "driver (`kiln run`'s, the operator's) logs these to the job's trackers at the trainer's "
        "global step: every poll `progress/<name>`, `rollout/<name>` and `buffer/<name>`, and "
        "after each held-out evaluation `eval/<task set>/<name>` and "
        "`eval/<task set>/pass_at_k/<k>`.\n\n" + table(["tag", "unit", "meaning"], [
            [f"`{prefix}/{x.name}`" if prefix != "eval" else f"`eval/<task set>/{x.name}`",
             x.unit, x.help]
            for prefix, group in [("progress", m.PROGRESS), *m.STATUS.items()]
            for x in group.values()]),
    ]) + "\n"


# --- alerts ---------------------------------------------------------------------------------

def _helm() -> str:
    found = shutil.which("helm", path=f"{ROOT / '.tools' / 'bin'}:{os.environ.get('PATH', '')}")
    if not found:
        raise SystemExit("helm not found in .tools/bin or on PATH (bash deploy/setup.sh installs it)")
    return found


def rendered_alerts() -> list[dict[str, Any]]:
    """The chart's alerts with its default values, as the API server would get them."""
    out = subprocess.run([_helm(), "template", "kiln", str(CHART), "--set", "prometheusRule.enabled=true",
                          "--show-only", "templates/prometheusrule.yaml"],
                         check=True, capture_output=True, text=True).stdout
    rule = next(d for d in yaml.safe_load_all(out) if d)
    return [dict(r, group=g["name"]) for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


def alerts_page() -> str:
    parts = [HEADER.format(source="`charts/kiln/templates/prometheusrule.yaml` (rendered with the chart's defaults)"),
             "# Alerts",
             "The PrometheusRule the chart installs with `--set prometheusRule.enabled=true`, with its "
             "default thresholds (`prometheusRule.thresholds` and `prometheusRule.forDuration` in the "
             "chart's values). Each alert's `runbook_url` points into "
             "[Troubleshooting](../guides/troubleshooting.md), under `docsBaseUrl`."]
    summary = []
    for a in rendered_alerts():
        anchor = a["alert"].lower()
        summary.append([f"[`{a['alert']}`](#{anchor})", a.get("labels", {}).get("severity", ""),
                        a.get("annotations", {}).get("summary", "")])
    parts.append(table(["alert", "severity", "summary"], summary))
    for a in rendered_alerts():
        ann = a.get("annotations", {})
        anchor = a["alert"].lower()
        parts.append("\n\n".join([
            f"## {a['alert']}",
            f"Group `{a['group']}`, severity `{a.get('labels', {}).get('severity', '')}`, "
            f"firing after `{a.get('for', '0s')}`. Runbook: [Troubleshooting: {a['alert']}]"
            f"(../guides/troubleshooting.md#{anchor}) (`{ann.get('runbook_url', '')}`).",
            prose(ann.get("description", "")),
            f"```promql\n{a['expr'].strip()}\n```"]))
    return "\n\n".join(parts) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "rljob.md": rljob_page, "cli.md": cli_page, "metrics.md": metrics_page, "alerts.md": alerts_page,
}


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for name, make in PAGES.items():
        files.append(File.generated(config, f"reference/{name}", content=make()))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.cli.reference_docs",
                                description="Write the documentation's generated reference pages.")
    p.add_argument("--out", type=Path, required=True, help="folder to write rljob.md, cli.md, "
                   "metrics.md and alerts.md into (the site makes them itself at build time)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (args.out / name).write_text(make())
    return 0


if __name__ == "__main__":
    sys.exit(main())
