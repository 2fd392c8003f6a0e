#!/bin/sh
# xpyd-engine-entrypoint: find out which KV transport this engine pod really has (RDMA or TCP),
# compare it with what was asked (UCX_TLS, XPYD_EXPECT_TRANSPORT), say so in one log line and in
# a JSON file, then exec the engine ("$@", by default `vllm serve`).
#
# The TCP fallback of NIXL/UCX is orders of magnitude slower than RDMA, and nothing else says
# which one a pod got; this script makes it visible. See engine-image/README.md.
#
# Environment (all optional):
#   XPYD_EXPECT_TRANSPORT  RDMA | TCP | auto (default auto: derived from UCX_TLS)
#   XPYD_REQUIRE_RDMA      1: exit 78 instead of starting when the transport is not RDMA
#   XPYD_TRANSPORT_FILE    where to write the JSON report (default /tmp/xpyd-transport.json; empty: none)
#   XPYD_TERMINATION_LOG   where a refusal to start is written (default /dev/termination-log, if it exists)
#   XPYD_MIN_MEMLOCK_KB    smallest `ulimit -l` accepted without CAP_IPC_LOCK (default 1048576 = 1 GiB)
#   XPYD_SYSFS_ROOT, XPYD_DEV_ROOT, XPYD_PROC_ROOT   /sys, /dev, /proc (tests point them at fake trees)
#   XPYD_MEMLOCK           the memlock limit in KiB or `unlimited`, instead of `ulimit -l` (tests)
set -eu

PROG=xpyd-engine
SYSFS=${XPYD_SYSFS_ROOT:-/sys}
DEVROOT=${XPYD_DEV_ROOT:-/dev}
PROCROOT=${XPYD_PROC_ROOT:-/proc}
STATUS_FILE=${XPYD_TRANSPORT_FILE-/tmp/xpyd-transport.json}
TERM_LOG=${XPYD_TERMINATION_LOG:-/dev/termination-log}
MIN_MEMLOCK_KB=${XPYD_MIN_MEMLOCK_KB:-1048576}
CAP_IPC_LOCK=14

log() {
    printf '%s: %s\n' "$PROG" "$*" >&2
}

# The content of a small sysfs file, first line, without a "4: " style numeric prefix.
sysfs_value() {
    _v=$(head -n 1 "$1" 2>/dev/null || true)
    printf '%s' "${_v#*: }"
}

# A JSON string literal.
json_str() {
    printf '"%s"' "$(printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g')"
}

# ---------------------------------------------------------------------------------------------
# What was asked: UCX_TLS decides which transports UCX may use at all.
ucx_tls=${UCX_TLS:-}
ucx_net_devices=${UCX_NET_DEVICES:-}
rdma_allowed=yes
tcp_allowed=yes
rdma_listed=no
case $ucx_tls in
    '' | all) ;;
    ^*)
        # "^a,b": every transport but a and b.
        for tl in $(printf '%s' "${ucx_tls#^}" | tr ',' ' '); do
            case ${tl%%:*} in
                rc | rc_* | ud | ud_* | dc | dc_* | ib) rdma_allowed=no ;;
                tcp) tcp_allowed=no ;;
            esac
        done
        ;;
    *)
        rdma_allowed=no
        tcp_allowed=no
        for tl in $(printf '%s' "$ucx_tls" | tr ',' ' '); do
            case ${tl%%:*} in
                rc | rc_* | ud | ud_* | dc | dc_* | ib) rdma_allowed=yes rdma_listed=yes ;;
                tcp) tcp_allowed=yes ;;
                all) rdma_allowed=yes tcp_allowed=yes ;;
            esac
        done
        ;;
esac

expect_raw=${XPYD_EXPECT_TRANSPORT:-auto}
case $expect_raw in
    RDMA | rdma) expected=RDMA ;;
    TCP | tcp) expected=TCP ;;
    auto | AUTO | '')
        if [ "$rdma_listed" = yes ] || { [ "$rdma_allowed" = yes ] && [ "$tcp_allowed" = no ]; }; then
            expected=RDMA
        elif [ "$rdma_allowed" = no ] && [ "$tcp_allowed" = yes ]; then
            expected=TCP
        else
            expected=any
        fi
        ;;
    *)
        log "WARNING: XPYD_EXPECT_TRANSPORT=$expect_raw is not RDMA, TCP or auto; using auto"
        expected=any
        ;;
esac

