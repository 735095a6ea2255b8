"""PromQL used by the deployment files, ready to evaluate, and the metric catalogue it may use.

Shared by tests/deploy/test_dashboard.py and tests/deploy/test_deploy.py, and meant for the
live test that evaluates every dashboard and alert expression against a real Prometheus scraping a real
pagedserve:

    from deploy_exprs import alert_expressions, dashboard_expressions
    for expr in dashboard_expressions() + alert_expressions():
        ...  # GET /api/v1/query?query=expr

``dashboard_expressions`` substitutes Grafana's variables (``$model_name``, ``$__rate_interval``,
...) the way Grafana would for the values given, so the strings are plain PromQL.

``promtool()`` finds promtool (Debian package ``prometheus``), installing it with apt-get when it
is missing and this process runs as root; ``check_promql()`` parses expressions with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "pagedserve.json"
ALERTS_PATH = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"

# Every metric pagedserve exports (names follow vLLM's, prefix pagedserve:, label model_name on
# every series), by Prometheus type. Histograms are exposed as <name>_bucket/_sum/_count; the
# info metric as <name> with value 1.
METRICS: dict[str, str] = {
    "pagedserve:num_requests_running": "gauge",
    "pagedserve:num_requests_waiting": "gauge",
    "pagedserve:kv_cache_usage_perc": "gauge",
    "pagedserve:prompt_tokens_total": "counter",
    "pagedserve:generation_tokens_total": "counter",
    "pagedserve:prefix_cache_queries_total": "counter",
    "pagedserve:prefix_cache_hits_total": "counter",
    "pagedserve:num_preemptions_total": "counter",
    "pagedserve:request_success_total": "counter",
    "pagedserve:request_failure_total": "counter",
    "pagedserve:time_to_first_token_seconds": "histogram",
    "pagedserve:inter_token_latency_seconds": "histogram",
    "pagedserve:request_time_per_output_token_seconds": "histogram",
    "pagedserve:e2e_request_latency_seconds": "histogram",
    "pagedserve:request_queue_time_seconds": "histogram",
    "pagedserve:request_prefill_time_seconds": "histogram",
    "pagedserve:request_decode_time_seconds": "histogram",
    "pagedserve:request_prompt_tokens": "histogram",
    "pagedserve:request_generation_tokens": "histogram",
    "pagedserve:iteration_tokens_total": "histogram",
    "pagedserve:step_duration_seconds": "histogram",
    "pagedserve:cpu_turns_wait_seconds_total": "counter",
    "pagedserve:cache_config_info": "info",
    "pagedserve:structured_output_requests_total": "counter",
    "pagedserve:grammar_compile_seconds": "histogram",
    "pagedserve:api_requests_total": "counter",
    "pagedserve:embedding_inputs_total": "counter",
    "pagedserve:embedding_tokens_total": "counter",
    "pagedserve:embedding_request_seconds": "histogram",
    "pagedserve:mm_images_total": "counter",
    "pagedserve:mm_images_encoded_total": "counter",
    "pagedserve:mm_encoder_cache_hits_total": "counter",
    "pagedserve:mm_encoder_seconds_total": "counter",
    "pagedserve:spec_decode_num_drafts_total": "counter",
    "pagedserve:spec_decode_num_draft_tokens_total": "counter",
    "pagedserve:spec_decode_num_accepted_tokens_total": "counter",
    "pagedserve:spec_decode_num_grammar_cut_tokens_total": "counter",
    "pagedserve:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "pagedserve:lora_requests_info": "gauge",
    "pagedserve:lora_adapter_requests_total": "counter",
    "pagedserve:lora_adapter_generation_tokens_total": "counter",
}
# Families with a label whose values are not known in advance (the adapter's name): no
# series until the first request under one finishes.
ON_DEMAND: frozenset[str] = frozenset({
    "pagedserve:lora_adapter_requests_total",
    "pagedserve:lora_adapter_generation_tokens_total",
})
# Label values the server documents for its labelled counters.
LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("pagedserve:request_success_total", "finished_reason"): frozenset({"stop", "length", "abort"}),
    ("pagedserve:request_failure_total", "reason"): frozenset(
        {"validation", "overload", "aborted", "engine_error"}
    ),
    ("pagedserve:structured_output_requests_total", "kind"): frozenset(
        {"json", "json_object", "regex", "choice", "grammar"}
    ),
    ("pagedserve:api_requests_total", "api"): frozenset(
        {"openai_chat", "openai_completions", "openai_responses", "anthropic_messages",
         "ollama_chat", "ollama_generate", "openai_embeddings", "ollama_embed",
         "ollama_embeddings", "vllm_score", "rerank"}
    ),
    ("pagedserve:api_requests_total", "status"): frozenset({"2xx", "4xx", "5xx"}),
}
# Series Prometheus itself produces for every target.
STANDARD_SERIES: dict[str, str] = {"up": "gauge"}

# Values Grafana would substitute. model_name: the dashboard's "All" value.
DEFAULT_VARIABLES: dict[str, str] = {
    "model_name": ".+",
    "__rate_interval": "1m",
    "__interval": "30s",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "30000",
    "__range_ms": "3600000",
}

RATE_FUNCTIONS = ("rate", "increase", "irate")

_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")


def series_types() -> dict[str, tuple[str, str]]:
    """Every series name the expressions may select -> (metric name, kind of series).

    The kind is the metric's type, or for histograms one of bucket/sum/count.
    """
    out: dict[str, tuple[str, str]] = {}
    for name, kind in {**METRICS, **STANDARD_SERIES}.items():
        if kind == "histogram":
            for suffix in ("bucket", "sum", "count"):
                out[f"{name}_{suffix}"] = (name, suffix)
        else:
            out[name] = (name, kind)
    return out


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}, [[x]]) with values; unknown ones raise."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}

    def repl(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"no value for Grafana variable {name!r} in {expr!r}")
        return values[name]

    return _VARIABLE_RE.sub(repl, expr)


def dashboard_panels(path: str | Path = DASHBOARD_PATH) -> list[dict]:
    """All panels of a dashboard, those nested in collapsed rows included, rows themselves too."""
    dashboard = json.loads(Path(path).read_text())
    out: list[dict] = []

    def walk(panels: Iterable[dict]) -> None:
        for panel in panels:
            out.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def dashboard_targets(path: str | Path = DASHBOARD_PATH) -> list[tuple[dict, dict]]:
    """(panel, target) for every query target of every panel."""
    return [
        (panel, target)
        for panel in dashboard_panels(path)
        for target in panel.get("targets", [])
        if not target.get("hide")
    ]


def dashboard_expressions(
    path: str | Path = DASHBOARD_PATH, variables: Mapping[str, str] | None = None
) -> list[str]:
    """Every PromQL expression of the dashboard's panels, Grafana variables substituted.

    ``variables`` overrides DEFAULT_VARIABLES, e.g. {"model_name": "SmolLM2-135M-Instruct",
    "__rate_interval": "30s"}. Order is panel order; duplicates are kept.
    """
    return [substitute(target["expr"], variables) for _, target in dashboard_targets(path)]


def alert_rules(path: str | Path = ALERTS_PATH) -> list[dict]:
    """Rules of a Prometheus rule file, or of a PrometheusRule resource's spec."""
    doc = yaml.safe_load(Path(path).read_text())
    if doc.get("kind") == "PrometheusRule":
        doc = doc["spec"]
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_expressions(path: str | Path = ALERTS_PATH) -> list[str]:
    """The PromQL expression of every rule (alerting and recording) in the rule file."""
    return [str(rule["expr"]).strip() for rule in alert_rules(path)]


