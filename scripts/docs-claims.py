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
  page lists.

    docs-claims.py BINARY [FILE.md ...]

BINARY is a switchyard binary (for its schema). Without files, the README
and every page of docs/src but the generated reference and the lab
notebook (its figures are a dated record). Prints each unknown name with
its page and line; exits 1 when there is one.
"""
import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "docs", "src")
GENERATED = {"reference/config-keys.md", "reference/cli.md", "reference/metrics-list.md", "contributing/lab.md"}

binary = sys.argv[1]
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

pages = sys.argv[2:] or [os.path.join(ROOT, "README.md")] + [
    os.path.join(base, name)
    for base, _, files in os.walk(SRC)
    for name in files
    if name.endswith(".md") and os.path.relpath(os.path.join(base, name), SRC) not in GENERATED
]
problems = []
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
            elif lang in ("sh", "bash", "console", ""):
                for offset, row in enumerate(block):
                    if re.match(r"^\s*(\$ )?switchyard ", row) or "/switchyard " in row:
                        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", row.split("#")[0]):
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

for problem in problems:
    print(f"docs-claims: {problem}")
print(f"docs-claims: {len(pages)} pages, {toml_blocks} TOML blocks, {len(problems)} unknown names")
sys.exit(1 if problems else 0)
