"""The placements page in a real browser (headless Chromium from Debian, driven by Selenium)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from demo import Api
from localstack import Stack
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = pytest.mark.integration

DAG = "drl_ml_pipeline"


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1600,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_placements_page_needs_a_login(stack: Stack) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{stack.api_url}/drl/", timeout=10)
    assert err.value.code in (401, 403)


def test_placements_page_shows_each_placement_and_why(stack: Stack, api: Api, browser: webdriver.Chrome) -> None:
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"

    browser.get(f"{stack.api_url}/api/v2/version")  # same origin first, so the cookie can be set
    browser.add_cookie({"name": "_token", "value": api.token, "path": "/"})
    browser.get(f"{stack.api_url}/drl/")
    WebDriverWait(browser, 30).until(expected_conditions.presence_of_element_located((By.ID, "placements")))
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#placements tbody tr")]
    ours = [r for r in rows if run_id in r]
    assert len(ours) == 7, rows[:3]
    train = next(r for r in ours if " train " in f" {r} ")
    # train asks for a GPU: the GPU pool is the only one it may use, and its reason says so
    assert " gpu " in f" {train} " and train.endswith(": only usable pool for cpus=4 mem=16GB gpus=1"), train
    # the others name the runner-up pool and what set them apart
    assert any(" over " in r and "p=" in r.split(" over ")[1] and ": " in r.split(" over ")[1] for r in ours), ours
    # which policy server is live and what it serves: the stack's one replica, the packaged GNN
    serving = browser.find_element(By.ID, "serving").text
    assert serving.startswith("Policy servers: 1 live: ") and " drl:" in serving and " on cpu (" in serving, serving
    browser.save_screenshot(str(stack.state / "ui-placements.png"))

    # the form narrows the page to this run, and to one pool of it
    form = browser.find_element(By.ID, "filters")
    form.find_element(By.NAME, "run_id").send_keys(run_id)
    form.find_element(By.NAME, "pool").send_keys("gpu")
    form.submit()
    WebDriverWait(browser, 30).until(expected_conditions.url_contains("pool=gpu"))
    shown = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#placements tbody tr")]
    on_gpu = [r for r in ours if r.split()[4] == "gpu"]  # dag_id run_id task_id try_number pool ...
    assert sorted(shown) == sorted(on_gpu) and train in shown, (shown, on_gpu)
    summary = browser.find_element(By.ID, "summary").text
    assert f"{len(on_gpu)} placements shown" in summary and f"by pool: gpu {len(on_gpu)}" in summary, summary
    assert browser.find_element(By.NAME, "run_id").get_attribute("value") == run_id, "the form keeps its filters"

    views = api.call("GET", "/api/v2/plugins")["plugins"]
    ours_plugin = next(p for p in views if p["name"] == "drl_executor")
    assert ours_plugin["external_views"][0]["href"] == "drl/"
    # the UI's nav entry: Airflow's own page, the placements in its iframe (the href resolved
    # against the UI's <base href>, so under a base_url path prefix too)
    browser.get(f"{stack.api_url}/plugin/drl-placements")
    frame = WebDriverWait(browser, 60).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "iframe[title='Placements']")))
    browser.switch_to.frame(frame)
    WebDriverWait(browser, 30).until(expected_conditions.presence_of_element_located((By.ID, "placements")))
    assert any(run_id in r.text for r in browser.find_elements(By.CSS_SELECTOR, "#placements tbody tr"))
    browser.switch_to.default_content()
