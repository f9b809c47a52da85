#!/usr/bin/env bash
# Two "nodes" on one machine, for multi-node tests of the broadcast queue: two network
# namespaces joined by veth pairs, each node with its own mount, UTS and IPC namespace (a
# private tmpfs /dev/shm, its own hostname and /etc/hosts), and per-port byte counters for TCP.
#
#   e2e/netns_nodes.sh up                 create the nodes (a leftover set is removed first)
#   e2e/netns_nodes.sh down               remove everything; idempotent
#   e2e/netns_nodes.sh exec NODE CMD...   run CMD on node 0 or 1, or on the stranger (s)
#                                             (cwd and environment kept)
#   e2e/netns_nodes.sh watch PORT...      count TCP bytes to/from these ports from now on
#   e2e/netns_nodes.sh counters           print every counter, one per line (see below)
#   e2e/netns_nodes.sh reset              zero the port counters
#   e2e/netns_nodes.sh status             namespaces, addresses, qdiscs, watched ports
#
#   PREFIX=vsa   node n is the network namespace $PREFIX-n<n>, its state is under
#                /run/$PREFIX-nodes (two sets with different prefixes can coexist)
#   At `up` only:
#   RATE=10gbit  rate limit (tc tbf) on both ends of the queue link; units bit kbit mbit gbit
#   OTHER=1      add the second link ("o", 10.78.0.0/24) for traffic other than the queue
#   SHM_SIZE=1g  size of each node's /dev/shm
#   PRIVATE_TMP=1  give each node its own tmpfs /tmp as well (ipc:// socket paths are files)
#   PORTS="5555 6000"  ports to watch from the start (as `watch`)
#   STRANGER=1   add "the stranger" (see below): a third network namespace linked to node 0 only
#
#   node 0 ($PREFIX-n0)                          node 1 ($PREFIX-n1)
#   +-------------------------------+            +-------------------------------+
#   | vsa-q 10.77.0.1/24 fd77::1/64 |<-- veth -->| vsa-q 10.77.0.2/24 fd77::2/64 |  queue link "q"
#   | vsa-o 10.78.0.1/24 (OTHER=1)  |<-- veth -->| vsa-o 10.78.0.2/24            |  other link "o"
#   | /dev/shm: own tmpfs           |            | /dev/shm: own tmpfs           |
#   | hostname $PREFIX-n0           |            | hostname $PREFIX-n1           |
#   | vsa-s 10.79.0.1/24 (STRANGER) |            +-------------------------------+
#   +---------------^---------------+
#                   | veth, link "s"
#   +---------------v---------------+
#   | vsa-s 10.79.0.2/24            |  the stranger ($PREFIX-s, STRANGER=1): a host that is not
#   | default route via 10.79.0.1   |  one of the queue's nodes, on its own link to node 0
#   +-------------------------------+
#
# The stranger reaches node 0's addresses, the queue link's 10.77.0.1 included, over link "s"
# (node 0 accepts a packet for any of its own addresses on any of its interfaces, so no
# forwarding is needed); node 0 does not forward, so node 1 is out of its reach, and its
# traffic with node 0 is alone on link "s" (counted there). It has a network namespace only:
# `exec s` keeps the host's mount namespace (its /tmp, not node 0's /dev/shm) and sets
# VSA_NODE=s alone.
#
# `exec` sets VSA_NODE=<n>, VLLM_HOST_IP=<the node's queue-link address> (what vLLM's get_ip()
# and the queue bind to) and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=vsa-o when the other link
# exists (vsa-q otherwise), so torch.distributed stays off the queue link; give other values
# with `exec 1 env VLLM_HOST_IP=... cmd`. The node's hostname resolves to its queue address.
#
# Counters (`counters`), one line each, read in both nodes and the stranger (node=s; a packet
# between two of them is tx on one and rx on the other):
#   node=0 link=q port=5555 dir=tx bytes=N packets=N   TCP from or to port 5555 (IP bytes:
#                                                      IP and TCP headers included)
#   node=0 link=q port=tcp  dir=tx bytes=N packets=N   all TCP on the link
#   node=0 link=q port=if   dir=tx bytes=N packets=N   the interface's own counters (every
#                                                      protocol, Ethernet headers included)
# With TSO/GRO on veth a "packet" is a segment of up to 64 KiB with one set of headers, so
# header overhead is well under the wire's. Port counters need nft (Debian: nftables); without
# it only port=if lines are printed.
set -euo pipefail

