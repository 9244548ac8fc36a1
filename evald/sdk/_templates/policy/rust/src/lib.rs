//! A template evald policy (ABI v1, docs/abi.md): reads one JSON object, writes one JSON value.
//! {"age": 34, "components": [6500, 1200]} -> {"total":7700,"action":"book_appointment",
//! "reason":"eligible"}. `evald_guest::json` reads the input and writes the value; manifest.json
//! declares both as JSON Schemas, which `evald test` checks.

use evald_guest::json::{self, Decimal, Writer};
use evald_guest::{evaluator, Error, Result};

evaluator!(policy, input_capacity = 4096, output_capacity = 256);

/// The value for one input, or a guest error (`syntax`, `too_large`).
fn policy(input: &str) -> Result<String> {
    let input = json::parse(input)?;
    if !matches!(input, json::Value::Object(_)) {
        return Err(Error::syntax("expected a JSON object"));
    }
    let age = match input.get("age") {
        None | Some(json::Value::Null) => None,
        Some(value) => Some(value.as_i64().ok_or_else(|| Error::syntax("age must be an integer"))?),
    };
    let mut total: Option<Decimal> = None;
    match input.get("components") {
        None | Some(json::Value::Null) => {}
        Some(json::Value::Array(items)) => {
            for item in items {
                let amount = item.decimal().ok_or_else(|| Error::syntax("bad component"))?;
                let sum = match total {
                    Some(t) => t.checked_add(amount),
                    None => Some(amount),
                };
                total = Some(sum.ok_or_else(|| Error::too_large("the total is too large"))?);
            }
        }
        Some(_) => return Err(Error::syntax("components must be an array")),
    }
    let (action, reason) = match (age, total) {
        (None, _) | (_, None) => ("escalate_human", "insufficient_info"),
        (Some(age), _) if age < 18 => ("decline", "under_age"),
        (_, Some(total)) if total > Decimal::from_i64(10000) => ("decline", "over_limit"),
        _ => ("book_appointment", "eligible"),
    };
    let mut out = Writer::new();
    out.begin_object();
    out.key("total");
    match total {
        Some(total) => out.decimal(total),
        None => out.null(),
    }
    out.key("action");
    out.string(action);
    out.key("reason");
    out.string(reason);
    out.end_object();
    Ok(out.finish())
}
