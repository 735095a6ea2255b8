"""Static checks of the Grafana dashboard (deploy/grafana/pagedserve.json) and its provisioning.

Structure (datasource, targets, unique ids, grid layout), the template variables, that every
series it selects is one pagedserve exports and is used the way its type allows (counters and
histogram series only under rate/increase, histogram_quantile grouped by le, means as
rate(_sum)/rate(_count)), that it covers every exported metric, and that every expression parses
as PromQL (promtool) once Grafana's variables are substituted. Evaluating the expressions
against a live Prometheus scraping a live server is a separate test.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

try:  # tests/ as a package (tests/__init__.py) or as plain rootdir-less test modules
    from tests.support import deploy_exprs as dx
except ImportError:
    import deploy_exprs as dx

DASHBOARD = dx.DASHBOARD_PATH
PROVISIONING = dx.REPO_ROOT / "docker" / "grafana" / "provisioning"
COMPOSE = dx.REPO_ROOT / "docker" / "compose.yaml"

MODEL_VARIABLE_QUERY = "label_values(pagedserve:num_requests_running, model_name)"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def panels() -> list[dict]:
    return [p for p in dx.dashboard_panels(DASHBOARD) if p.get("type") != "row"]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _provisioned_datasources() -> list[dict]:
    out = []
    for path in sorted((PROVISIONING / "datasources").glob("*.y*ml")):
        out += yaml.safe_load(path.read_text()).get("datasources", [])
    return out


def test_dashboard_top_level(dashboard):
    assert dashboard["uid"] == "pagedserve"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    # Provisioned dashboards must not carry a database id from some other Grafana.
    assert dashboard.get("id") is None


def test_template_variables(dashboard):
    variables = _variables(dashboard)
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"

    model = variables["model_name"]
    assert model["type"] == "query"
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == MODEL_VARIABLE_QUERY
    assert model["datasource"]["uid"] == "${datasource}"
    assert model["multi"] and model["includeAll"]
    # Multi-value variables are only valid inside regex matchers.
    for _, target in dx.dashboard_targets(DASHBOARD):
        assert '!="$model_name"' not in target["expr"]
        assert 'model_name="$model_name"' not in target["expr"], target["expr"]


def test_datasource_variable_defaults_to_the_provisioned_datasource(dashboard):
    """The compose stack's Grafana has exactly the datasource the dashboard selects by default."""
    datasources = _provisioned_datasources()
    assert datasources, "no datasource provisioned under docker/grafana/provisioning"
    default = _variables(dashboard)["datasource"]["current"]["value"]
    matching = [d for d in datasources if d.get("uid") == default]
    assert matching, f"dashboard default datasource uid {default!r} is not provisioned"
    assert matching[0]["type"] == "prometheus"
    assert matching[0].get("isDefault") is True
    # Its URL is the compose service that runs Prometheus.
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    host = re.match(r"https?://([^:/]+)", matching[0]["url"]).group(1)
    assert host in services and "prometheus" in services[host]["image"]


def test_dashboard_provider_loads_this_dashboard():
    """The provider's path is where compose mounts deploy/grafana, and the home dashboard exists."""
    providers = []
    for path in sorted((PROVISIONING / "dashboards").glob("*.y*ml")):
        providers += yaml.safe_load(path.read_text())["providers"]
    assert providers
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = (COMPOSE.parent / source).resolve()
    for provider in providers:
        assert provider["type"] == "file"
        path = provider["options"]["path"]
        assert mounts.get(path) == DASHBOARD.parent.resolve(), (
            f"provider path {path} is not the mount of deploy/grafana"
        )
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    directory, _, name = home.rpartition("/")
    assert mounts[directory] == DASHBOARD.parent.resolve() and name == DASHBOARD.name
    # Anonymous visitors can view, not edit.
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_every_panel_has_datasource_targets_and_unique_ids(dashboard, panels):
    all_panels = dx.dashboard_panels(DASHBOARD)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert all(isinstance(i, int) for i in ids)
    assert len(panels) >= 20
    for panel in panels:
        title = panel.get("title")
        assert title, f"panel {panel['id']} has no title"
        assert panel.get("datasource", {}).get("uid") == "${datasource}", title
        assert panel["datasource"].get("type") == "prometheus", title
        targets = panel.get("targets")
        assert targets, f"panel {title!r} has no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {title!r}: duplicate refIds"
        for target in targets:
            assert target.get("expr", "").strip(), f"panel {title!r}: empty expression"
            assert target.get("datasource", panel["datasource"])["uid"] == "${datasource}"


def test_grid_layout(panels):
    """Every panel (and row) has a gridPos inside the 24-column grid, and none overlap."""
    boxes = []
    for panel in dx.dashboard_panels(DASHBOARD):
        pos = panel.get("gridPos")
        assert pos, f"panel {panel.get('title')!r} has no gridPos"
        for key in ("h", "w", "x", "y"):
            assert isinstance(pos[key], int) and pos[key] >= 0, (panel.get("title"), pos)
        assert pos["w"] >= 1 and pos["h"] >= 1 and pos["x"] + pos["w"] <= 24, panel["title"]
        boxes.append((panel["title"], pos))
    for i, (title_a, a) in enumerate(boxes):
        for title_b, b in boxes[i + 1 :]:
            overlap = (
                a["x"] < b["x"] + b["w"]
                and b["x"] < a["x"] + a["w"]
                and a["y"] < b["y"] + b["h"]
                and b["y"] < a["y"] + a["h"]
            )
            assert not overlap, f"panels {title_a!r} and {title_b!r} overlap"


