#!/usr/bin/env bash
# Copy this repository to every worker and install it there exactly as `make tpu` does here:
# the package with its `tpu` extra (libtpu), every version from the lock (constraints.txt):
#   pip install -c constraints.txt -e ".[tpu]"
# Then each worker prints its jax, jaxlib and libtpu versions and its devices, and the script
# fails if any worker's versions differ from the lock (tpu_scripts/check_versions.py).
#   ./tpu_scripts/setup.sh            (settings: tpu_scripts/common.sh or the environment)
# The package needs Python >= 3.11; where the TPU VM image has an older python3, python3.11
# is installed from the distribution's packages (Ubuntu 22.04: apt-get install python3.11-venv).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

archive="$(mktemp -t lopd-jax-XXXX.tar.gz)"
trap 'rm -f "$archive"' EXIT
tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=workdirs --exclude='__pycache__' -czf "$archive" .

gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:lopd-jax.tar.gz" \
  --project="$PROJECT" --zone="$ZONE" --worker=all

# shellcheck disable=SC2016  # expanded on the worker
tpu_ssh "set -e; mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf lopd-jax.tar.gz && cd $REMOTE_DIR && \
  if ! command -v python3.11 >/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv; fi && \
  python3.11 -m venv $VENV && . $VENV/bin/activate && pip install -q --upgrade pip && \
  pip install -q -c constraints.txt -e '.[tpu]' && \
  python tpu_scripts/check_versions.py --devices"
echo "set up $TPU_NAME: every worker has the locked jax / jaxlib / libtpu (lines above)"
