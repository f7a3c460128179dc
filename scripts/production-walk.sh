#!/usr/bin/env bash
# The README's production lines (the ```sh block under "## Production in
# ... lines"), run in a scratch copy of deploy/ (the other paths are links
# to this tree) against the loopback services, so that the lines and what
# they name cannot drift apart. Every line runs as written, in one shell,
# except:
#
#   - the `$EDITOR` line, the one edit the walk makes for the user: the
#     copy's switchyard.toml gets a fresh database on the loopback
#     PostgreSQL (fleet: a catalog listing two, on the TLS one), the
#     loopback nats-server or tansu as its target (no login there), the
#     loopback registry (and its CA) for its plugin, and `registry` names
#     that registry. ./secrets/ holds a file for every name the overlay
#     reads under /run/secrets/switchyard/, ./registry/ a .dockerconfigjson
#     with the registry's login, all of them mode 0600 as a user makes them;
#   - the lines that need a cluster: `kubectl create` runs with
#     --dry-run=client (the Secret as YAML), `kubectl apply -k` as `kubectl
#     kustomize`, `rollout status` and `port-forward` are skipped.
#
# What makes the rest run here as written is the environment, as a user's
# machine trusts their registry: podman trusts the registry's test CA
# (SSL_CERT_FILE, a bundle with it) and its containers get
# SWITCHYARD_REGISTRY_CA_FILE (CONTAINERS_CONF); `scripts/image.sh build`
# takes the binary given with --binary (SWITCHYARD_IMAGE_BINARY).
#
# The claim overlay runs every line. Replication and fleet then run the
# lines that differ for them (the image and the plugin are pushed already):
# the `cp` of their overlay (the alternative its comment names), the edit,
# `images:`, migrate and validate on a database set up for their mode
# (replication: a slot, wal_level=logical; fleet: a catalog on the TLS
# server), the Secrets and the rendering.
#
# Then it checks what only a cluster would show: the image is in the
# registry (its manifest's config is the image built), the rendered pods
# run it from there, with the README's registry Secret as imagePullSecrets
# and a login for that registry in it, under the tag in host/Cargo.toml;
# the Secrets have every file the overlay names, under the names and
# mounts the Deployment uses, readable by the pod's user; every plugin
# comes from the registry, none from a pod's files.
#
#   scripts/production-walk.sh [--binary PATH | --image NAME]
#
# --binary assembles the image from a relay built already (CI's one
# build); --image takes an image built already (the build line is then
# skipped). Either way the lines find it as switchyard:VERSION, the name
# they use; afterwards it is left under IMAGE when that is set (CI:
# switchyard:test, what tests/container.rs runs), a test build never keeps
# the release tag, and an image that had that tag before gets it back.
#
# Needs the loopback services (`eval "$(scripts/services.sh start)"`, the
# registry included), the example plugins built, podman, kubectl and curl.
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
for name in DATABASE_URL SWITCHYARD_PG_TLS_URL SWITCHYARD_NATS_URL SWITCHYARD_KAFKA_BOOTSTRAP \
    SWITCHYARD_REGISTRY SWITCHYARD_REGISTRY_DIR SWITCHYARD_TLS_DIR; do
    [ -n "${!name:-}" ] || { echo "walk: $name is not set: run eval \"\$(scripts/services.sh start)\"" >&2; exit 1; }
done
started=$SECONDS
# The engine and its settings first: the walk's CONTAINERS_CONF below is a
# copy of the system's containers.conf, which a fresh machine only has once
# podman is installed (a copy made before lacked `default_ulimits = []`
# and runc, and every container failed to set its rlimits).
scripts/image.sh tools

