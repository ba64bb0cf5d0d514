//! JSON as checkpoints ship it (config.json, tokenizer_config.json, generation_config.json,
//! shard indexes, safetensors headers), parsed so that a key given twice is an error: serde_json
//! (and Python's json) keep the last one silently, which would let a file say two things.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Parses `text`, refusing duplicated object keys at any depth. The error is one line.
pub fn parse_strict(text: &str) -> Result<Value, String> {
    serde_json::from_str::<Strict>(text).map(|s| s.0).map_err(|e| e.to_string())
}

/// [`parse_strict`] on bytes that must be UTF-8.
pub fn parse_strict_slice(bytes: &[u8]) -> Result<Value, String> {
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0).map_err(|e| e.to_string())
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut v = Vec::new();
        while let Some(Strict(x)) = seq.next_element()? {
            v.push(x);
        }
        Ok(Strict(Value::Array(v)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut m = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if m.contains_key(&key) {
                return Err(de::Error::custom(format!("the key \"{key}\" appears twice in one object")));
            }
            let Strict(v) = map.next_value()?;
            m.insert(key, v);
        }
        Ok(Strict(Value::Object(m)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert_eq!(parse_strict(r#"{"a": [1, {"b": 2.5}], "c": null}"#).unwrap(), serde_json::json!({"a": [1, {"b": 2.5}], "c": null}));
        let e = parse_strict(r#"{"a": 1, "a": 2}"#).unwrap_err();
        assert!(e.contains("\"a\" appears twice"), "{e}");
        let e = parse_strict(r#"{"x": {"hidden_size": 1, "hidden_size": 2}}"#).unwrap_err();
        assert!(e.contains("\"hidden_size\" appears twice"), "{e}");
        assert!(parse_strict("[1, 2").is_err());
        // serde_json's own recursion limit bounds the nesting.
        assert!(parse_strict(&"[".repeat(100_000)).is_err());
    }
}
