#!/usr/bin/env bash
# Runs on a TPU worker, from the code's directory (run.sh calls it through gcloud ssh).
#   bash tpu_scripts/worker.sh start PROGRAM [ARGS ...]
#       start `python -m lopd_jax.PROGRAM ARGS` in the background, detached from the ssh
#       session; output in logs/PROGRAM-worker-<i>.log, exit status in logs/PROGRAM-worker-<i>.rc
#   bash tpu_scripts/worker.sh report PROGRAM
#       print one line: LOPD-WORKER <i> <exit status or -> <base64 of the log's last 8 kB>
# <i> is the worker's index from the TPU VM metadata server (LOPD_WORKER overrides it).
set -euo pipefail

worker_index() {
  if [[ -n "${LOPD_WORKER:-}" ]]; then echo "$LOPD_WORKER"; return; fi
  curl -sf --max-time 5 -H Metadata-Flavor:Google \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname
}

cmd="${1:?usage: worker.sh start|report PROGRAM [ARGS ...]}"
program="${2:?usage: worker.sh start|report PROGRAM [ARGS ...]}"
shift 2
i="$(worker_index)"
log="logs/$program-worker-$i.log"
rc="logs/$program-worker-$i.rc"

case "$cmd" in
  start)
    mkdir -p logs
    rm -f "$rc"
    # SIGHUP ignored (as nohup does) so the program outlives the ssh session; its exit status
    # lands in the .rc file for report
    ( trap '' HUP; status=0; python -m "lopd_jax.$program" "$@" > "$log" 2>&1 < /dev/null || status=$?
      echo "$status" > "$rc" ) > /dev/null 2>&1 < /dev/null &
    echo "worker $i: started python -m lopd_jax.$program (log: $PWD/$log)"
    ;;
  report)
    status="-"
    if [[ -f "$rc" ]]; then status="$(cat "$rc")"; fi
    payload=""
    if [[ -f "$log" ]]; then payload="$(tail -c 8192 "$log" | base64 -w0)"; fi
    echo "LOPD-WORKER $i ${status:--} $payload"
    ;;
  *) echo "worker.sh: unknown command $cmd (start or report)" >&2; exit 2 ;;
esac
