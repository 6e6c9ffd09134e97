#!/usr/bin/env bash
# Debian's libibverbs1 and librdmacm1, which Mooncake's CPU build links (the PD tests move KV with it).
# Installs them when they are missing and this runs as root on a Debian/Ubuntu host; otherwise says which
# line would install them and returns 0, so the tests that need them skip with that line as the reason.
set -u
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && ldconfig -p 2>/dev/null | grep -q 'librdmacm\.so\.1'; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's libibverbs1 librdmacm1 (Mooncake's CPU build links them)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null \
        && exit 0
    echo "apt-get could not install libibverbs1 librdmacm1; the Mooncake PD tests will skip" >&2
    exit 0
fi
echo "libibverbs1 / librdmacm1 missing and not root: the Mooncake PD tests will skip (sudo apt-get install libibverbs1 librdmacm1)" >&2
exit 0
