#!/usr/bin/env bash
# Makes sure redis-server (>= 6.2) and redis-cli exist for the store's integration tests and
# benchmark: they start their own throwaway server, and a throwaway 3-node Redis Cluster,
# on free loopback ports (kvblend.store.localredis; cluster mode needs nothing more than
# redis-server, redis-cli is for operators: `redis-cli --cluster create`, docs/deploy.md).
# Installs Debian's redis-server and redis-tools packages when missing.
set -euo pipefail

version_ok() {
  # "Redis server v=7.0.15 sha=..." -> 7.0.15 ; needs 6.2+ (CLIENT PAUSE ... ALL in the tests)
  local v
  v=$(redis-server --version | sed -n 's/.*v=\([0-9][0-9.]*\).*/\1/p')
  [ -n "$v" ] && [ "$(printf '%s\n6.2\n' "$v" | sort -V | head -n1)" = "6.2" ]
}

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  version_ok && exit 0
  echo "redis-server is older than 6.2: $(redis-server --version)" >&2
fi
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "redis-server (>= 6.2) or redis-cli is missing and we are not root: install Debian's redis-server and redis-tools packages" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = "0" ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
# Debian's package may start a system service on 6379; the tests never use it.
command -v redis-server redis-cli
version_ok
