# Sourced by scripts/test and .ci/run: Debian's Chromium for the browser tests.
# Playwright drives the system binary (its own browser download is not
# available here): QL_CHROMIUM, default /usr/bin/chromium.

ql_chromium_missing_message() {
  # The same wording as qinglong/tests/browser/chromium.py.
  echo "The browser tests need Chromium, not found at $1: install Debian's package" \
    "(apt-get install chromium) or set QL_CHROMIUM to a Chromium binary."
}

# Install Debian's chromium package: non-interactive and quiet, and
# `apt-get update` only when the install fails without it (no package lists yet).
ql_install_chromium() {
  local log
  log="$(mktemp)"
  echo "==> installing Chromium for the browser tests (apt-get install chromium)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >"$log" 2>&1; then
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$log" 2>&1; then
      cat "$log" >&2
      rm -f "$log"
      return 1
    fi
  fi
  rm -f "$log"
}

# The browser tests must never pass silently without a browser: find the
# binary, install the default one when we may (root, apt-get, QL_CHROMIUM
# unset), or fail naming the package and QL_CHROMIUM.
ql_require_chromium() {
  local path="${QL_CHROMIUM:-/usr/bin/chromium}"
  if [ ! -x "$path" ] && [ -z "${QL_CHROMIUM:-}" ] && [ "$(id -u)" -eq 0 ] &&
    command -v apt-get >/dev/null 2>&1; then
    ql_install_chromium || true
  fi
  if [ ! -f "$path" ] || [ ! -x "$path" ]; then
    ql_chromium_missing_message "$path" >&2
    return 1
  fi
}
