#!/usr/bin/env bash
# tests/workers/peer_ddp.py with two processes per replica, as on a multi-GPU VM: each
# replica runs torchrun, whose processes share the replica's machine (and its disk).
set -euo pipefail
exec torchrun --nnodes "$WORLD_SIZE" --node-rank "$RANK" --nproc-per-node 2 \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$(dirname "$0")/peer_ddp.py" "$@"
