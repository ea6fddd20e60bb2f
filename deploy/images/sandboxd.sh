#!/bin/sh
# The images' entry point, /opt/sandboxd/bin/sandboxd: the bundled CLI under the pinned Bun.
# In the agent image, `agent` first copies the guest artifacts built at image build time
# (/opt/sandboxd/guest-seed) into the data volume's guest/ when that lacks them: an agent then
# starts with no kernel download and no compiler. A copy, not a link: the agent owns its data
# (and rebuilds an initramfs beside them); each piece is copied under a temporary name and renamed,
# so a stop mid-copy leaves nothing half-written under its real name.
set -eu
APP=/opt/sandboxd
if [ "${1:-}" = agent ] && [ -d "$APP/guest-seed" ]; then
  guest="${SANDBOXD_DATA_DIR:-/var/lib/sandboxd}/guest"
  mkdir -p "$guest"
  for src in "$APP"/guest-seed/*; do
    name=$(basename "$src")
    [ -e "$guest/$name" ] && continue
    rm -rf "$guest/.seed-$name"
    cp -a "$src" "$guest/.seed-$name"
    mv "$guest/.seed-$name" "$guest/$name"
  done
fi
exec "$APP/bin/bun" "$APP/lib/cli/main.js" "$@"
