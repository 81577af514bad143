#!/usr/bin/env bash
# A base image made here, for hosts that reach Debian's mirror but no container registry:
# Debian bookworm (minbase) with Python 3.11, imported into podman as localhost/vitserve-base:bookworm.
# Build the service on it with `--build-arg BASE=localhost/vitserve-base:bookworm`. Kept once built.
#   bash deploy/local-base.sh [TAG]
set -euo pipefail
tag="${1:-localhost/vitserve-base:bookworm}"
if podman image exists "$tag"; then
    echo "$tag: already built"
    exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    http://deb.debian.org/debian > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
tar -C "$root" -c . | podman import --change 'CMD ["python3"]' - "$tag"
echo "$tag: built"
