#!/usr/bin/env bash
# Copy this repository to every worker and install it into a venv there
# (requirements.txt, then requirements-tpu.txt for jax[tpu]).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

archive="$(mktemp -t lopd-jax-XXXX.tar.gz)"
trap 'rm -f "$archive"' EXIT
tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=workdirs --exclude='__pycache__' -czf "$archive" .

gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:lopd-jax.tar.gz" \
  --project="$PROJECT" --zone="$ZONE" --worker=all

tpu_ssh "set -e; mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf lopd-jax.tar.gz && \
  python3 -m venv $VENV && . $VENV/bin/activate && pip install -q --upgrade pip && \
  pip install -q -r $REMOTE_DIR/requirements.txt && \
  if [ -f $REMOTE_DIR/requirements-tpu.txt ]; then pip install -q -r $REMOTE_DIR/requirements-tpu.txt; fi && \
  python -c 'import jax; print(jax.process_index(), jax.device_count(), jax.local_device_count())'"
