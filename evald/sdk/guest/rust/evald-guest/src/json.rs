//! One JSON value in, one JSON value out, for a policy evaluator (docs/writing-evaluators.md,
//! "A policy"), with `core` and `alloc` only.
//!
//! [`parse`] reads one JSON value (RFC 8259: objects, arrays, numbers, strings with every
//! escape, true, false, null; no lone surrogates) at most [`MAX_DEPTH`] arrays and objects
//! deep; anything else is a [`ParseError`], which `?` turns into a `syntax` error. Numbers keep
//! their JSON text; [`Decimal`] reads one exactly (no binary floating point: 0.1 + 0.2 is 0.3).
//!
//! [`Writer`] writes one compact JSON value: strings escaped as JSON does, and `<` written
//! `\u003c`, so a value never holds the `<` the ABI forbids in a result.
//!
//! ```ignore
//! use evald_guest::json::{self, Writer};
//! let input = json::parse(text)?;
//! let age = input.get("age").and_then(|v| v.as_i64());
//! let mut out = Writer::new();
//! out.begin_object();
//! out.key("adult");
//! out.boolean(age.map_or(false, |a| a >= 18));
//! out.end_object();
//! Ok(out.finish())
//! ```

use alloc::string::String;
use alloc::vec::Vec;
use core::cmp::Ordering;

/// How deeply arrays and objects may nest in a value [`parse`] accepts.
pub const MAX_DEPTH: usize = 32;

/// Why [`parse`] refused its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParseError {
    Syntax,
    TooDeep,
}

impl ParseError {
    pub fn message(self) -> &'static str {
        match self {
            ParseError::Syntax => "the input is not one JSON value",
            ParseError::TooDeep => "the input nests arrays and objects too deeply",
        }
    }
}

impl From<ParseError> for crate::Error {
    fn from(error: ParseError) -> crate::Error {
        crate::Error::syntax(error.message())
    }
}

/// One JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    /// The number's JSON text as written (read it with [`Value::decimal`] or [`Value::as_i64`]).
    Number(String),
    String(String),
    Array(Vec<Value>),
    /// The members in document order.
    Object(Vec<(String, Value)>),
}

impl Value {
    /// An object's member (the last one of that key, as JSON.parse reads duplicates).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// A number as an exact decimal; None when not a number or beyond [`Decimal`]'s range.
    pub fn decimal(&self) -> Option<Decimal> {
        match self {
            Value::Number(text) => Decimal::parse(text),
            _ => None,
        }
    }

    /// A number with no fractional part (`34`, `34.0`, `3.4e1`) as an integer.
    pub fn as_i64(&self) -> Option<i64> {
        self.decimal().and_then(|d| d.to_i64())
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
}

/// An exact decimal: `units / 10^scale`, in an i64, scale at most 18. [`Decimal::parse`]
/// refuses a number written with more than 18 significant digits, an exponent beyond 1000, or
/// a value whose units or scale leave that range (trailing zeros past scale 18 dropped first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decimal {
    pub units: i64,
    pub scale: u8,
}

fn pow10(n: u8) -> i64 {
    10i64.pow(n as u32)
}

impl Decimal {
    pub const MAX_SCALE: u8 = 18;

    pub fn from_i64(n: i64) -> Decimal {
        Decimal { units: n, scale: 0 }
    }

    /// Reads a JSON number's text.
    pub fn parse(text: &str) -> Option<Decimal> {
        let bytes = text.as_bytes();
        let negative = bytes.first() == Some(&b'-');
        let mut i = negative as usize;
        let (mut units, mut scale, mut digits, mut fraction) = (0i64, 0i32, 0u32, false);
        while i < bytes.len() {
            match bytes[i] {
                b'.' => fraction = true,
                c @ b'0'..=b'9' => {
                    if digits > 0 || c != b'0' {
                        digits += 1;
                    }
                    if digits > 18 {
                        return None;
                    }
                    units = units * 10 + (c - b'0') as i64;
                    scale += fraction as i32;
                }
                _ => break,
            }
            i += 1;
        }
        if i < bytes.len() {
            i += 1;
            let mut sign = -1; // 1e5 lowers the scale by 5, 1e-5 raises it
            if bytes[i] == b'+' || bytes[i] == b'-' {
                sign = if bytes[i] == b'-' { 1 } else { -1 };
                i += 1;
            }
            let mut exponent = 0i32;
            for &c in &bytes[i..] {
                exponent = exponent * 10 + (c - b'0') as i32;
                if exponent > 1000 {
                    return None;
                }
            }
            scale += sign * exponent;
        }
        while scale < 0 {
            units = units.checked_mul(10)?;
            scale += 1;
        }
        while scale > Decimal::MAX_SCALE as i32 && units % 10 == 0 {
            units /= 10;
            scale -= 1;
        }
        if scale > Decimal::MAX_SCALE as i32 {
            return None;
        }
        Some(Decimal { units: if negative { -units } else { units }, scale: scale as u8 })
    }

