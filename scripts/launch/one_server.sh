#!/usr/bin/env bash
# One GPU server: one process per GPU, all of them.
#
#   scripts/launch/one_server.sh model=gpt_small cluster=h100_x8 parallel.pp=4 parallel.dp=2
#
# Copy and edit. Every argument is a Hydra override for pipedream.train; the config's world size
# (pp x tp x dp, or the plan's) must equal the number of GPUs, which pipedream.train checks.
# `python -m launcher ...` is the equivalent that derives the process count from the config instead
# (and pre-checks it); `python -m launcher launcher.dry_run=true ...` prints its torchrun line.
#
# Environment (all optional):
#   NPROC     processes to start (default: the GPUs `nvidia-smi -L` lists)
# torchrun must be the one of the environment pipedream is installed in.
set -euo pipefail

nproc="${NPROC:-$(nvidia-smi -L | wc -l)}"
if [ "$nproc" -lt 1 ]; then
    echo "error: no GPU found (nvidia-smi -L lists none): set NPROC, or run on a GPU server" >&2
    exit 2
fi

# --standalone: a private rendezvous on this host, no address or port to choose.
# Stop with Ctrl-C or SIGTERM; torchrun ends the ranks.
# If torchrun dies otherwise (even by SIGKILL), the ranks end with it: each watches its parent
# (pipedream/lifecycle/parent_watch.py).
exec torchrun --standalone --nproc-per-node="$nproc" \
    -m pipedream.train "$@"
