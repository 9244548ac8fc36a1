// json_echo: reads one JSON value with evald-guest/json and writes it back with its writer,
// numbers as exact decimals where they fit (else as written), so a test can hold the library
// to Python's json on any input.

import { Code, evaluator, fail } from "evald-guest";
import { Kind, Value, Writer, parse, parseError } from "evald-guest/json";
export * from "evald-guest/abi";

evaluator(echo, 16384, 65536);

function echo(input: string): string {
  const value = parse(input);
  if (value == null) return fail(Code.Syntax, parseError());
  const out = new Writer();
  write(out, value);
  return out.finish();
}

function write(out: Writer, value: Value): void {
  if (value.kind == Kind.Null) out.null();
  else if (value.kind == Kind.Bool) out.boolean(value.flag);
  else if (value.kind == Kind.Number) {
    const d = value.decimal();
    if (d != null) out.decimal(d);
    else out.json(value.text);
  } else if (value.kind == Kind.String) out.string(value.text);
  else if (value.kind == Kind.Array) {
    out.beginArray();
    for (let i = 0; i < value.items.length; i++) write(out, value.items[i]);
    out.endArray();
  } else {
    out.beginObject();
    for (let i = 0; i < value.items.length; i++) {
      out.key(value.keys[i]);
      write(out, value.items[i]);
    }
    out.endObject();
  }
}
