#!/usr/bin/env bash
# Sourced by create.sh, setup.sh, data.sh, run.sh, stop.sh, logs.sh and teardown.sh (not run on its own):
# reads the slice's settings from tpu_scripts/slice.env (the environment overrides them)
# and defines the gcloud helpers.
# shellcheck disable=SC2034  # the variables are used by the scripts that source this file

TPU_SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=slice.env
source "$TPU_SCRIPTS/slice.env"

if [[ -z "$PROJECT" ]]; then
  echo "error: PROJECT is not set: put your GCP project in tpu_scripts/slice.env or run PROJECT=... $0" >&2
  exit 2
fi

tpu_ssh() {  # tpu_ssh COMMAND [WORKER]: run COMMAND on every worker of the slice (or on WORKER)
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --worker="${2:-all}" --command="$1"
}