# UCX_NET_DEVICES entries "dev:port" (or a bare RDMA device name) restrict the RDMA ports UCX
# may use; a list with none of them (e.g. "eth0") leaves UCX no RDMA device at all.
net_restricted=no
case $ucx_net_devices in
    '' | all) ;;
    *) net_restricted=yes ;;
esac

port_selected() { # dev port
    [ "$net_restricted" = no ] && return 0
    for nd in $(printf '%s' "$ucx_net_devices" | tr ',' ' '); do
        if [ "$nd" = "$1:$2" ] || [ "$nd" = "$1" ]; then
            return 0
        fi
    done
    return 1
}

# ---------------------------------------------------------------------------------------------
# What the pod has: RDMA ports (sysfs), their uverbs character devices, the memlock limit.

# The accessible /dev/infiniband/uverbsN of an RDMA device; empty when there is none.
uverbs_of() { # dev
    _mapped=no
    for _ibdev in "$SYSFS"/class/infiniband_verbs/uverbs*/ibdev; do
        [ -f "$_ibdev" ] || continue
        [ "$(sysfs_value "$_ibdev")" = "$1" ] || continue
        _mapped=yes
        _node=${_ibdev%/ibdev}
        _node=$DEVROOT/infiniband/${_node##*/}
        if [ -c "$_node" ] && [ -r "$_node" ] && [ -w "$_node" ]; then
            printf '%s' "$_node"
            return 0
        fi
    done
    if [ "$_mapped" = no ]; then
        # No infiniband_verbs class to map devices to nodes: any accessible node will do.
        for _node in "$DEVROOT"/infiniband/uverbs*; do
            if [ -c "$_node" ] && [ -r "$_node" ] && [ -w "$_node" ]; then
                printf '%s' "$_node"
                return 0
            fi
        done
    fi
    return 0
}

usable=''       # "mlx5_0 port 1 ACTIVE InfiniBand, ..." (selected, ACTIVE, with accessible uverbs)
unusable=''     # the other selected ports, with why
found_any=no
devices_json=''
for devdir in "$SYSFS"/class/infiniband/*; do
    [ -d "$devdir" ] || continue
    dev=${devdir##*/}
    found_any=yes
    uverbs=$(uverbs_of "$dev")
    for portdir in "$devdir"/ports/*; do
        [ -d "$portdir" ] || continue
        port=${portdir##*/}
        state=$(sysfs_value "$portdir/state")
        phys=$(sysfs_value "$portdir/phys_state")
        link=$(sysfs_value "$portdir/link_layer")
        desc="$dev port $port ${state:-UNKNOWN} ${link:-unknown}"
        selected=no
        ok=no
        if port_selected "$dev" "$port"; then
            selected=yes
            if [ "$state" != ACTIVE ]; then
                unusable="${unusable:+$unusable, }$desc"
            elif [ -z "$uverbs" ]; then
                unusable="${unusable:+$unusable, }$desc without an accessible $DEVROOT/infiniband/uverbs*"
            else
                ok=yes
                usable="${usable:+$usable, }$desc"
            fi
        fi
        devices_json="${devices_json:+$devices_json,}{\"device\":$(json_str "$dev"),\"port\":$(json_str "$port"),\
\"state\":$(json_str "$state"),\"phys_state\":$(json_str "$phys"),\"link_layer\":$(json_str "$link"),\
\"uverbs\":$(json_str "$uverbs"),\"selected\":$([ $selected = yes ] && echo true || echo false),\
\"usable\":$([ $ok = yes ] && echo true || echo false)}"
    done
done

# shellcheck disable=SC3045 # `ulimit -l` is not POSIX, but dash, bash and busybox sh have it.
memlock=${XPYD_MEMLOCK:-$(ulimit -l 2>/dev/null || echo unknown)}
ipc_lock=no
capeff=$(sed -n 's/^CapEff:[[:space:]]*//p' "$PROCROOT/self/status" 2>/dev/null || true)
case $capeff in
    '' | *[!0-9a-fA-F]*) ;;
    *) [ $(((0x$capeff >> CAP_IPC_LOCK) & 1)) -eq 1 ] && ipc_lock=yes ;;
esac
case $memlock in
    unlimited) memlock_desc='memlock unlimited' memlock_ok=yes ;;
    '' | *[!0-9]*) memlock_desc="memlock $memlock" memlock_ok=yes ;; # cannot tell: do not block
    *)
        memlock_desc="memlock $memlock KiB"
        if [ "$memlock" -ge "$MIN_MEMLOCK_KB" ]; then memlock_ok=yes; else memlock_ok=no; fi
        ;;
