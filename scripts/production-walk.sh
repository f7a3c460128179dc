#!/usr/bin/env bash
# The README's "Production in eleven lines", run as written, in a scratch
# copy of deploy/ (the other paths are links to this tree), so that the
# lines and what they name cannot drift apart:
#
#   - `scripts/image.sh build` builds the image (from PATH with --binary,
#     as CI does from its one build; tagged IMAGE when set), unless
#     --image names one built already;
#   - the `$EDITOR` line is the one edit the walk makes for the user: the
#     overlay's database becomes a fresh database on the loopback
#     PostgreSQL, its NATS target the loopback nats-server (no login there,
#     so no creds file), its plugin registry the loopback registry (whose
#     CA the user's registry would not need), ./secrets/ gets a file for
#     every name the overlay reads under /run/secrets/switchyard/ and
#     ./registry/ a .dockerconfigjson for the loopback registry;
#   - `plugin push` pushes to the loopback registry, trusting its CA;
#   - `validate` and `migrate` run in the image as written;
#   - the kubectl lines run offline: `create` with --dry-run=client, `apply
#     -k` as `kubectl kustomize`; port-forward needs a cluster and is
#     skipped.
#
# Then it checks what only a cluster would show: the image tag is the one
# the manifests run and the version in host/Cargo.toml; the Secrets have
# every file the overlay names, under the names and mounts the Deployment
# uses; every plugin comes from the registry, none from a pod's files.
#
#   scripts/production-walk.sh [--binary PATH | --image NAME]
#
# Needs the loopback services (`eval "$(scripts/services.sh start)"`, the
# registry included), the example plugins built, podman and kubectl.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
binary=""
ready=""
case "${1:-}" in
--binary) binary="$(realpath "$2")" ;;
--image) ready="$2" ;;
"") ;;
*) echo "usage: scripts/production-walk.sh [--binary PATH | --image NAME]" >&2; exit 2 ;;
esac
: "${DATABASE_URL:?DATABASE_URL is not set: run eval \"\$(scripts/services.sh start)\"}"
: "${SWITCHYARD_NATS_URL:?SWITCHYARD_NATS_URL is not set: run eval \"\$(scripts/services.sh start)\"}"
: "${SWITCHYARD_REGISTRY:?SWITCHYARD_REGISTRY is not set: run eval \"\$(scripts/services.sh start)\"}"
: "${SWITCHYARD_REGISTRY_DIR:?SWITCHYARD_REGISTRY_DIR is not set: run eval \"\$(scripts/services.sh start)\"}"
: "${SWITCHYARD_TLS_DIR:?SWITCHYARD_TLS_DIR is not set: run eval \"\$(scripts/services.sh start)\"}"