    fn rescale(self, scale: u8) -> Option<i64> {
        self.units.checked_mul(pow10(scale - self.scale))
    }

    /// The sum, or None when it leaves the range.
    pub fn checked_add(self, other: Decimal) -> Option<Decimal> {
        let scale = self.scale.max(other.scale);
        let units = self.rescale(scale)?.checked_add(other.rescale(scale)?)?;
        Some(Decimal { units, scale })
    }

    pub fn to_i64(self) -> Option<i64> {
        let ten = pow10(self.scale);
        if self.units % ten != 0 {
            return None;
        }
        Some(self.units / ten)
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Decimal) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Decimal {
    fn cmp(&self, other: &Decimal) -> Ordering {
        let scale = self.scale.max(other.scale);
        let x = self.units as i128 * pow10(scale - self.scale) as i128;
        let y = other.units as i128 * pow10(scale - other.scale) as i128;
        x.cmp(&y)
    }
}

/// Parses `text` as exactly one JSON value (whitespace around it allowed).
pub fn parse(text: &str) -> Result<Value, ParseError> {
    let mut reader = Reader { text: text.as_bytes(), pos: 0 };
    let value = reader.value(0)?;
    reader.space();
    if reader.pos != reader.text.len() {
        return Err(ParseError::Syntax);
    }
    Ok(value)
}

struct Reader<'a> {
    text: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn space(&mut self) {
        while self.pos < self.text.len() && b" \t\n\r".contains(&self.text[self.pos]) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.text.get(self.pos).copied()
    }

    fn word(&mut self, word: &str, value: Value) -> Result<Value, ParseError> {
        if !self.text[self.pos..].starts_with(word.as_bytes()) {
            return Err(ParseError::Syntax);
        }
        self.pos += word.len();
        Ok(value)
    }

