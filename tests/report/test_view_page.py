"""`hybridflow view`'s page in headless Chromium (Debian's `chromium`, driven by Playwright): the curves, a
multi-turn row colored token by token, the color modes, and the page following a run that writes a new step.
Skipped with the reason where Chromium or Playwright is missing (CI installs Chromium: .ci/run)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the test extra)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
# flags for a machine with no network, as root, with no GPU: without the background-networking ones
# Chromium keeps trying hosts it cannot reach
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def metrics_line(step: int) -> str:
    return json.dumps({"step": step, "reward/mean": 0.1 * step, "actor/entropy": 2.0 - 0.1 * step,
                       "response_length/mean": 10 + step, "rollout/staleness_mean": 0.5}) + "\n"


def write_run(root):
    root.mkdir()
    (root / "metrics.jsonl").write_text("".join(metrics_line(s) for s in (1, 2, 3)))
    record = {"step": 3, "uid": "g0", "data_source": "toy", "score": 1.0, "prompt": "What is 6*7?", "version": 3,
              "tokens": ["<tool_call>", "6*7", "</tool_call>", "<tool_response>", "42", "</tool_response>", "The",
                         " answer", " is", " 42"],
              "trained": [1, 1, 1, 0, 0, 0, 1, 1, 1, 1],
              "logprob": [-0.1, -4.0, -0.2, 0, 0, 0, -0.3, -0.5, -0.1, -6.0],
              "old_logprob": [-0.1, -3.5, -0.2, 0, 0, 0, -0.3, -0.5, -0.1, -6.0],
              "advantage": [1.0] * 3 + [0.0] * 3 + [1.0] * 4, "staleness": [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]}
    (root / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    (root / "samples.jsonl").write_text(json.dumps({"step": 3, "prompt": "2+2?", "response": "4", "reward": 1.0,
                                                    "data_source": "toy"}) + "\n")


@pytest.fixture
def served(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    # --port 0: the server binds a free port itself and prints it (a port probed free here could be taken by
    # another test worker before the server bound it)
    server = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "view", str(run), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed = ""
    for line in server.stdout:  # a library's warning may come first; EOF if the server ends
        printed += line
        if match := re.match(r"hybridflow view: (http://127\.0\.0\.1:\d+/) ", line):
            break
    else:
        server.kill()
        pytest.fail(f"hybridflow view did not start: {printed[-2000:]}")
    url = match.group(1)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "api/run", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"hybridflow view did not answer: {server.stdout.read()[-2000:]}")
            time.sleep(0.2)
    yield run, url
    server.terminate()
    server.wait(timeout=10)


def test_page_shows_curves_tokens_turns_and_follows_the_run(served, tmp_path):
    run, url = served
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1400})
        page.goto(url)
        page.wait_for_selector(".chart .main-svg", timeout=20_000)
        charts = page.eval_on_selector_all(".chart", "els => els.map(e => e.dataset.key)")
        assert charts == ["reward/mean", "response_length/mean", "actor/entropy", "rollout/staleness_mean"]
        page.wait_for_selector(".record .tok")
        assert page.inner_text("#status").startswith("step 3")
        # the trajectory turn by turn: model (the tool call), the tool's answer, model
        turns = page.eval_on_selector_all(".record .turn", "els => els.map(e => e.className)")
        assert turns == ["turn model", "turn env", "turn model"]
        assert "42" in page.inner_text(".turn.env")
        colors = page.eval_on_selector_all(".turn.model .tok", "els => els.map(e => e.style.background)")
        assert len(colors) == 7 and all(colors) and len(set(colors)) > 1  # log-prob colors differ
        assert page.eval_on_selector_all(".turn.env .tok", "els => els.map(e => e.style.background)") == [""] * 3
        tip = page.get_attribute(".turn.model .tok >> nth=1", "title")
        assert "log-prob -4.0000" in tip and "staleness 1" in tip
        page.select_option("#color-by", "gap")  # only the second token's gap (-0.5) shows
        gaps = page.eval_on_selector_all(".turn.model .tok", "els => els.map(e => e.style.background)")
        assert gaps[1] != gaps[0] and "rollout log-prob minus trainer" in page.inner_text("#legend")
        assert "2+2?" in page.inner_text("#samples")
        page.screenshot(path=str(tmp_path / "view.png"), full_page=True)
        # the run goes on: a new step appears without a reload
        with open(run / "metrics.jsonl", "a") as f:
            f.write(metrics_line(4))
        page.wait_for_function("document.querySelector('#status').innerText.startsWith('step 4')", timeout=10_000)
        points = page.evaluate("document.querySelector('.chart[data-key=\"reward/mean\"]').data[0].x")
        assert points == [1, 2, 3, 4]
        browser.close()
    assert (tmp_path / "view.png").stat().st_size > 10_000
