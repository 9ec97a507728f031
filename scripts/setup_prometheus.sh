#!/usr/bin/env bash
# Installs Debian's prometheus package (prometheus + promtool) where either is missing: the
# tests in tests/integration/test_prometheus.py run the real tools. scripts/test.sh calls this,
# so the README's test command sets up everything on a fresh machine; HYPERTRAIN_SKIP_PROMETHEUS=1
# skips the install (and those tests). Never fails: if apt is unavailable it says so, and the
# Prometheus tests then fail naming the package.
set -uo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi
if [ "${HYPERTRAIN_SKIP_PROMETHEUS:-}" = 1 ]; then exit 0; fi
if ! command -v apt-get >/dev/null; then
    echo "setup_prometheus: no apt-get here; install prometheus and promtool yourself" >&2
    exit 0
fi
echo "setup_prometheus: installing Debian's prometheus package (prometheus, promtool) for the tests"
# A package's postinst must start no service here (the tests start their own Prometheus on
# 127.0.0.1): policy-rc.d answers "not allowed" while apt runs, where none exists.
# No recommends: prometheus-node-exporter would be a daemon on 0.0.0.0:9100.
sudo=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo="sudo -n"; fi
rcd=/usr/sbin/policy-rc.d
own_rcd=""
if [ ! -e "$rcd" ] && printf '#!/bin/sh\nexit 101\n' | $sudo tee "$rcd" >/dev/null 2>&1; then
    $sudo chmod 755 "$rcd" && own_rcd=1
fi
{ $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends prometheus >/dev/null; } \
    || echo "setup_prometheus: could not install prometheus with apt-get; its tests will fail" >&2
if [ -n "$own_rcd" ]; then $sudo rm -f "$rcd"; fi
exit 0
