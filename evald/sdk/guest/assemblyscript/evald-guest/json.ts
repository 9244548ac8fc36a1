// One JSON value in, one JSON value out, for a policy evaluator in AssemblyScript
// (docs/writing-evaluators.md, "A policy"): `import { parse, parseError, Writer } from
// "evald-guest/json"`.
//
// `parse` reads one JSON value (RFC 8259: objects, arrays, numbers, strings with every escape,
// true, false, null; no lone surrogates) at most MAX_DEPTH arrays and objects deep, and returns
// null for anything else, with `parseError()` saying why (a guest returns it as `syntax`).
// Numbers keep their JSON text; `Decimal` reads one exactly (no binary floating point: 0.1 +
// 0.2 is 0.3). `Writer` writes one compact JSON value: strings escaped as JSON does, and `<`
// written \u003c, so a value never holds the `<` the ABI forbids in a result.

/** How deeply arrays and objects may nest in a value `parse` accepts. */
export const MAX_DEPTH: i32 = 32;

export enum Kind { Null, Bool, Number, String, Array, Object }

/** One JSON value; `text` is a number's JSON text or a string's value. */
export class Value {
  kind: Kind = Kind.Null;
  flag: bool = false;
  text: string = "";
  /** An array's items, or an object's member values (in document order). */
  items: Value[] = [];
  /** An object's member keys, beside `items`. */
  keys: string[] = [];

  /** An object's member (the last one of that key, as JSON.parse reads duplicates). */
  get(key: string): Value | null {
    if (this.kind != Kind.Object) return null;
    for (let i = this.keys.length - 1; i >= 0; i--) {
      if (this.keys[i] == key) return this.items[i];
    }
    return null;
  }

  /** A number as an exact decimal; null when not a number or beyond Decimal's range. */
  decimal(): Decimal | null {
    return this.kind == Kind.Number ? Decimal.parse(this.text) : null;
  }
}

const I64_MAX: i64 = 9223372036854775807;

function pow10(n: i32): i64 {
  let ten: i64 = 1;
  for (let i = 0; i < n; i++) ten *= 10;
  return ten;
}

/** `units` times 10, or false when it overflows (the result in `scaled`). */
let scaled: i64 = 0;
function times10(units: i64): bool {
  if (units > I64_MAX / 10 || units < -I64_MAX / 10) return false;
  scaled = units * 10;
  return true;
}

/**
 * An exact decimal: units / 10^scale, in an i64, scale at most 18. `parse` refuses a number
 * written with more than 18 significant digits, an exponent beyond 1000, or a value whose
 * units or scale leave that range (trailing zeros past scale 18 dropped first).
 */
export class Decimal {
  constructor(public units: i64, public scale: i32) {}

  static fromInt(n: i64): Decimal {
    return new Decimal(n, 0);
  }

  static parse(text: string): Decimal | null {
    let i = 0;
    const negative = text.length > 0 && text.charCodeAt(0) == 0x2d;
    if (negative) i++;
    let units: i64 = 0;
    let scale = 0;
    let digits = 0;
    let fraction = false;
    for (; i < text.length; i++) {
      const c = text.charCodeAt(i);
      if (c == 0x2e) {
        fraction = true;
      } else if (c >= 0x30 && c <= 0x39) {
        if (digits > 0 || c != 0x30) digits++;
        if (digits > 18) return null;
        units = units * 10 + <i64>(c - 0x30);
        if (fraction) scale++;
      } else break;
    }
    if (i < text.length) {
      i++;
      let sign = -1; // 1e5 lowers the scale by 5, 1e-5 raises it
      const c = text.charCodeAt(i);
      if (c == 0x2b || c == 0x2d) {
        sign = c == 0x2d ? 1 : -1;
        i++;
      }
      let exponent = 0;
      for (; i < text.length; i++) {
        exponent = exponent * 10 + (text.charCodeAt(i) - 0x30);
        if (exponent > 1000) return null;
      }
      scale += sign * exponent;
    }
    for (; scale < 0; scale++) {
      if (!times10(units)) return null;
      units = scaled;
    }
    for (; scale > 18 && units % 10 == 0; scale--) units /= 10;
    if (scale > 18) return null;
    return new Decimal(negative ? -units : units, scale);
  }

  private rescaled(scale: i32): bool {
    let units = this.units;
    for (let s = this.scale; s < scale; s++) {
      if (!times10(units)) return false;
      units = scaled;
    }
    scaled = units;
    return true;
  }

  /** The sum, or null when it leaves the range. */
  add(other: Decimal): Decimal | null {
    const scale = max(this.scale, other.scale);
    if (!this.rescaled(scale)) return null;
    const x = scaled;
    if (!other.rescaled(scale)) return null;
    const y = scaled;
    const sum = x + y;
    if (((x ^ sum) & (y ^ sum)) < 0) return null;
    return new Decimal(sum, scale);
  }

