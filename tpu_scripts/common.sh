#!/usr/bin/env bash
# Shared settings for the Cloud TPU scripts; edit here or override from the environment.
# Sourced by create.sh, setup.sh, run.sh and teardown.sh (not run on its own).
# shellcheck disable=SC2034  # the variables are used by the scripts that source this file

PROJECT="${PROJECT:-my-gcp-project}"
ZONE="${ZONE:-us-east5-a}"                         # v5p: us-east5-a; v5e: us-west4-a / us-central1-a
TPU_NAME="${TPU_NAME:-lopd-v5p-32}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5p-32}"     # e.g. v5litepod-16 (v5e) or v5p-32
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5}"  # v5e: v2-alpha-tpuv5-lite
QUEUED_RESOURCE_ID="${QUEUED_RESOURCE_ID:-${TPU_NAME}-qr}"
SPOT="${SPOT:-false}"                              # true: preemptible capacity (the trainer resumes)
REMOTE_DIR="${REMOTE_DIR:-lopd-jax}"               # code directory in each worker's home
VENV="${VENV:-\$HOME/lopd-venv}"                   # expanded on the worker

tpu_ssh() {  # tpu_ssh COMMAND: run COMMAND on every worker of the slice
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --worker=all --command="$1"
}
