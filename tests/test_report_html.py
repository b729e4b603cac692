"""Tests of the HTML report (``Plan.to_html``, autopar/core/report_html.py) and of ``autopar diff``
(autopar/core/diff.py): small plans of gpt-tiny on a 2x2 mesh and a pipeline of a deep GPT."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
from dataclasses import replace
from html.parser import HTMLParser

import pytest

import autopar
from autopar import Plan
from autopar.cli import main
from autopar.core.diff import plan_diff
from autopar.core.mesh import MeshSpec
from autopar.core.report import headline
from autopar.core.report_html import GANTT_DETAIL, gantt_chart
from autopar.core.units import fmt
from autopar.planning.baselines import candidates
from autopar.planning.pipeline import schedule_timeline
from tests.equivalence import build, make_batches, meta_model
from tests.tiers import slow

CHARTS = ("memory per device over the step", "placement map", "time per layer", "communication per mesh axis")
SHAPES = ("rect", "polygon", "line", "path", "circle")
#: Headless Chromium binaries the screenshot test looks for on PATH (Debian: chromium-headless-shell).
CHROMIUMS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
#: Set to a folder (docs/images) and the screenshot test saves a PNG of each chart of the pages
#: ``PICTURED`` there.
SAVE_CHARTS = "AUTOPAR_SAVE_CHARTS"
PICTURED = ("gpt-tiny-2x2", "pipeline")
# Per chart: its label, its box, and how many of its shapes the browser laid out with an area.
DRAWN = """els => els.map(e => [e.getAttribute('aria-label'), e.getBoundingClientRect().width,
    e.getBoundingClientRect().height, [...e.querySelectorAll('rect,polygon,line')].filter(s => {
        const b = s.getBBox(); return b.width > 0 || b.height > 0; }).length])"""


class Page(HTMLParser):
    """What the tests read of a page: each chart's shapes by its label, the summary table's rows,
    every src and href, and whether it has a script."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.charts: dict[str, int] = {}
        self.links: list[str] = []
        self.scripts = 0
        self.cells: list[str] = []
        self._chart: str | None = None
        self._cell = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]
        self.scripts += tag == "script"
        if tag == "svg":
            self._chart = a.get("aria-label", "?")
            self.charts[self._chart] = 0
        elif tag in SHAPES and self._chart is not None:
            self.charts[self._chart] += 1
        self._cell = tag == "td"

    def handle_endtag(self, tag):
        if tag == "svg":
            self._chart = None

    def handle_data(self, data):
        if self._cell:
            self.cells.append(data)
            self._cell = False


@pytest.fixture(scope="module")
def tiny():
    model = build("gpt-tiny")
    args, kwargs = make_batches("gpt-tiny", 8, 16, steps=1)[0]
    mesh = MeshSpec((2, 2), ("dp", "tp"))
    return autopar.plan(model, mesh, args, kwargs, profile=None), candidates(model, mesh, args, kwargs, profile=None)


@pytest.fixture(scope="module")
def pipelined():
    model = build("tests.deep_gpt:build")
    args, kwargs = make_batches("tests.deep_gpt:build", 64, 32, steps=1)[0]
    mesh = MeshSpec((2, 8), ("dp", "tp"), hardware="h100-80gb")
    return autopar.plan(model, mesh, args, kwargs, pipeline={"axis": "auto"})


def _check_page(plan: Plan, text: str, charts: tuple[str, ...]) -> Page:
    page = Page(text)
    for chart in charts:
        assert page.charts.get(chart, 0) > 0, (chart, page.charts)
    assert not page.scripts and not any(link.startswith(("http", "//")) for link in page.links), page.links
    assert text.count("http") == text.count('xmlns="http://www.w3.org/2000/svg"')   # no other URL at all
    cells = 2 * len(headline(plan))   # the context line only where attention is split by sequence
    summary = dict(zip(page.cells[0:cells:2], page.cells[1:cells:2], strict=True))
    assert summary == headline(plan)
    p = plan.predicted
    assert summary["step time"].startswith(fmt(p.step_time_s, "s"))
    assert summary["peak memory"].startswith(fmt(p.peak_memory_bytes, "B"))
    assert summary["planning time"] == fmt(plan.planning_s, "s") and summary["model"] == plan.model_name
    assert f"step time       {summary['step time']}" in plan.report()   # the text report says the same
    return page


def test_html_report_draws_every_chart_from_the_plan_alone(tiny, tmp_path):
    plan = tiny[0]
    path = tmp_path / "report.html"
    text = plan.to_html(str(path))
    assert path.read_text() == text
    _check_page(plan, text, CHARTS)
    assert Plan.from_json(plan.to_json()).to_html() == text   # a saved plan reports the same
    rows = text.split("Strategies weighed")[1]
    assert "chosen" in rows and all(name in rows for name in plan.solver["hand_plans"])
    assert len(text) < 100_000
    marked = replace(plan, recompute={"transformer.h.0": "full"}).to_html()
    assert "transformer.h.*.attn.c_attn (x2) [recompute full 1/2]" in marked