  /** -1, 0 or 1 as this is below, equal to or above `other`. */
  compare(other: Decimal): i32 {
    const ta = pow10(this.scale);
    const tb = pow10(other.scale);
    const ia = this.units / ta;
    const ib = other.units / tb;
    if (ia != ib) return ia < ib ? -1 : 1;
    let fa = this.units % ta; // below 10^18 at either scale
    let fb = other.units % tb;
    for (let s = this.scale; s < other.scale; s++) fa *= 10;
    for (let s = other.scale; s < this.scale; s++) fb *= 10;
    return fa < fb ? -1 : fa > fb ? 1 : 0;
  }

  isInteger(): bool {
    return this.units % pow10(this.scale) == 0;
  }

  /** The whole part (the value itself when `isInteger()`). */
  toInt(): i64 {
    return this.units / pow10(this.scale);
  }
}

let error = "";

/** Why the last `parse` returned null. */
export function parseError(): string {
  return error;
}

/** Parses `text` as exactly one JSON value (whitespace around it allowed), or returns null. */
export function parse(text: string): Value | null {
  error = "";
  const reader = new Reader(text);
  const value = reader.value(0);
  if (value == null) return null;
  reader.space();
  if (reader.pos != text.length) return reader.fail();
  return value;
}

class Reader {
  pos: i32 = 0;
  constructor(public text: string) {}

  fail(message: string = "the input is not one JSON value"): Value | null {
    if (error.length == 0) error = message;
    return null;
  }

  at(): i32 {
    return this.pos < this.text.length ? this.text.charCodeAt(this.pos) : -1;
  }

  space(): void {
    for (;;) {
      const c = this.at();
      if (c != 0x20 && c != 0x09 && c != 0x0a && c != 0x0d) return;
      this.pos++;
    }
  }

  peek(): i32 {
    this.space();
    return this.at();
  }

  word(word: string, value: Value): Value | null {
    if (this.text.substr(this.pos, word.length) != word) return this.fail();
    this.pos += word.length;
    return value;
  }

  value(depth: i32): Value | null {
    const c = this.peek();
    const value = new Value();
    if (c == 0x7b || c == 0x5b) {
      if (depth + 1 > MAX_DEPTH) return this.fail("the input nests arrays and objects too deeply");
      value.kind = c == 0x7b ? Kind.Object : Kind.Array;
      return this.container(value, depth + 1, c == 0x7b ? 0x7d : 0x5d);
    }
    if (c == 0x22) {
      const text = this.string();
      if (text == null) return this.fail();
      value.kind = Kind.String;
      value.text = text;
      return value;
    }
    if (c == 0x74 || c == 0x66) {
      value.kind = Kind.Bool;
      value.flag = c == 0x74;
      return this.word(c == 0x74 ? "true" : "false", value);
    }
    if (c == 0x6e) return this.word("null", value);
    value.kind = Kind.Number;
    return this.number(value);
  }

  container(value: Value, depth: i32, close: i32): Value | null {
    this.pos++;
    if (this.peek() == close) {
      this.pos++;
      return value;
    }
    for (;;) {
      if (value.kind == Kind.Object) {
        if (this.peek() != 0x22) return this.fail();
        const key = this.string();
        if (key == null || this.peek() != 0x3a) return this.fail();
        this.pos++;
        value.keys.push(key);
      }
      const item = this.value(depth);
      if (item == null) return null;
      value.items.push(item);
      const next = this.peek();
      this.pos++;
      if (next == close) return value;
      if (next != 0x2c) return this.fail();
    }
    return null; // not reached: the loop returns
  }

  digits(): i32 {
    const start = this.pos;
    while (this.at() >= 0x30 && this.at() <= 0x39) this.pos++;
    return this.pos - start;
  }

  number(value: Value): Value | null {
    const start = this.pos;
    if (this.at() == 0x2d) this.pos++;
    if (this.at() == 0x30) this.pos++;
    else if (this.digits() == 0) return this.fail();
    if (this.at() == 0x2e) {
      this.pos++;
      if (this.digits() == 0) return this.fail();
    }
    if (this.at() == 0x65 || this.at() == 0x45) {
      this.pos++;
      if (this.at() == 0x2b || this.at() == 0x2d) this.pos++;
      if (this.digits() == 0) return this.fail();
    }
    value.text = this.text.substring(start, this.pos);
    return value;
  }

  hex4(): i32 {
    if (this.pos + 4 > this.text.length) return -1;
    let code = 0;
    for (let k = 0; k < 4; k++) {
      const c = this.text.charCodeAt(this.pos++);
      code <<= 4;
      if (c >= 0x30 && c <= 0x39) code |= c - 0x30;
      else if (c >= 0x61 && c <= 0x66) code |= c - 0x61 + 10;
      else if (c >= 0x41 && c <= 0x46) code |= c - 0x41 + 10;
      else return -1;
    }
    return code;
  }

