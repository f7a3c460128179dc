#!/usr/bin/env bash
# Checks what deploy/ ships, offline and in seconds: every Kubernetes
# overlay renders with kustomize, alone and with the ServiceMonitor
# component, and validates against the Kubernetes schemas
# (kubernetes-validate, strict) and the Prometheus Operator's CRDs; its
# selectors, probes and grace are checked (scripts/k8s-check.py); the
# Prometheus rules load and their unit tests pass (promtool), the dashboard
# is JSON, and systemd accepts the unit. Installs promtool (Debian's
# prometheus package), kubernetes-validate (PyPI) and the CRD validators
# (npm) when missing; kubectl comes with the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Kubernetes version the manifests are checked against.
kubernetes_version="${SWITCHYARD_KUBERNETES_VERSION:-1.32.0}"

if ! command -v promtool >/dev/null; then
    echo "deploy-check: installing promtool (Debian package prometheus)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# kubernetes-validate (PyPI) in a virtual environment of its own: Debian's
# Python refuses packages installed beside its own (PEP 668).
tools_dir="${SWITCHYARD_TOOLS_DIR:-$HOME/.local/share/switchyard}"
validate_env="$tools_dir/kubernetes-validate"
if ! command -v kubernetes-validate >/dev/null; then
    if [ ! -x "$validate_env/bin/kubernetes-validate" ]; then
        echo "deploy-check: installing kubernetes-validate into $validate_env"
        if ! python3 -m venv --help >/dev/null 2>&1; then
            if [ "$(id -u)" = 0 ]; then as_root=(); else as_root=(sudo); fi
            "${as_root[@]}" apt-get update -qq
            "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        rm -rf "$validate_env"
        python3 -m venv "$validate_env"
        "$validate_env/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate
    fi
    export PATH="$validate_env/bin:$PATH"
fi
command -v kubectl >/dev/null || { echo "deploy-check: kubectl (with kustomize) is missing" >&2; exit 1; }
# The Prometheus Operator's CRD schemas, generated from its CRDs into
# validators (npm); node comes with the plugin toolchains.
k8s_models="$tools_dir/k8s-models"
prometheus_operator_models=6.0.0
if ! grep -qs "\"version\": \"$prometheus_operator_models\"" \
    "$k8s_models/node_modules/@kubernetes-models/prometheus-operator/package.json"; then
    if ! command -v npm >/dev/null; then
        if [ "$(id -u)" = 0 ]; then as_root=(); else as_root=(sudo); fi
        "${as_root[@]}" apt-get update -qq
        "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    fi
    echo "deploy-check: installing @kubernetes-models/prometheus-operator $prometheus_operator_models"
    mkdir -p "$k8s_models"
    npm install --silent --no-audit --no-fund --prefix "$k8s_models" \
        "@kubernetes-models/prometheus-operator@$prometheus_operator_models" >&2
fi
cp scripts/crd-validate.mjs "$k8s_models/crd-validate.mjs"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== kubernetes (kustomize, kubernetes-validate --strict, Kubernetes $kubernetes_version; CRDs; selectors, probes, grace)"
# Each overlay as shipped, and with the ServiceMonitor component an
# operator's cluster adds: built-in kinds against the Kubernetes schemas,
# custom ones against their CRDs' schemas (scripts/crd-validate.mjs), and
# what no schema says (scripts/k8s-check.py): the budget and the spread
# select the relays, the monitor finds the Service, the grace covers the
# relay's shutdown.
rel="$(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$PWD/deploy/kubernetes" "$work/overlay")"
for overlay in deploy/kubernetes/overlays/*/; do
    name="$(basename "$overlay")"
    kubectl kustomize "$overlay" >"$work/$name.yaml"
    mkdir -p "$work/$name+monitor"
    printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\ncomponents:\n  - %s\n' \
        "$rel/overlays/$name" "$rel/components/servicemonitor" >"$work/$name+monitor/kustomization.yaml"
    kubectl kustomize "$work/$name+monitor" >"$work/$name+monitor.yaml"
    for rendered in "$work/$name.yaml" "$work/$name+monitor.yaml"; do
        # Built-in kinds only: kubernetes-validate has no CRD schemas.
        python3 - "$rendered" >"$rendered.builtin" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
yaml.safe_dump_all([d for d in docs if not d["apiVersion"].split("/")[0].count(".") or d["apiVersion"].split("/")[0].endswith("k8s.io")], sys.stdout)
PY
        if ! kubernetes-validate -k "$kubernetes_version" --strict --quiet "$rendered.builtin" >"$rendered.out" 2>&1 || [ -s "$rendered.out" ]; then
            cat "$rendered.out" >&2
            exit 1
        fi
        python3 scripts/k8s-check.py "$rendered" "$overlay/switchyard.toml"
    done
    python3 - "$work/$name+monitor.yaml" <<'PY' | node "$k8s_models/crd-validate.mjs"
import json, sys, yaml
for d in yaml.safe_load_all(open(sys.argv[1])):
    group = d["apiVersion"].split("/")[0] if d else ""
    if "." in group and not group.endswith("k8s.io"):
        print(json.dumps(d))
PY
    echo "$name: $(grep -c '^kind:' "$work/$name.yaml") objects valid, $(grep -c '^kind:' "$work/$name+monitor.yaml") with the ServiceMonitor component"
done

echo "== prometheus"
promtool check rules deploy/prometheus/switchyard-alerts.yml
promtool test rules deploy/prometheus/switchyard-alerts.test.yml
# Each alert's runbook_url names a section the book's deploy page has (its
# mdBook anchor: the heading lowercased, spaces to dashes, the rest dropped).
python3 - <<'PY'
import re, sys
rules = open("deploy/prometheus/switchyard-alerts.yml").read()
page = open("docs/src/how-to/deploy.md").read()
anchors = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
           for h in re.findall(r"(?m)^#+ (.+)$", page)}
urls = re.findall(r'runbook_url: "([^"]*)"', rules)
bad = [u for u in urls if not re.fullmatch(r"\{\{ \$externalLabels\.runbook_base_url \}\}/how-to/deploy\.html#([a-z0-9-]+)", u)
       or u.rsplit("#", 1)[1] not in anchors]
for u in bad:
    print(f"deploy-check: runbook_url {u} names no section of docs/src/how-to/deploy.md", file=sys.stderr)
if bad or not urls:
    sys.exit(1)
print(f"runbooks: {len(urls)} alerts, each linked to a section of the deploy page")
PY

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
