#!/usr/bin/env bash
# Print the end of every worker's log of a program started by run.sh.
#   ./tpu_scripts/logs.sh [PROGRAM (default train)] [LINES (default 30)]
set -euo pipefail
source "$(dirname "$0")/common.sh"
program="${1:-train}"
lines="${2:-30}"
tpu_ssh "cd $REMOTE_DIR && for f in logs/$program-worker-*.log; do echo \"== \$HOSTNAME \$f\"; tail -n $lines \"\$f\"; done"