  /** A string at `pos` (its opening quote), unescaped; null when malformed. */
  string(): string | null {
    this.pos++;
    const parts: string[] = [];
    let run = this.pos;
    for (;;) {
      if (this.pos >= this.text.length) return null;
      const c = this.text.charCodeAt(this.pos);
      if (c == 0x22) {
        parts.push(this.text.substring(run, this.pos++));
        return parts.join("");
      }
      if (c < 0x20) return null;
      if (c != 0x5c) {
        this.pos++;
        continue;
      }
      parts.push(this.text.substring(run, this.pos));
      this.pos++;
      const e = this.at();
      this.pos++;
      if (e == 0x22 || e == 0x5c || e == 0x2f) parts.push(String.fromCharCode(e));
      else if (e == 0x62) parts.push("\b");
      else if (e == 0x66) parts.push("\f");
      else if (e == 0x6e) parts.push("\n");
      else if (e == 0x72) parts.push("\r");
      else if (e == 0x74) parts.push("\t");
      else if (e == 0x75) {
        const code = this.hex4();
        if (code < 0 || (code >= 0xdc00 && code <= 0xdfff)) return null;
        if (code >= 0xd800 && code <= 0xdbff) {
          if (this.text.substr(this.pos, 2) != "\\u") return null;
          this.pos += 2;
          const low = this.hex4();
          if (low < 0xdc00 || low > 0xdfff) return null;
          parts.push(String.fromCharCode(code, low));
        } else parts.push(String.fromCharCode(code));
      } else return null;
      run = this.pos;
    }
    return null; // not reached: the loop returns
  }
}

const HEX = "0123456789abcdef";

/** Writes one compact JSON value: call the methods in document order, then `finish()`. */
export class Writer {
  private out: string[] = [];
  /** Bit d: the container at depth d already holds an item (a comma comes first). */
  private filled: u64 = 0;
  private depth: i32 = 0;
  private afterKey: bool = false;

  /** The text written. */
  finish(): string {
    return this.out.join("");
  }

  private item(): void {
    if (this.afterKey) {
      this.afterKey = false;
      return;
    }
    const bit: u64 = (<u64>1) << <u64>this.depth;
    if (this.filled & bit) this.out.push(",");
    this.filled |= bit;
  }

  private open(bracket: string): void {
    this.item();
    this.out.push(bracket);
    this.depth++;
    this.filled &= ~((<u64>1) << <u64>this.depth);
  }

  beginObject(): void { this.open("{"); }
  beginArray(): void { this.open("["); }
  endObject(): void { this.depth--; this.out.push("}"); }
  endArray(): void { this.depth--; this.out.push("]"); }

  /** An object member's key; the next call writes its value. */
  key(name: string): void {
    this.item();
    this.quoted(name);
    this.out.push(":");
    this.afterKey = true;
  }

  string(text: string): void {
    this.item();
    this.quoted(text);
  }

  private quoted(text: string): void {
    this.out.push("\"");
    let run = 0;
    for (let i = 0; i < text.length; i++) {
      const c = text.charCodeAt(i);
      if (c >= 0x20 && c != 0x22 && c != 0x5c && c != 0x3c) continue;
      this.out.push(text.substring(run, i));
      run = i + 1;
      if (c == 0x22) this.out.push("\\\"");
      else if (c == 0x5c) this.out.push("\\\\");
      else if (c == 0x0a) this.out.push("\\n");
      else if (c == 0x0d) this.out.push("\\r");
      else if (c == 0x09) this.out.push("\\t");
      else if (c == 0x08) this.out.push("\\b");
      else if (c == 0x0c) this.out.push("\\f");
      else this.out.push("\\u00" + HEX.charAt(c >> 4) + HEX.charAt(c & 15));
    }
    this.out.push(text.substring(run));
    this.out.push("\"");
  }

  /** A decimal in plain notation, trailing fractional zeros dropped (7700.5, 7700). */
  decimal(d: Decimal): void {
    this.item();
    let units = d.units;
    let scale = d.scale;
    for (; scale > 0 && units % 10 == 0; scale--) units /= 10;
    let magnitude: u64 = units < 0 ? <u64>0 - <u64>units : <u64>units;
    let digits = magnitude.toString();
    while (digits.length <= scale) digits = "0" + digits;
    if (scale > 0) {
      const point = digits.length - scale;
      digits = digits.substring(0, point) + "." + digits.substring(point);
    }
    this.out.push(units < 0 ? "-" + digits : digits);
  }

  int(n: i64): void { this.decimal(Decimal.fromInt(n)); }
  boolean(b: bool): void { this.item(); this.out.push(b ? "true" : "false"); }
  null(): void { this.item(); this.out.push("null"); }

  /** A value's JSON text as it is (a number as the input wrote it). */
  json(text: string): void { this.item(); this.out.push(text); }
}
