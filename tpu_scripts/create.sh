#!/usr/bin/env bash
# Create a v5e / v5p slice through a queued resource and wait until it is ACTIVE.
#   ./tpu_scripts/create.sh        (settings: tpu_scripts/slice.env, or override from the environment)
set -euo pipefail
source "$(dirname "$0")/common.sh"

extra=()
if [[ "$SPOT" == "true" ]]; then extra+=(--spot); fi

gcloud compute tpus queued-resources create "$QUEUED_RESOURCE_ID" \
  --project="$PROJECT" --zone="$ZONE" --node-id="$TPU_NAME" \
  --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${extra[@]}"

echo "waiting for $QUEUED_RESOURCE_ID to become ACTIVE ..."
while true; do
  state="$(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE_ID" \
    --project="$PROJECT" --zone="$ZONE" --format='value(state.state)')"
  echo "  state: $state"
  case "$state" in
    ACTIVE) break ;;
    FAILED|SUSPENDED) echo "queued resource ended in $state" >&2; exit 1 ;;
  esac
  sleep 30
done
echo "slice $TPU_NAME ($ACCELERATOR_TYPE) is up"
