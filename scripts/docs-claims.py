#!/usr/bin/env python3
"""Checks what the README and the book name against what the code has:

- every config key: each TOML block is read and its keys walked through the
  config's JSON Schema (`switchyard config schema`), and every dotted key
  in inline code (`relay.publish_timeout_ms`, `[database.tls]`) likewise;
- every `SWITCHYARD_*` variable: one a field's `x-env` names (a `<NAME>`
  there stands for any name; any variable may be given as `NAME_FILE`), or
  one the code reads itself (a string literal in host/src);
- every `switchyard_*` name: a metric (the generated metrics page, with the
  suffixes Prometheus adds) or a database object the migrations or the
  code create;
- every `--flag` of a `switchyard ...` command line: one the generated CLI
  page lists;

and that the numbers the book states for them are the code's:

- a default stated beside a config key in prose (`relay.poll_interval_ms`
  (500 ms by default), `relay.concurrency`, default 4, `key` defaults to
  30, `[admin] listen` (default `...`)) or in a TOML block's comment (`x =
  5  # the default`, `# default "keep"`) equals the schema's `default` for
  that key, in the key's unit (`_ms`, `_seconds`, `_bytes`). A bare key
  name is checked when every key of that name has the same default;
- a metric written with a label set (`switchyard_target_paused{database,
  target}`, `{error="..."}`) has those labels in host/src/metrics.rs (or the
  plugins' collector, host/src/plugin/scrape.rs), all of
  them or all but `database` (the metrics page says which carry it);
- a fixed limit the book quotes (LIMITS below: a phrase, and the constant
  in host/src, or the value in a migration, that it quotes) equals the
  constant's value, parsed from the source.

    docs-claims.py BINARY [--tally] [FILE.md ...]

BINARY is a switchyard binary (for its schema). Without files, the README
and every page of docs/src but the generated reference and the lab
notebook (its figures are a dated record). Prints each unknown name or
wrong number with its page and line; exits 1 when there is one.
`--tally` also prints how many numbers each check read, and how many
numbers with a unit the prose holds that none of them reads.
"""
import collections
import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "docs", "src")
GENERATED = {"reference/config-keys.md", "reference/cli.md", "reference/metrics-list.md", "contributing/lab.md"}

args = sys.argv[1:]
tally_wanted = "--tally" in args
args = [a for a in args if a != "--tally"]
binary = args[0]
schema = json.loads(subprocess.run([binary, "config", "schema"], check=True, capture_output=True, text=True).stdout)
defs = schema.get("$defs", {})


def resolve(node):
    while True:
        if "$ref" in node:
            node = defs[node["$ref"].split("/")[-1]]
        elif "anyOf" in node:
            real = [o for o in node["anyOf"] if o.get("type") != "null"]
            if len(real) != 1:
                return node
            node = real[0]
        else:
            return node


def children(node):
    """The schemas a table's keys may take: its properties, the members of
    a map, or (targets, a value-or-table) every form's properties together."""
    node = resolve(node)
    if node.get("type") == "array" and "items" in node:
        return children(node["items"])
    forms = node.get("anyOf") or (node.get("oneOf") if "properties" not in node else None)
    if forms:
        merged, free = {}, False
        for form in forms:
            props, open_ = children(form)
            merged.update(props)
            free = free or open_
        return merged, free
    props = dict(node.get("properties", {}))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra:
        # A map (`targets`, `admin.tokens`): any name, each a member.
        return {"*": extra}, False
    if extra is True or (node.get("type") == "object" and "properties" not in node):
        return props, True
    return props, False


def check_path(keys):
    """The first key of `keys` the schema does not have, or None."""
    node = schema
    for i, key in enumerate(keys):
        props, free = children(node)
        if free:
            return None
        if key in props:
            node = props[key]
        elif "*" in props:
            node = props["*"]
        else:
            return ".".join(keys[: i + 1])
    return None


def walk_toml(table, prefix, problems):
    for key, value in table.items():
        path = prefix + [key]
        unknown = check_path(path)
        if unknown:
            problems.append(unknown)
            continue
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, dict):
                walk_toml(item, path, problems)


# Variables: the schema's x-env, and what host/src reads by name.
variables = set()


def collect_env(node):
    if isinstance(node, dict):
        if "x-env" in node:
            variables.add(node["x-env"])
        for value in node.values():
            collect_env(value)
    elif isinstance(node, list):
        for value in node:
            collect_env(value)


collect_env(schema)
# The relay's own reads, and the variables the scripts and the suite take
# (the contributor's pages name those).
for folder, _, files in [w for d in ("host/src", "tests", "scripts", "bench", ".ci") for w in os.walk(os.path.join(ROOT, d))]:
    for name in files:
        if name.endswith((".rs", ".sh", ".py")) or name == "run":
            text = open(os.path.join(folder, name)).read()
            variables.update(re.findall(r'"(SWITCHYARD_[A-Z0-9_]+)', text))
            variables.update(re.findall(r"\$\{?(SWITCHYARD_[A-Z0-9_]+)", text))
            variables.update(re.findall(r"\b(SWITCHYARD_[A-Z0-9_]+)=", text))
            for prefix in re.findall(r'"(SWITCHYARD_[A-Z0-9_]*_)\{', text):
                variables.add(prefix + "<NAME>")
