#!/usr/bin/env bash
# Fetch the vLLM releases the conformance suite (tests/conformance/) checks the renderer against,
# and unpack their pure-Python sources. No torch, no GPU: the suite reads these files (ast) and
# loads vllm/config/kv_transfer.py with stubs, nothing else of vLLM runs.
#
# The releases are the ones at the API's version boundaries (operator/xpyd/vllm.py).
# Cached outside the repository, like the control plane's binaries (build.sh):
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/vllm-wheels/<version>/vllm-<version>-*.whl
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/vllm-src/<version>/vllm/**/*.py
# A wheel already in its directory is never downloaded again, and a release already unpacked is
# not unpacked again (about 2.5 GB and 80 s the first time, nothing after).
#
# Usage:
#   e2e/build/vllm-wheels.sh           fetch and unpack what is missing
#   e2e/build/vllm-wheels.sh --force   unpack every release again (the wheels stay)
set -euo pipefail

# ---- pinned versions (the suite checks exactly these; bump with operator/xpyd/vllm.py) ----
VLLM_RELEASES=(0.13.0 0.16.0 0.18.0 0.23.0 0.24.0 0.32.0 0.33.0)

XPYD_CACHE=${XPYD_CACHE:-$HOME/.cache/xpyd}
WHEELS=$XPYD_CACHE/vllm-wheels
SRC=$XPYD_CACHE/vllm-src
PYTHON=${PYTHON:-python3}

FORCE=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

# The wheel of a release in its directory (empty when there is none).
find_wheel() {
  local dir=$1 version=$2 w
  for w in "$dir"/vllm-"$version"-*.whl; do
    if [[ -f $w ]]; then echo "$w"; return; fi
  done
}

# Every vllm/**/*.py of the wheel (the compiled extensions and kernels stay out), into a temp
# directory next to the target, then renamed: an interrupted unpack never looks finished.
unpack() {
  local wheel=$1 dest=$2 tmp=$2.tmp.$$
  rm -rf "$tmp"
  mkdir -p "$tmp"
  "$PYTHON" - "$wheel" "$tmp" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    z.extractall(dest, names)
print(len(names))
PY
  rm -rf "$dest"
  mv "$tmp" "$dest"
}

# True when the files the suite reads are there (an unpack is renamed into place only when done).
unpacked() {
  local f
  for f in vllm/config/kv_transfer.py vllm/envs.py vllm/engine/arg_utils.py \
      vllm/distributed/kv_transfer/kv_connector/factory.py; do
    [[ -f $1/$f ]] || return 1
  done
}

START=$SECONDS
mkdir -p "$WHEELS" "$SRC"
for version in "${VLLM_RELEASES[@]}"; do
  wheel_dir=$WHEELS/$version
  dest=$SRC/$version
  wheel=$(find_wheel "$wheel_dir" "$version")
  fetched=cached
  if [[ -z $wheel ]]; then
    mkdir -p "$wheel_dir"
    log=$wheel_dir/pip-download.log
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheel_dir" \
        "vllm==$version" > "$log" 2>&1; then
      echo "vllm $version: pip download vllm==$version failed (log: $log):" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    wheel=$(find_wheel "$wheel_dir" "$version")
    if [[ -z $wheel ]]; then
      echo "vllm $version: pip download succeeded but left no vllm-$version-*.whl in $wheel_dir" >&2
      exit 1
    fi
    fetched=downloaded
  fi
  if [[ $FORCE == 0 ]] && unpacked "$dest"; then
    echo "vllm $version: $fetched, unpacked ($dest)"
    continue
  fi
  files=$(unpack "$wheel" "$dest")
  echo "vllm $version: $fetched, $files Python files unpacked -> $dest"
done
echo "vllm wheels ready in $((SECONDS - START))s: $SRC"
