// route-by-type in JavaScript: the same routing as plugins/route-by-type
// (Rust), config for config, message for message.
//
// Config (the plugin's `config` table in the relay config):
//   target  required                          target name for every message
//   topic   "{aggregate_type}.{event_type}"   topic template when `routes` has no entry
//   routes  {}                                event type -> topic template
//   key     "{aggregate_id}"                  key template; "" sends no key
//   drop    []                                event types to drop deliberately
// Templates may name {aggregate_type}, {aggregate_id}, {event_type} and {tenant}.
//
// Build, for the router world (one `route` call per event):
//   componentize-js app.js --wit ../../../wit --world-name router \
//     --disable http fetch-event -o route_by_type.wasm
// or for the batch-router world (one `routeBatch` call per batch: the engine
// is entered once for many events): --world-name batch-router.

import { log } from "switchyard:plugin/host@0.1.2";

const FIELDS = {
  aggregate_type: (event) => event.aggregateType,
  aggregate_id: (event) => event.aggregateId,
  event_type: (event) => event.eventType,
  tenant: (event) => event.tenant ?? "",
};
const CONFIG_KEYS = ["target", "topic", "routes", "key", "drop"];

let config = null;

// A template as a list of literal strings and field readers; unknown
// placeholders are an error so that a typo fails init.
function parseTemplate(source) {
  const parts = [];
  let rest = source;
  let open;
  while ((open = rest.indexOf("{")) >= 0) {
    if (open > 0) parts.push(rest.slice(0, open));
    const close = rest.indexOf("}", open);
    if (close < 0) throw `unclosed '{' in template ${JSON.stringify(source)}`;
    const name = rest.slice(open + 1, close);
    if (!(name in FIELDS)) {
      throw `unknown placeholder {${name}} in template ${JSON.stringify(source)}; ` +
        "known: aggregate_type, aggregate_id, event_type, tenant";
    }
    parts.push(FIELDS[name]);
    rest = rest.slice(close + 1);
  }
  if (rest.length > 0) parts.push(rest);
  return parts;
}

function render(parts, event) {
  return parts.map((part) => (typeof part === "string" ? part : part(event))).join("");
}

function stringField(raw, key, fallback) {
  const value = key in raw ? raw[key] : fallback;
  if (typeof value !== "string") throw `bad config: \`${key}\` must be a string`;
  return value;
}

function parseConfig(text) {
  let raw;
  try {
    raw = JSON.parse(text);
  } catch (error) {
    throw `bad config: ${error}`;
  }
  if (raw === null || typeof raw !== "object" || Array.isArray(raw)) throw "bad config: expected a table";
  for (const key of Object.keys(raw)) {
    if (!CONFIG_KEYS.includes(key)) throw `bad config: unknown field \`${key}\``;
  }
  if (!("target" in raw)) throw "bad config: missing field `target`";
  const target = stringField(raw, "target", "");
  if (target === "") throw "bad config: `target` must not be empty";
  const routes = raw.routes ?? {};
  if (typeof routes !== "object" || Array.isArray(routes) ||
      !Object.values(routes).every((t) => typeof t === "string")) {
    throw "bad config: `routes` must map event types to topic templates";
  }
  const drop = raw.drop ?? [];
  if (!Array.isArray(drop) || !drop.every((t) => typeof t === "string")) {
    throw "bad config: `drop` must be a list of event types";
  }
  const key = stringField(raw, "key", "{aggregate_id}");
  return {
    target,
    topic: parseTemplate(stringField(raw, "topic", "{aggregate_type}.{event_type}")),
    routes: new Map(Object.entries(routes).map(([type, t]) => [type, parseTemplate(t)])),
    key: key === "" ? null : parseTemplate(key),
    drop: new Set(drop),
  };
}

export function init(text) {
  const parsed = parseConfig(text);
  log("debug", `routing to target ${JSON.stringify(parsed.target)}`);
  // A second init in the same instance keeps the first config.
  if (config === null) config = parsed;
}

export function route(event) {
  if (config === null) throw { tag: "permanent", val: "route called before init" };
  if (config.drop.has(event.eventType)) return [];
  const topic = config.routes.get(event.eventType) ?? config.topic;
  const contentType = event.payloadFormat === "json" ? "application/json" : "application/octet-stream";
  return [
    {
      target: config.target,
      topic: render(topic, event),
      key: config.key === null ? undefined : render(config.key, event),
      payload: event.payload,
      headers: [["content-type", contentType]],
    },
  ];
}

// One answer per event, in order: what `route` returns, or its refusal.
export function routeBatch(events) {
  return events.map((event) => {
    try {
      return { tag: "ok", val: route(event) };
    } catch (refusal) {
      if (refusal?.tag === "transient" || refusal?.tag === "permanent") return { tag: "err", val: refusal };
      throw refusal;
    }
  });
}