patterns = [re.compile("^" + re.escape(v).replace(re.escape("<NAME>"), "[A-Z0-9_]+") + "(_FILE)?$") for v in variables]

# switchyard_* names: metrics (with the suffixes the exposition adds) and
# database objects.
metrics_page = open(os.path.join(SRC, "reference", "metrics-list.md")).read()
objects = set(re.findall(r"\bswitchyard_[a-z0-9_]+", metrics_page))
for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
    objects |= {m + suffix for m in list(objects)}
for folder in ("migrations", os.path.join("host", "src"), "examples", "tests"):
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            if name.endswith((".sql", ".rs")):
                objects.update(re.findall(r"\bswitchyard_[a-z0-9_]+", open(os.path.join(base, name)).read()))
cli_page = open(os.path.join(SRC, "reference", "cli.md")).read()
flags = set(re.findall(r"--[a-z][a-z0-9-]*", cli_page)) | {"--help", "--version"}
# Each flag's defaults on the CLI page (a flag several commands take may
# have several).
cli_defaults = {}
for flag, default in re.findall(r"^\| `(--[a-z0-9-]+)`[^|]*\| `([^`]*)` \|", cli_page, re.M):
    cli_defaults.setdefault(flag, set()).add(int(default) if default.isdigit() else default)

# ---------------------------------------------------------------------------
# Numbers: defaults, label sets and fixed limits against the code.

