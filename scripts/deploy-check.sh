#!/usr/bin/env bash
# Checks what deploy/ ships, offline and in seconds: every Kubernetes
# overlay renders with kustomize and validates against the Kubernetes
# schemas (kubernetes-validate, strict), the Prometheus rules load and their
# unit tests pass (promtool), the dashboard is JSON, and systemd accepts the
# unit. Installs promtool (Debian's prometheus package) and
# kubernetes-validate (PyPI) when missing; kubectl comes with the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Kubernetes version the manifests are checked against.
kubernetes_version="${SWITCHYARD_KUBERNETES_VERSION:-1.32.0}"

if ! command -v promtool >/dev/null; then
    echo "deploy-check: installing promtool (Debian package prometheus)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
if ! command -v kubernetes-validate >/dev/null; then
    echo "deploy-check: installing kubernetes-validate"
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
    hash -r
fi
command -v kubectl >/dev/null || { echo "deploy-check: kubectl (with kustomize) is missing" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== kubernetes (kustomize, kubernetes-validate --strict, Kubernetes $kubernetes_version)"
for overlay in deploy/kubernetes/overlays/*/; do
    name="$(basename "$overlay")"
    kubectl kustomize "$overlay" >"$work/$name.yaml"
    # The ServiceMonitor is a CRD whose schema is not vendored here: its
    # lack of a schema is the one warning accepted.
    if ! kubernetes-validate -k "$kubernetes_version" --strict --quiet "$work/$name.yaml" >"$work/$name.out" 2>&1; then
        cat "$work/$name.out" >&2
        exit 1
    fi
    if grep -v "Couldn't find schema for kind ServiceMonitor" "$work/$name.out" | grep -q .; then
        cat "$work/$name.out" >&2
        exit 1
    fi
    echo "$name: $(grep -c '^kind:' "$work/$name.yaml") objects valid (ServiceMonitor: no schema, not checked)"
done

echo "== prometheus"
promtool check rules deploy/prometheus/switchyard-alerts.yml
promtool test rules deploy/prometheus/switchyard-alerts.test.yml

echo "== grafana"
python3 -m json.tool deploy/grafana/switchyard.json >/dev/null
echo "deploy/grafana/switchyard.json: valid JSON"

echo "== systemd"
# verify needs the executables to exist: the ones built here stand in.
binary="${SWITCHYARD_BIN:-$PWD/target/debug/switchyard}"
[ -x "$binary" ] || cargo build --quiet -p switchyard --bin switchyard
sed "s|/usr/local/bin/switchyard|$binary|g" deploy/systemd/switchyard.service >"$work/switchyard.service"
# Any remark (an unknown key, a bad value) fails the check, not only errors.
if ! systemd-analyze verify "$work/switchyard.service" >"$work/systemd.out" 2>&1 || [ -s "$work/systemd.out" ]; then
    cat "$work/systemd.out" >&2
    exit 1
fi
echo "deploy/systemd/switchyard.service: accepted"
