#!/usr/bin/env bash
# Copy this checkout's files to every worker and install them there as `make tpu bfcl` does
# here: the package with its `tpu` (libtpu) and `bfcl` extras plus bfcl-eval (for
# `evaluate --env=bfcl` and the evaluation suite), every version from the lock:
#   pip install -c constraints.txt -e ".[tpu,bfcl]" && pip install --no-deps bfcl-eval==...
# Then each worker prints its jax, jaxlib and libtpu versions and its devices, and the script
# fails if any worker's versions differ from the lock (tpu_scripts/check_versions.py).
#   ./tpu_scripts/setup.sh            (settings: tpu_scripts/slice.env or the environment)
# Shipped: the files git tracks plus untracked ones it does not ignore (git ls-files), so
# .venv/, workdirs/, checkpoints/ and downloaded data (data/envscaler/, data/bench/, ...) stay
# here. Task data goes to the workers from a bucket: with DATA_URL set (slice.env), setup.sh
# ends by running data.sh, which copies it to data/ on every worker (docs/data.md). The
# package needs Python >= 3.11; where the TPU VM image has an older python3, python3.11 is
# installed from the distribution's packages.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ROOT="$(cd "$TPU_SCRIPTS/.." && pwd)"

if ! git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
  echo "error: $ROOT is not a git checkout; setup.sh ships the files git lists (clone the repository)" >&2
  exit 2
fi
bfcl_eval="$(sed -n 's/^BFCL_EVAL := //p' "$ROOT/Makefile")"   # the pin `make bfcl` installs
archive="$(mktemp -t lopd-jax-XXXX.tar.gz)"
trap 'rm -f "$archive"' EXIT
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
  | tar --null -T - -czf "$archive")
echo "shipping $(tar -tzf "$archive" | wc -l) files ($(du -h "$archive" | cut -f1))"

gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:lopd-jax.tar.gz" \
  --project="$PROJECT" --zone="$ZONE" --worker=all

tpu_ssh "set -e; mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf lopd-jax.tar.gz && cd $REMOTE_DIR && \
  if ! command -v python3.11 >/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv; fi && \
  python3.11 -m venv $LOPD_VENV && . $LOPD_VENV/bin/activate && pip install -q --upgrade pip && \
  pip install -q -c constraints.txt -e '.[tpu,bfcl]' && pip install -q --no-deps $bfcl_eval && \
  python tpu_scripts/check_versions.py --devices"
echo "set up $TPU_NAME: every worker has the locked jax / jaxlib / libtpu (lines above)"
if [[ -n "$DATA_URL" ]]; then
  bash "$TPU_SCRIPTS/data.sh"
else
  echo "DATA_URL is not set (slice.env): no task data copied to the workers (docs/data.md; then ./tpu_scripts/data.sh)"
fi
