"""Screenshot of the playground page with a real blend run: ``docs/playground.png``.

    PYTHONPATH=src:. .venv/bin/python scripts/playground_screenshot.py [OUT.png [STORE_VIEW.png]]

Starts ``kvblend serve`` (SmolLM2-135M, memory store) on a free loopback port, drives the
page in headless Debian chromium (the browser tests' tooling, tests/server/browser.py):
cacheblend and blend at a few ratios, the default blend last, then saves the whole page."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.server.browser import headless_chromium, wait_for
from tests.server.helpers import ServerProcess
from tests.server.test_playground import fill, run_and_wait

DOCS = [
    "Paris is the capital of France and its largest city, with about two million people inside the city limits "
    "and more than twelve million in the wider region. The Seine runs through the centre from east to west, "
    "dividing the Right Bank from the Left Bank, and thirty-seven bridges cross it. The city grew around the "
    "Ile de la Cite, where Notre-Dame stands. In the nineteenth century Baron Haussmann rebuilt much of the "
    "centre with wide boulevards, parks and uniform stone buildings, which still give Paris its look today. "
    "The Louvre, once a royal palace, became a public museum in 1793 and is now the most visited museum in "
    "the world.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars, near the Seine in the seventh "
    "arrondissement of Paris. The engineer Gustave Eiffel's company designed and built it for the 1889 "
    "World's Fair, held a century after the French Revolution. Many artists of the time called it an eyesore, "
    "and it was meant to stand for only twenty years, but its use as a radio antenna saved it. It is about "
    "330 metres tall, and for forty-one years it was the tallest structure built by people anywhere, until "
    "the Chrysler Building in New York passed it in 1930. Visitors can climb stairs or take lifts to three "
    "levels; the top one is 276 metres above the ground.",
]
QUESTION = "Who built the Eiffel Tower, and in which city is it?"
RUNS = (("cacheblend", 0.15), ("blend", 0.5), ("blend", 0.3))


def set_ratio(driver, ratio: float) -> None:
    driver.execute_script("const r = document.getElementById('ratio'); r.value = arguments[0];"
                          "r.dispatchEvent(new Event('input'));", str(ratio))


def shoot(url: str, out: Path, store: Path | None = None) -> None:
    driver = headless_chromium(width=1280, height=1000)
    try:
        driver.get(url + "/")
        wait_for(driver, lambda d: "smollm2" in d.find_element(By.ID, "model").text, timeout=30)
        fill(driver, DOCS, QUESTION, max_tokens=24)
        for i, (strategy, ratio) in enumerate(RUNS):
            Select(driver.find_element(By.ID, "strategy")).select_by_value(strategy)
            set_ratio(driver, ratio)
            run_and_wait(driver, i)
        Select(driver.find_element(By.ID, "strategy")).select_by_value("blend")
        set_ratio(driver, 0.15)
        run_and_wait(driver, len(RUNS))  # the page shows the default blend, the chart every run
        driver.execute_script("document.querySelectorAll('#docs textarea').forEach(a => { a.scrollTop = 0; })")
        save_page(driver, out)
        if store is not None:
            driver.find_element(By.CSS_SELECTOR, "[data-view=store]").click()
            wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#store-tiers tbody tr"), timeout=30)
            save_page(driver, store)
    finally:
        driver.quit()


def save_page(driver, out: Path) -> None:
    """The whole page: the window made as tall as the document (plus the window's frame)."""
    frame = driver.execute_script("return window.outerHeight - window.innerHeight")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, height + frame)
    driver.save_screenshot(str(out))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/playground.png")
    store = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("smollm2-135m", Path(tmp), {"store": {"tiers": ["memory"]}}, ready_s=180)
        try:
            shoot(server.url, out, store)
        finally:
            server.stop()
    print(out)


if __name__ == "__main__":
    main()