_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING_RE = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
_IDENT_RE = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "atan2",
        "inf",
        "nan",
        "start",
        "end",
    }
)


def selectors(expr: str) -> list[tuple[str, int]]:
    """(metric name, position) of every vector selector of a PromQL expression.

    A small lexer, enough for the expressions this project writes: it drops string literals,
    label matchers, grouping clauses and range/subquery brackets, then takes every identifier
    that is not a function call or a keyword. Positions index into ``expr``.
    """
    masked = _STRING_RE.sub(lambda m: " " * len(m.group()), expr)
    for pattern in (r"\{[^}]*\}", r"\[[^\]]*\]"):
        masked = re.sub(pattern, lambda m: " " * len(m.group()), masked)
    masked = _GROUPING_RE.sub(lambda m: " " * len(m.group()), masked)
    out = []
    for match in _IDENT_RE.finditer(masked):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        # Durations/numbers are not identifiers; the lookbehind already skips "1e3" tails.
        out.append((name, match.start(1)))
    return out


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects."""
    return {name for name, _ in selectors(expr)}


def enclosing_function(expr: str, position: int) -> str | None:
    """Name of the innermost function call whose parentheses contain ``position``."""
    depth = 0
    for i in range(position - 1, -1, -1):
        ch = expr[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            if depth == 0:
                # "sum by (le) (" and "sum (...) by (le)" both name the aggregation.
                head = re.sub(r"\b(by|without)\s*\([^)]*\)\s*$", "", expr[:i])
                match = re.search(r"([A-Za-z_]\w*)\s*$", head)
                return match.group(1) if match else None
            depth -= 1
    return None


def usage_problems(expr: str, heatmap: bool = False) -> list[str]:
    """How an expression misuses a series for its type; empty when it does not.

    Counters and histogram series only under rate/increase/irate, gauges never; raw buckets only
    in histogram_quantile (or a heatmap target), grouped by le; a histogram's _sum only as
    rate(_sum) / rate(_count) of the same histogram (the mean). Unknown series are reported too.
    """
    known = series_types()
    problems = []
    for name, position in selectors(expr):
        if name not in known:
            problems.append(f"unknown series {name} in {expr!r}")
            continue
        metric, kind = known[name]
        func = enclosing_function(expr, position)
        if kind in ("counter", "bucket", "sum", "count") and func not in RATE_FUNCTIONS:
            problems.append(f"{name} ({kind}) not under rate()/increase() in {expr!r}")
        if kind == "gauge" and func in RATE_FUNCTIONS:
            problems.append(f"{func}() of gauge {name} in {expr!r}")
        if kind == "bucket":
            if not heatmap and "histogram_quantile(" not in expr:
                problems.append(f"raw buckets of {metric} outside histogram_quantile: {expr!r}")
            if not re.search(r"\bby\s*\([^)]*\ble\b[^)]*\)", expr):
                problems.append(f"buckets of {metric} not aggregated 'by (le)': {expr!r}")
        if kind == "sum":
            count = f"{metric}_count"
            if count not in expr:
                problems.append(f"{name} without {count}: {expr!r}")
            elif not expr.index(name) < expr.index("/") < expr.index(count):
                problems.append(f"mean must be rate(_sum) / rate(_count): {expr!r}")
    return problems


def label_value_problems(expr: str) -> list[str]:
    """Equality/regex matchers on documented labels that name undocumented values."""
    problems = []
    for match in re.finditer(r"(pagedserve:\w+)\{([^}]*)\}", expr):
        metric = match.group(1)
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', match.group(2)):
            allowed = LABEL_VALUES.get((metric, label))
            if allowed is None or op not in ("=", "=~"):
                continue
            values = set(value.split("|")) if op == "=~" else {value}
            if not values <= allowed:
                problems.append(f"{metric}{{{label}}} has no value(s) {sorted(values - allowed)}")
    return problems


# ------------------------------------------------------------------------------------------
# promtool


_PROMTOOL: list[str | None] = []


def promtool(install: bool = True) -> str | None:
    """Path of promtool; installs Debian's ``prometheus`` package when absent (as root).

    Returns None when it is absent and cannot be installed here (not root, no apt-get, or the
    install failed); callers skip with that reason.
    """
    if _PROMTOOL:
        return _PROMTOOL[0]
    found = shutil.which("promtool")
    if found is None and install and shutil.which("apt-get") and _is_root():
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
        try:
            if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
                subprocess.run(
                    ["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600
                )
                subprocess.run(cmd, env=env, capture_output=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired):
            pass
        found = shutil.which("promtool")
    _PROMTOOL.append(found)
    return found


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def check_promql(exprs: Iterable[str], promtool_path: str) -> subprocess.CompletedProcess:
    """Parse expressions with ``promtool check rules``, each as a recording rule."""
    unique = list(dict.fromkeys(exprs))
    rules = {
        "groups": [
            {
                "name": "expressions",
                "rules": [
                    {"record": f"deploy_check:expr_{i}", "expr": expr}
                    for i, expr in enumerate(unique)
                ],
            }
        ]
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exprs.yaml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        return subprocess.run(
            [promtool_path, "check", "rules", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
