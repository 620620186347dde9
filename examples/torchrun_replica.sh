#!/usr/bin/env bash
# Several processes (GPUs) per replica: each replica runs torchrun, as a multi-GPU VM does on
# the platform. The launcher's RANK / WORLD_SIZE count replicas (nodes); torchrun turns them
# into per-process ranks for the script.
#
#   resilient-train launch --workers 2 -- bash examples/torchrun_replica.sh
#   resilient-train launch --workers 2 --gpus-per-worker 2 -- bash examples/torchrun_replica.sh   # on a GPU node
#
# torchrun's agents rendezvous among themselves: when the first machine alone restarts, its
# new agent waits for the others' agents, which never come back, and the job hangs. Where
# the script does not need torchrun, `resilient-train spawn` starts the same processes
# without that rendezvous (docs/launcher.md, "Several processes per machine"):
#
#   resilient-train launch --workers 2 -- resilient-train spawn --nproc-per-node 2 -- python examples/train_demo.py
set -euo pipefail
nproc="${NPROC_PER_NODE:-2}"
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  nproc=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
fi

exec torchrun --nnodes "$WORLD_SIZE" --node-rank "$RANK" --nproc-per-node "$nproc" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$(dirname "$0")/train_demo.py" "$@"