PREFIX=${PREFIX:-vsa}
# It also names the nft table: letters and digits only.
[[ $PREFIX =~ ^[A-Za-z][A-Za-z0-9]{0,30}$ ]] || {
  echo "netns_nodes: PREFIX='$PREFIX': use letters and digits (at most 31)" >&2
  exit 1
}
STATE=/run/$PREFIX-nodes
NODES=(0 1)
Q_NET=10.77.0
O_NET=10.78.0
S_NET=10.79.0
Q6_NET=fd77:
IF_Q=vsa-q
IF_O=vsa-o
IF_S=vsa-s
TABLE="inet $PREFIX"

die() {
  echo "netns_nodes: $*" >&2
  exit 1
}
ns() { if [ "$1" = s ]; then echo "$PREFIX-s"; else echo "$PREFIX-n$1"; fi; }
# The namespaces that exist: the nodes, and the stranger when it was made.
all_ns() {
  echo "${NODES[@]}"
  [ -e "/run/netns/$(ns s)" ] && echo s
  return 0
}
ifname_of() { # LINK -> its interface name
  case "$1" in
    q) echo $IF_Q ;;
    o) echo $IF_O ;;
    s) echo $IF_S ;;
  esac
}
has_nft() { command -v nft > /dev/null 2>&1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces)"
  local tool
  for tool in ip nsenter unshare mount; do
    command -v "$tool" > /dev/null || die "needs $tool (Debian: iproute2, util-linux, mount)"
  done
}

node_of() {
  case "$1" in
    0 | n0 | "$PREFIX-n0") echo 0 ;;
    1 | n1 | "$PREFIX-n1") echo 1 ;;
    s | "$PREFIX-s") echo s ;;
    *) die "unknown node '$1' (use 0, 1 or s)" ;;
  esac
}

# tc's rate (NUMBER with bit, kbit, mbit, gbit or tbit) in bits per second.
rate_bits() {
  awk -v r="$1" 'BEGIN {
    if (match(r, /^[0-9]+(\.[0-9]+)?/) == 0) exit 1
    n = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    if (!(u in m)) exit 1
    printf "%.0f\n", n * m[u] }'
}

down() {
  local n pids pid left
  for n in "${NODES[@]}" s; do
    if [ -e "/run/netns/$(ns "$n")" ]; then
      # Whatever still runs in a node was started in it through this script.
      pids=$(ip netns pids "$(ns "$n")" 2> /dev/null || true)
      if [ -n "$pids" ]; then
        echo "netns_nodes: ending processes left on node $n: $pids" >&2
        for pid in $pids; do kill -TERM "$pid" 2> /dev/null || true; done
        for _ in $(seq 30); do
          left=$(ip netns pids "$(ns "$n")" 2> /dev/null || true)
          [ -z "$left" ] && break
          sleep 0.1
        done
        for pid in $(ip netns pids "$(ns "$n")" 2> /dev/null || true); do
          kill -KILL "$pid" 2> /dev/null || true
        done
      fi
      # Deleting the namespace deletes the veth ends in it, and so their peers.
      ip netns del "$(ns "$n")" 2> /dev/null || true
    fi
  done
  if [ -d "$STATE" ]; then
    for f in "$STATE"/n*.mnt "$STATE"/n*.uts "$STATE"/n*.ipc; do
      [ -e "$f" ] && umount "$f" 2> /dev/null || true
    done
    mountpoint -q "$STATE" && umount "$STATE" 2> /dev/null || true
    rm -rf "$STATE"
  fi
}

# The node's mount, UTS and IPC namespaces, kept by bind mounts under $STATE (no process holds
# them). Created from inside the node's network namespace, so the sysfs mounted in it shows
# that namespace's interfaces.
make_node_namespaces() {
  local n=$1
  printf '127.0.0.1 localhost\n::1 localhost\n%s.1 %s-n0\n%s.2 %s-n1\n' \
    "$Q_NET" "$PREFIX" "$Q_NET" "$PREFIX" > "$STATE/hosts"
  touch "$STATE/n$n.mnt" "$STATE/n$n.uts" "$STATE/n$n.ipc"
  nsenter --net="/run/netns/$(ns "$n")" \
    unshare --mount="$STATE/n$n.mnt" --uts="$STATE/n$n.uts" --ipc="$STATE/n$n.ipc" \
    --propagation private \
    env STATE="$STATE" NAME="$(ns "$n")" SHM_SIZE="${SHM_SIZE:-1g}" \
    PRIVATE_TMP="${PRIVATE_TMP:-0}" sh -euc '
      hostname "$NAME"
      mount -t tmpfs -o "size=$SHM_SIZE,mode=1777" "$NAME-shm" /dev/shm
      if [ "$PRIVATE_TMP" = 1 ]; then mount -t tmpfs -o mode=1777 "$NAME-tmp" /tmp; fi
      mount -t sysfs "$NAME-sys" /sys
      mount --bind "$STATE/hosts" /etc/hosts
      # In the node the namespace files under $STATE are plain files: it cannot enter the
      # other node through them.
      umount -l "$STATE"'
}

