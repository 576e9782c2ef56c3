#!/usr/bin/env bash
# Makes sure a redis-server binary (>= 6.2) exists for the store's integration tests and
# benchmark: they start their own throwaway server on a free loopback port
# (kvblend.store.localredis). Installs Debian's package when missing.
set -euo pipefail

version_ok() {
  # "Redis server v=7.0.15 sha=..." -> 7.0.15 ; needs 6.2+ (CLIENT PAUSE ... ALL in the tests)
  local v
  v=$(redis-server --version | sed -n 's/.*v=\([0-9][0-9.]*\).*/\1/p')
  [ -n "$v" ] && [ "$(printf '%s\n6.2\n' "$v" | sort -V | head -n1)" = "6.2" ]
}

if command -v redis-server >/dev/null 2>&1; then
  version_ok && exit 0
  echo "redis-server is older than 6.2: $(redis-server --version)" >&2
fi
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "redis-server (>= 6.2) is missing and we are not root: install Debian's redis-server package" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = "0" ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# Debian's package may start a system service on 6379; the tests never use it.
command -v redis-server
version_ok
