#!/usr/bin/env bash
# Makes sure a redis-server binary exists for the integration tests (they start
# their own server on a loopback port). Installs Debian's package when missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "redis-server is missing and we are not root: install Debian's redis-server package" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = "0" ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# Debian's package may start a system service; tests use their own server.
command -v redis-server
