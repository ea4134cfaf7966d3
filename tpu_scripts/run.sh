#!/usr/bin/env bash
# Run one lopd_jax program on every worker of the slice (one JAX process per host) and wait.
#   ./tpu_scripts/run.sh --config=qwen3_8b --workdir=gs://BUCKET/runs/r1 [overrides ...]
#   ./tpu_scripts/run.sh --program=export --workdir=gs://BUCKET/runs/r1 --out=gs://BUCKET/exports/r1
#   ./tpu_scripts/run.sh --program=evaluate --model=gs://BUCKET/exports/r1 --env=bfcl --out=gs://...
# --program=NAME runs python -m lopd_jax.NAME (default: train). Settings: tpu_scripts/slice.env.
# Training runs in the background: this returns (0) once every worker has joined the run and
# process 0 has built the model on every device, or (1) with the first failing worker's
# error and the end of its log. Other programs are waited for until every worker exits.
# Logs: ~/REMOTE_DIR/logs/PROGRAM-worker-<i>.log on each worker (tpu_scripts/logs.sh shows them).
# The programs call jax.distributed.initialize() themselves on a multi-host slice; rerunning
# the same training command after a preemption resumes from the newest checkpoint.
# WAIT_S (default 3600) bounds the wait, POLL_S (default 20) is the polling interval.
set -euo pipefail
source "$(dirname "$0")/common.sh"

program=train
if [[ "${1:-}" == --program=* ]]; then program="${1#--program=}"; shift; fi
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--program=train|evaluate|export] ARGS ...   (e.g. --config=NAME --workdir=DIR)" >&2
  exit 2
fi
until=started
if [[ "$program" != train ]]; then until=exited; fi
args="$(printf '%q ' "$@")"

tpu_ssh "cd $REMOTE_DIR && . $VENV/bin/activate && bash tpu_scripts/worker.sh start $program $args"

deadline=$((SECONDS + ${WAIT_S:-3600}))
while true; do
  sleep "${POLL_S:-20}"
  rc=0
  # a failed ssh leaves its workers unreported (pending), not a failure of the run
  { tpu_ssh "cd $REMOTE_DIR && bash tpu_scripts/worker.sh report $program" || true; } \
    | python3 "$TPU_SCRIPTS/worker_status.py" --until="$until" || rc=$?
  case "$rc" in
    0) echo "follow the logs: ./tpu_scripts/logs.sh $program"; exit 0 ;;
    3) ;;
    *) echo "(logs of every worker: ./tpu_scripts/logs.sh $program)" >&2; exit 1 ;;
  esac
  if (( SECONDS >= deadline )); then
    echo "error: not every worker got under way within ${WAIT_S:-3600} s (last status above; ./tpu_scripts/logs.sh $program)" >&2
    exit 1
  fi
done
