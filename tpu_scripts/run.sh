#!/usr/bin/env bash
# Run the same training command on every worker, in the background, one log per worker.
#   ./tpu_scripts/run.sh --config=qwen3_8b --workdir=gs://bucket/runs/r1 [overrides ...]
# Logs: ~/REMOTE_DIR/logs/worker-<i>.log on each worker (fetch with: tpu_ssh 'tail -n 50 ...').
# The trainer calls jax.distributed.initialize() itself on a multi-host slice. Rerunning the
# same command after a preemption resumes from the newest checkpoint in the workdir.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ $# -eq 0 ]]; then
  echo "usage: $0 --config=NAME --workdir=DIR [dotted.key=value ...]" >&2
  exit 2
fi
args="$(printf '%q ' "$@")"

# shellcheck disable=SC2016  # $(...) and $HOSTNAME expand on the worker, not here
tpu_ssh "cd $REMOTE_DIR && mkdir -p logs && . $VENV/bin/activate && \
  i=\$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname) && \
  nohup python -m lopd_jax.train $args > logs/worker-\$i.log 2>&1 < /dev/null & \
  echo started on \$HOSTNAME"