NUM = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10}
# Seconds per time unit, bytes per size unit.
TIME = {"ms": 0.001, "s": 1, "second": 1, "seconds": 1, "min": 60, "minute": 60, "minutes": 60,
        "h": 3600, "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}
SIZE = {"bytes": 1, "byte": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
        "KB": 1000, "MB": 1000**2, "GB": 1000**3}
UNIT = r"(?:ms|seconds?|s|minutes?|min|hours?|h|days?|KiB|MiB|GiB|KB|MB|GB|bytes?|B)\b"


def to_number(text):
    text = text.strip().lower()
    return float(WORDS[text]) if text in WORDS else float(text.replace(",", ""))


def in_base(value, unit):
    """(value in seconds or bytes, 'time' | 'size' | None)."""
    if unit in TIME:
        return value * TIME[unit], "time"
    if unit in SIZE:
        return value * SIZE[unit], "size"
    return value, None


def fmt(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def key_node(keys):
    """The schema's property for a dotted key (unresolved: its `default` is
    beside the `$ref`), or None."""
    node = schema
    for key in keys:
        props, free = children(node)
        if free:
            return None
        node = props.get(key) or props.get("*")
        if node is None:
            return None
    return node


# Every key name, with the properties of that name anywhere in the schema.
leaves = {}


def collect_leaves(node, depth=0):
    if depth > 12:
        return
    props, _ = children(node)
    for name, prop in props.items():
        if name != "*":
            leaves.setdefault(name, []).append(prop)
        collect_leaves(prop, depth + 1)


collect_leaves(schema)
MISSING = object()


def schema_default(key):
    """(default, key's last name), MISSING when the key states none (or is
    ambiguous), None when the key is not one."""
    key = key.strip()
    if key.startswith("--"):
        found = cli_defaults.get(key.split()[0])
        if found is None:
            return None, None
        return (next(iter(found)) if len(found) == 1 else MISSING), key
    if m := re.fullmatch(r"\[\[?([a-z_.]+)\]\]? ([a-z_]+)", key):
        parts = m.group(1).split(".") + [m.group(2)]
    else:
        parts = key.strip("[]").split(".")
    if not all(re.fullmatch(r"[a-z_]+", p) for p in parts):
        return None, None
    if len(parts) > 1:
        if parts[0] not in schema["properties"]:
            return None, None
        node = key_node(parts)
        if node is None:
            return None, None
        return node.get("default", MISSING), parts[-1]
    found = leaves.get(parts[0])
    if not found:
        return None, None
    defaults = {json.dumps(node.get("default")) for node in found}
    if len(defaults) != 1 or "default" not in found[0]:
        return MISSING, parts[0]
    return found[0]["default"], parts[0]


def said_value(text):
    """A value as the book writes it: `code`, "quoted", true/false, or a
    number with a unit. (value, unit) or None."""
    text = text.strip()
    if m := re.fullmatch(r"`([^`]*)`|\"([^\"]*)\"", text):
        return (m.group(1) if m.group(1) is not None else m.group(2)), "text"
    if text in ("true", "false"):
        return text == "true", "bool"
    if m := re.fullmatch(rf"({NUM})\s?({UNIT})?", text):
        return to_number(m.group(1)), m.group(2)
    return None


def same_default(key_name, said, default):
    """Whether what the book says (`said_value`) is the schema's default."""
    value, unit = said
    if unit == "text":
        return isinstance(default, str) and value == default or (
            not isinstance(default, (str, bool)) and value == json.dumps(default))
    if unit == "bool":
        return default is value
    if not isinstance(default, (int, float)) or isinstance(default, bool):
        return False
    base, kind = in_base(value, unit) if unit else (value, None)
    if kind == "time":
        scale = 0.001 if key_name.endswith("_ms") else 60 if key_name.endswith("_minutes") else 1
        return abs(base - default * scale) < 1e-9 * max(1, base)
    if kind == "size":
        return abs(base - default) < 0.5
    return abs(value - default) < 1e-9 * max(1, value)


VALUE = rf"`[^`]+`|\"[^\"]*\"|true|false|{NUM}(?:\s?{UNIT})?"
# A default beside a key in prose; group 1 the key's span, 2 the value.
DEFAULT_PROSE = [
    re.compile(rf"`([^`]+)` \(({VALUE}) by default(?=[);, ])"),
    re.compile(rf"`([^`]+)`,? ({VALUE}) by default(?=[);, ])"),
    re.compile(rf"`([^`]+)`\*{{0,2}} \(default:? ({VALUE})(?=[);, ])"),
    re.compile(rf"`([^`]+)`(?: [a-z]+){{0,3}},? default:? ({VALUE})(?=[);,. ]|$)"),
    re.compile(rf"`([^`]+)` defaults to ({VALUE})"),
    re.compile(rf"`([^`]+)` \(({NUM}(?:\s?{UNIT})?)\)"),
    re.compile(rf"\(`([^`]+)`, ({NUM}(?:\s?{UNIT})?)\)"),
]
TOML_DEFAULT = [
    re.compile(rf"\bdefaults?:? ({VALUE})"),
    re.compile(rf"({VALUE}) is the default(?=$|[;,.)])"),
]
TOML_THE_DEFAULT = re.compile(r"\((?:the )?default\)|\b(?:the|by) default(?=$|[;,.)])")


def check_default(where, line, key, said_text, origin, problems, tally):
    default, name = schema_default(key)
    if default is None and name is None:
        return
    said = said_value(said_text)
    if said is None or default is MISSING or default is None:
        tally["defaults not checkable (no default in the schema, or a name several keys share)"] += 1
        return
    tally[f"defaults ({origin})"] += 1
    if not same_default(name, said, default):
        unit = next((u for suffix, u in (("_ms", " ms"), ("_seconds", " s"), ("_bytes", " bytes")) if name.endswith(suffix)), "")
        problems.append(f"{where}:{line}: default of {key} is {json.dumps(default)}{unit}, not {said_text}")


# Label sets, from host/src/metrics.rs and the plugins' scrape-time
# collector (host/src/plugin/scrape.rs): metric name -> its labels.
def metric_labels():
    text = "".join(
        open(os.path.join(ROOT, "host", "src", *path)).read() for path in (("metrics.rs",), ("plugin", "scrape.rs"))
    )
    consts = dict(re.findall(r'pub const ([A-Z_]+): &str = "(switchyard_[a-z0-9_]+)";', text))
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\n\}", text, re.S):
        structs[name] = set(re.findall(r"^\s*(?:pub(?:\(crate\))? )?([a-z_]+):", body, re.M))
    fields = {}
    families = re.search(r"struct Families \{(.*?)\n\}", text, re.S)
    body = families.group(1) if families else ""
    for field, label in re.findall(r"^\s*([a-z_]+): (?:Family|HistogramFamily)<(\w+|Vec<\(String, String\)>)", body, re.M):
        fields[field] = set() if label.startswith("Vec") else structs.get(label)
    labels = {}
    for const, field in re.findall(r"register\(\s*([A-Z_]+),.*?f\.([a-z_]+)\.clone\(\)", text, re.S):
        if const in consts:
            labels[consts[const]] = fields.get(field)
    # What the collector encodes at scrape time: each descriptor's names
    # (an array of them, or one entry of it) and the label struct it uses.
    arrays = {
        name: [consts[c] for c in re.findall(r"names::([A-Z_]+),", body) if c in consts]
        for name, body in re.findall(r"const ([A-Z_]+): \[\(&str, &str\); \d+\] = \[(.*?)\];", text, re.S)
    }
    collector = re.search(r"impl Collector for \w+ \{(.*?)\n\}\n", text, re.S)
    parts = re.split(r"encode_descriptor\(", collector.group(1) if collector else "")
    for before, after in zip(parts, parts[1:]):
        used = re.search(r"let labels = (\w+) \{", after)
        source = re.findall(r"([A-Z_]+)(?:\[(\d)\])?\s*[;.)]", before)
        source = [(n, i) for n, i in source if n in arrays]
        if not used or not source:
            continue
        name, index = source[-1]
        for metric in arrays[name] if index == "" else [arrays[name][int(index)]]:
            labels[metric] = structs.get(used.group(1))
    return labels


labels_of = metric_labels()


def check_labels(where, line, metric, inside, problems, tally):
    base = metric
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if base.endswith(suffix) and base[: -len(suffix)] in labels_of:
            base = base[: -len(suffix)]
    said = {part.split("=")[0].strip().strip('"') for part in inside.split(",") if part.strip()}
    tally["label sets"] += 1
    have = labels_of.get(base)
    if have is None:
        problems.append(f"{where}:{line}: labels of {metric}: host/src/metrics.rs and plugin/scrape.rs give none for it")
    elif said != have and said != have - {"database"}:
        problems.append(
            f"{where}:{line}: labels of {metric} are {{{','.join(sorted(have))}}}, not {{{','.join(sorted(said))}}}"
        )


# Fixed limits: (the phrase, with the number as group `n` and its unit as
# `u` or fixed after it; where the value is). A location is a Rust file and
# the name of a `const` in it, or a file and a regular expression whose
# group 1 is the value.
LIMITS = [
    (r"count of matching rows stops at (?P<n>[\d,]+)", "host/src/console/view.rs", "MATCHING_BOUND"),
    (r"counts on the overview stop at (?P<n>[\d,]+)", "host/src/console/view.rs", "COUNT_BOUND"),
    (r"Pages of (?P<n>\d+) in row order", "host/src/console/mod.rs", "PAGE_SIZE"),
    (r"cookie, (?P<n>\d+) (?P<u>hours) long", "host/src/console/auth.rs", "SESSION_LIFETIME"),
    (r"sign-ins are limited to (?P<n>\d+) a minute", "host/src/console/auth.rs", "FAILED_SIGN_INS_PER_MINUTE"),
    (r"masked[^.;]{0,40}? cut at (?P<n>\d+) (?P<u>KiB)", "host/src/console/pages.rs", "PREVIEW_BYTES"),
    (r"sampled every (?P<n>\d+) (?P<u>s) from the relay's memory", "host/src/console/charts.rs", "SAMPLE_EVERY"),
    (r"over (?P<n>\d+) (?P<u>MiB) is refused before it is downloaded", "host/src/plugin/oci.rs", "MAX_COMPONENT_BYTES"),
    (r"(?:more than|at most) (?P<n>\d+) messages", "host/src/relay/route/router.rs", "MAX_MESSAGES_PER_EVENT"),
    (r"more than (?P<n>\d+) headers", "host/src/relay/route/router.rs", "MAX_HEADERS"),
    (r"(?P<n>\d+) headers per message", "host/src/relay/route/router.rs", "MAX_HEADERS"),
    (r"a topic with a control character or over (?P<n>[\d,]+) bytes", "host/src/relay/route/router.rs", "MAX_TOPIC_BYTES"),
    (r"a topic without control characters and at most (?P<n>[\d,]+) bytes", "host/src/relay/route/router.rs", "MAX_TOPIC_BYTES"),
    (r"at most (?P<n>\d+) (?P<u>KiB) per stream and call", "host/src/plugin/output.rs", "MAX_OUTPUT_PER_CALL"),
    (r"captured \((?P<n>\d+) (?P<u>KiB) per call and stream", "host/src/plugin/output.rs", "MAX_OUTPUT_PER_CALL"),
    (r"at most (?P<n>\d+) lines and \d+ KiB per call", "host/src/plugin/host.rs", "MAX_LOG_LINES_PER_CALL"),
    (r"at most \d+ lines and (?P<n>\d+) (?P<u>KiB) per call", "host/src/plugin/host.rs", "MAX_LOG_BYTES_PER_CALL"),
    (r"each line cut at (?P<n>\d+) (?P<u>KiB)", "host/src/plugin/host.rs", "MAX_LOG_LINE"),
    (r"`init` (?:gets )?at least (?P<n>\d+) (?P<u>s)", "host/src/plugin/version.rs", "INIT_TIME_FLOOR"),
    (r"health check every (?P<n>\d+) (?P<u>ms)", "host/src/relay/outage.rs", "PROBE_INTERVAL"),
    (r"probes it every (?P<n>\d+) (?P<u>ms)", "host/src/relay/outage.rs", "PROBE_INTERVAL"),
    (r"every relay, every (?P<n>\d+) (?P<u>s), health-checks", "host/src/relay/outage.rs", "WAITING_SWEEP_INTERVAL"),
    (r"every (?P<n>\d+) (?P<u>s) for parked rows", "host/src/relay/claim_feed.rs", "PARKED_SWEEP_INTERVAL"),
    (r"every (?P<n>\d+) (?P<u>seconds) the relay does the same", "host/src/relay/claim_feed.rs", "PARKED_SWEEP_INTERVAL"),
    (r"(?P<n>\d+)-(?P<u>second) sweep", "host/src/relay/claim_feed.rs", "PARKED_SWEEP_INTERVAL"),
    (r"Up to (?P<n>\d+) of the others are \*parked\*", "host/src/store/postgres/claim.rs", "PARK_LIMIT"),
    (r"parked (?P<n>\d+) per (?:claim|statement)", "host/src/store/postgres/claim.rs", "PARK_LIMIT"),
    (r"each of its checks bounded at (?P<n>\d+) (?P<u>s)", "host/src/admin/mod.rs", "CHECK_TIMEOUT"),
    (r"check's statement got no answer within (?P<n>\d+) (?P<u>s)", "host/src/admin/mod.rs", "CHECK_TIMEOUT"),
    (r"metadata request at a time, bounded by (?P<n>[\d.]+) (?P<u>s)", "host/src/sinks/kafka/sink.rs", "HEALTH_TIMEOUT"),
    (r"at most once every (?P<n>\d+) (?P<u>s) however many clients ask", "host/src/sinks/mod.rs", "HEALTH_FRESH_FOR"),
    (r"batch panicked (?:with)?in the last (?P<u>minute)", "host/src/relay/health.rs", "PANIC_UNREADY_FOR"),
    (r"`/readyz` unready for (?P<n>a) (?P<u>minute)", "host/src/relay/health.rs", "PANIC_UNREADY_FOR"),
    (r"at most once (?P<n>a) (?P<u>minute) per relay", "host/src/relay/health.rs", "ANALYZE_INTERVAL"),
    (r"a claim that takes over (?P<n>a) (?P<u>second) is logged", "host/src/relay/claim_feed.rs", "SLOW_CLAIM"),
    (r"next poll comes (?P<n>\d+) (?P<u>ms) later", "host/src/relay/claim_feed.rs", "POLL_UNDER_LOAD"),
    (r"spaced at least (?P<n>\d+) (?P<u>ms) apart", "host/src/relay/claim_feed.rs", "CLAIM_SPACING"),
    (r"tries again \(up to every (?P<u>second)\)", "host/src/relay/claim_feed.rs", "ACK_RETRY_MAX"),
    (r"sends a heartbeat every (?P<u>second)", "host/src/store/mysql/binlog/stream.rs", "HEARTBEAT"),
    (r"a session silent for (?P<n>\d+) (?P<u>s) is taken for dead", "host/src/store/mysql/binlog/stream.rs", "SILENCE"),
    (r"writing it at most every (?P<n>\d+) (?P<u>ms)", "host/src/store/mysql/binlog/stream.rs", "RECORD_EVERY"),
    (r"A LISTEN session that has heard nothing for (?P<n>\d+) (?P<u>s) is pinged", "host/src/store/postgres/listen.rs", "QUIET_FOR"),
    (r"is pinged, and one that does not answer within (?P<n>\d+) (?P<u>s) is replaced", "host/src/store/postgres/connect.rs",
     "PING_WITHIN"),
    (r"stand by and try every (?P<n>\d+) (?P<u>s)", "host/src/relay/wal_feed/mod.rs", "STANDBY_RETRY"),
    (r"handed over again \((?P<n>\w+) times in all", "host/src/relay/wal_feed/machine.rs", "HANDOVER_TRIES"),
    (r"refreshes it every (?P<n>\d+) (?P<u>s)", "host/src/runtime.rs", "ANNOUNCE_EVERY"),
    (r"one silent for (?P<n>a) (?P<u>day)", "host/src/store/relays.rs", "FORGOTTEN_AFTER"),
    (r"doubling (?:up )?to (?P<n>\d+) (?P<u>s)\)", "host/src/fleet/mod.rs", "CONNECT_RETRY_MAX"),
    (r"serves at most (?P<n>\d+) connections at once", "host/src/admin/serve.rs", "MAX_CONNECTIONS"),
    (r"header must arrive within (?P<n>\d+) (?P<u>s)", "host/src/admin/serve.rs", "HEADER_READ_TIMEOUT"),
    (r"short enough for its (?P<n>\d+) (?P<u>KiB) control line", "host/src/sinks/nats/sink.rs", "MAX_CONTROL_LINE"),
    (r"over AMQP's (?P<n>\d+) bytes", "host/src/sinks/rabbitmq/config.rs", "SHORT_STRING_MAX"),
    (r"`message_id` longer than (?P<n>\d+) bytes", "host/src/sinks/rabbitmq/config.rs", "SHORT_STRING_MAX"),
    (r"a message over (?P<n>\d+) (?P<u>MiB|MB) \(data, attributes", "host/src/sinks/pubsub/sink.rs", "MESSAGE_BYTES"),
    (r"more than (?P<n>\d+) attributes", "host/src/sinks/pubsub/sink.rs", "ATTRIBUTES"),
    (r"an attribute name over (?P<n>\d+) bytes", "host/src/sinks/pubsub/sink.rs", "ATTRIBUTE_KEY_BYTES"),
    (r"a value over (?P<n>[\d,]+) bytes", "host/src/sinks/pubsub/sink.rs", "ATTRIBUTE_VALUE_BYTES"),
    (r"an ordering key over (?P<n>[\d,]+) bytes", "host/src/sinks/pubsub/sink.rs", "ORDERING_KEY_BYTES"),
    (r"after (?P<n>[\d,]+) keyed messages", "host/src/sinks/pubsub/sink.rs", "KEYED_MESSAGES_PER_PUBLISHER"),
    (r"takes up to (?P<n>\d+) attributes", "host/src/sinks/aws/attributes.rs", "MAX_ATTRIBUTES"),
    (r"when they fit SNS's (?P<n>\d+)", "host/src/sinks/aws/attributes.rs", "MAX_ATTRIBUTES"),
    (r"over (?P<n>\d+) (?P<u>KiB) with its attributes", "host/src/sinks/aws/attributes.rs", "MAX_MESSAGE_BYTES"),
    (r"A call holds (?P<n>\d+) (?P<u>KiB) at most", "host/src/sinks/aws/attributes.rs", "MAX_MESSAGE_BYTES"),
    (r"over (?P<n>\d+) characters,? (?:or hold|is its SHA-256)", "host/src/sinks/aws/attributes.rs",
     r"fitted\(&group, (\d+), id_char\)"),
    (r"`SendMessageBatch` calls of up to (?P<n>\d+) entries", "host/src/sinks/aws/sqs.rs", "BATCH"),
    (r"`PublishBatch` calls of up to (?P<n>\d+) entries", "host/src/sinks/aws/sns.rs", "BATCH"),
    (r"`PutEvents`, sent in calls of up to (?P<n>\d+) entries", "host/src/sinks/aws/eventbridge.rs", "BATCH"),
    (r"an entry over (?P<n>\d+) (?P<u>KiB)", "host/src/sinks/aws/eventbridge.rs", "MAX_ENTRY_BYTES"),
    (r"A `PutEvents` call holds (?P<n>\d+) (?P<u>KiB) at most", "host/src/sinks/aws/eventbridge.rs", "MAX_ENTRY_BYTES"),
    (r"a record over (?P<n>\d+) (?P<u>MiB) with its partition key", "host/src/sinks/aws/kinesis.rs", "MAX_RECORD_BYTES"),
    (r"`PutRecords` calls of up to (?P<n>\d+) records", "host/src/sinks/aws/kinesis.rs", "MAX_CALL_RECORDS"),
    (r"`PutRecords` calls of up to \d+ records and (?P<n>\d+) (?P<u>MiB)", "host/src/sinks/aws/kinesis.rs", "MAX_CALL_BYTES"),
    (r"A partition key over (?P<n>\d+) bytes", "host/src/sinks/aws/kinesis.rs", r"fitted\(key, (\d+), "),
    (r"again (?P<n>\d+) (?P<u>minutes) before they expire", "host/src/sinks/aws/client.rs", "EXPIRY_MARGIN"),
    (r"first (?P<n>\d+) bytes of the answer's body", "host/src/sinks/http/sink.rs", "BODY_KEPT"),
    (r"A longer wait than (?P<n>an?|[\d,]+) (?P<u>hours?|minutes?|days?|s) is taken as", "host/src/sinks/http/sink.rs", "MAX_RETRY_AFTER"),
    (r"`Retry-After`: (?P<n>an?|[\d,]+) (?P<u>hours?|minutes?|days?|s) at most", "host/src/sinks/http/sink.rs", "MAX_RETRY_AFTER"),
    (r"sends nothing until then \((?P<n>an?|[\d,]+) (?P<u>hours?|minutes?|days?|s) at most\)", "host/src/sinks/http/sink.rs", "MAX_RETRY_AFTER"),
    (r"the connection at most (?P<n>\d+) (?P<u>s) of it", "host/src/sinks/http/sink.rs",
     r"connect_timeout\(timeout\.min\(Duration::from_secs\((\d+)\)\)\)"),
    (r"no `\.` or `\.\.` segment, at most (?P<n>[\d,]+) characters", "host/src/sinks/http/config.rs", r"topic\.len\(\) > (\d+)"),
    (r"A topic under `base_url`: at most (?P<n>[\d,]+) characters", "host/src/sinks/http/config.rs", r"topic\.len\(\) > (\d+)"),
    (r"`max_batch`: 1 to (?P<n>[\d,]+) events", "host/src/sinks/http/config.rs", r"self\.max_batch > (\d+)"),
    (r"holds a control character, or runs over (?P<n>[\d,]+) bytes", "host/src/sinks/redis.rs", "MAX_STREAM_NAME"),
    (r"connecting at most (?P<n>\d+) (?P<u>s) of it", "host/src/sinks/aws/client.rs",
     r"timeout\.min\(Duration::from_secs\((\d+)\)\)"),
    (r"`aggregate_id`,? (?:is )?at most (?P<n>[\d,]+) bytes", "migrations/postgres/20261123000000_bound_aggregate_keys.sql",
     r"octet_length\(aggregate_id\) <= (\d+)"),
    (r"bounds aggregate ids at (?P<n>[\d,]+) bytes", "migrations/postgres/20261123000000_bound_aggregate_keys.sql",
     r"octet_length\(aggregate_id\) <= (\d+)"),
    (r"over (?P<n>[\d,]+) bytes for `aggregate_id`", "migrations/postgres/20261123000000_bound_aggregate_keys.sql",
     r"octet_length\(aggregate_id\) <= (\d+)"),
    (r"`aggregate_type` (?:at most )?(?P<n>\d+)\b", "migrations/postgres/20261123000000_bound_aggregate_keys.sql",
     r"octet_length\(aggregate_type\) <= (\d+)"),
    (r"(?P<n>\d+) for `aggregate_type`", "migrations/postgres/20261123000000_bound_aggregate_keys.sql",
     r"octet_length\(aggregate_type\) <= (\d+)"),
    (r"password file is read again every (?P<n>\d+) (?P<u>s)", "host/src/secret.rs", r"if self\.file\.is_some\(\) \{ (\d+) \}"),
    (r"a password file every (?P<n>\d+) (?P<u>s)", "host/src/secret.rs", r"if self\.file\.is_some\(\) \{ (\d+) \}"),
    (r"`file` \(read again every (?P<n>\d+) (?P<u>s)", "host/src/secret.rs", r"if self\.file\.is_some\(\) \{ (\d+) \}"),
    (r"read again every `refresh_seconds` \((?P<n>\d+) (?P<u>s) by default\)", "host/src/secret.rs",
     r"if self\.file\.is_some\(\) \{ \d+ \} else \{ (\d+) \}"),
    (r"\| every (?P<n>\d+) (?P<u>s) by default; a Kafka password", "host/src/secret.rs",
     r"if self\.file\.is_some\(\) \{ \d+ \} else \{ (\d+) \}"),
]
LIMITS = [(re.compile(phrase), file, where) for phrase, file, where in LIMITS]
sources = {}


def limit_value(file, where):
    """The value at a location: (number, 'time' (seconds) | None), or None."""
    if file not in sources:
        sources[file] = open(os.path.join(ROOT, file)).read()
    text = sources[file]
    if re.fullmatch(r"[A-Z][A-Z0-9_]*", where):
        m = re.search(rf"\bconst {where}\s*:\s*[^=]+=\s*(.+?);", text, re.S)
        if not m:
            return None
        expr = m.group(1).strip()
        kind = None
        if d := re.fullmatch(r"Duration::from_(secs|millis)\((.*)\)", expr, re.S):
            kind, expr = "time", d.group(2)
            scale = 1 if d.group(1) == "secs" else 0.001
        else:
            scale = 1
        expr = expr.replace("_", "")
        if not re.fullmatch(r"[\d\s*+()]+", expr):
            return None
        return eval(expr) * scale, kind  # digits and * + only
    m = re.search(where, text)
    return (float(m.group(1)), "time" if "secret" in file else None) if m else None


def check_limits(where, text, line_of, problems, tally):
    for phrase, file, location in LIMITS:
        for m in phrase.finditer(text):
            line = line_of[m.start()]
            found = limit_value(file, location)
            if found is None:
                problems.append(f"{where}:{line}: limit: {file} has no {location}")
                continue
            value, kind = found
            groups = m.groupdict()
            said = to_number(groups["n"]) if groups.get("n") else 1.0
            if groups.get("u"):
                said, _ = in_base(said, groups["u"])
            tally["limits"] += 1
            if abs(said - value) > 1e-9 * max(1.0, abs(value)):
                shown = f"{fmt(value)} s" if kind == "time" else fmt(value)
                name = location if re.fullmatch(r"[A-Z][A-Z0-9_]*", location) else "the value"
                problems.append(f'{where}:{line}: limit "{m.group(0)}": {name} in {file} is {shown}')


# An estimate of what no check reads: numbers with a unit in prose.
UNITED = re.compile(rf"(?<![\w.]){NUM}\s?(?:{UNIT}|%|x\b|events/s|rows\b|us\b|µs\b|ns\b)")


pages = args[1:] or [os.path.join(ROOT, "README.md")] + [
    os.path.join(base, name)
    for base, _, files in os.walk(SRC)
    for name in files
    if name.endswith(".md") and os.path.relpath(os.path.join(base, name), SRC) not in GENERATED
]
def check_toml_defaults(where, start, block, problems, tally):
    """`key = value  # ... the default` and `# default "x"` in a TOML block."""
    header = []
    for offset, row in enumerate(block):
        code, _, comment = row.partition(" #")
        code = code.strip()
        if m := re.match(r"^\[\[?([a-z0-9_.\-]+)\]\]?$", code):
            header = m.group(1).split(".")
            continue
        m = re.match(r"^([a-z0-9_]+)\s*=\s*(.+)$", code)
        if not m or "default" not in comment:
            continue
        key = ".".join(header + [m.group(1)])
        said = None
        for rule in TOML_DEFAULT:
            if d := rule.search(comment):
                said = d.group(1)
                break
        if said is None and TOML_THE_DEFAULT.search(comment):
            try:
                value = tomllib.loads(f"v = {m.group(2)}")["v"]
            except tomllib.TOMLDecodeError:
                continue
            said = json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
        if said is not None:
            check_default(where, start + 1 + offset, key, said, "TOML comments", problems, tally)


def prose_of(lines):
    """The page without its fenced blocks, whitespace runs made one space,
    and the line each character of it came from."""
    out, line_of, fenced, last_space = [], [], False, True
    for number_, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            line = ""
        if fenced:
            line = ""
        for ch in line + "\n":
            if ch.isspace():
                if last_space:
                    continue
                ch, last_space = " ", True
            else:
                last_space = False
            out.append(ch)
            line_of.append(number_)
    return "".join(out), line_of


problems = []
tally = collections.Counter()
united = 0
toml_blocks = 0
for page in sorted(pages):
    where = os.path.relpath(page, ROOT)
    text = open(page).read()
    lines = text.split("\n")
    # TOML blocks, read whole; a block that does not parse (an excerpt
    # with `...`) is read key line by key line under its headers.
    block, lang, start = None, None, 0
    for number, line in enumerate(lines, 1):
        fence = line.strip().startswith("```")
        if fence and block is None:
            block, lang, start = [], line.strip()[3:].strip(), number
            continue
        if fence and block is not None:
            if lang == "toml":
                toml_blocks += 1
                found = []
                try:
                    walk_toml(tomllib.loads("\n".join(block)), [], found)
                except tomllib.TOMLDecodeError:
                    header = []
                    for row in block:
                        row = row.split("#")[0].strip()
                        if m := re.match(r"^\[\[?([a-z0-9_.\-]+)\]\]?$", row):
                            header = m.group(1).split(".")
                        elif m := re.match(r"^([a-z0-9_]+)\s*=", row):
                            if unknown := check_path(header + [m.group(1)]):
                                found.append(unknown)
                for unknown in found:
                    problems.append(f"{where}:{start}: config key {unknown} (a TOML block)")
                check_toml_defaults(where, start, block, problems, tally)
            elif lang in ("sh", "bash", "console", ""):
                for offset, row in enumerate(block):
                    # Each command of the line whose program is `switchyard`
                    # (or a path to it), not a word that ends so
                    # (`kubectl rollout status deploy/switchyard --timeout`).
                    for command in re.split(r"&&|\|\||[;|&]", row.split("#")[0]):
                        words = command.split()
                        while words and (words[0] == "$" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0])):
                            words = words[1:]
                        if not words or words[0].rsplit("/", 1)[-1] != "switchyard":
                            continue
                        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command):
                            if flag not in flags:
                                problems.append(f"{where}:{start + 1 + offset}: switchyard flag {flag}")
            block = None
            continue
        if block is not None:
            block.append(line)
            continue
        for span in re.findall(r"`([^`]+)`", line):
            for name in re.findall(r"\bSWITCHYARD_[A-Z0-9_<>]+", span):
                if "<" in name or name.endswith("_"):
                    continue
                if not any(p.match(name) for p in patterns):
                    problems.append(f"{where}:{number}: variable {name}")
            for name in re.findall(r"\bswitchyard_[a-z0-9_]+", span):
                if name not in objects:
                    problems.append(f"{where}:{number}: name {name} (no metric or database object)")
            if span.startswith("switchyard "):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
                    if flag not in flags:
                        problems.append(f"{where}:{number}: switchyard flag {flag}")
            # `relay.publish_timeout_ms`, `[database.tls]`: a dotted key
            # under a top-level section.
            key = span.strip("[]")
            # Not a file (`relay.toml`) nor a field of /readyz or /status.
            before = line[: line.find(f"`{span}`")][-40:]
            if key.endswith((".rs", ".toml", ".md", ".json", ".yaml", ".yml", ".sh", ".py", ".wasm")) or re.search(
                r"/readyz|/status", before
            ):
                continue
            if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", key) and key.split(".")[0] in schema["properties"]:
                if unknown := check_path(key.split(".")):
                    problems.append(f"{where}:{number}: config key {unknown}")
    # The numbers the prose states: defaults, label sets, limits.
    prose, line_of = prose_of(lines)
    for rule in DEFAULT_PROSE:
        for m in rule.finditer(prose):
            check_default(where, line_of[m.start()], m.group(1), m.group(2), "prose", problems, tally)
    for m in re.finditer(r"`([^`]+)`", prose):
        for metric in re.finditer(r"\b(switchyard_[a-z0-9_]+)\{([^}]*)\}", m.group(1)):
            check_labels(where, line_of[m.start()], metric.group(1), metric.group(2), problems, tally)
    check_limits(where, prose, line_of, problems, tally)
    united += len(UNITED.findall(re.sub(r"`[^`]*`", "``", prose)))

for problem in problems:
    print(f"docs-claims: {problem}")
if tally_wanted:
    for kind, count in sorted(tally.items()):
        print(f"docs-claims: tally: {count} {kind}")
    checked = sum(count for kind, count in tally.items() if kind.startswith(("defaults (", "limits")))
    print(f"docs-claims: tally: {united} numbers with a unit in prose, {checked} of them read by a check")
print(f"docs-claims: {len(pages)} pages, {toml_blocks} TOML blocks, {len(problems)} unknown names")
sys.exit(1 if problems else 0)