# The stranger: its network namespace and link "s" to node 0 (see the top of this file).
add_stranger() {
  local s
  s=$(ns s)
  ip netns add "$s"
  ip -n "$s" link set lo up
  ip link add $IF_S netns "$(ns 0)" type veth peer name $IF_S netns "$s"
  ip -n "$(ns 0)" addr add "$S_NET.1/24" dev $IF_S
  ip -n "$s" addr add "$S_NET.2/24" dev $IF_S
  ip -n "$(ns 0)" link set $IF_S up
  ip -n "$s" link set $IF_S up
  # Node 0's other addresses (10.77.0.1, the queue's) are reached through node 0, which
  # forwards nothing (a new namespace may inherit the host's setting).
  ip -n "$s" route add default via "$S_NET.1"
  ip netns exec "$(ns 0)" sh -c 'echo 0 > /proc/sys/net/ipv4/ip_forward'
}

add_link() { # NAME NET: a veth pair between the nodes, up, with NET.1 and NET.2.
  local name=$1 net=$2 n
  ip link add "$name" netns "$(ns 0)" type veth peer name "$name" netns "$(ns 1)"
  for n in "${NODES[@]}"; do
    ip -n "$(ns "$n")" addr add "$net.$((n + 1))/24" dev "$name"
    ip -n "$(ns "$n")" link set "$name" up
  done
}

setup_counters() { # N: the nft table with the chains the port rules go in, and link totals.
  local n=$1 link ifname
  has_nft || return 0
  ip netns exec "$(ns "$n")" nft -f - << EOF
table $TABLE {
  chain out { type filter hook output priority 0; policy accept; }
  chain in { type filter hook input priority 0; policy accept; }
}
EOF
  for link in q o s; do
    ifname=$(ifname_of $link)
    ip -n "$(ns "$n")" link show "$ifname" > /dev/null 2>&1 || continue
    ip netns exec "$(ns "$n")" nft -f - << EOF
add counter $TABLE ${link}_tx_tcp
add counter $TABLE ${link}_rx_tcp
add rule $TABLE out oifname "$ifname" meta l4proto tcp counter name ${link}_tx_tcp
add rule $TABLE in iifname "$ifname" meta l4proto tcp counter name ${link}_rx_tcp
EOF
  done
}

