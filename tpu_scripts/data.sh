#!/usr/bin/env bash
# Copy the task data from the bucket to data/ in the code's directory on every worker
# (each host reads the same local files; setup.sh runs this when DATA_URL is set).
#   DATA_URL=gs://BUCKET/data ./tpu_scripts/data.sh     (or DATA_URL in tpu_scripts/slice.env)
# gs://BUCKET/data/envscaler/train.jsonl lands as data/envscaler/train.jsonl, the path the
# run's env.kwargs name (docs/data.md). Files already there and unchanged are not copied again.
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [[ -z "$DATA_URL" ]]; then
  echo "error: DATA_URL is not set: put gs://BUCKET/data (where you uploaded data/envscaler)" \
       "in tpu_scripts/slice.env or run DATA_URL=... $0" >&2
  exit 2
fi
url="$(printf '%q' "${DATA_URL%/}")"
tpu_ssh "set -e; mkdir -p $REMOTE_DIR/data && gcloud storage rsync --recursive $url $REMOTE_DIR/data && \
  echo \"\$HOSTNAME: \$(find $REMOTE_DIR/data -type f | wc -l) files under $REMOTE_DIR/data\""