work="$(mktemp -d)"
id="sy_walk_$$"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' host/Cargo.toml | sed -n 1p)"
release="switchyard:$version"
# An image that has the release tag before the walk: kept under a second
# name too, so that image.sh does not remove it when the walk's build
# takes the tag, and given the tag back at the end.
before_id="$(podman image inspect "$release" --format '{{.Id}}' 2>/dev/null || true)"
if [ -n "$before_id" ] && [ "$ready" != "$release" ]; then podman tag "$before_id" "switchyard:walk-saved-$$"; fi
cleanup() {
    for server in "$DATABASE_URL" "$SWITCHYARD_PG_TLS_URL"; do
        psql "$server" -qAt -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database LIKE '${id}\_%'" >/dev/null 2>&1 || true
        psql "$server" -qAt -c "SELECT 'DROP DATABASE IF EXISTS ' || quote_ident(datname) || ' WITH (FORCE);' FROM pg_database WHERE datname LIKE '${id}\_%'" 2>/dev/null |
            psql "$server" -q >/dev/null 2>&1 || true
    done
    if [ "$ready" != "$release" ]; then
        local built old
        built="$(podman image inspect "$release" --format '{{.Id}}' 2>/dev/null || true)"
        if [ -n "$built" ] && [ "$built" != "$before_id" ] && [ -n "${IMAGE:-}" ] && [ "$IMAGE" != "$release" ]; then
            # What image.sh does for a tag it moves: the image it named
            # before goes, unless a container or another tag holds it.
            old="$(podman image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)"
            podman tag "$built" "$IMAGE"
            if [ -n "$old" ] && [ "$old" != "$built" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
        fi
        if [ -n "$before_id" ]; then
            podman tag "$before_id" "$release"
            podman untag "$before_id" "switchyard:walk-saved-$$" 2>/dev/null || true
        elif [ -n "$built" ] && [ -n "$binary$ready" ]; then
            # A test build never passes for the release.
            podman rmi "$release" >/dev/null 2>&1 || true
        fi
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# The block under the heading, without its fences; its heading counts it.
heading="$(grep -m1 -E '^## Production in [a-z-]+ lines$' README.md || true)"
[ -n "$heading" ] || { echo "walk: no \"## Production in ... lines\" heading in README.md" >&2; exit 1; }
awk -v heading="$heading" '$0 == heading { on = 1; next }
     on && /^```sh/ { inside = 1; next }
     inside && /^```/ { exit }
     inside { print }' README.md >"$work/lines"
mapfile -t lines <"$work/lines"
total=${#lines[@]}
faults=()
words=(zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen
    sixteen seventeen eighteen nineteen twenty)
said="$(sed -E 's/^## Production in ([a-z-]+) lines$/\1/' <<<"$heading")"
[ "$said" = "${words[$total]:-$total}" ] ||
    faults+=("the heading says \"$said lines\"; the block has $total")
readme_tag="$({ grep -oE '(^| )switchyard:[0-9A-Za-z][0-9A-Za-z._-]*' "$work/lines" || true; } | tr -d " " | sort -u)"
base_tag="$(sed -n 's/^ *image: //p' deploy/kubernetes/base/deployment.yaml | sort -u)"
[ "$readme_tag" = "$release" ] ||
    faults+=("the README runs image ${readme_tag//$'\n'/ and }, not $release (host/Cargo.toml)")
[ "$base_tag" = "$release" ] ||
    faults+=("the base Deployment runs image $base_tag, not $release (host/Cargo.toml)")
if [ ${#faults[@]} -gt 0 ]; then printf 'walk: %s\n' "${faults[@]}" >&2; exit 1; fi

# What the machine has: trust in the registry's CA (the user's registry
# has a CA their machine trusts), for podman and for its containers.
mkdir "$work/trust"
cat "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$SWITCHYARD_TLS_DIR/ca.pem" >"$work/trust/ca-bundle.pem"
python3 - "$work/trust/containers.conf" <<'PY'
# CONTAINERS_CONF replaces the system's containers.conf: this is a copy of
# it (the runtime it names), with one variable more for every container.
import os, re, sys
path = "/etc/containers/containers.conf"
text = open(path).read() if os.path.exists(path) else ""
env = ('env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm", '
       '"SWITCHYARD_REGISTRY_CA_FILE=/run/secrets/registry/ca.pem"]\n')
if re.search(r"(?m)^\[containers\]\s*$", text):
    text = re.sub(r"(?m)^\[containers\]\s*$\n?", "[containers]\n" + env, text, count=1)
else:
    text = "[containers]\n" + env + text
open(sys.argv[1], "w").write(text)
PY
password="$(cat "$SWITCHYARD_REGISTRY_DIR/password")"
if [ -n "$ready" ] && [ "$ready" != "$release" ]; then podman tag "$ready" "$release"; fi

url_for() { # server-url database: the server's URL naming another database
    python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p._replace(path="/" + sys.argv[2]).geturl())' "$1" "$2"
}

# The user's edit: what the walk runs for the `$EDITOR FILE` line.
cat >"$work/edit.py" <<'PY'
import json, re, sys
path, settings = sys.argv[1], json.loads(sys.argv[2])
text = open(path).read()
def sub(pattern, replacement, count=1):
    global text
    text, n = re.subn(pattern, replacement, text, count=count, flags=re.M)
    if n == 0:
        sys.exit(f"edit: nothing in {path} matches {pattern!r}")
said = []
if "database" in settings:
    sub(r'^url = "postgres://[^"]*"', f'url = "{settings["database"]}"')
    said.append(f"database {settings['database']}")
if "slot" in settings:
    sub(r'^slot = "[^"]*"', f'slot = "{settings["slot"]}"')
    said.append(f"slot {settings['slot']}")
if "catalog" in settings:
    sub(r'^url = "postgres://[^"]*"', f'url = "{settings["catalog"]}"')
    sub(r'^(\[catalog\.tls\]\n(?:.*\n)*?mode = .*)$', r'\1' + f'\nroot_cert = "{settings["catalog_ca"]}"')
    said.append(f"catalog {settings['catalog']} (CA {settings['catalog_ca']})")
if "nats" in settings:
    sub(r'^url = "nats://[^"]*"', f'url = "{settings["nats"]}"')
    sub(r'^credentials_file = .*\n', "")
    said.append(f"NATS {settings['nats']}, no login")
if "kafka" in settings:
    sub(r'^bootstrap_servers = "[^"]*"', f'bootstrap_servers = "{settings["kafka"]}"')
    sub(r'^password = \{ file = "/run/secrets/switchyard/kafka-password" \}\n', "")
    sub(r'^"(security\.protocol|sasl\.[a-z]+)" = .*\n', "", count=0)
    said.append(f"Kafka {settings['kafka']}, plaintext")
sub(r'oci://registry\.example\.internal/switchyard/', f'oci://{settings["registry"]}/', count=0)
sub(r'^(docker_config = .*)$', r'\1' + f'\nca_file = "{settings["registry_ca"]}"', count=0)
said.append(f"plugin from oci://{settings['registry']}/ (CA {settings['registry_ca']})")
open(path, "w").write(text)
print("; ".join(said))
PY

# The user's files before the lines: ./secrets/ (every name the overlay
# reads, and the CA of the fleet's databases), ./registry/ (the login and
# the CA), private as a user keeps them.
prepare() { # dir overlay
    local dir="$1" overlay="$2" name
    mkdir -p "$dir"
    for part in scripts plugins host examples; do ln -s "$repo/$part" "$dir/$part"; done
    cp -r deploy "$dir/deploy"
    mkdir -m 700 "$dir/secrets" "$dir/registry"
    for name in $(grep -oE '"/run/secrets/switchyard/[^"]+"' "deploy/kubernetes/overlays/$overlay/switchyard.toml" | tr -d '"' | sed 's|.*/||' | sort -u); do
        echo walk >"$dir/secrets/$name"
    done
    [ "$overlay" != fleet ] || cp "$SWITCHYARD_TLS_DIR/ca.pem" "$dir/secrets/postgres-ca.pem"
    python3 - "$dir/registry/.dockerconfigjson" "$SWITCHYARD_REGISTRY" "$password" <<'PY'
import base64, json, sys
out, host, password = sys.argv[1:4]
auth = base64.b64encode(f"switchyard:{password}".encode()).decode()
json.dump({"auths": {host: {"auth": auth}}}, open(out, "w"))
PY
    cp "$SWITCHYARD_TLS_DIR/ca.pem" "$dir/registry/ca.pem"
    chmod 600 "$dir"/secrets/* "$dir"/registry/.dockerconfigjson "$dir"/registry/ca.pem
}

# Each overlay's databases, as its mode needs them, and the edit's settings.
settings_for() { # overlay
    local registry="$SWITCHYARD_REGISTRY/switchyard" base="{\"registry_ca\": \"/run/secrets/registry/ca.pem\""
    case "$1" in
    claim)
        psql "$DATABASE_URL" -qAt -c "CREATE DATABASE ${id}_claim" >/dev/null
        echo "$base, \"registry\": \"$registry\", \"database\": \"$(url_for "$DATABASE_URL" "${id}_claim")\", \"nats\": \"$SWITCHYARD_NATS_URL\"}" ;;
    replication)
        # The loopback server runs wal_level=logical; migrate makes the
        # slot (named after the database: slots are per server) and the
        # publication.
        psql "$DATABASE_URL" -qAt -c "CREATE DATABASE ${id}_replication" >/dev/null
        echo "$base, \"registry\": \"$registry\", \"database\": \"$(url_for "$DATABASE_URL" "${id}_replication")\", \"slot\": \"${id}_replication\", \"kafka\": \"$SWITCHYARD_KAFKA_BOOTSTRAP\"}" ;;
    fleet)
        # A catalog on the TLS server (the overlay asks for verify-full)
        # listing two databases there (and one retired), which migrate and
        # validate go through; the listed URLs take the catalog's TLS.
        local tls="$SWITCHYARD_PG_TLS_URL" server
        server="$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(f"{p.scheme}://{p.netloc}")' "$tls")"
        for database in "${id}_fleet" "${id}_tenant_a" "${id}_tenant_b"; do
            psql "$tls" -qAt -c "CREATE DATABASE $database" >/dev/null
        done
        psql "$(url_for "$tls" "${id}_fleet")" -qAt >/dev/null <<SQL
CREATE TABLE tenants (name text PRIMARY KEY, url text NOT NULL, active boolean NOT NULL);
INSERT INTO tenants VALUES
    ('tenant-a', '$server/${id}_tenant_a', true),
    ('tenant-b', '$server/${id}_tenant_b', true),
    ('retired', '$server/${id}_retired', false);
SQL
        echo "$base, \"registry\": \"$registry\", \"catalog\": \"$server/${id}_fleet?sslmode=verify-full\", \"catalog_ca\": \"/run/secrets/switchyard/postgres-ca.pem\", \"nats\": \"$SWITCHYARD_NATS_URL\"}" ;;
    esac
}

# One README line: what it is, what ran, what it printed, how it ended.
# Runs in the walk's shell, so what a line sets (registry, sy) the next
# ones see.
step() { # number line how command
    local number="$1" line="$2" how="$3" command="$4" out="$work/out" rc t0
    printf '[%2d/%d] %s\n' "$number" "$total" "$line"
    case "$how" in
    written) echo "        ran: as written"; written=$((written + 1)) ;;
    skip:*) echo "        ran: nothing (${how#skip:})"; echo "        => skipped"; skipped=$((skipped + 1)); return 0 ;;
    *) echo "        ran instead (${how}): $command"; instead=$((instead + 1)) ;;
    esac
    t0=$(date +%s%N)
    # As a user's shell runs it: no -e, no -u.
    set +eu
    eval "$command" >"$out" 2>&1 </dev/null
    rc=$?
    set -eu
    sed 's/^/        | /' "$out"
    if [ "$rc" != 0 ]; then
        printf '        => failed (exit %s)\n' "$rc"
        return "$rc"
    fi
    printf '        => ok (%s s)\n' "$(awk -v n="$(( $(date +%s%N) - t0 ))" 'BEGIN { printf "%.1f", n / 1e9 }')"
}

walk() { # overlay
    local overlay="$1" dir="$work/$1" settings n=0 line how command name
    written=0 instead=0 skipped=0
    prepare "$dir" "$overlay"
    settings="$(settings_for "$overlay")"
    echo "== the README's lines, $overlay overlay (in $dir)"
    cd "$dir"
    for line in "${lines[@]}"; do
        n=$((n + 1))
        how=written
        command="$line"
        case "$line" in
        'scripts/image.sh build'*)
            if [ "$overlay" != claim ]; then how="skip:built for the claim overlay"
            elif [ -n "$ready" ]; then how="skip:$ready, tagged $release"; fi ;;
        'cp -r deploy/kubernetes/overlays/claim '*)
            if [ "$overlay" != claim ]; then
                how="the alternative its comment names"
                command="${line/overlays\/claim /overlays\/$overlay }"
            fi ;;
        '$EDITOR '*)
            how="the user's edit"
            command="python3 ../edit.py $(awk '{ print $2 }' <<<"$line") '$settings' && registry=$SWITCHYARD_REGISTRY/switchyard" ;;
        'podman push '* | *' plugin push '*)
            if [ "$overlay" != claim ]; then how="skip:pushed for the claim overlay"; fi ;;
        'kubectl create '*)
            # `create secret generic NAME`, `create configmap NAME`
            name="$(awk '{ print ($3 == "secret" ? $5 : $4) }' <<<"$line")"
            how="no cluster"
            command="${line%%#*}"
            command="${command%"${command##*[![:space:]]}"} --dry-run=client -o yaml >$name.yaml" ;;
        'kubectl apply -k '*)
            how="no cluster"
            command="kubectl kustomize $(awk '{ print $4 }' <<<"$line") >rendered.yaml" ;;
        'kubectl rollout status '* | 'kubectl port-forward '*)
            how="skip:needs a cluster" ;;
        kubectl*)
            echo "walk: no offline form for the README's line: $line" >&2
            return 1 ;;
        esac
        step "$n" "$line" "$how" "$command"
    done
    echo "walk: $overlay: $written of $total lines as written, $instead in another form, $skipped skipped"
    check "$overlay" "$dir"
}

check() { # overlay dir
    python3 - "$1" "$2" "$repo/deploy/kubernetes/overlays/$1/switchyard.toml" "$SWITCHYARD_REGISTRY/switchyard/switchyard:$version" <<'PY'
import os, re, stat, sys, base64, json, yaml
overlay, work, shipped, image = sys.argv[1:5]
faults = []
def load(name):
    return [d for d in yaml.safe_load_all(open(f"{work}/{name}")) if d]
secrets = {name: load(f"{name}.yaml")[0] for name in ("switchyard-secrets", "switchyard-registry")}
rendered = load("rendered.yaml")
deployment, = [d for d in rendered if d["kind"] == "Deployment"]
pod = deployment["spec"]["template"]["spec"]
volumes = {v["name"]: v for v in pod["volumes"]}
containers = pod["containers"]
mounts = {m["mountPath"]: volumes[m["name"]] for c in containers for m in c.get("volumeMounts", [])}
generated = {d["metadata"]["name"] for d in rendered if d["kind"] == "ConfigMap"}
config_volume = mounts.get("/etc/switchyard", {}).get("configMap", {}).get("name", "")
toml_text = open(shipped).read()
def keys(obj):
    return set((obj.get("data") or {})) | set((obj.get("binaryData") or {}))

# The image: from the registry the lines pushed to, pulled with the
# README's registry Secret, which holds a login for that registry.
for c in containers:
    if c["image"] != image:
        faults.append(f"container {c['name']} runs {c['image']}, not {image} (pushed by the README)")
pulls = [s["name"] for s in pod.get("imagePullSecrets", [])]
if "switchyard-registry" not in pulls:
    faults.append(f"the pods pull the image with {pulls or 'no Secret'}, not switchyard-registry")
registry_secret = secrets["switchyard-registry"]
if registry_secret.get("type") != "kubernetes.io/dockerconfigjson":
    faults.append("the README's registry secret is not of type kubernetes.io/dockerconfigjson")
else:
    auths = json.loads(base64.b64decode(registry_secret["data"][".dockerconfigjson"]))["auths"]
    if image.split("/")[0] not in auths:
        faults.append(f"the registry Secret has no login for {image.split('/')[0]} (it has {sorted(auths)})")

# The Secrets: every file the overlay names, mounted where it reads them,
# readable by the pod's user (made 0600 here, as a user makes them).
security = pod.get("securityContext", {})
user = containers[0].get("securityContext", {}).get("runAsUser", security.get("runAsUser"))
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
    mode = volume["secret"].get("defaultMode", 0o644)
    # Files are root's; with fsGroup, of that group (which the pod's user is in).
    if not (mode & 0o004 or (security.get("fsGroup") is not None and mode & 0o040)):
        faults.append(f"uid {user} cannot read {mount}: mode {mode:o}, fsGroup {security.get('fsGroup')}")
modes = sorted({oct(stat.S_IMODE(os.stat(f"{work}/secrets/{f}").st_mode)) for f in os.listdir(f"{work}/secrets")})
if modes != ["0o600"]:
    faults.append(f"the walk's secret files have modes {modes}, not 0600")

local = [p for p in re.findall(r'(?m)^path = "([^"]+)"', toml_text) if not p.startswith("oci://")]
if local:
    faults.append(f"switchyard.toml loads plugins from files no pod has: {local}")
if "/plugins" in mounts:
    faults.append("the Deployment still mounts /plugins")
if not config_volume.startswith("switchyard-config") or not generated:
    faults.append("the overlay's switchyard.toml does not reach /etc/switchyard")
for fault in faults:
    print(f"walk: {overlay}: {fault}", file=sys.stderr)
if faults:
    sys.exit(1)
print(f"walk: {overlay} ok: pods run {image} with imagePullSecrets switchyard-registry; "
      f"secrets {sorted(keys(secrets['switchyard-secrets']))} (0600 here, mode {mode:o} + fsGroup {security.get('fsGroup')} for uid {user}), "
      f"registry {sorted(keys(registry_secret))}; plugins from the registry")
PY
}

# The image the lines pushed is in the registry: its manifest's config is
# the image built (an image's ID is its config's digest).
pushed() {
    local manifest config built
    manifest="$(curl -sf --cacert "$SWITCHYARD_TLS_DIR/ca.pem" -u "switchyard:$password" \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json' \
        "https://$SWITCHYARD_REGISTRY/v2/switchyard/switchyard/manifests/$version")" ||
        { echo "walk: the registry has no switchyard/switchyard:$version" >&2; return 1; }
    config="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["config"]["digest"])' "$manifest")"
    built="sha256:$(podman image inspect "$release" --format '{{.Id}}')"
    [ "$config" = "$built" ] ||
        { echo "walk: $SWITCHYARD_REGISTRY/switchyard/switchyard:$version is image $config; the walk built $built" >&2; return 1; }
    echo "walk: $SWITCHYARD_REGISTRY/switchyard/switchyard:$version is in the registry: the image the lines ran ($built)"
}

export SSL_CERT_FILE="$work/trust/ca-bundle.pem" CONTAINERS_CONF="$work/trust/containers.conf"
unset EDITOR
[ -z "$binary" ] || export SWITCHYARD_IMAGE_BINARY="$binary"
echo "== environment: SSL_CERT_FILE (system CAs + the registry's test CA), CONTAINERS_CONF (+ SWITCHYARD_REGISTRY_CA_FILE)${binary:+, SWITCHYARD_IMAGE_BINARY=$binary}"
failed=()
for overlay in claim replication fleet; do
    # A subshell each: what one overlay's lines set is not the next one's.
    # The others' lines are still walked after one fails (they need the
    # claim walk's pushes).
    set +e
    (
        set -e
        unset IMAGE
        walk "$overlay"
    )
    status=$?
    set -e
    if [ "$status" != 0 ]; then
        failed+=("$overlay")
        [ "$overlay" != claim ] || break
    elif [ "$overlay" = claim ]; then
        pushed || { failed+=(claim); break; }
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "walk: failed: ${failed[*]} ($((SECONDS - started)) s)" >&2
    exit 1
fi
echo "walk: ok, 3 overlays in $((SECONDS - started)) s"
