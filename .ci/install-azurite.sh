#!/usr/bin/env bash
# Install Azurite, Microsoft's Azure Storage emulator (npm package), for the az:// tests (tests/azurite_server.py
# starts `azurite-blob` on 127.0.0.1 itself); tests skip without it.
#   bash .ci/install-azurite.sh
# Never fails the CI run: when it cannot install, the az:// tests skip and say why.
set -uo pipefail
if command -v azurite-blob >/dev/null; then
  exit 0
fi
if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ]; then  # this machine kind has Node.js and npm; apt if not
  export DEBIAN_FRONTEND=noninteractive
  (apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null) || echo "install-azurite: apt-get failed" >&2
fi
npm install -g --silent azurite@3.37.0 >/dev/null \
  || echo "install-azurite: npm install failed, the az:// tests will be skipped" >&2
exit 0
