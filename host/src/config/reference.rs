//! The configuration's JSON Schema, made from the types the config is read
//! into, and the book's key-by-key reference page made from that schema:
//! neither is written by hand, so neither drifts from the code.

use serde_json::{Map, Value};

use super::Config;

/// The schema keyword that names the environment variable overriding a key.
pub const ENV_KEY: &str = "x-env";

/// The JSON Schema of `switchyard.toml` (`switchyard config schema`), for
/// editors that complete and check TOML against one.
#[must_use]
pub fn schema() -> Value {
    let mut schema = serde_json::to_value(schemars::schema_for!(Config)).unwrap_or(Value::Null);
    if let Some(root) = schema.as_object_mut() {
        root.insert("title".into(), "switchyard.toml".into());
    }
    schema
}

/// The book's configuration reference (`docs/src/reference/config-keys.md`).
#[must_use]
pub fn markdown() -> String {
    let schema = schema();
    let empty = Map::new();
    let defs = schema.get("$defs").and_then(Value::as_object).unwrap_or(&empty);
    let mut out = String::from(
        "# Configuration keys\n\n\
         <!-- Generated from the config types by `switchyard config reference --page config`: do not edit. -->\n\n\
         Every key of `switchyard.toml`, section by section, from the types the relay reads it into. \
         Unknown keys are refused. `switchyard config schema` prints the same as a JSON Schema for \
         editors.\n\n\
         A key with an environment variable is overridden by it ([Configuration](configuration.md)): \
         `<NAME>` is the database's or target's name upper-cased, with `-` as `_`. A variable may \
         instead be given as `VARIABLE_FILE`, naming a file that holds the value; for a password \
         that file is read again for each connection, so the secret may rotate.\n",
    );
    section(&mut out, "", &schema, defs, 2);
    out
}

/// A `$ref`, or an `Option`'s `anyOf [T, null]`, taken to what it names.
fn resolve<'a>(schema: &'a Value, defs: &'a Map<String, Value>) -> &'a Value {
    if let Some(name) = schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
        && let Some(def) = defs.get(name)
    {
        return resolve(def, defs);
    }
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        let real: Vec<&Value> = options
            .iter()
            .filter(|o| o.get("type").and_then(Value::as_str) != Some("null"))
            .collect();
        if let [one] = real.as_slice() {
            return resolve(one, defs);
        }
    }
    schema
}

/// One line of a doc comment's first paragraph.
fn describe(schema: &Value) -> String {
    let text = schema.get("description").and_then(Value::as_str).unwrap_or("");
    let first = text.split("\n\n").next().unwrap_or("");
    first
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn kind(schema: &Value, defs: &Map<String, Value>) -> String {
    let schema = resolve(schema, defs);
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .map(|v| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    if let Some(variants) = schema.get("oneOf").and_then(Value::as_array) {
        let consts: Vec<String> = variants
            .iter()
            .filter_map(|v| v.get("const").or_else(|| v.get("enum").and_then(|e| e.get(0))))
            .map(|v| format!("`{v}`"))
            .collect();
        if consts.len() == variants.len() {
            return consts.join(" \\| ");
        }
    }
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        return options
            .iter()
            .map(|o| kind(o, defs))
            .collect::<Vec<_>>()
            .join(" or ");
    }
    match schema.get("type") {
        Some(Value::String(t)) if t == "array" => {
            let items = schema.get("items").map_or_else(String::new, |i| kind(i, defs));
            format!("list of {items}")
        }
        Some(Value::String(t)) if t == "object" && schema.get("properties").is_some() => "table".into(),
        Some(Value::String(t)) if t == "object" => "table of any keys".into(),
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "any".into(),
    }
}

fn default_of(schema: &Value) -> String {
    match schema.get("default") {
        None | Some(Value::Null) => String::new(),
        Some(value) => format!("`{value}`"),
    }
}

/// The variable that overrides a key (`x-env`, set beside the field).
fn environment(schema: &Value) -> String {
    schema
        .get(ENV_KEY)
        .and_then(Value::as_str)
        .map(|name| format!(" Environment: `{name}`."))
        .unwrap_or_default()
}

/// The keys of one table, then the tables inside it, each under its TOML header.
fn section(out: &mut String, path: &str, schema: &Value, defs: &Map<String, Value>, depth: usize) {
    let schema = resolve(schema, defs);
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut rows = String::new();
    let mut nested = Vec::new();
    for (key, property) in properties {
        let target = resolve(property, defs);
        let is_table = target.get("properties").is_some();
        let item = target.get("items").map(|i| resolve(i, defs));
        let map_of = target.get("additionalProperties").filter(|v| v.is_object());
        let full = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        if is_table {
            nested.push((format!("[{full}]"), property.clone()));
        } else if let Some(item) = item.filter(|i| i.get("properties").is_some()) {
            nested.push((format!("[[{full}]]"), item.clone()));
        } else if let Some(value) = map_of.map(|v| resolve(v, defs))
            && (value.get("properties").is_some() || value.get("oneOf").is_some())
        {
            nested.push((format!("[{full}.NAME]"), value.clone()));
        } else if property.get("const").is_some() {
            // The `type` that picks a target's kind: its heading says it.
            continue;
        } else {
            let need = if required.contains(&key.as_str()) {
                "required"
            } else {
                ""
            };
            rows.push_str(&format!(
                "| `{key}` | {} | {}{need} | {}{} |\n",
                kind(property, defs),
                default_of(property),
                describe(property),
                environment(property)
            ));
        }
    }
    if !rows.is_empty() {
        out.push_str("\n| key | type | default | what it is |\n|---|---|---|---|\n");
        out.push_str(&rows);
    }
    for (header, property) in nested {
        let target = resolve(&property, defs);
        let about = Some(describe(&property))
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| describe(target));
        // A table a variable stands in for (`[database.password]` and
        // `SWITCHYARD_DATABASE_PASSWORD_FILE`): said under its heading.
        let about = format!("{about}{}", environment(&property));
        let hashes = "#".repeat(depth);
        out.push_str(&format!("\n{hashes} `{header}`\n\n{about}\n"));
        let inner = header.trim_matches(|c| c == '[' || c == ']').to_string();
        match target.get("oneOf").and_then(Value::as_array) {
            // A table whose `type` picks its kind (targets): each kind's keys.
            Some(variants) if target.get("properties").is_none() => {
                for variant in variants {
                    let variant = resolve(variant, defs);
                    let tag = variant
                        .get("properties")
                        .and_then(|p| p.get("type"))
                        .and_then(|t| t.get("const").or_else(|| t.get("enum").and_then(|e| e.get(0))))
                        .map(|t| t.to_string())
                        .unwrap_or_default();
                    out.push_str(&format!("\n{hashes}# `type = {tag}`\n\n{}\n", describe(variant)));
                    section(out, &inner, variant, defs, depth + 2);
                }
            }
            _ => section(out, &inner, target, defs, depth),
        }
    }
}
