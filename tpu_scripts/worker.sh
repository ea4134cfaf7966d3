#!/usr/bin/env bash
# Runs on a TPU worker, from the code's directory (run.sh and stop.sh call it through gcloud ssh).
#   bash tpu_scripts/worker.sh start PROGRAM [ARGS ...]
#       start `python -m lopd_jax.PROGRAM ARGS` in the background, in a session of its own
#       (detached from the ssh session); output in logs/PROGRAM-worker-<i>.log, exit status
#       in logs/PROGRAM-worker-<i>.rc. Refused (exit 2, one line) while a program started
#       here is still running: stop it first with ./tpu_scripts/stop.sh.
#   bash tpu_scripts/worker.sh busy
#       print that refusal's line when a program started here is running, nothing otherwise (exit 0)
#   bash tpu_scripts/worker.sh report PROGRAM
#       print one line: LOPD-WORKER <i> <exit status or -> <base64 of the log's last 8 kB>
#   bash tpu_scripts/worker.sh stop
#       SIGTERM to the running program (the trainer saves a checkpoint and exits), then,
#       after STOP_GRACE_S seconds (default 120), SIGKILL to it and every process it started
# <i> is the worker's index from the TPU VM metadata server (LOPD_WORKER overrides it).
# The running program's pid is in logs/worker-<i>.pid ("PID PROGRAM") while it runs.
set -euo pipefail

worker_index() {
  if [[ -n "${LOPD_WORKER:-}" ]]; then echo "$LOPD_WORKER"; return; fi
  curl -sf --max-time 5 -H Metadata-Flavor:Google \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname
}

running() {  # prints "PID PROGRAM" of the program started here while it runs; stale pid files are removed
  [[ -f "$pidfile" ]] || return 1
  local pid prog
  read -r pid prog < "$pidfile" || true
  if [[ -n "${pid:-}" ]] && ps -ww -o args= -p "$pid" 2>/dev/null | grep -q "lopd_jax\."; then
    echo "$pid $prog"
    return 0
  fi
  rm -f "$pidfile"
  return 1
}

busy_line() {  # busy_line PID PROGRAM: the one line that refuses a second start
  echo "error: worker $i: python -m lopd_jax.$2 is already running here (pid $1, log $PWD/logs/$2-worker-$i.log);" \
       "stop it first with ./tpu_scripts/stop.sh (or wait until it exits)"
}

cmd="${1:?usage: worker.sh start|busy|report|stop [PROGRAM] [ARGS ...]}"
shift
i="$(worker_index)"
pidfile="logs/worker-$i.pid"

case "$cmd" in
  start)
    program="${1:?usage: worker.sh start PROGRAM [ARGS ...]}"
    shift
    if found="$(running)"; then busy_line $found >&2; exit 2; fi
    mkdir -p logs
    log="logs/$program-worker-$i.log"
    rc="logs/$program-worker-$i.rc"
    rm -f "$rc"
    # SIGHUP ignored (as nohup does) and a session of its own (setsid), so the program outlives
    # the ssh session and stop can end its whole process group; its exit status lands in the
    # .rc file for report
    ( trap '' HUP
      setsid python -m "lopd_jax.$program" "$@" > "$log" 2>&1 < /dev/null &
      pid=$!
      echo "$pid $program" > "$pidfile"
      status=0
      wait "$pid" || status=$?
      echo "$status" > "$rc"
      rm -f "$pidfile" ) > /dev/null 2>&1 < /dev/null &
    for _ in $(seq 100); do [[ -f "$pidfile" || -f "$rc" ]] && break; sleep 0.05; done
    echo "worker $i: started python -m lopd_jax.$program (log: $PWD/$log)"
    ;;
  busy)
    if found="$(running)"; then busy_line $found; fi
    ;;
  report)
    program="${1:?usage: worker.sh report PROGRAM}"
    log="logs/$program-worker-$i.log"
    rc="logs/$program-worker-$i.rc"
    status="-"
    if [[ -f "$rc" ]]; then status="$(cat "$rc")"; fi
    payload=""
    if [[ -f "$log" ]]; then payload="$(tail -c 8192 "$log" | base64 -w0)"; fi
    echo "LOPD-WORKER $i ${status:--} $payload"
    ;;
  stop)
    if ! found="$(running)"; then echo "worker $i: nothing running"; exit 0; fi
    read -r pid program <<< "$found"
    grace="${STOP_GRACE_S:-120}"
    kill -TERM "$pid" 2>/dev/null || true
    start=$SECONDS
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - start < grace )); do sleep 1; done
    how="exited after SIGTERM"
    if kill -0 "$pid" 2>/dev/null; then how="killed (SIGKILL) after ${grace} s"; fi
    kill -KILL -- "-$pid" 2>/dev/null || true   # the program's process group: what it started
    for _ in $(seq 100); do [[ -f "$pidfile" ]] || break; sleep 0.05; done
    echo "worker $i: stopped python -m lopd_jax.$program (pid $pid): $how"
    ;;
  *) echo "worker.sh: unknown command $cmd (start, busy, report or stop)" >&2; exit 2 ;;
esac
