#!/usr/bin/env bash
# Run one lopd_jax program on every worker of the slice (one JAX process per host) and wait.
#   ./tpu_scripts/run.sh --config=qwen3_8b --workdir=gs://BUCKET/runs/r1 [overrides ...]
#   ./tpu_scripts/run.sh --program=export --workdir=gs://BUCKET/runs/r1 --out=gs://BUCKET/exports/r1
#   ./tpu_scripts/run.sh --program=evaluate --model=gs://BUCKET/exports/r1 --env=bfcl --out=gs://...
# --program=NAME runs python -m lopd_jax.NAME (default: train). Settings: tpu_scripts/slice.env.
# Refused (exit 2, nothing started) while a program started by run.sh still runs on any
# worker: ./tpu_scripts/stop.sh stops it.
# Training runs in the background: this returns 0 once every worker has joined the run and
# process 0 has built the model on every device. Other programs are waited for until every
# worker exits 0. When a worker fails, this prints its error and the end of its log, stops
# the program on every other worker (as stop.sh does) and returns 1.
# The wait is per program: TRAIN_WAIT_S (default 3600, until under way), EXPORT_WAIT_S
# (7200), EVALUATE_WAIT_S (43200), <PROGRAM>_WAIT_S for any other (3600). When it runs out
# with no worker failed, the workers keep going: this says how to follow and stop them and
# returns 3. POLL_S (default 20) is the polling interval; STOP_GRACE_S as for stop.sh.
# Logs: ~/REMOTE_DIR/logs/PROGRAM-worker-<i>.log on each worker (tpu_scripts/logs.sh shows them).
# The programs call jax.distributed.initialize() themselves on a multi-host slice; rerunning
# the same training command after a preemption resumes from the newest checkpoint.
set -euo pipefail
source "$(dirname "$0")/common.sh"

program=train
if [[ "${1:-}" == --program=* ]]; then program="${1#--program=}"; shift; fi
if [[ $# -eq 0 || ! "$program" =~ ^[a-z][a-z0-9_]*$ ]]; then
  echo "usage: $0 [--program=train|evaluate|export] ARGS ...   (e.g. --config=NAME --workdir=DIR)" >&2
  exit 2
fi
until=started
if [[ "$program" != train ]]; then until=exited; fi
wait_var="$(tr '[:lower:]' '[:upper:]' <<< "$program")_WAIT_S"
case "$program" in
  export) default_wait=7200 ;;
  evaluate) default_wait=43200 ;;
  *) default_wait=3600 ;;
esac
wait_s="${!wait_var:-$default_wait}"
if [[ ! "$wait_s" =~ ^[0-9]+$ ]]; then echo "error: $wait_var=$wait_s: give the wait in whole seconds" >&2; exit 2; fi
args="$(printf '%q ' "$@")"

busy="$(tpu_ssh "cd $REMOTE_DIR 2>/dev/null && bash tpu_scripts/worker.sh busy" \
  | grep -E 'error: worker [^ ]+: python -m lopd_jax' || true)"
if [[ -n "$busy" ]]; then
  echo "$busy" >&2
  echo "error: not started: a program is still running on the slice; ./tpu_scripts/stop.sh stops it" >&2
  exit 2
fi

stop_all() {  # stop the program on every worker (each prints what it stopped)
  echo "stopping every worker's program (./tpu_scripts/stop.sh) ..." >&2
  tpu_ssh "cd $REMOTE_DIR && STOP_GRACE_S=${STOP_GRACE_S:-120} bash tpu_scripts/worker.sh stop" >&2 || true
}

if ! tpu_ssh "cd $REMOTE_DIR && . $LOPD_VENV/bin/activate && bash tpu_scripts/worker.sh start $program $args"; then
  echo "error: the start failed on a worker (above)" >&2
  stop_all
  exit 1
fi

deadline=$((SECONDS + wait_s))
while true; do
  sleep "${POLL_S:-20}"
  rc=0
  # a failed ssh leaves its workers unreported (pending), not a failure of the run
  { tpu_ssh "cd $REMOTE_DIR && bash tpu_scripts/worker.sh report $program" || true; } \
    | python3 "$TPU_SCRIPTS/worker_status.py" --until="$until" || rc=$?
  case "$rc" in
    0) echo "follow the logs: ./tpu_scripts/logs.sh $program"; exit 0 ;;
    3) ;;
    *) stop_all; echo "(logs of every worker: ./tpu_scripts/logs.sh $program)" >&2; exit 1 ;;
  esac
  if (( SECONDS >= deadline )); then
    echo "still going after $wait_s s ($wait_var): no worker has failed; the workers keep running." \
         "Follow them: ./tpu_scripts/logs.sh $program; stop them: ./tpu_scripts/stop.sh"
    exit 3
  fi
done