work="$(mktemp -d)"
database="sy_walk_$$"
cleanup() {
    psql "$DATABASE_URL" -qAt -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

# The block under the heading, without its fences.
awk '/^## Production in eleven lines/ { on = 1; next }
     on && /^```sh/ { inside = 1; next }
     inside && /^```/ { exit }
     inside { print }' README.md >"$work/lines"
[ -s "$work/lines" ] || { echo "walk: no \"Production in eleven lines\" block in README.md" >&2; exit 1; }

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' host/Cargo.toml | sed -n 1p)"
readme_tag="$({ grep -oE '(^| )switchyard:[0-9A-Za-z][0-9A-Za-z._-]*' "$work/lines" || true; } | tr -d " " | sort -u)"
manifest_tag="$(kubectl kustomize deploy/kubernetes/overlays/claim | sed -n 's/^ *image: //p' | sort -u)"
faults=()
[ "$readme_tag" = "switchyard:$version" ] ||
    faults+=("the README runs image ${readme_tag//$'\n'/ and }, not switchyard:$version (host/Cargo.toml)")
[ "$manifest_tag" = "switchyard:$version" ] ||
    faults+=("the manifests run image $manifest_tag, not switchyard:$version (host/Cargo.toml)")
image="${ready:-${IMAGE:-switchyard:$version}}"

for part in scripts plugins host examples; do ln -s "$repo/$part" "$work/$part"; done
cp -r deploy "$work/deploy"
mkdir "$work/secrets" "$work/registry"
# What the user's registry gives: a .dockerconfigjson (and here, the test CA).
python3 - "$work/registry" "$SWITCHYARD_REGISTRY" "$SWITCHYARD_REGISTRY_DIR/password" <<'PY'
import base64, json, sys
out, host, password = sys.argv[1], sys.argv[2], open(sys.argv[3]).read().strip()
auth = base64.b64encode(f"switchyard:{password}".encode()).decode()
json.dump({"auths": {host: {"auth": auth}}}, open(f"{out}/.dockerconfigjson", "w"))
PY
cp "$SWITCHYARD_TLS_DIR/ca.pem" "$work/registry/ca.pem"
psql "$DATABASE_URL" -qAt -c "CREATE DATABASE $database" >/dev/null
database_url="$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p._replace(path="/" + sys.argv[2]).geturl())' "$DATABASE_URL" "$database")"

# The user's edit: what the walk runs for the `$EDITOR FILE` line.
cat >"$work/edit.py" <<'PY'
import re, sys
path, database_url, nats_url, secrets, registry = sys.argv[1:6]
text = open(path).read()
# What the overlay names, before the edit: the checks read this.
open(f"{secrets}/../edited.toml", "w").write(text)
for name in sorted(set(re.findall(r'"/run/secrets/switchyard/([^"]+)"', text))):
    with open(f"{secrets}/{name}", "w") as f:
        f.write("walk\n")
text = re.sub(r'(?m)^url = "postgres://[^"]*"', f'url = "{database_url}"', text)
text = re.sub(r'(?m)^url = "nats://[^"]*"', f'url = "{nats_url}"', text)
text = re.sub(r'(?m)^credentials_file = .*\n', "", text)
text = text.replace("oci://registry.example.internal/", f"oci://{registry}/")
text = re.sub(r'(?m)^(docker_config = .*)$', r'\1\nca_file = "/run/secrets/registry/ca.pem"', text)
open(path, "w").write(text)
PY

# The lines as the walk runs them: the same commands, made to run here.
{
    echo 'set -euxo pipefail'
    while IFS= read -r line; do
        case "$line" in
        "scripts/image.sh build"*)
            if [ -n "$ready" ]; then echo ": built already: $ready"; continue; fi
            if [ -n "$binary" ]; then line="${line/scripts\/image.sh build/scripts/image.sh build --binary $binary}"; fi
            echo "IMAGE=$image $line" ;;
        '$EDITOR '*)
            file="$(awk '{ print $2 }' <<<"$line")"
            echo "python3 edit.py $file '$database_url' '$SWITCHYARD_NATS_URL' secrets '$SWITCHYARD_REGISTRY'" ;;
        *" plugin push "*)
            line="${line//registry.example.internal/$SWITCHYARD_REGISTRY}"
            echo "${line//switchyard:$version/$image} --registry-ca-file /run/secrets/registry/ca.pem" ;;
        "kubectl create "*)
            # `create secret generic NAME`, `create configmap NAME`
            name="$(awk '{ print ($3 == "secret" ? $5 : $4) }' <<<"$line")"
            echo "${line%%#*} --dry-run=client -o yaml >$name.yaml" ;;
        "kubectl apply -k "*)
            echo "kubectl kustomize $(awk '{ print $4 }' <<<"$line") >rendered.yaml" ;;
        "kubectl port-forward"*)
            echo ": skipped, needs a cluster: '$line'" ;;
        *) echo "${line//switchyard:$version/$image}" ;;
        esac
    done <"$work/lines"
} >"$work/walk.sh"
echo "== the README's production lines, as run here"
(cd "$work" && bash walk.sh)

python3 - "$work" "${faults[@]}" <<'PY'
import re, sys, yaml
work, faults = sys.argv[1], sys.argv[2:]
def load(name):
    return [d for d in yaml.safe_load_all(open(f"{work}/{name}")) if d]
secrets = {name: load(f"{name}.yaml")[0] for name in ("switchyard-secrets", "switchyard-registry")}
rendered = load("rendered.yaml")
deployment, = [d for d in rendered if d["kind"] == "Deployment"]
pod = deployment["spec"]["template"]["spec"]
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = {m["mountPath"]: volumes[m["name"]] for c in pod["containers"] for m in c.get("volumeMounts", [])}
generated = {d["metadata"]["name"] for d in rendered if d["kind"] == "ConfigMap"}
config_volume = mounts.get("/etc/switchyard", {}).get("configMap", {}).get("name", "")
toml_text = open(f"{work}/edited.toml").read()
def keys(obj):
    return set((obj.get("data") or {})) | set((obj.get("binaryData") or {}))
for mount, name in (("/run/secrets/switchyard", "switchyard-secrets"), ("/run/secrets/registry", "switchyard-registry")):
    volume = mounts.get(mount)
    created = secrets[name]
    if not volume or "secret" not in volume:
        faults.append(f"the Deployment mounts no secret at {mount}")
        continue
    if volume["secret"].get("secretName") != name:
        faults.append(f"the Deployment mounts secret {volume['secret'].get('secretName')} at {mount}; the README creates {name}")
    for file in sorted(set(re.findall(re.escape(mount) + r'/([^"]+)"', toml_text))):
        if file not in keys(created):
            faults.append(f"switchyard.toml reads {mount}/{file}; the README's secret {name} has no {file} (it has {sorted(keys(created))})")
if secrets["switchyard-registry"].get("type") != "kubernetes.io/dockerconfigjson":
    faults.append("the README's registry secret is not of type kubernetes.io/dockerconfigjson")
local = [p for p in re.findall(r'(?m)^path = "([^"]+)"', toml_text) if not p.startswith("oci://")]
if local:
    faults.append(f"switchyard.toml loads plugins from files no pod has: {local}")
if "/plugins" in mounts:
    faults.append("the Deployment still mounts /plugins")
if not config_volume.startswith("switchyard-config") or not generated:
    faults.append("the overlay's switchyard.toml does not reach /etc/switchyard")
for fault in faults:
    print(f"walk: {fault}", file=sys.stderr)
if faults:
    sys.exit(1)
print(f"walk: ok (secrets {sorted(keys(secrets['switchyard-secrets']))}, registry {sorted(keys(secrets['switchyard-registry']))}, plugins from the registry)")
PY
