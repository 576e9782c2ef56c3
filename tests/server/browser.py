"""Headless Debian chromium driven by Selenium, for the playground tests and its screenshot.

Uses the system's ``chromium`` and ``chromedriver`` (``scripts/ensure-chromium.sh``, run by
``make test``); nothing is downloaded. Missing ones are an error, never a skip."""

from __future__ import annotations

import os
import shutil

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
         "--disable-extensions", "--disable-sync", "--disable-background-networking", "--disable-component-update",
         "--disable-default-apps", "--mute-audio")


class ChromiumMissing(RuntimeError):
    pass


def system_chromium() -> tuple[str, str]:
    """(browser, driver) executables of Debian's chromium and chromium-driver."""
    browser, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if browser is None or driver is None:
        raise ChromiumMissing("chromium and chromedriver are needed: run `make chromium` "
                              "(scripts/ensure-chromium.sh installs Debian's chromium and chromium-driver)")
    return browser, driver


def headless_chromium(width: int = 1280, height: int = 1800) -> WebDriver:
    browser, driver = system_chromium()
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never fetch a browser or driver
    options = Options()
    options.binary_location = browser
    for flag in (*FLAGS, f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def wait_for(driver: WebDriver, condition, timeout: float = 60.0):  # noqa: ANN001, ANN201 - a Selenium condition
    """``condition(driver)`` once it is truthy (its value), or a TimeoutException."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)
