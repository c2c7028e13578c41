#!/usr/bin/env bash
# A stand-in for the public base image python:3.11-slim-bookworm, built offline from
# Debian's package mirror, for hosts where the public container registry is out of reach
# (docker pull fails) but a Debian mirror is not. Debian bookworm's python3 is Python 3.11,
# the release the images pin.
#
#   sudo scripts/build_base_image.sh                       # tags minivllm/base:py311-bookworm
#   sudo scripts/build_base_image.sh --tag my/base:1 --mirror http://deb.example.edu/debian
#   sudo scripts/build_base_image.sh --ca-cert /usr/local/share/ca-certificates/proxy.crt
#   docker build --build-arg BASE_IMAGE=minivllm/base:py311-bookworm \
#       -f docker/lab-cpu.Dockerfile -t minivllm/lab-cpu .
#
# Steps: debootstrap (variant minbase) of bookworm with python3, python3-venv (ensurepip:
# scripts/install.sh creates a virtualenv with pip), python-is-python3 and
# ca-certificates into a scratch folder; apt's sources (bookworm, -updates, -security, so
# the images' apt-get install takes security updates as on the public image); apt's lists
# and caches and the documentation removed; `docker import` of the tree with the public
# image's environment (LANG=C.UTF-8) and command (python3).
#
# What differs from python:3.11-slim-bookworm: Debian's Python 3.11 in /usr/bin (the
# public image builds CPython 3.11.x from source into /usr/local, a newer patch release),
# its pip comes only inside a virtualenv (the images make one), and the image has one
# layer. The images built on it run the same install (scripts/install.sh).
# --ca-cert FILE (repeatable): a certificate authority to trust besides Debian's, for a
# site whose outbound HTTPS goes through a TLS-inspecting proxy (pip then fails with
# CERTIFICATE_VERIFY_FAILED); it goes into the image's store and PIP_CERT, SSL_CERT_FILE
# and REQUESTS_CA_BUNDLE point at the store, so pip and Python use it. Such an image is
# for that site only: do not publish it.
# Needs root (debootstrap, chroot), debootstrap and docker. About a minute or two (72 s on a 2-core machine).
set -euo pipefail

tag="minivllm/base:py311-bookworm"
mirror="http://deb.debian.org/debian"
security="http://deb.debian.org/debian-security"
suite="bookworm"
cas=()

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --mirror) mirror="$2"; shift 2 ;;
        --security-mirror) security="$2"; shift 2 ;;
        --ca-cert) cas+=("$(realpath "$2")"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build_base_image.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || { echo "build_base_image.sh: needs root (debootstrap, chroot)" >&2; exit 1; }
for tool in debootstrap docker; do
    command -v "$tool" >/dev/null || {
        echo "build_base_image.sh: $tool not found (apt-get install debootstrap docker.io)" >&2
        exit 1; }
done

start=$SECONDS
work="$(mktemp -d /tmp/minivllm-base.XXXXXX)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

echo "==> debootstrap $suite from $mirror into $rootfs"
debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    "$suite" "$rootfs" "$mirror"

echo "==> apt sources, cleanup"
cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
SOURCES
# the public image's apt settings: no recommends, nothing kept after install
cat > "$rootfs/etc/apt/apt.conf.d/docker-clean" <<'APTCONF'
APT::Install-Recommends "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APTCONF
chroot "$rootfs" apt-get clean
changes=()
if [ ${#cas[@]} -gt 0 ]; then
    echo "==> trusting ${cas[*]}"
    for ca in "${cas[@]}"; do
        cp "$ca" "$rootfs/usr/local/share/ca-certificates/$(basename "${ca%.*}").crt"
    done
    chroot "$rootfs" update-ca-certificates
    bundle=/etc/ssl/certs/ca-certificates.crt
    changes=(--change "ENV PIP_CERT=$bundle" --change "ENV SSL_CERT_FILE=$bundle"
             --change "ENV REQUESTS_CA_BUNDLE=$bundle")
fi
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/tmp/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
# no mounts or device nodes of the host: debootstrap leaves /proc and /sys empty
version="$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"

echo "==> docker import as $tag (Python $version)"
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL org.opencontainers.image.description=\"Debian $suite minbase with Python $version (stand-in for python:3.11-slim-bookworm)\"" \
    --change 'CMD ["python3"]' \
    ${changes[@]+"${changes[@]}"} \
    - "$tag"
docker run --rm "$tag" python3 -c 'import ssl, venv, ensurepip, sys; print(sys.version)'
echo "==> $tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}') in $((SECONDS - start)) s"
