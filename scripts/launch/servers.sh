#!/usr/bin/env bash
# Several GPU servers by hand: run this on every server with the same arguments and the same
# NNODES, MASTER_ADDR and RUN_DIR; only NODE_RANK differs (0 on the server named by MASTER_ADDR).
#
#   server A (10.0.0.1):  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 RUN_DIR=runs/big scripts/launch/servers.sh parallel.pp=8 parallel.dp=2
#   server B:             NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 RUN_DIR=runs/big scripts/launch/servers.sh parallel.pp=8 parallel.dp=2
#
# Copy and edit. The arguments are Hydra overrides for pipedream.train. torchrun's c10d rendezvous
# runs on MASTER_ADDR:MASTER_PORT (reachable from every server); ranks are numbered node by node,
# so with the default rank order a node holds whole tensor-parallel groups and data-parallel
# replicas of a stage. RUN_DIR must be one folder every server sees (a shared file system):
# rank 0 writes metrics, every rank writes its checkpoint shards there.
# `python -m launcher launcher.nnodes=2 launcher.master_addr=10.0.0.1 ...` prints these commands
# (and `launcher.node_rank=K` runs node K's).
#
# Environment:
#   NNODES, NODE_RANK, MASTER_ADDR, RUN_DIR   required
#   MASTER_PORT   rendezvous port (default 29500)
#   NPROC         processes on this server (default: the GPUs `nvidia-smi -L` lists)
#   RDZV_ID       names the job at the rendezvous (default pipedream; change it to run two jobs at once)
# torchrun (and python) must be the ones of the environment pipedream is installed in.
# If torchrun dies (even by SIGKILL), its ranks end with it (pipedream/lifecycle/parent_watch.py), and
# the other servers' ranks fail at once on the closed connections.
set -euo pipefail

: "${NNODES:?set NNODES to the number of servers}"
: "${NODE_RANK:?set NODE_RANK to the index of this server, 0 .. NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the server with NODE_RANK=0}"
: "${RUN_DIR:?set RUN_DIR to a folder on a file system every server shares}"
nproc="${NPROC:-$(nvidia-smi -L | wc -l)}"

exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" \
    --nproc-per-node="$nproc" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv-id="${RDZV_ID:-pipedream}" \
    -m pipedream.train "train.run_dir=$RUN_DIR" "$@"
