#!/usr/bin/env bash
# Installs what the browser tests (pytest -m browser) drive: Debian's Chromium and its
# ChromeDriver, at /usr/bin/chromium and /usr/bin/chromedriver. Does nothing when both are
# there. Needs root (apt-get); the package lists are refreshed only if the install fails.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/browser.sh: not root, Chromium not installed: the browser tests will fail;" \
        "install Debian's chromium and chromium-driver" >&2
    exit 0
fi
# Two test runs may start side by side (.ci/run): one installs, the other waits for it.
exec 9>"${TMPDIR:-/tmp}/lonnymq-browser.lock"
flock 9
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver
}
if ! install; then
    apt-get update
    install
fi