def test_metric_names_are_exported_ones():
    known = dx.series_types()
    for expr in dx.dashboard_expressions(DASHBOARD):
        names = dx.metric_names(expr)
        assert names, f"no series selected by {expr!r}"
        unknown = names - set(known)
        assert not unknown, f"{expr!r} uses unknown series {sorted(unknown)}"


def test_dashboard_covers_every_metric():
    used = {
        dx.series_types()[n][0]
        for e in dx.dashboard_expressions(DASHBOARD)
        for n in dx.metric_names(e)
    }
    missing = set(dx.METRICS) - used
    assert not missing, f"no panel shows {sorted(missing)}"


def test_metric_usage_matches_type():
    for _, target in dx.dashboard_targets(DASHBOARD):
        expr = dx.substitute(target["expr"])
        problems = dx.usage_problems(expr, heatmap=target.get("format") == "heatmap")
        problems += dx.label_value_problems(expr)
        assert not problems, "\n".join(problems)


def test_heatmaps_use_bucket_increases():
    heatmaps = [p for p in dx.dashboard_panels(DASHBOARD) if p.get("type") == "heatmap"]
    shown = set()
    for panel in heatmaps:
        assert panel["options"]["calculate"] is False, panel["title"]
        for target in panel["targets"]:
            assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}"
            assert re.search(r"sum by \(le\) \(increase\(", target["expr"]), target["expr"]
            shown |= {dx.series_types()[n][0] for n in dx.metric_names(target["expr"])}
    assert {"pagedserve:request_prompt_tokens", "pagedserve:request_generation_tokens"} <= shown


@pytest.mark.parametrize(
    "metric",
    [
        "pagedserve:time_to_first_token_seconds",
        "pagedserve:inter_token_latency_seconds",
        "pagedserve:request_time_per_output_token_seconds",
        "pagedserve:e2e_request_latency_seconds",
        "pagedserve:request_queue_time_seconds",
    ],
)
def test_latency_panels_have_quantiles_and_mean(metric):
    """One panel per latency histogram with p50, p90, p99 and the mean."""
    for panel in dx.dashboard_panels(DASHBOARD):
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if not any(f"{metric}_bucket" in e for e in exprs):
            continue
        quantiles = set()
        for expr in exprs:
            match = re.match(r"histogram_quantile\(([0-9.]+),", expr)
            if match:
                quantiles.add(float(match.group(1)))
        assert quantiles >= {0.5, 0.9, 0.99}, panel["title"]
        assert any(f"{metric}_sum" in e and f"{metric}_count" in e for e in exprs), panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"
        return
    pytest.fail(f"no panel shows {metric}")


def test_required_panels_exist():
    exprs_by_title = {
        p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
        for p in dx.dashboard_panels(DASHBOARD)
    }

    def find(*needles: str) -> str:
        for title, exprs in exprs_by_title.items():
            if all(n in exprs for n in needles):
                return title
        pytest.fail(f"no panel uses all of {needles}")

    find("finished_reason", "pagedserve:request_success_total")  # finish reasons
    find("by (reason)", "pagedserve:request_failure_total")  # errors by reason
    find("pagedserve:num_requests_running", "pagedserve:num_requests_waiting")
    find("pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total")
    find("pagedserve:kv_cache_usage_perc")
    find("pagedserve:num_preemptions_total")
    find("pagedserve:step_duration_seconds_bucket")
    # Hit rate is hits / queries.
    hit = find("pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total")
    expr = exprs_by_title[hit]
    assert expr.index("prefix_cache_hits_total") < expr.index("/") < expr.index("queries_total")


def test_substitution_leaves_no_variables():
    for expr in dx.dashboard_expressions(DASHBOARD):
        assert "$" not in expr and "[[" not in expr, expr
    with pytest.raises(KeyError):
        dx.substitute("rate(x[$no_such_variable])")
    assert dx.substitute('x{m=~"${model_name:regex}"}', {"model_name": "a|b"}) == 'x{m=~"a|b"}'


def test_expressions_parse_as_promql():
    promtool = dx.promtool()
    if promtool is None:
        pytest.skip("promtool is missing and could not be installed (needs root and apt-get)")
    exprs = dx.dashboard_expressions(DASHBOARD)
    # Also with a concrete model and interval, as a live test would send them.
    exprs += dx.dashboard_expressions(
        DASHBOARD, {"model_name": "SmolLM2-135M-Instruct", "__rate_interval": "30s"}
    )
    result = dx.check_promql(exprs, promtool)
    assert result.returncode == 0, result.stdout + result.stderr
    # The check itself catches a broken expression.
    broken = dx.check_promql(["sum(rate(pagedserve:prompt_tokens_total[1m])"], promtool)
    assert broken.returncode != 0


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(pagedserve:num_requests_running[1m]))",  # rate of a gauge
        "sum(pagedserve:prompt_tokens_total)",  # counter without rate
        "histogram_quantile(0.9, sum(rate(pagedserve:step_duration_seconds_bucket[1m])))",  # no le
        "sum(rate(pagedserve:step_duration_seconds_sum[1m]))",  # mean without _count
        "sum(rate(pagedserve:step_duration_seconds_count[1m])) / "
        "sum(rate(pagedserve:step_duration_seconds_sum[1m]))",  # inverted mean
        "sum(pagedserve:num_requests_queued)",  # not an exported metric
    ],
)
def test_usage_checker_catches_mistakes(expr):
    assert dx.usage_problems(expr)


def test_label_value_checker_catches_mistakes():
    assert dx.label_value_problems('rate(pagedserve:request_failure_total{reason="timeout"}[1m])')
    assert not dx.label_value_problems(
        'rate(pagedserve:request_success_total{finished_reason=~"stop|length"}[1m])'
    )
