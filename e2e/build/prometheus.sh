#!/usr/bin/env bash
# Fetch Prometheus for the local cluster from Debian's package, without installing it as a
# service (the package's init script would listen on 0.0.0.0:9090): download the .deb and
# unpack only its files into the cache. Writes ${XPYD_CACHE}/bin/prometheus.env with
# PROMETHEUS=<path> (the Debian build has no Kubernetes discovery; the pod runtime writes
# file_sd targets instead).
set -euo pipefail

XPYD_CACHE=${XPYD_CACHE:-$HOME/.cache/xpyd}
BIN_ROOT=$XPYD_CACHE/bin
ENV_FILE=$BIN_ROOT/prometheus.env

if [[ -f $ENV_FILE ]] && [[ -x $(sed -n 's/^PROMETHEUS=//p' "$ENV_FILE") ]]; then
  echo "cached"
  echo "$ENV_FILE"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# apt-get download needs package lists; refresh them only when the package is unknown.
if ! apt-cache show prometheus >/dev/null 2>&1; then
  apt-get update -qq
fi
apt-get download -qq prometheus
deb=$(ls prometheus_*.deb)
version=$(dpkg-deb -f "$deb" Version)
dest=$BIN_ROOT/prometheus-${version//[:+~]/_}
dpkg-deb -x "$deb" unpacked
mkdir -p "$dest"
cp unpacked/usr/bin/prometheus "$dest/prometheus"
"$dest/prometheus" --version >/dev/null
printf '# written by e2e/build/prometheus.sh\nPROMETHEUS=%s\nPROMETHEUS_VERSION=%s\n' \
  "$dest/prometheus" "$version" > "$ENV_FILE.tmp"
mv "$ENV_FILE.tmp" "$ENV_FILE"
echo "prometheus $version"
echo "$ENV_FILE"
