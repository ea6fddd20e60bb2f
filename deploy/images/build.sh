#!/usr/bin/env bash
# Builds the OCI images sandboxd-gateway and sandboxd-agent with podman, from Debian packages only
# (docs/deploy.md "Building the images"). No base image is pulled from a registry: the base is a Debian
# bookworm minbase root filesystem made here by debootstrap, imported as localhost/sandboxd-base.
#
# usage: deploy/images/build.sh [--rebuild]
#   Prints, as its last two lines, `gateway IMAGE` and `agent IMAGE` (the content-addressed tags).
#   --rebuild  ignore every cached base and image (e.g. to take Debian's latest security updates)
# Environment: SANDBOXD_DEBIAN_MIRROR (default: the host's apt sources' Debian mirror).
#
# Tags: localhost/sandboxd-<name>:<version>-<hash> and :<version> (version: package.json), where
# <hash> covers the build context (the bundled CLI, Bun, the Containerfile) and the base: an image
# whose inputs did not change is not built again, so a second run costs the bundle and a hash.
set -euo pipefail

ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
HERE="$ROOT/deploy/images"
WORK="$ROOT/.data/images"
REBUILD=0
[ "${1:-}" = --rebuild ] && REBUILD=1

say() { printf 'sandboxd-images: %s\n' "$*" >&2; }
die() { printf 'sandboxd-images: error: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (debootstrap and rootful podman)"

# podman builds and runs the images; runc as its runtime, since crun 1.8 (bookworm's) refuses a
# host with cgroup v1 and v2 hierarchies mounted together, which runc handles. debootstrap makes
# the base.
missing=()
for p in podman runc debootstrap; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
PODMAN=(podman --runtime runc)

# The pinned Bun, installed by the project's launcher when missing (and the node modules the
# bundle is made from).
BUN=$("$ROOT/bin/sandboxd" bun -e 'console.log(process.execPath)')
VERSION=$("$BUN" -e "console.log(require('$ROOT/package.json').version)")
REVISION=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)

# The Debian mirror: the setting, else the first Debian archive of the host's apt sources (as the
# catalog's python template finds it, agent/catalog/python.ts).
MIRROR="${SANDBOXD_DEBIAN_MIRROR:-}"
if [ -z "$MIRROR" ]; then
  MIRROR=$(sed -nE -e 's#^URIs:[[:space:]]*([^[:space:]]*/debian/?)([[:space:]].*)?$#\1#p' \
    -e 's#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]*/debian/?)[[:space:]].*#\2#p' \
    /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list 2>/dev/null | head -n 1 || true)
fi
[ -n "$MIRROR" ] || die "no Debian mirror in /etc/apt/sources.list(.d); set SANDBOXD_DEBIAN_MIRROR"
# Security updates (where the pinned guest kernel is published): the host's debian-security
# archive, else the mirror's sibling (/debian -> /debian-security, as Debian's mirrors lay it out).
SECURITY=$(sed -nE -e 's#^URIs:[[:space:]]*([^[:space:]]*/debian-security/?)([[:space:]].*)?$#\1#p' \
  -e 's#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]*/debian-security/?)[[:space:]].*#\2#p' \
  /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list 2>/dev/null | head -n 1 || true)
[ -n "$SECURITY" ] || SECURITY="${MIRROR%/}-security"

exists() { [ $REBUILD = 0 ] && "${PODMAN[@]}" image exists "$1"; }

# 1. The base: debootstrap minbase, imported FROM scratch. Its tag hashes its recipe and mirror.
BASE_RECIPE="bookworm minbase $MIRROR $SECURITY base-v1"
BASE="localhost/sandboxd-base:bookworm-$(printf '%s' "$BASE_RECIPE" | sha256sum | cut -c1-12)"
if exists "$BASE"; then
  say "base $BASE is built"