def test_html_report_of_a_pipeline_has_its_schedule(pipelined):
    schedule = schedule_timeline(pipelined)
    p = pipelined.pipeline
    assert len(schedule) == 2 * p.num_microbatches * p.num_stages
    assert {e[0] for e in schedule} == set(range(p.ranks))
    text = pipelined.to_html(schedule=schedule)
    page = _check_page(pipelined, text, (*CHARTS, "pipeline schedule"))
    assert page.charts["pipeline schedule"] >= len(schedule)
    assert p.schedule in text and len(text) < 1_000_000
    assert "No schedule was given" in pipelined.to_html()


def test_a_long_schedule_draws_busy_runs_not_every_microbatch(pipelined):
    long = replace(pipelined, pipeline=replace(pipelined.pipeline, num_microbatches=1024))
    schedule = schedule_timeline(long)
    assert len(schedule) > GANTT_DETAIL
    chart = gantt_chart(schedule)
    assert 0 < chart.count("<rect") < len(schedule) / 4 and len(chart) < 300_000


def test_diff_of_a_plan_with_itself_says_nothing(tiny, pipelined):
    assert plan_diff(tiny[0], tiny[0]) == []
    assert plan_diff(pipelined, Plan.from_json(pipelined.to_json())) == []


def test_diff_names_the_changed_placements(tiny):
    auto, hand = tiny[0], tiny[1]["dp(dp) x tp(tp)"]
    lines = plan_diff(auto, hand)
    assert any(line.startswith("placements in ") for line in lines), lines
    changed = [n.name for n in auto.nodes if n.out != hand.node(n.name).out]
    assert changed and any(line.strip().startswith(changed[0] + ":") for line in lines)
    assert any(line.startswith("predicted step: ") for line in lines)
    assert any(line.startswith("plan: auto -> dp(dp) x tp(tp)") for line in lines)


def test_cli_writes_html_and_diffs(tiny, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    tiny[0].to_json(str(a))
    tiny[1]["ddp"].to_json(str(b))
    for pair, wanted in (((a, a), "no change"), ((a, b), "placements in ")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["-q", "diff", str(pair[0]), str(pair[1])]) == 0
        assert wanted in out.getvalue()
    html_path = tmp_path / "r.html"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["-q", "plan", "--model", "gpt-tiny", "--mesh", "2x2", "--html", str(html_path)]) == 0
    Page(html_path.read_text())
    assert all(f'aria-label="{c}"' in html_path.read_text() for c in CHARTS)


def _browser():
    """playwright's sync API and a headless Chromium binary, or a skip saying what is missing."""
    how = "pip install playwright; apt-get install chromium-headless-shell (playwright's own browser download needs " \
          "a host this machine cannot reach)"
    sync = pytest.importorskip("playwright.sync_api", reason=f"the screenshot test needs playwright: {how}")
    exe = next((path for path in map(shutil.which, CHROMIUMS) if path), None)
    if exe is None:
        pytest.skip(f"no headless Chromium on PATH ({', '.join(CHROMIUMS)}): {how}")
    return sync, exe


@slow
def test_reports_render_in_headless_chromium(tiny, pipelined, tmp_path):
    """The pages open in Chromium offline: no console error, every chart laid out with shapes
    that have an area; a screenshot of each (``AUTOPAR_SAVE_CHARTS=docs/images``: a PNG per chart).
    GPT-3 175B on 128x8 H100 (as 32 pipeline stages x 4 x 8, 1F1B; planned here, once a browser
    is found): its page under 3 MB."""
    sync, exe = _browser()
    pages = {"gpt-tiny-2x2": (tiny[0].to_html(), CHARTS),
             "pipeline": (pipelined.to_html(schedule=schedule_timeline(pipelined)), ("pipeline schedule",))}
    model, args, kwargs = meta_model("gpt-175b", 1536, 2048)
    big = autopar.plan(model, MeshSpec((32, 4, 8), ("pp", "dp", "tp"), hardware="h100-80gb"), args, kwargs,
                       pipeline={"axis": "pp", "schedule": "Schedule1F1B"}, time_limit=30)
    assert big.pipeline is not None
    pages["gpt-175b-128x8"] = (big.to_html(schedule=schedule_timeline(big)), CHARTS + ("pipeline schedule",))
    assert len(pages["gpt-175b-128x8"][0].encode()) < 3 * 2**20
    save = os.environ.get(SAVE_CHARTS)
    with sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            for name, (text, charts) in pages.items():
                path = tmp_path / f"{name}.html"
                path.write_text(text)
                page = browser.new_page(viewport={"width": 1000, "height": 800})
                errors: list[str] = []
                page.on("console", lambda m, errors=errors: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(path.as_uri())
                drawn = {label: (w, h, shapes) for label, w, h, shapes in page.eval_on_selector_all("svg", DRAWN)}
                assert not errors, errors
                for chart in charts:
                    w, h, shapes = drawn[chart]
                    assert w > 0 and h > 0 and shapes > 0, (name, chart, drawn[chart])
                assert len(page.screenshot(full_page=True)) > 10_000
                if save and name in PICTURED:   # the README's pictures: gpt-tiny's charts, the pipeline's
                    for chart in charts:
                        page.locator(f'svg[aria-label="{chart}"]').screenshot(
                            path=os.path.join(save, chart.replace(" ", "-") + ".png"))
        finally:
            browser.close()
