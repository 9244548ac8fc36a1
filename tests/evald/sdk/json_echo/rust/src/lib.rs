//! json_echo: reads one JSON value with evald_guest::json and writes it back with its writer,
//! numbers as exact decimals where they fit (else as written), so a test can hold the library
//! to Python's json on any input.

use evald_guest::json::{self, Value, Writer};
use evald_guest::{evaluator, Result};

evaluator!(echo, input_capacity = 16384, output_capacity = 65536);

fn echo(input: &str) -> Result<String> {
    let value = json::parse(input)?;
    let mut out = Writer::new();
    write(&mut out, &value);
    Ok(out.finish())
}

fn write(out: &mut Writer, value: &Value) {
    match value {
        Value::Null => out.null(),
        Value::Bool(b) => out.boolean(*b),
        Value::Number(text) => match value.decimal() {
            Some(d) => out.decimal(d),
            None => out.json(text),
        },
        Value::String(text) => out.string(text),
        Value::Array(items) => {
            out.begin_array();
            for item in items {
                write(out, item);
            }
            out.end_array();
        }
        Value::Object(members) => {
            out.begin_object();
            for (key, item) in members {
                out.key(key);
                write(out, item);
            }
            out.end_object();
        }
    }
}