    fn value(&mut self, depth: usize) -> Result<Value, ParseError> {
        match self.peek().ok_or(ParseError::Syntax)? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => Ok(Value::String(self.string()?)),
            b't' => self.word("true", Value::Bool(true)),
            b'f' => self.word("false", Value::Bool(false)),
            b'n' => self.word("null", Value::Null),
            _ => self.number(),
        }
    }

    /// After the opening bracket: true for an empty container (its closing bracket taken).
    fn open(&mut self, depth: usize, close: u8) -> Result<bool, ParseError> {
        if depth > MAX_DEPTH {
            return Err(ParseError::TooDeep);
        }
        self.pos += 1;
        if self.peek() == Some(close) {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// After an item: true at the closing bracket, false after a comma.
    fn after_item(&mut self, close: u8) -> Result<bool, ParseError> {
        let next = self.peek().ok_or(ParseError::Syntax)?;
        self.pos += 1;
        match next {
            c if c == close => Ok(true),
            b',' => Ok(false),
            _ => Err(ParseError::Syntax),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, ParseError> {
        let mut members = Vec::new();
        if !self.open(depth, b'}')? {
            loop {
                if self.peek() != Some(b'"') {
                    return Err(ParseError::Syntax);
                }
                let key = self.string()?;
                if self.peek() != Some(b':') {
                    return Err(ParseError::Syntax);
                }
                self.pos += 1;
                members.push((key, self.value(depth)?));
                if self.after_item(b'}')? {
                    break;
                }
            }
        }
        Ok(Value::Object(members))
    }

    fn array(&mut self, depth: usize) -> Result<Value, ParseError> {
        let mut items = Vec::new();
        if !self.open(depth, b']')? {
            loop {
                items.push(self.value(depth)?);
                if self.after_item(b']')? {
                    break;
                }
            }
        }
        Ok(Value::Array(items))
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while self.pos < self.text.len() && self.text[self.pos].is_ascii_digit() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn at(&self, options: &[u8]) -> bool {
        self.pos < self.text.len() && options.contains(&self.text[self.pos])
    }

    fn number(&mut self) -> Result<Value, ParseError> {
        let start = self.pos;
        if self.at(b"-") {
            self.pos += 1;
        }
        if self.at(b"0") {
            self.pos += 1;
        } else if self.digits() == 0 {
            return Err(ParseError::Syntax);
        }
        if self.at(b".") {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(ParseError::Syntax);
            }
        }
        if self.at(b"eE") {
            self.pos += 1;
            if self.at(b"+-") {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(ParseError::Syntax);
            }
        }
        let text = core::str::from_utf8(&self.text[start..self.pos]).unwrap_or("");
        Ok(Value::Number(String::from(text)))
    }

    fn hex4(&mut self) -> Result<u32, ParseError> {
        let digits = self.text.get(self.pos..self.pos + 4).ok_or(ParseError::Syntax)?;
        let text = core::str::from_utf8(digits).map_err(|_| ParseError::Syntax)?;
        if !digits.iter().all(|c| c.is_ascii_hexdigit()) {
            return Err(ParseError::Syntax);
        }
        self.pos += 4;
        u32::from_str_radix(text, 16).map_err(|_| ParseError::Syntax)
    }

    fn string(&mut self) -> Result<String, ParseError> {
        self.pos += 1;
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = *self.text.get(self.pos).ok_or(ParseError::Syntax)?;
            self.pos += 1;
            match c {
                b'"' => return String::from_utf8(out).map_err(|_| ParseError::Syntax),
                b'\\' => {
                    let e = *self.text.get(self.pos).ok_or(ParseError::Syntax)?;
                    self.pos += 1;
                    let plain = match e {
                        b'"' | b'\\' | b'/' => e,
                        b'b' => 8,
                        b'f' => 12,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => 0,
                        _ => return Err(ParseError::Syntax),
                    };
                    if e != b'u' {
                        out.push(plain);
                        continue;
                    }
                    let mut code = self.hex4()?;
                    if (0xdc00..=0xdfff).contains(&code) {
                        return Err(ParseError::Syntax);
                    }
                    if (0xd800..=0xdbff).contains(&code) {
                        if !self.text[self.pos..].starts_with(b"\\u") {
                            return Err(ParseError::Syntax);
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xdc00..=0xdfff).contains(&low) {
                            return Err(ParseError::Syntax);
                        }
                        code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                    }
                    let ch = char::from_u32(code).ok_or(ParseError::Syntax)?;
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                c if c < 0x20 => return Err(ParseError::Syntax),
                c => out.push(c),
            }
        }
    }
}

/// Writes one compact JSON value: call the methods in document order, then [`Writer::finish`].
#[derive(Default)]
pub struct Writer {
    out: String,
    /// Bit d: the container at depth d already holds an item (a comma comes first).
    filled: u64,
    depth: u32,
    after_key: bool,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    /// The text written.
    pub fn finish(self) -> String {
        self.out
    }

    fn item(&mut self) {
        if self.after_key {
            self.after_key = false;
            return;
        }
        if self.filled & (1 << self.depth) != 0 {
            self.out.push(',');
        }
        self.filled |= 1 << self.depth;
    }

    fn open(&mut self, bracket: char) {
        self.item();
        self.out.push(bracket);
        self.depth += 1;
        self.filled &= !(1 << self.depth);
    }

    fn close(&mut self, bracket: char) {
        self.depth -= 1;
        self.out.push(bracket);
    }

    pub fn begin_object(&mut self) {
        self.open('{');
    }
    pub fn end_object(&mut self) {
        self.close('}');
    }
    pub fn begin_array(&mut self) {
        self.open('[');
    }
    pub fn end_array(&mut self) {
        self.close(']');
    }

    /// An object member's key; the next call writes its value.
    pub fn key(&mut self, name: &str) {
        self.item();
        self.quoted(name);
        self.out.push(':');
        self.after_key = true;
    }

    pub fn string(&mut self, text: &str) {
        self.item();
        self.quoted(text);
    }

    fn quoted(&mut self, text: &str) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.out.push('"');
        for c in text.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || c == '<' => {
                    let b = c as usize;
                    self.out.push_str("\\u00");
                    self.out.push(HEX[b >> 4] as char);
                    self.out.push(HEX[b & 15] as char);
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }

    /// A decimal in plain notation, trailing fractional zeros dropped (`7700.5`, `7700`).
    pub fn decimal(&mut self, d: Decimal) {
        self.item();
        let (mut units, mut scale) = (d.units, d.scale);
        while scale > 0 && units % 10 == 0 {
            units /= 10;
            scale -= 1;
        }
        let mut magnitude = units.unsigned_abs();
        let mut text = [0u8; 48];
        let mut i = text.len();
        let mut written = 0u8;
        while magnitude > 0 || written <= scale {
            if written == scale && scale > 0 {
                i -= 1;
                text[i] = b'.';
            }
            i -= 1;
            text[i] = b'0' + (magnitude % 10) as u8;
            magnitude /= 10;
            written += 1;
        }
        if units < 0 {
            i -= 1;
            text[i] = b'-';
        }
        self.out.push_str(core::str::from_utf8(&text[i..]).unwrap_or("0"));
    }

    pub fn int(&mut self, n: i64) {
        self.decimal(Decimal::from_i64(n));
    }

    pub fn boolean(&mut self, b: bool) {
        self.item();
        self.out.push_str(if b { "true" } else { "false" });
    }

    pub fn null(&mut self) {
        self.item();
        self.out.push_str("null");
    }

    /// A value's JSON text as it is (a number as the input wrote it).
    pub fn json(&mut self, text: &str) {
        self.item();
        self.out.push_str(text);
    }
}
