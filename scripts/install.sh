#!/usr/bin/env bash
# Install what mcp-code-sandbox needs on a Debian/Ubuntu machine, skipping what is there:
# system packages (bubblewrap, libseccomp, npm), a virtualenv in .venv with the package, and the
# sandbox runtime environment (`mcp-code-sandbox setup`). --dev adds what the tests use:
# chromium and chromedriver, the dev extras, the MCP conformance suite (npm, pinned), and in
# a git clone the commit-message hook (scripts/hooks).
# Idempotent; every line of output goes to stderr, so this can run in front of a stdio MCP
# server.
# Usage: scripts/install.sh [--dev] [--no-runtime]
#   --no-runtime: leave the runtime environment to the server, which builds it in the
#   background on its first start while it answers its client (scripts/serve.sh).
set -euo pipefail
exec 3>&1 1>&2   # keep stdout clean: stdio mode reserves it for the MCP protocol

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dev=0
runtime=1
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --no-runtime) runtime=0 ;;
    *) echo "install.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

sudo=""
if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)  # not -q: pipefail + SIGPIPE
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
# npm fetches the sandbox's Node.js, bun and npm packages (setup works without it: Python only).
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((dev)); then
  # The browser tests of /ui (tests/e2e/test_ui_browser.py) drive the system's chromium
  # through Debian's chromedriver: no browser is downloaded.
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
fi
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

venv="$root/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating $venv"
  python3 -m venv "$venv"
fi
stamp="$venv/.installed-$(sha256sum "$root/pyproject.toml" | cut -c1-16)-$dev"
dev_stamp="${stamp%-*}-1"   # a dev install holds everything a plain one needs
if [[ ! -e "$stamp" && ! -e "$dev_stamp" ]]; then
  echo "installing mcp-code-sandbox into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if ((dev)); then
    "$venv/bin/python" -m pip install -q -e "$root[dev]"
  else
    "$venv/bin/python" -m pip install -q -e "$root"
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

if ((dev)) && [[ "$(git -C "$root" rev-parse --show-toplevel 2>/dev/null)" == "$root" ]]; then
  # A clone (not an unpacked sdist) checks commit messages: scripts/hooks/commit-msg.
  git -C "$root" config core.hooksPath scripts/hooks
fi

if ((dev)); then
  # The official MCP conformance suite (tests/e2e/test_conformance.py), at the versions
  # its lockfile pins, into a directory git ignores; it runs on the sandbox runtime's
  # Node.js (setup, below), as it needs Node >= 22. npm only installs it here.
  suite="$root/tests/conformance"
  suite_stamp="$suite/node_modules/.installed-$(sha256sum "$suite/package-lock.json" | cut -c1-16)"
  if [[ ! -e "$suite_stamp" ]]; then
    echo "installing the MCP conformance suite into $suite/node_modules"
    npm ci --prefix "$suite" --no-audit --no-fund --loglevel=error --engine-strict=false
    touch "$suite_stamp"
  fi
fi

if ((runtime)); then
  "$venv/bin/mcp-code-sandbox" setup
fi