watch_ports() {
  local port n link ifname
  has_nft || die "port counters need nft (Debian: apt-get install nftables)"
  for port in "$@"; do
    [[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] \
      || die "not a TCP port: '$port'"
    for n in $(all_ns); do
      for link in q o s; do
        ifname=$(ifname_of $link)
        ip -n "$(ns "$n")" link show "$ifname" > /dev/null 2>&1 || continue
        # Watching a port twice keeps one set of rules.
        ip netns exec "$(ns "$n")" nft list counter $TABLE "${link}_tx_$port" > /dev/null 2>&1 \
          && continue
        ip netns exec "$(ns "$n")" nft -f - << EOF
add counter $TABLE ${link}_tx_$port
add counter $TABLE ${link}_rx_$port
add rule $TABLE out oifname "$ifname" tcp sport $port counter name ${link}_tx_$port
add rule $TABLE out oifname "$ifname" tcp dport $port counter name ${link}_tx_$port
add rule $TABLE in iifname "$ifname" tcp sport $port counter name ${link}_rx_$port
add rule $TABLE in iifname "$ifname" tcp dport $port counter name ${link}_rx_$port
EOF
      done
    done
  done
}

up() {
  need_root
  local n bits=
  if [ -n "${RATE:-}" ]; then
    bits=$(rate_bits "$RATE") || die "RATE='$RATE': use a number with bit, kbit, mbit, gbit or tbit"
  fi
  down
  # Any failure from here on (set -e) removes whatever was made.
  trap 'rc=$?; [ $rc -ne 0 ] && echo "netns_nodes: up failed; removing what it made" >&2 && down; exit $rc' EXIT
  mkdir -p "$STATE"
  # Namespace files may only be bound under a mount that does not propagate.
  mount --bind "$STATE" "$STATE"
  mount --make-private "$STATE"
  for n in "${NODES[@]}"; do
    ip netns add "$(ns "$n")"
    ip -n "$(ns "$n")" link set lo up
  done
  add_link $IF_Q $Q_NET
  for n in "${NODES[@]}"; do
    ip -n "$(ns "$n")" -6 addr add "$Q6_NET:$((n + 1))/64" dev $IF_Q nodad
  done
  if [ "${OTHER:-0}" = 1 ]; then
    add_link $IF_O $O_NET
  fi
  if [ "${STRANGER:-0}" = 1 ]; then
    add_stranger
  fi
  if [ -n "$bits" ]; then
    # tbf needs a bucket that holds a whole TSO segment (64 KiB) and about 10 ms at the rate.
    local burst=$((bits / 8 / 100))
    [ "$burst" -lt 262144 ] && burst=262144
    for n in "${NODES[@]}"; do
      ip netns exec "$(ns "$n")" tc qdisc replace dev $IF_Q root tbf rate "$RATE" \
        burst "$burst" latency 100ms
    done
  fi
  for n in "${NODES[@]}"; do
    make_node_namespaces "$n"
    setup_counters "$n"
  done
  if [ "${STRANGER:-0}" = 1 ]; then
    setup_counters s
  fi
  if [ -n "${PORTS:-}" ]; then
    # shellcheck disable=SC2086  # a list of ports
    watch_ports $PORTS
  fi
  trap - EXIT
  has_nft || echo "netns_nodes: nft not found: only interface counters (apt-get install nftables)" >&2
  local other=
  [ "${OTHER:-0}" = 1 ] && other="other link $O_NET.0/24"
  [ "${STRANGER:-0}" = 1 ] && other="${other:+$other, }stranger $(ns s) ($S_NET.2)"
  echo "netns_nodes: up: nodes $(ns 0) ($Q_NET.1) and $(ns 1) ($Q_NET.2)" \
    "${RATE:+rate $RATE }$other"
}

require_up() {
  local n
  for n in "${NODES[@]}"; do
    [ -e "$STATE/n$n.mnt" ] && [ -e "/run/netns/$(ns "$n")" ] \
      || die "nodes are not up (e2e/netns_nodes.sh up)"
  done
}

node_exec() {
  [ $# -ge 2 ] || die "usage: exec NODE CMD..."
  need_root
  require_up
  local n
  n=$(node_of "$1")
  shift
  if [ "$n" = s ]; then
    [ -e "/run/netns/$(ns s)" ] || die "the stranger is not up (up with STRANGER=1)"
    exec nsenter --net="/run/netns/$(ns s)" --wd="$PWD" env VSA_NODE=s "$@"
  fi
  local ifname=$IF_Q
  ip -n "$(ns "$n")" link show $IF_O > /dev/null 2>&1 && ifname=$IF_O
  exec nsenter --net="/run/netns/$(ns "$n")" --mount="$STATE/n$n.mnt" \
    --uts="$STATE/n$n.uts" --ipc="$STATE/n$n.ipc" --wd="$PWD" \
    env VSA_NODE="$n" VLLM_HOST_IP="$Q_NET.$((n + 1))" \
    GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="$ifname" "$@"
}

counters() {
  require_up
  local n link ifname dir
  for n in $(all_ns); do
    if has_nft; then
      ip netns exec "$(ns "$n")" nft list counters table $TABLE | awk -v node="$n" '
        $1 == "counter" { split($2, p, "_"); name = $2 }
        $1 == "packets" && name != "" {
          printf "node=%s link=%s port=%s dir=%s bytes=%s packets=%s\n",
            node, p[1], p[3], p[2], $4, $2
          name = "" }'
    fi
    for link in q o s; do
      ifname=$(ifname_of $link)
      ip -n "$(ns "$n")" link show "$ifname" > /dev/null 2>&1 || continue
      for dir in tx rx; do
        ip netns exec "$(ns "$n")" sh -c "echo node=$n link=$link port=if dir=$dir \
          bytes=\$(cat /sys/class/net/$ifname/statistics/${dir}_bytes) \
          packets=\$(cat /sys/class/net/$ifname/statistics/${dir}_packets)"
      done
    done
  done
}

reset() {
  require_up
  has_nft || return 0
  local n
  for n in $(all_ns); do
    ip netns exec "$(ns "$n")" nft reset counters table $TABLE > /dev/null
  done
}

status() {
  require_up
  local n
  for n in "${NODES[@]}"; do
    echo "== node $n: $(ns "$n")"
    ip -n "$(ns "$n")" -br addr
    ip -n "$(ns "$n")" -br link show $IF_Q > /dev/null 2>&1 && tc -n "$(ns "$n")" qdisc show dev $IF_Q
    nsenter --mount="$STATE/n$n.mnt" --uts="$STATE/n$n.uts" sh -c 'echo "hostname $(hostname)"; df -h /dev/shm | tail -n 1'
  done
  if [ -e "/run/netns/$(ns s)" ]; then
    echo "== the stranger: $(ns s)"
    ip -n "$(ns s)" -br addr
    ip -n "$(ns s)" route
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up) up ;;
  down)
    need_root
    down
    ;;
  exec) node_exec "$@" ;;
  watch)
    need_root
    require_up
    watch_ports "$@"
    ;;
  counters) counters ;;
  reset) reset ;;
  status) status ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2 && exit 2 ;;
esac