esac
if [ "$ipc_lock" = yes ]; then
    memlock_desc="$memlock_desc, CAP_IPC_LOCK"
    memlock_ok=yes
fi

# ---------------------------------------------------------------------------------------------
# The verdict.
if [ -n "$usable" ] && [ "$memlock_ok" = yes ]; then
    rdma_usable=yes
    detail="$usable; $memlock_desc"
else
    rdma_usable=no
    if [ "$found_any" = no ]; then
        detail='no RDMA devices'
    elif [ -n "$unusable" ]; then
        detail=$unusable
    elif [ "$net_restricted" = yes ]; then
        detail="UCX_NET_DEVICES=$ucx_net_devices selects no RDMA port"
    else
        detail='RDMA devices without ports'
    fi
    if [ -n "$usable" ]; then
        detail="$usable but $memlock_desc without CAP_IPC_LOCK (need unlimited or >= $MIN_MEMLOCK_KB KiB)"
    fi
fi

reason=$detail # why RDMA is not used, when it is not
consequence=''
if [ "$rdma_allowed" = yes ] && [ "$rdma_usable" = yes ]; then
    transport=RDMA
    if [ -n "$unusable" ]; then detail="$detail; unusable: $unusable"; fi
elif [ "$tcp_allowed" = yes ]; then
    transport=TCP
    if [ "$rdma_usable" = yes ]; then
        reason="UCX_TLS=$ucx_tls excludes RDMA"
        detail="$reason; RDMA available: $detail"
    fi
    consequence='KV transfers fall back to TCP, which is orders of magnitude slower'
else
    transport=NONE
    detail="$detail; UCX_TLS=$ucx_tls allows no TCP fallback"
    consequence="KV transfers will fail: UCX_TLS=$ucx_tls allows no TCP fallback"
fi

healthy=true
problem=''
if [ "$expected" = RDMA ] && [ "$transport" != RDMA ]; then
    healthy=false
    case $expect_raw in
        RDMA | rdma) why='XPYD_EXPECT_TRANSPORT=RDMA' ;;
        *) why="UCX_TLS=$ucx_tls" ;;
    esac
    problem="RDMA expected ($why) but not usable: $reason. $consequence"
fi

log "kv transport: $transport ($detail)"

if [ -n "$STATUS_FILE" ]; then
    tmp="$STATUS_FILE.$$"
    if printf '{"version":1,"transport":%s,"expected":%s,"healthy":%s,"detail":%s,"problem":%s,"ucx_tls":%s,"ucx_net_devices":%s,"memlock":%s,"ipc_lock":%s,"ports":[%s]}\n' \
        "$(json_str "$transport")" "$(json_str "$expected")" "$healthy" "$(json_str "$detail")" \
        "$(json_str "$problem")" "$(json_str "$ucx_tls")" "$(json_str "$ucx_net_devices")" \
        "$(json_str "$memlock")" "$([ $ipc_lock = yes ] && echo true || echo false)" "$devices_json" \
        2>/dev/null >"$tmp" && mv -f "$tmp" "$STATUS_FILE" 2>/dev/null; then
        :
    else
        rm -f "$tmp" 2>/dev/null || true
        log "note: cannot write $STATUS_FILE"
    fi
fi

if [ "${XPYD_REQUIRE_RDMA:-0}" = 1 ] && [ "$transport" != RDMA ]; then
    msg="ERROR: XPYD_REQUIRE_RDMA=1 but the kv transport is $transport ($detail); not starting the engine"
    log "$msg"
    if [ -f "$TERM_LOG" ] && [ -w "$TERM_LOG" ]; then
        printf '%s: %s\n' "$PROG" "$msg" >"$TERM_LOG" 2>/dev/null || true
    fi
    exit 78
fi
if [ -n "$problem" ]; then
    log "WARNING: $problem. Check the pod's RDMA device resource, IPC_LOCK and UCX_NET_DEVICES;" \
        "XPYD_REQUIRE_RDMA=1 refuses to start instead."
fi

# ---------------------------------------------------------------------------------------------
# The engine: the arguments, `vllm serve` when there are none, `vllm serve <flags>` for flags only
# (so `docker run IMAGE --model ...` works as with the official image).
if [ "$#" -eq 0 ]; then
    set -- vllm serve
elif [ "${1#-}" != "$1" ]; then
    set -- vllm serve "$@"
fi
exec "$@"
