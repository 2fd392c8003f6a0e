#!/usr/bin/env bash
# Build the binaries of a local Kubernetes control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok, helm) and the LeaderWorkerSet
# controller from Go modules at pinned versions.
#
# Why from source: the only thing reachable from CI and developer machines is the Go
# module proxy (no release tarballs, no container images), so every binary is compiled
# from a module fetched through it.
#
# Binaries are cached outside the repository, keyed by component and version:
#   ${XPYD_CACHE:-$HOME/.cache/xpyd}/bin/<component>-<version>/<binary>
# and a cold build (~19 min on 2 cores: 11 of them Kubernetes, 3 the LeaderWorkerSet controller)
# happens once per machine.
# GOMODCACHE and GOCACHE live under the same directory so rebuilds after a version bump
# stay warm. When everything is present the script does not even start `go`.
#
# Output for the test code (KEY=VALUE lines, no quoting; paths never contain spaces):
#   ${XPYD_CACHE}/bin/current.env   e.g. ETCD=/.../bin/etcd-v3.6.16/etcd
#   ${XPYD_CACHE}/bin/current/      symlinks to every binary (for PATH)
#
# Usage:
#   e2e/build/build.sh           build what is missing, write current.env
#   e2e/build/build.sh --force   rebuild everything (ignores cached binaries)
#   e2e/build/build.sh --tidy    maintainer only: regenerate the committed go.mod/go.sum
#                                of the tools modules after changing a version below
set -euo pipefail

# ---- pinned versions (bump here, then run --tidy and commit e2e/build/*/go.{mod,sum}) ----
ETCD_VERSION=v3.6.16        # kwok pairs recent Kubernetes with etcd 3.6
KUBERNETES_VERSION=v1.37.2
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
LWS_VERSION=v0.9.0          # sigs.k8s.io/lws: multi-node replicas (its CRDs are copied beside it)

# Kubernetes publishes its staging repos as k8s.io/<name> at v0.<minor>.<patch>;
# k8s.io/kubernetes itself requires them at v0.0.0 with replaces to local paths, which
# dependents ignore, so our tools module must replace each one (list = its go.work).
K8S_STAGING=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go
  cloud-provider cluster-bootstrap code-generator component-base component-helpers
  controller-manager cri-api cri-client cri-streaming csi-translation-lib
  dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
  kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils
  pod-security-admission sample-apiserver sample-cli-plugin sample-controller streaming)
K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
XPYD_CACHE=${XPYD_CACHE:-$HOME/.cache/xpyd}
BIN_ROOT=$XPYD_CACHE/bin
ENV_FILE=$BIN_ROOT/current.env

FORCE=0
TIDY=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    --tidy) TIDY=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

# The env file is unquoted KEY=VALUE for easy parsing; refuse paths that would break it.
if [[ $XPYD_CACHE =~ [[:space:]] ]]; then
  echo "XPYD_CACHE must not contain whitespace: '$XPYD_CACHE'" >&2
  exit 2
fi

