//! `[admin] mask_fields`: payload fields the console shows as `***`, and
//! that a target's quote of an answer (a webhook's refusal) hides alike.
//! A dotted path (`card.number`) names a field from the top; a name alone
//! (`ssn`) names that field at any depth, in objects and arrays.

use serde_json::Value;

/// What a masked value shows as.
pub const MASKED: &str = "***";

/// Replaces every field `fields` names in `value`.
pub fn mask(value: &mut Value, fields: &[String]) {
    for field in fields {
        let path: Vec<&str> = field.split('.').collect();
        if let [name] = path.as_slice() {
            mask_anywhere(value, name);
        } else {
            mask_path(value, &path);
        }
    }
}

fn mask_anywhere(value: &mut Value, name: &str) {
    match value {
        Value::Object(map) => {
            for (key, inner) in map.iter_mut() {
                if key == name {
                    *inner = Value::String(MASKED.into());
                } else {
                    mask_anywhere(inner, name);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| mask_anywhere(item, name)),
        _ => {}
    }
}

fn mask_path(value: &mut Value, path: &[&str]) {
    match (value, path) {
        (Value::Object(map), [last]) => {
            if let Some(inner) = map.get_mut(*last) {
                *inner = Value::String(MASKED.into());
            }
        }
        (Value::Object(map), [first, rest @ ..]) => {
            if let Some(inner) = map.get_mut(*first) {
                mask_path(inner, rest);
            }
        }
        // A path through a list applies to each of its items.
        (Value::Array(items), path) => items.iter_mut().for_each(|item| mask_path(item, path)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_names_are_masked_wherever_they_are() {
        let mut payload = serde_json::json!({
            "card": {"number": "4111", "brand": "visa"},
            "lines": [{"ssn": "1"}, {"ssn": "2", "sku": "x"}],
            "number": "kept: only card.number is masked at the top",
        });
        mask(&mut payload, &["card.number".into(), "ssn".into()]);
        assert_eq!(payload["card"]["number"], MASKED);
        assert_eq!(payload["card"]["brand"], "visa");
        assert_eq!(payload["lines"][1]["ssn"], MASKED);
        assert_eq!(payload["lines"][1]["sku"], "x");
        assert_eq!(payload["number"], "kept: only card.number is masked at the top");
    }
}
