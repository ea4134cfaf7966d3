#!/usr/bin/env bash
# Stop the program that run.sh started, on every worker of the slice.
#   ./tpu_scripts/stop.sh        (settings: tpu_scripts/slice.env, or override from the environment)
# Each worker sends SIGTERM to its program (a trainer saves a checkpoint and exits 0; the
# same run.sh command resumes it), waits up to STOP_GRACE_S seconds (default 120), then
# SIGKILLs it and every process it started, and prints one line: what it stopped, or
# "nothing running". The logs stay (./tpu_scripts/logs.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
tpu_ssh "cd $REMOTE_DIR && STOP_GRACE_S=${STOP_GRACE_S:-120} bash tpu_scripts/worker.sh stop"