K8S_MINOR=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
K8S_STAGING_VERSION=v0.${KUBERNETES_VERSION#v1.}          # v1.37.2 -> v0.37.2

ETCD_DIR=$BIN_ROOT/etcd-$ETCD_VERSION
K8S_DIR=$BIN_ROOT/kubernetes-$KUBERNETES_VERSION
KWOK_DIR=$BIN_ROOT/kwok-$KWOK_VERSION
HELM_DIR=$BIN_ROOT/helm-$HELM_VERSION
LWS_DIR=$BIN_ROOT/lws-$LWS_VERSION

START=$SECONDS
log() { printf '[build %4ss] %s\n' "$((SECONDS - START))" "$*"; }

# True when every named binary exists in the directory.
have_all() {
  local dir=$1; shift
  local b
  for b in "$@"; do [[ -x $dir/$b ]] || return 1; done
}

# ---- go.mod of the tools modules -------------------------------------------------------
# Each component whose main package cannot be `go install`ed (relative replace directives)
# gets a tiny module with only a go.mod: `tool` directives keep the requirement through
# `go mod tidy`, and `go build <pkg>` inside it uses the pinned versions.

gen_etcd_gomod() {
  cat <<EOF
module xpyd.local/e2e/build/etcd

go 1.26.0

tool go.etcd.io/etcd/server/v3

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF
}

gen_kubernetes_gomod() {
  local b m
  printf 'module xpyd.local/e2e/build/kubernetes\n\ngo 1.26.0\n\ntool (\n'
  for b in "${K8S_BINARIES[@]}"; do printf '\tk8s.io/kubernetes/cmd/%s\n' "$b"; done
  printf ')\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$KUBERNETES_VERSION"
  for m in "${K8S_STAGING[@]}"; do printf '\tk8s.io/%s => k8s.io/%s %s\n' "$m" "$m" "$K8S_STAGING_VERSION"; done
  printf ')\n'
}

gen_lws_gomod() {
  cat <<EOF
module xpyd.local/e2e/build/lws

go 1.26.0

tool sigs.k8s.io/lws/cmd

require sigs.k8s.io/lws $LWS_VERSION
EOF
}

setup_go() {
  command -v go >/dev/null || { echo "go is not installed (need Go >= 1.26)" >&2; exit 1; }
  export GOMODCACHE=$XPYD_CACHE/go/mod
  export GOCACHE=$XPYD_CACHE/go/build
  # -modcacherw: module files are normally read-only, which makes `rm -rf $XPYD_CACHE` fail.
  export GOFLAGS="${GOFLAGS:-} -modcacherw"
  export CGO_ENABLED=0           # static binaries, as upstream releases them
  # (every build below also uses -trimpath and -ldflags "-s -w", as upstream release builds
  # do: reproducible paths, ~30% smaller binaries)
  mkdir -p "$GOMODCACHE" "$GOCACHE" "$BIN_ROOT" "$XPYD_CACHE/logs" "$XPYD_CACHE/work"
}

if [[ $TIDY == 1 ]]; then
  setup_go
  for comp in etcd kubernetes lws; do
    log "$comp: regenerating $HERE/$comp/go.mod and go.sum"
    mkdir -p "$HERE/$comp"
    "gen_${comp}_gomod" > "$HERE/$comp/go.mod"
    rm -f "$HERE/$comp/go.sum"
    (cd "$HERE/$comp" && go mod tidy)
  done
  log "done; commit e2e/build/*/go.mod and go.sum"
  exit 0
fi

# ---- fast path: everything cached -> no `go` at all ---------------------------------------
write_env() {
  local tmp=$ENV_FILE.tmp.$$ b
  {
    echo "# written by e2e/build/build.sh; KEY=VALUE, no quoting"
    echo "XPYD_BIN_DIR=$BIN_ROOT/current"
    echo "ETCD=$ETCD_DIR/etcd"
    echo "ETCD_VERSION=$ETCD_VERSION"
    for b in "${K8S_BINARIES[@]}"; do
      echo "$(echo "$b" | tr 'a-z-' 'A-Z_')=$K8S_DIR/$b"
    done
    echo "KUBERNETES_VERSION=$KUBERNETES_VERSION"
    echo "KWOK=$KWOK_DIR/kwok"
    echo "KWOK_VERSION=$KWOK_VERSION"
    echo "HELM=$HELM_DIR/helm"
    echo "HELM_VERSION=$HELM_VERSION"
    echo "LWS_CONTROLLER=$LWS_DIR/lws-controller"
    echo "LWS_CRDS=$LWS_DIR/crds"
    echo "LWS_VERSION=$LWS_VERSION"
  } > "$tmp"
  mv -f "$tmp" "$ENV_FILE"      # atomic: readers never see a half-written file
  mkdir -p "$BIN_ROOT/current"
  for b in "$ETCD_DIR/etcd" "$K8S_DIR"/* "$KWOK_DIR/kwok" "$HELM_DIR/helm" "$LWS_DIR/lws-controller"; do
    ln -sfn "$b" "$BIN_ROOT/current/$(basename "$b")"
  done
}

all_cached() {
  have_all "$ETCD_DIR" etcd && have_all "$K8S_DIR" "${K8S_BINARIES[@]}" &&
    have_all "$KWOK_DIR" kwok && have_all "$HELM_DIR" helm &&
    have_all "$LWS_DIR" lws-controller && lws_crds_present
}

LWS_CRDS=(leaderworkerset.x-k8s.io_leaderworkersets.yaml disaggregatedset.x-k8s.io_disaggregatedsets.yaml)
lws_crds_present() {
  local f
  for f in "${LWS_CRDS[@]}"; do [[ -f $LWS_DIR/crds/$f ]] || return 1; done
}

mkdir -p "$BIN_ROOT"
if [[ $FORCE == 0 ]] && all_cached; then
  write_env
  echo "cached"
  echo "$ENV_FILE"
  exit 0
fi

# ---- slow path ------------------------------------------------------------------------------
setup_go
# Two runs at once (e.g. parallel test workers) would compile the same thing twice.
exec 9>"$XPYD_CACHE/build.lock"
flock 9
# Leftovers of an interrupted build (we hold the lock, so nobody else is writing them).
rm -rf "$BIN_ROOT"/*.tmp.*

# Run a build step with its output in a log file; show the tail on failure.
run_logged() {
  local name=$1; shift
  local logfile=$XPYD_CACHE/logs/$name.log
  if ! "$@" > "$logfile" 2>&1; then
    log "$name: FAILED, last lines of $logfile:"
    tail -n 30 "$logfile" >&2
    exit 1
  fi
}

# Copy a committed tools module into a scratch dir ($WORK) and build there, so building
# never modifies the repository. A missing or stale go.mod/go.sum (fresh checkout, version
# bump without --tidy) is regenerated in the scratch copy instead of failing.
prepare_module() {
  local comp=$1 pin=$2
  WORK=$XPYD_CACHE/work/$comp
  rm -rf "$WORK"
  mkdir -p "$WORK"
  if [[ -f $HERE/$comp/go.mod ]] && grep -Eq "^[[:space:]]*(require[[:space:]]+)?$pin([[:space:]]|$)" "$HERE/$comp/go.mod"; then
    cp "$HERE/$comp/go.mod" "$WORK/"
    if [[ -f $HERE/$comp/go.sum ]]; then cp "$HERE/$comp/go.sum" "$WORK/"; fi
  else
    log "$comp: e2e/build/$comp/go.mod missing or not pinned to '$pin'; generating it (run --tidy to commit it)"
    "gen_${comp}_gomod" > "$WORK/go.mod"
  fi
  if [[ ! -f $WORK/go.sum ]]; then
    (cd "$WORK" && run_logged "$comp-tidy" go mod tidy)
  fi
}

# Build into a temp dir next to the target, check the binary reports the right version,
# then rename: an interrupted build never leaves a directory that looks cached.
# usage: build_component NAME VERSION DEST_DIR BUILD_FN "VERSION_CMD" EXPECTED_TEXT BINARIES...
BUILD_TMP=""
trap 'if [[ -n $BUILD_TMP ]]; then rm -rf "$BUILD_TMP"; fi' EXIT
build_component() {
  local name=$1 version=$2 dest=$3 fn=$4 version_cmd=$5 expect=$6; shift 6
  if [[ $FORCE == 0 ]] && have_all "$dest" "$@"; then
    log "$name $version: cached ($dest)"
    return
  fi
  log "$name $version: building $* (log: $XPYD_CACHE/logs/$name.log)"
  local t0=$SECONDS out
  BUILD_TMP=$dest.tmp.$$
  rm -rf "$BUILD_TMP"
  mkdir -p "$BUILD_TMP"
  "$fn" "$BUILD_TMP"
  # shellcheck disable=SC2086  # version_cmd is "binary args..."
  out=$("$BUILD_TMP"/$version_cmd 2>&1 || true)
  if ! grep -qF -- "$expect" <<<"$out"; then
    log "$name: '$version_cmd' does not report '$expect':"
    echo "$out" >&2
    exit 1
  fi
  rm -rf "$dest"
  mv "$BUILD_TMP" "$dest"
  BUILD_TMP=""
  log "$name $version: built in $((SECONDS - t0))s -> $dest"
}

build_etcd() {
  local out=$1
  prepare_module etcd "go.etcd.io/etcd/server/v3 $ETCD_VERSION"
  # server/v3 is itself the etcd main package.
  (cd "$WORK" && run_logged etcd go build -mod=mod -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
}

build_kubernetes() {
  local out=$1 pkgs=() b
  prepare_module kubernetes "k8s.io/kubernetes $KUBERNETES_VERSION"
  for b in "${K8S_BINARIES[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  # Without these the binaries report v0.0.0-master, which breaks version checks
  # (e.g. Helm's kubeVersion constraints against the API server).
  local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION
    -X k8s.io/component-base/version.gitMajor=1
    -X k8s.io/component-base/version.gitMinor=$K8S_MINOR
    -X k8s.io/component-base/version.gitTreeState=clean
    -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  # One `go build` for all binaries so the shared packages compile once.
  (cd "$WORK" && run_logged kubernetes go build -mod=mod -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
}

build_kwok() {
  # No replace directives: plain `go install` works. Its version is in the source.
  GOBIN=$1 run_logged kwok go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

build_helm() {
  # Without the Makefile's ldflags, `helm template`/`lint` assume Kubernetes v1.20 and
  # `helm version` says v3.22 without patch; set both to match what we run.
  local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION
    -X helm.sh/helm/v3/internal/version.gitTreeState=clean
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$K8S_MINOR
    -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1
    -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$K8S_MINOR"
  GOBIN=$1 run_logged helm go install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

build_lws() {
  # A tools module rather than `go install pkg@version`: the proxy refuses the module's
  # version list, which `go install` reads for deprecations. Its main package is `cmd`;
  # the version is stamped as its Makefile does. The CRDs come from the same module, so
  # the cluster installs exactly the API this controller serves.
  local out=$1 pkg=sigs.k8s.io/lws
  prepare_module lws "$pkg $LWS_VERSION"
  local ldflags="-s -w -X $pkg/pkg/version.GitVersion=$LWS_VERSION"
  (cd "$WORK" && run_logged lws go build -mod=mod -trimpath -ldflags "$ldflags" -o "$out/lws-controller" "$pkg/cmd")
  mkdir -p "$out/crds"
  # Both: the controller always runs its DisaggregatedSet reconciler too (and exits when that
  # kind's informer cannot sync).
  local f
  for f in "${LWS_CRDS[@]}"; do
    cp "$(go env GOMODCACHE)/$pkg@$LWS_VERSION/config/crd/bases/$f" "$out/crds/"
  done
  chmod u+w "$out/crds"/*
}

log "cache: $XPYD_CACHE ($(go version | cut -d' ' -f3))"
build_component etcd "$ETCD_VERSION" "$ETCD_DIR" build_etcd \
  "etcd --version" "etcd Version: ${ETCD_VERSION#v}" etcd
build_component kwok "$KWOK_VERSION" "$KWOK_DIR" build_kwok \
  "kwok --version" "${KWOK_VERSION#v}" kwok
build_component helm "$HELM_VERSION" "$HELM_DIR" build_helm \
  "helm version" "Version:\"$HELM_VERSION\"" helm
if ! lws_crds_present; then rm -rf "$LWS_DIR"; fi   # a build older than its CRD list: redo it
build_component lws "$LWS_VERSION" "$LWS_DIR" build_lws \
  "lws-controller --version" "Version: $LWS_VERSION" lws-controller
build_component kubernetes "$KUBERNETES_VERSION" "$K8S_DIR" build_kubernetes \
  "kube-apiserver --version" "Kubernetes $KUBERNETES_VERSION" "${K8S_BINARIES[@]}"

write_env
log "all built"
echo "$ENV_FILE"
