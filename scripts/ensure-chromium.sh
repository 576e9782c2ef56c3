#!/usr/bin/env bash
# Makes sure Debian's chromium and chromium-driver exist for the playground's browser tests
# (tests/server/test_playground.py drives the system chromium headless through Selenium;
# nothing is downloaded at test time). Installs the packages when missing.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "chromium or chromedriver is missing and we are not root: install Debian's chromium and chromium-driver" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = "0" ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
command -v chromium
command -v chromedriver
