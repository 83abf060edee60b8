#!/usr/bin/env bash
# CI check of the gRPC API: `buf lint` (STANDARD + COMMENTS, buf.yaml) and `buf breaking` against the
# baseline, the first commit of this history that has buf.yaml (where the buf-clean v1 API landed; a
# squash merge keeps that true), or $PDSERVE_BUF_BASELINE (any git ref). buf comes from the npm package
# @bufbuild/buf, installed once into a cache directory; it runs offline afterwards.
# Exit 1 on a lint finding or a breaking change. When npm is missing, the registry is unreachable or the
# baseline is not in the clone (shallow), the step prints a loud SKIP line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=${PDSERVE_BUF_VERSION:-1.75.0}
CACHE=${PDSERVE_BUF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-buf/$BUF_VERSION}

skip() {
    echo "==================================================================================" >&2
    echo "SKIP buf_check: $* - the gRPC API was NOT checked by buf" >&2
    echo "==================================================================================" >&2
    exit 0
}

if command -v buf >/dev/null 2>&1; then
    BUF=$(command -v buf)
else
    BUF="$CACHE/node_modules/.bin/buf"
    if [ ! -x "$BUF" ]; then
        command -v npm >/dev/null 2>&1 || skip "npm is not installed (install Node.js, or put buf on PATH)"
        mkdir -p "$CACHE"
        if ! timeout 300 npm install --prefix "$CACHE" --no-audit --no-fund --silent "@bufbuild/buf@$BUF_VERSION" >&2; then
            skip "npm could not install @bufbuild/buf@$BUF_VERSION (registry unreachable?)"
        fi
    fi
    "$BUF" --version >/dev/null 2>&1 || skip "$BUF does not run on this machine"
fi

echo "buf lint (buf $("$BUF" --version))"
"$BUF" lint || { echo "buf lint: findings above (buf.yaml: STANDARD + COMMENTS)" >&2; exit 1; }

baseline=${PDSERVE_BUF_BASELINE:-$(git log --diff-filter=A --format=%H -- buf.yaml 2>/dev/null | tail -n 1)}
if [ -z "$baseline" ] || ! git cat-file -e "$baseline^{commit}" 2>/dev/null; then
    skip "baseline commit for buf breaking not found (shallow clone? set PDSERVE_BUF_BASELINE or fetch history)"
fi
against=$(mktemp -d)
trap 'rm -rf "$against"' EXIT
git archive "$baseline" buf.yaml protos | tar -x -C "$against" || { echo "cannot export $baseline" >&2; exit 1; }
echo "buf breaking against $(git rev-parse --short "$baseline")"
"$BUF" breaking --against "$against" || { echo "buf breaking: the API changes above break clients" >&2; exit 1; }
echo "buf: lint and breaking checks passed"
