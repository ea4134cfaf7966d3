#!/usr/bin/env bash
# Delete the slice and its queued resource (checkpoints in a gs:// workdir survive).
set -euo pipefail
source "$(dirname "$0")/common.sh"

gcloud compute tpus queued-resources delete "$QUEUED_RESOURCE_ID" \
  --project="$PROJECT" --zone="$ZONE" --force --quiet
