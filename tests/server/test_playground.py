"""The playground page (``GET /``) in a real headless chromium, over ``kvblend serve`` with
the real default model (SmolLM2-135M) and an API key: the error state until a key is
entered, two documents and a question answered by blend and by full prefill side by side
with the recomputed tokens highlighted, the ratio slider changing the recompute fraction,
and nothing loaded from anywhere but the server."""

from __future__ import annotations

import re

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.server.browser import headless_chromium, wait_for
from tests.server.helpers import ServerProcess

KEY = "key-playground-01"
DOCS = ["Paris is the capital and largest city of France. It sits on the Seine.",
        "The Eiffel Tower is a wrought-iron tower on the Champ de Mars in Paris, built in 1889."]
QUESTION = "In which city is the Eiffel Tower?"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_calibrated):
    config = {"api_keys": {KEY: "playground"}, "store": {"tiers": ["memory"], "memory_bytes": "256MiB"}}
    proc = ServerProcess("smollm2-135m", tmp_path_factory.mktemp("playground"), config, ready_s=180)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def driver():
    browser = headless_chromium()
    yield browser
    browser.quit()


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def banner(driver) -> str:
    el = driver.find_element(By.ID, "banner")
    return el.text if el.is_displayed() else ""


def enter_key(driver, key: str) -> None:
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key, Keys.ENTER)


def fill(driver, docs: list[str], question: str, max_tokens: int = 10) -> None:
    areas = driver.find_elements(By.CSS_SELECTOR, "#docs textarea")
    for area, doc in zip(areas, docs):
        area.clear()
        area.send_keys(doc)
    driver.find_element(By.ID, "question").send_keys(question)
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))


def runs(driver) -> int:
    """Runs the page has finished (each one a blend and a full prefill)."""
    return int(driver.find_element(By.ID, "chart").get_attribute("data-runs") or 0)


def run_and_wait(driver, runs_before: int) -> None:
    driver.find_element(By.ID, "run").click()
    wait_for(driver, lambda d: runs(d) > runs_before or banner(d), timeout=60)
    assert banner(driver) == ""


def percent(driver) -> float:
    return float(re.match(r"([\d.]+) %", text(driver, "#answer-blend [data-field=recompute]")).group(1))


def test_an_api_key_server_shows_the_error_until_a_key_is_entered(smol, driver) -> None:
    driver.get(smol.url + "/")
    assert "401" in wait_for(driver, banner, timeout=20)  # /v1/models refused without a key
    fill(driver, DOCS, QUESTION)
    driver.find_element(By.ID, "run").click()
    assert "API key" in wait_for(driver, banner, timeout=20)
    enter_key(driver, "wrong-key-0001")
    wait_for(driver, lambda d: "invalid API key" in banner(d), timeout=20)
    enter_key(driver, KEY)
    wait_for(driver, lambda d: banner(d) == "" and "smollm2" in text(d, "#model"), timeout=20)
    assert driver.execute_script("return sessionStorage.getItem('kvblend.apiKey')") == KEY
    assert driver.execute_script("return localStorage.length") == 0


def first_run(smol, driver) -> None:
    """The page with the key entered, the documents and question filled in, and run once."""
    driver.get(smol.url + "/")
    if "smollm2" not in text(driver, "#model"):  # the key stays for the tab's session once entered
        enter_key(driver, KEY)
    wait_for(driver, lambda d: "smollm2" in text(d, "#model"), timeout=20)
    fill(driver, DOCS, QUESTION)
    run_and_wait(driver, 0)


