#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, beside the single-node one
# (tests/cluster/start_local_slurm.sh, whose munged it shares). Each node is a network
# namespace (dmln1, dmln2: a veth pair onto the bridge dmlbr0, addresses 10.213.0.11 and
# .12, on a private subnet routed nowhere) plus a UTS namespace (hostname node1, node2);
# one slurmd per node, and a slurmctld in this namespace on its own ports and state
# directory. Aim commands at it with SLURM_CONF=$DMLTRAIN_TWO_NODES/slurm.conf.
#
#   bash tests/cluster/two_node_slurm.sh up     # start it (again: a no-op when it is up)
#   bash tests/cluster/two_node_slurm.sh down   # stop it and remove everything it made
#   bash tests/cluster/two_node_slurm.sh slurmd 2   # start node2's slurmd again
#
# Needs root, iproute2 (ip), util-linux (nsenter, unshare) and slurm-wlm. Only the
# namespaces, bridge and /etc/hosts lines (tagged "# dmltrain-two-node") made here are
# touched. slurmd runs under nsenter+unshare rather than "ip netns exec", which remounts
# /sys: slurmd then finds no cgroup file system and will not start.
set -euo pipefail
dir=${DMLTRAIN_TWO_NODES:-/var/tmp/dmltrain-two-nodes}
bridge=dmlbr0
net=10.213.0
conf=$dir/slurm.conf

down() {
    for n in 1 2; do
        { ip netns pids "dmln$n" 2>/dev/null || true; } | xargs -r kill -9
        ip netns del "dmln$n" 2>/dev/null || true
    done
    if [ -f "$dir/ctld.pid" ]; then kill "$(cat "$dir/ctld.pid")" 2>/dev/null || true; fi
    ip link del "$bridge" 2>/dev/null || true
    sed -i '/# dmltrain-two-node$/d' /etc/hosts
    rm -rf "$dir"
}

nodes_up() {
    [ "$(SLURM_CONF=$conf sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$')" = 2 ]
}

start_slurmd() {  # node number
    nsenter --net="/run/netns/dmln$1" unshare --uts \
        sh -c "hostname node$1 && SLURM_CONF='$dir/node$1/slurm.conf' slurmd -f '$dir/node$1/slurm.conf'"
}

case "${1:-}" in
    down) down; exit 0 ;;
    slurmd) start_slurmd "${2:?which node: 1 or 2}"; exit 0 ;;
    up) ;;
    *) echo "usage: bash tests/cluster/two_node_slurm.sh up|down|slurmd N" >&2; exit 2 ;;
esac

if [ -f "$conf" ] && nodes_up; then
    exit 0
fi
down  # whatever a half-started or stale cluster left behind
pgrep -x munged >/dev/null || { echo "two_node_slurm.sh: munged is not running: run tests/cluster/start_local_slurm.sh first" >&2; exit 1; }
mkdir -p "$dir/state" "$dir/spool-node1" "$dir/spool-node2"
ip link add "$bridge" type bridge
ip addr add "$net.1/24" dev "$bridge"
ip link set "$bridge" up
for n in 1 2; do
    ip netns add "dmln$n"
    ip link add "vh$n" type veth peer name "vn$n"
    ip link set "vn$n" netns "dmln$n"
    ip link set "vh$n" master "$bridge"
    ip link set "vh$n" up
    ip netns exec "dmln$n" ip addr add "$net.1$n/24" dev "vn$n"
    ip netns exec "dmln$n" ip link set "vn$n" up
    ip netns exec "dmln$n" ip link set lo up
    echo "$net.1$n node$n # dmltrain-two-node" >> /etc/hosts
done
cat > "$conf" <<CONF
ClusterName=twonode
SlurmctldHost=$(hostname -s)($net.1)
SlurmctldPort=6917
SlurmdPort=6918
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/ctld.pid
SlurmdSpoolDir=$dir/spool-%n
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
MpiDefault=none
KillWait=10
# Nodes that stop answering are marked DOWN after 90 s (real clusters: minutes): later
# than a lost node's survivors stop and the batch script requeues the job (about 80 s
# with the test's --dist-timeout and srun --wait), as on a real cluster.
SlurmdTimeout=90
NodeName=node1 NodeAddr=$net.11 CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeAddr=$net.12 CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
PartitionName=two Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
SLURM_CONF=$conf slurmctld -f "$conf"
# Each slurmd reads its slurm.conf (the same) from a directory of its own, beside an
# mpi.conf that gives PMIx (srun --mpi=pmix) a temporary directory of its own: the nodes
# share /tmp, where both would otherwise make the same directory for a job step.
for n in 1 2; do
    mkdir -p "$dir/node$n" "$dir/pmix-node$n"
    cp "$conf" "$dir/node$n/slurm.conf"
    echo "PMIxCliTmpDirBase=$dir/pmix-node$n" > "$dir/node$n/mpi.conf"
    start_slurmd "$n"
done
for _ in $(seq 30); do
    nodes_up && exit 0
    sleep 1
done
echo "two_node_slurm.sh: the two-node cluster did not come up; logs in $dir:" >&2
tail -n 5 "$dir"/*.log >&2
exit 1
