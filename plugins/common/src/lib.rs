//! Helpers shared by the example plugins: topic templates over event fields
//! and dotted paths into JSON documents.

use serde_json::Value;

/// The event fields a topic or key template may name.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    /// `{aggregate_type}`
    pub aggregate_type: &'a str,
    /// `{aggregate_id}`
    pub aggregate_id: &'a str,
    /// `{event_type}`
    pub event_type: &'a str,
    /// `{tenant}`; empty when the row has none.
    pub tenant: &'a str,
    /// `{database}`: the outbox database the event comes from, when the
    /// relay serves several; empty otherwise.
    pub database: &'a str,
}

/// A parsed template such as `"{aggregate_type}.{event_type}"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    AggregateType,
    AggregateId,
    EventType,
    Tenant,
    Database,
}

impl Template {
    /// Parses a template; unknown placeholders are an error so that a typo in
    /// the config fails `init` instead of producing odd topics.
    pub fn parse(source: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut rest = source;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed '{{' in template {source:?}"))?;
            let name = &rest[open + 1..open + close];
            parts.push(match name {
                "aggregate_type" => Part::AggregateType,
                "aggregate_id" => Part::AggregateId,
                "event_type" => Part::EventType,
                "tenant" => Part::Tenant,
                "database" => Part::Database,
                other => {
                    return Err(format!(
                        "unknown placeholder {{{other}}} in template {source:?}; \
                         known: aggregate_type, aggregate_id, event_type, tenant, database"
                    ));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Ok(Template { parts })
    }

    /// Fills the template in.
    pub fn render(&self, fields: &Fields<'_>) -> String {
        let mut out = String::new();
        for part in &self.parts {
            out.push_str(match part {
                Part::Text(text) => text,
                Part::AggregateType => fields.aggregate_type,
                Part::AggregateId => fields.aggregate_id,
                Part::EventType => fields.event_type,
                Part::Tenant => fields.tenant,
                Part::Database => fields.database,
            });
        }
        out
    }
}

/// Replaces the value at a dotted path (`"card.number"`) with `replacement`.
/// Returns whether the path existed.
pub fn mask_path(doc: &mut Value, path: &str, replacement: &Value) -> bool {
    match lookup_mut(doc, path) {
        Some(slot) => {
            *slot = replacement.clone();
            true
        }
        None => false,
    }
}

/// Removes the value at a dotted path. Returns whether the path existed.
pub fn drop_path(doc: &mut Value, path: &str) -> bool {
    let (parent, leaf) = match path.rsplit_once('.') {
        Some((parent, leaf)) => (lookup_mut(doc, parent), leaf),
        None => (Some(doc), path),
    };
    parent
        .and_then(Value::as_object_mut)
        .is_some_and(|object| object.remove(leaf).is_some())
}

fn lookup_mut<'a>(doc: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    path.split('.')
        .try_fold(doc, |value, key| value.as_object_mut()?.get_mut(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const FIELDS: Fields<'static> = Fields {
        aggregate_type: "order",
        aggregate_id: "o-1",
        event_type: "OrderCreated",
        tenant: "",
        database: "",
    };

    #[test]
    fn renders_placeholders_and_text() {
        let t = Template::parse("{aggregate_type}s.{event_type}.v1").unwrap();
        assert_eq!(t.render(&FIELDS), "orders.OrderCreated.v1");
    }

    #[test]
    fn rejects_unknown_placeholder_and_unclosed_brace() {
        assert!(
            Template::parse("{aggregate}")
                .unwrap_err()
                .contains("unknown placeholder")
        );
        assert!(Template::parse("a.{event_type").unwrap_err().contains("unclosed"));
    }

    #[test]
    fn masks_and_drops_nested_paths() {
        let mut doc = json!({"card": {"number": "4111", "brand": "visa"}, "note": "x"});
        assert!(mask_path(&mut doc, "card.number", &json!("****")));
        assert!(drop_path(&mut doc, "note"));
        assert!(!drop_path(&mut doc, "card.cvv"));
        assert!(!mask_path(&mut doc, "missing.path", &json!(null)));
        assert_eq!(doc, json!({"card": {"number": "****", "brand": "visa"}}));
    }
}