else
  say "building base $BASE (debootstrap --variant=minbase bookworm $MIRROR)"
  mkdir -p "$WORK"
  rootfs=$(mktemp -d "$WORK/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    die "debootstrap failed: $(tail -n 5 "$WORK/debootstrap.log")"
  # The image's apt sources: bookworm, its updates and its security archive.
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  # Debian's own apt/dpkg settings for images: no downloaded .debs kept, no docs or man pages.
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    >"$rootfs/etc/apt/apt.conf.d/90sandboxd-image"
  printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n' \
    >"$rootfs/etc/dpkg/dpkg.cfg.d/90sandboxd-image"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -c . | "${PODMAN[@]}" import --quiet - "$BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi
BASE_ID=$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$BASE")

# 2. The build context: the app as files, laid out as the bundle expects (docs/deploy.md
#    "What is in each image"): /opt/sandboxd/bin/{bun,sandboxd}, lib/cli/ (the bundled CLI, the
#    files it reads beside itself), lib/{package.json,migrations,openapi.yaml,console,node_modules}.
CTX="$WORK/context"
rm -rf "$CTX"
APP="$CTX/app"
mkdir -p "$APP/bin" "$APP/lib/cli" "$APP/lib/node_modules/@xterm" "$CTX/prepare-guest"
"$BUN" build "$ROOT/cli/main.ts" --target bun --splitting --outdir "$APP/lib/cli" >/dev/null
# What the bundle reads from beside its chunks (`new URL(..., import.meta.url)`, import.meta.dir):
# PGlite's wasm and data, the registry pull's forwarder (run as a file), the RAM shim's source.
PGLITE="$ROOT/node_modules/@electric-sql/pglite/dist"
cp "$PGLITE/pglite.wasm" "$PGLITE/pglite.data" "$PGLITE/initdb.wasm" "$APP/lib/cli/"
cp "$ROOT/agent/image/pull-forwarder.ts" "$ROOT/agent/qemu/ram-readonly.c" "$APP/lib/cli/"
# ... and one level up (the CLI's, database's and gateway's root).
cp "$ROOT/package.json" "$ROOT/openapi.yaml" "$APP/lib/"
cp -r "$ROOT/migrations" "$ROOT/gateway/console" "$APP/lib/"
for pkg in xterm addon-fit; do
  src="$ROOT/node_modules/@xterm/$pkg"
  mkdir -p "$APP/lib/node_modules/@xterm/$pkg"
  cp "$src/package.json" "$APP/lib/node_modules/@xterm/$pkg/"
  cp -r "$src/lib" "$APP/lib/node_modules/@xterm/$pkg/"
  [ -d "$src/css" ] && cp -r "$src/css" "$APP/lib/node_modules/@xterm/$pkg/"
done
echo "$REVISION" >"$APP/lib/.build-stamp"
install -m 0755 "$BUN" "$APP/bin/bun"
install -m 0755 "$HERE/sandboxd.sh" "$APP/bin/sandboxd"
# The agent's build stage: the guest agent's sources and the step that builds from them.
cp -r "$ROOT/guest" "$CTX/guest"
"$BUN" build "$HERE/prepare-guest.ts" --target bun --outdir "$CTX/prepare-guest" >/dev/null
cp "$ROOT/agent/qemu/ram-readonly.c" "$CTX/prepare-guest/"

# 3. The images, each tagged by the hash of what it is built from.
hash_of() { # Containerfile, then the context's files (paths and contents) and the base's id
  { echo "$BASE_ID"; sha256sum "$1"; (cd "$CTX" && find . -type f -print0 | sort -z | xargs -0 sha256sum); } |
    sha256sum | cut -c1-12
}
built=()
for name in gateway agent; do
  file="$HERE/Containerfile.$name"
  image="localhost/sandboxd-$name:$VERSION-$(hash_of "$file")"
  if exists "$image"; then
    say "$image is built"
  else
    say "building $image"
    # --network host: the build's apt reaches the mirror the way this host does.
    "${PODMAN[@]}" build --network host --file "$file" --tag "$image" \
      --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
      "$CTX" >&2
  fi
  "${PODMAN[@]}" tag "$image" "localhost/sandboxd-$name:$VERSION"
  # Earlier builds' tags go (a machine that builds every commit would otherwise keep ~1 GB each);
  # the layer cache stays, and an image a container still uses is kept by podman.
  "${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}}' "localhost/sandboxd-$name" |
    grep -E -- "-[0-9a-f]{12}$" | grep -v -x -F "$image" | xargs -r "${PODMAN[@]}" rmi >/dev/null 2>&1 || true
  built+=("$name $image")
done
rm -rf "$CTX"
printf '%s\n' "${built[@]}"
