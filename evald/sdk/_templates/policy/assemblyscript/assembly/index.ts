// A template evald policy (ABI v1, docs/abi.md): reads one JSON object, writes one JSON value.
// {"age": 34, "components": [6500, 1200]} -> {"total":7700,"action":"book_appointment",
// "reason":"eligible"}. evald-guest/json reads the input and writes the value; manifest.json
// declares both as JSON Schemas, which `evald test` checks.

import { Code, evaluator, fail } from "evald-guest";
import { Decimal, Kind, Writer, parse, parseError } from "evald-guest/json";
export * from "evald-guest/abi";

const limit = Decimal.fromInt(10000);

evaluator(policy, 4096, 256); // the input and output buffers' capacities, in bytes

/** The value for one input, or `fail(code, message)`. */
function policy(text: string): string {
  const input = parse(text);
  if (input == null) return fail(Code.Syntax, parseError());
  if (input.kind != Kind.Object) return fail(Code.Syntax, "expected a JSON object");
  const age = input.get("age");
  let ageKnown = false;
  let years: i64 = 0;
  if (age != null && age.kind != Kind.Null) {
    const exact = age.decimal();
    if (exact == null || !exact.isInteger()) return fail(Code.Syntax, "age must be an integer");
    ageKnown = true;
    years = exact.toInt();
  }
  let total: Decimal | null = null;
  const components = input.get("components");
  if (components != null && components.kind == Kind.Array) {
    for (let i = 0; i < components.items.length; i++) {
      const amount = components.items[i].decimal();
      if (amount == null) return fail(Code.Syntax, "bad component");
      total = total == null ? amount : total.add(amount);
      if (total == null) return fail(Code.TooLarge, "the total is too large");
    }
  } else if (components != null && components.kind != Kind.Null) {
    return fail(Code.Syntax, "components must be an array");
  }

  let action = "book_appointment";
  let reason = "eligible";
  if (!ageKnown || total == null) {
    action = "escalate_human";
    reason = "insufficient_info";
  } else if (years < 18) {
    action = "decline";
    reason = "under_age";
  } else if (total.compare(limit) > 0) {
    action = "decline";
    reason = "over_limit";
  }
  const out = new Writer();
  out.beginObject();
  out.key("total");
  if (total != null) out.decimal(total);
  else out.null();
  out.key("action");
  out.string(action);
  out.key("reason");
  out.string(reason);
  out.endObject();
  return out.finish();
}
