"""route-by-type in Python: the same routing as plugins/route-by-type (Rust),
config for config, message for message.

Config (the plugin's `config` table in the relay config):

  target  required   target name for every message
  topic   "{aggregate_type}.{event_type}"   topic template when `routes` has no entry
  routes  {}         event type -> topic template
  key     "{aggregate_id}"   key template; "" sends no key
  drop    []         event types to drop deliberately

Templates may name {aggregate_type}, {aggregate_id}, {event_type} and {tenant}.

Build, for the router world (one `route` call per event):
  componentize-py -d ../../../wit -w router componentize app -o route_by_type.wasm
or for the batch-router world (one `route_batch` call per batch: the
interpreter is entered once for many events):
  componentize-py -d ../../../wit -w batch-router componentize app -o route_by_type_batch.wasm
"""

import json

import wit_world
from componentize_py_types import Err, Ok
from wit_world.imports import host, types

KNOWN_FIELDS = ("aggregate_type", "aggregate_id", "event_type", "tenant")
CONFIG_KEYS = ("target", "topic", "routes", "key", "drop")

CONFIG = None


def parse_template(source):
    """A template as a list of literal strings and (field,) tuples; unknown
    placeholders are an error so that a typo fails init."""
    parts = []
    rest = source
    while "{" in rest:
        open_at = rest.index("{")
        if open_at > 0:
            parts.append(rest[:open_at])
        close_at = rest.find("}", open_at)
        if close_at < 0:
            raise ValueError(f"unclosed '{{' in template {json.dumps(source)}")
        name = rest[open_at + 1 : close_at]
        if name not in KNOWN_FIELDS:
            raise ValueError(
                f"unknown placeholder {{{name}}} in template {json.dumps(source)}; "
                "known: aggregate_type, aggregate_id, event_type, tenant"
            )
        parts.append((name,))
        rest = rest[close_at + 1 :]
    if rest:
        parts.append(rest)
    return parts


def render(parts, event):
    out = []
    for part in parts:
        if isinstance(part, tuple):
            value = getattr(event, part[0])
            out.append(value if value is not None else "")
        else:
            out.append(part)
    return "".join(out)


def string_field(raw, key, default):
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"bad config: `{key}` must be a string")
    return value


def parse_config(text):
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise ValueError(f"bad config: {error}")
    if not isinstance(raw, dict):
        raise ValueError("bad config: expected a table")
    for key in raw:
        if key not in CONFIG_KEYS:
            raise ValueError(f"bad config: unknown field `{key}`")
    if "target" not in raw:
        raise ValueError("bad config: missing field `target`")
    target = string_field(raw, "target", "")
    if not target:
        raise ValueError("bad config: `target` must not be empty")
    routes = raw.get("routes", {})
    if not isinstance(routes, dict) or not all(isinstance(t, str) for t in routes.values()):
        raise ValueError("bad config: `routes` must map event types to topic templates")
    drop = raw.get("drop", [])
    if not isinstance(drop, list) or not all(isinstance(t, str) for t in drop):
        raise ValueError("bad config: `drop` must be a list of event types")
    key = string_field(raw, "key", "{aggregate_id}")
    return {
        "target": target,
        "topic": parse_template(string_field(raw, "topic", "{aggregate_type}.{event_type}")),
        "routes": {event_type: parse_template(t) for event_type, t in routes.items()},
        "key": parse_template(key) if key else None,
        "drop": set(drop),
    }


class WitWorld(wit_world.WitWorld):
    def init(self, config: str) -> None:
        global CONFIG
        try:
            parsed = parse_config(config)
        except ValueError as error:
            raise Err(str(error))
        host.log(host.Level.DEBUG, f"routing to target {json.dumps(parsed['target'])}")
        # A second init in the same instance keeps the first config.
        if CONFIG is None:
            CONFIG = parsed

    def route(self, event: types.Event) -> list:
        if CONFIG is None:
            raise Err(types.Refusal_Permanent("route called before init"))
        if event.event_type in CONFIG["drop"]:
            return []
        topic = CONFIG["routes"].get(event.event_type, CONFIG["topic"])
        key = render(CONFIG["key"], event) if CONFIG["key"] is not None else None
        if event.payload_format == types.PayloadFormat.JSON:
            content_type = "application/json"
        else:
            content_type = "application/octet-stream"
        return [
            types.Message(
                target=CONFIG["target"],
                topic=render(topic, event),
                key=key,
                payload=event.payload,
                headers=[("content-type", content_type)],
            )
        ]

    def route_batch(self, events: list) -> list:
        """One answer per event, in order: what `route` answers, or its refusal."""
        answers = []
        for event in events:
            try:
                answers.append(Ok(self.route(event)))
            except Err as refusal:
                answers.append(refusal)
        return answers