def test_blend_and_full_prefill_answer_side_by_side_with_the_recomputed_tokens(smol, driver) -> None:
    first_run(smol, driver)
    for side in ("blend", "full"):
        assert text(driver, f"#answer-{side} [data-field=text]").strip() not in ("", "…")
        assert re.match(r"[\d.]+ ms", text(driver, f"#answer-{side} [data-field=ttft]"))
    assert "memory ×2" in text(driver, "#answer-blend [data-field=hits]")
    assert "of" in text(driver, "#answer-blend [data-field=cached]")
    assert percent(driver) < 100 and text(driver, "#answer-full [data-field=recompute]").startswith("100.0 %")
    assert "token F1" in text(driver, "#agreement")
    # the real server's logprobs reach the page: KL to full at the positions both answers share
    assert re.fullmatch(r"[\d.]+( · [\d.]+)*( · …)? \(mean [\d.]+ over \d+ tokens?\)",
                        text(driver, "#answer-blend [data-field=kl]"))
    views = driver.find_elements(By.CSS_SELECTOR, "#doc-views .docview")
    assert len(views) == 2
    for view in views:  # each document shows its tokens, some of them highlighted with their numbers
        kept = view.find_elements(By.CSS_SELECTOR, ".tok.kept")
        assert kept and all("recomputed, chosen by" in k.get_attribute("title") for k in kept)
        assert re.search(r"[\d.]+ % of the recomputed tokens", view.text)
    first = driver.find_elements(By.CSS_SELECTOR, "#doc-views .docview")[0]
    assert "Paris is the capital" in first.find_element(By.CSS_SELECTOR, ".tokens").text


def test_moving_the_ratio_slider_changes_the_recompute_fraction(smol, driver) -> None:
    if not runs(driver):  # run alone: make the first run here
        first_run(smol, driver)
    before, kept = percent(driver), len(driver.find_elements(By.CSS_SELECTOR, ".tok.kept"))
    slider = driver.find_element(By.ID, "ratio")
    slider.send_keys(*[Keys.ARROW_RIGHT] * 6)  # 0.20 -> 0.50 in steps of 0.05
    assert text(driver, "#ratio-value") == "0.50"
    run_and_wait(driver, 1)
    assert percent(driver) > before
    assert len(driver.find_elements(By.CSS_SELECTOR, ".tok.kept")) > kept


def test_the_page_loads_nothing_from_elsewhere(smol, driver) -> None:
    driver.get(smol.url + "/")
    wait_for(driver, lambda d: "smollm2" in text(d, "#model"), timeout=20)
    urls = driver.execute_script(
        "return performance.getEntries().map(e => e.name).filter(n => /^[a-z]+:/.test(n))")
    assert any(u.endswith("/playground/playground.js") for u in urls)
    assert all(u.startswith(smol.url + "/") for u in urls), urls
    refs = driver.execute_script(
        "return [...document.querySelectorAll('[src],[href]')].map(e => e.src || e.href)")
    assert refs and all(r.startswith(smol.url + "/") for r in refs), refs
    console = " ".join(entry["message"] for entry in driver.get_log("browser"))
    assert "Content Security Policy" not in console, console


def test_the_store_view_shows_the_tenants_documents_and_tiers(smol, driver) -> None:
    if not runs(driver):
        first_run(smol, driver)
    driver.find_element(By.ID, "save-docs").click()
    wait_for(driver, lambda d: "stored under your key" in text(d, "#status") or banner(d), timeout=30)
    driver.find_element(By.CSS_SELECTOR, "[data-view=store]").click()
    rows = wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#store-docs tbody tr")[1:] and
                    d.find_elements(By.CSS_SELECTOR, "#store-docs tbody tr"), timeout=20)
    assert len(rows) == 2 and all(r.text.startswith("doc-") for r in rows)
    (memory,) = driver.find_elements(By.CSS_SELECTOR, "#store-tiers tbody tr")
    assert re.match(r"memory [\d.]+ (KiB|MiB) / 256\.0 MiB \d+ [\d.]+ (KiB|MiB) \d+ / \d+ [\d.]+ %", memory.text)
    assert "2 stored documents" in text(driver, "#store-summary")
    driver.find_element(By.CSS_SELECTOR, "[data-view=ask]").click()
