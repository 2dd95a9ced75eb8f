//! How a config table is built: `section.key=value` overrides and the merge
//! of a partial table into the full one, naming unknown keys and wrong types.

use super::{ConfigError, Precision, Recompute, Result};

/// Parse `section.key=value` and set it in `table`. The value is read as a
/// TOML value (numbers, booleans, arrays) or, failing that, as a string.
pub(crate) fn apply_override(table: &mut toml::Table, o: &str) -> Result<()> {
    let (key, value) = o
        .split_once('=')
        .ok_or_else(|| ConfigError(format!("override {o:?} must look like section.key=value")))?;
    // `a.b.c=v` sets key c of table a.b (nested sections such as
    // zero_optimization.offload_optimizer).
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.len() < 2 || path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError(format!(
            "override key {key:?} must look like section.key"
        )));
    }
    let v = format!("v = {}", value.trim())
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.trim().to_string()));
    let mut t = table;
    for (i, name) in path[..path.len() - 1].iter().enumerate() {
        let entry = t
            .entry(name.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| ConfigError(format!("{} is not a section", path[..=i].join("."))))?;
    }
    t.insert(path[path.len() - 1].to_string(), v);
    Ok(())
}

/// Merge `over` into `base`, naming unknown keys and mismatched types.
pub(crate) fn merge(base: &mut toml::Table, over: toml::Table, path: &str) -> Result<()> {
    for (k, v) in over {
        let full = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        match base.get_mut(&k) {
            None => {
                let known: Vec<&String> = base.keys().collect();
                return Err(ConfigError(format!(
                    "unknown key `{full}` (known here: {known:?})"
                )));
            }
            Some(toml::Value::Table(b)) => match v {
                toml::Value::Table(t) => merge(b, t, &full)?,
                other => {
                    return Err(ConfigError(format!(
                        "`{full}` is a section, not a value ({other})"
                    )))
                }
            },
            Some(slot) => {
                // Keys whose values are parsed from text: check them here so
                // that the error names the key, and accept integers where the
                // key allows them (`train.activation_checkpointing = 2`).
                if let Some(v) = typed_value(&full, &v)? {
                    *slot = v;
                    continue;
                }
                // Every integer setting is a count, size or seed: never negative.
                if let (toml::Value::Integer(_), toml::Value::Integer(i)) = (&*slot, &v) {
                    if *i < 0 {
                        return Err(ConfigError(format!(
                            "`{full}` must be a non-negative integer, not {i}"
                        )));
                    }
                }
                let ok = match (&*slot, &v) {
                    (toml::Value::Float(_), toml::Value::Integer(i)) => {
                        *slot = toml::Value::Float(*i as f64);
                        continue;
                    }
                    // A path key takes one path or a list of them.
                    (toml::Value::String(_), toml::Value::Array(_))
                    | (toml::Value::Array(_), toml::Value::String(_))
                        if full == "data.path" || full == "data.val_path" =>
                    {
                        true
                    }
                    (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
                };
                if !ok {
                    return Err(ConfigError(format!(
                        "`{full}` expects {}, got {v}",
                        type_name(slot)
                    )));
                }
                *slot = v;
            }
        }
    }
    Ok(())
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Array(_) => "an array",
        _ => "a table",
    }
}

/// The normalised value of a key whose type is parsed from a string (an
/// enum), or `None` for every other key.
fn typed_value(full: &str, v: &toml::Value) -> Result<Option<toml::Value>> {
    let text = match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => other.to_string(),
    };
    match full {
        "train.activation_checkpointing" => {
            let r: Recompute = text
                .parse()
                .map_err(|e| ConfigError(format!("`{full}`: {e}")))?;
            // Integers stay integers in the merged table (as Serialize writes them).
            Ok(Some(match r {
                Recompute::Every(k) => toml::Value::Integer(k as i64),
                r => toml::Value::String(r.to_string()),
            }))
        }
        "train.precision" | "train.reduce_dtype" => {
            let p: Precision = text
                .parse()
                .map_err(|e| ConfigError(format!("`{full}`: {e}")))?;
            Ok(Some(toml::Value::String(p.name().into())))
        }
        _ => match super::choices::parser(full) {
            Some(parse) => parse(full, &text).map(Some).map_err(ConfigError),
            None => Ok(None),
        },
    }
}
