//! evald_json: one JSON value in, one JSON value out, for a policy evaluator (docs/abi.md,
//! docs/writing-evaluators.md "A policy"). `evald build` makes it importable from any Zig
//! guest as `@import("evald_json")`.
//!
//! The reader parses one JSON value (RFC 8259: objects, arrays, numbers, strings with every
//! escape, true, false, null) into a tree allocated from the allocator it is given (a
//! `std.heap.FixedBufferAllocator` over a static buffer: the guest has no heap of its own),
//! at most `max_depth` arrays and objects deep. It refuses anything else with an `Error` whose
//! `message` a guest returns as a `syntax` error. Numbers keep their JSON text; `Decimal` reads
//! one exactly (no binary floating point: 0.1 + 0.2 is 0.3), so a policy's sums and limits
//! give the same answer as a Python reference with `decimal.Decimal`.
//!
//! The writer writes one compact JSON value into a fixed buffer (the ABI's output buffer):
//! objects, arrays, strings (escaped, and `<` written `\u003c`, so a value can never hold the
//! `<` the ABI forbids in a result), integers, decimals, booleans and null.

const std = @import("std");

/// How deeply arrays and objects may nest in a value the reader accepts.
pub const max_depth: usize = 32;

pub const Error = error{ Syntax, TooDeep, OutOfMemory };

/// A message for people, for a guest's `syntax` (or `too_large`) error.
pub fn message(err: Error) []const u8 {
    return switch (err) {
        error.Syntax => "the input is not one JSON value",
        error.TooDeep => "the input nests arrays and objects too deeply",
        error.OutOfMemory => "the input holds more values than the evaluator has room for",
    };
}

pub const Member = struct { key: []const u8, value: Value };

pub const Value = union(enum) {
    null,
    bool: bool,
    /// The number's JSON text as written (read it with `decimal` or `int`).
    number: []const u8,
    /// The string, unescaped (UTF-8).
    string: []const u8,
    array: []const Value,
    object: []const Member,

    /// An object's member (the last one of that key, as JSON.parse reads duplicates), or null.
    pub fn get(self: Value, key: []const u8) ?Value {
        if (self != .object) return null;
        var i = self.object.len;
        while (i > 0) {
            i -= 1;
            if (std.mem.eql(u8, self.object[i].key, key)) return self.object[i].value;
        }
        return null;
    }

    /// A number as an exact decimal, or null (not a number, or beyond `Decimal`'s range).
    pub fn decimal(self: Value) ?Decimal {
        if (self != .number) return null;
        return Decimal.parse(self.number);
    }

    /// A number with no fractional part (`34`, `34.0`, `3.4e1`) as an integer, or null.
    pub fn int(self: Value) ?i64 {
        const d = self.decimal() orelse return null;
        return d.toInt();
    }
};

/// An exact decimal: `units / 10^scale`, in an i64 (at most 18 significant digits as written),
/// scale at most 18. `parse` refuses (null) a number written with more than 18 significant
/// digits, an exponent beyond `max_exponent`, or a value whose units or scale leave that range
/// once the exponent is applied (trailing zeros past scale 18 are dropped first).
pub const Decimal = struct {
    units: i64,
    scale: u8,

    pub const max_scale: u8 = 18;
    /// The largest exponent a number may be written with (`1e1000`).
    pub const max_exponent: i32 = 1000;

    pub fn fromInt(n: i64) Decimal {
        return .{ .units = n, .scale = 0 };
    }

    /// Reads a JSON number's text; null beyond the range.
    pub fn parse(text: []const u8) ?Decimal {
        var i: usize = 0;
        const negative = i < text.len and text[i] == '-';
        if (negative) i += 1;
        var units: i64 = 0;
        var scale: i32 = 0;
        var digits: u32 = 0;
        var fraction = false;
        while (i < text.len) : (i += 1) {
            const c = text[i];
            if (c == '.') {
                fraction = true;
            } else if (c >= '0' and c <= '9') {
                if (digits > 0 or c != '0') digits += 1;
                if (digits > 18) return null;
                units = units * 10 + (c - '0');
                if (fraction) scale += 1;
            } else break;
        }
        if (i < text.len) { // an exponent: e, E, then an optional sign and digits
            i += 1;
            var exp_negative = false;
            if (i < text.len and (text[i] == '+' or text[i] == '-')) {
                exp_negative = text[i] == '-';
                i += 1;
            }
            var exponent: i32 = 0;
            while (i < text.len) : (i += 1) {
                exponent = exponent * 10 + @as(i32, text[i] - '0');
                if (exponent > max_exponent) return null;
            }
            scale += if (exp_negative) exponent else -exponent;
        }
        while (scale < 0) : (scale += 1) {
            units = std.math.mul(i64, units, 10) catch return null;
        }
        while (scale > 0 and @rem(units, 10) == 0 and scale > max_scale) : (scale -= 1) {
            units = @divTrunc(units, 10);
        }
        if (scale > max_scale) return null;
        return .{ .units = if (negative) -units else units, .scale = @intCast(scale) };
    }

    fn rescale(self: Decimal, scale: u8) ?i64 {
        var units = self.units;
        var s = self.scale;
        while (s < scale) : (s += 1) units = std.math.mul(i64, units, 10) catch return null;
        return units;
    }

    /// The sum, or null when it leaves the range.
    pub fn add(a: Decimal, b: Decimal) ?Decimal {
        const scale = @max(a.scale, b.scale);
        const x = a.rescale(scale) orelse return null;
        const y = b.rescale(scale) orelse return null;
        return .{ .units = std.math.add(i64, x, y) catch return null, .scale = scale };
    }

    pub fn order(a: Decimal, b: Decimal) std.math.Order {
        const scale = @max(a.scale, b.scale);
        const x: i128 = @as(i128, a.units) * std.math.pow(i128, 10, scale - a.scale);
        const y: i128 = @as(i128, b.units) * std.math.pow(i128, 10, scale - b.scale);
        return std.math.order(x, y);
    }

    pub fn toInt(self: Decimal) ?i64 {
        const ten = std.math.pow(i64, 10, self.scale);
        if (@rem(self.units, ten) != 0) return null;
        return @divTrunc(self.units, ten);
    }
};

/// Parses `text` as exactly one JSON value (whitespace around it allowed).
pub fn parse(allocator: std.mem.Allocator, text: []const u8) Error!Value {
    if (!std.unicode.utf8ValidateSlice(text)) return error.Syntax;
    var reader = Reader{ .text = text, .allocator = allocator };
    const value = try reader.value(0);
    reader.skipSpace();
    if (reader.pos != text.len) return error.Syntax;
    return value;
}

const Reader = struct {
    text: []const u8,
    pos: usize = 0,
    allocator: std.mem.Allocator,

    fn skipSpace(self: *Reader) void {
        while (self.pos < self.text.len) : (self.pos += 1) {
            switch (self.text[self.pos]) {
                ' ', '\t', '\n', '\r' => {},
                else => return,
            }
        }
    }

    fn peek(self: *Reader) ?u8 {
        self.skipSpace();
        return if (self.pos < self.text.len) self.text[self.pos] else null;
    }

    fn literal(self: *Reader, word: []const u8) Error!void {
        if (!std.mem.startsWith(u8, self.text[self.pos..], word)) return error.Syntax;
        self.pos += word.len;
    }

    fn value(self: *Reader, depth: usize) Error!Value {
        const c = self.peek() orelse return error.Syntax;
        switch (c) {
            '{' => return self.object(depth + 1),
            '[' => return self.array(depth + 1),
            '"' => return .{ .string = try self.string() },
            't' => {
                try self.literal("true");
                return .{ .bool = true };
            },
            'f' => {
                try self.literal("false");
                return .{ .bool = false };
            },
            'n' => {
                try self.literal("null");
                return .null;
            },
            else => return .{ .number = try self.number() },
        }
    }

    fn object(self: *Reader, depth: usize) Error!Value {
        if (depth > max_depth) return error.TooDeep;
        self.pos += 1;
        var members: std.ArrayListUnmanaged(Member) = .empty;
        if (self.peek() == '}') {
            self.pos += 1;
            return .{ .object = &.{} };
        }
        while (true) {
            if (self.peek() != '"') return error.Syntax;
            const key = try self.string();
            if (self.peek() != ':') return error.Syntax;
            self.pos += 1;
            try members.append(self.allocator, .{ .key = key, .value = try self.value(depth) });
            const next = self.peek() orelse return error.Syntax;
            self.pos += 1;
            if (next == '}') return .{ .object = try members.toOwnedSlice(self.allocator) };
            if (next != ',') return error.Syntax;
        }
    }

    fn array(self: *Reader, depth: usize) Error!Value {
        if (depth > max_depth) return error.TooDeep;
        self.pos += 1;
        var items: std.ArrayListUnmanaged(Value) = .empty;
        if (self.peek() == ']') {
            self.pos += 1;
            return .{ .array = &.{} };
        }
        while (true) {
            try items.append(self.allocator, try self.value(depth));
            const next = self.peek() orelse return error.Syntax;
            self.pos += 1;
            if (next == ']') return .{ .array = try items.toOwnedSlice(self.allocator) };
            if (next != ',') return error.Syntax;
        }
    }

    /// Whether the byte at `pos` is one of `options`.
    fn at(self: *Reader, options: []const u8) bool {
        return self.pos < self.text.len and std.mem.indexOfScalar(u8, options, self.text[self.pos]) != null;
    }

    fn digits(self: *Reader) usize {
        const start = self.pos;
        while (self.at("0123456789")) self.pos += 1;
        return self.pos - start;
    }

    fn number(self: *Reader) Error![]const u8 {
        const start = self.pos;
        if (self.at("-")) self.pos += 1;
        if (self.at("0")) {
            self.pos += 1;
        } else if (self.digits() == 0) return error.Syntax;
        if (self.at(".")) {
            self.pos += 1;
            if (self.digits() == 0) return error.Syntax;
        }
        if (self.at("eE")) {
            self.pos += 1;
            if (self.at("+-")) self.pos += 1;
            if (self.digits() == 0) return error.Syntax;
        }
        return self.text[start..self.pos];
    }

    /// Four hex digits, exactly (no sign, no `_`, as std.fmt.parseInt would allow).
    fn hex4(self: *Reader) Error!u21 {
        if (self.pos + 4 > self.text.len) return error.Syntax;
        var code: u21 = 0;
        for (self.text[self.pos .. self.pos + 4]) |c| {
            const digit: u21 = switch (c) {
                '0'...'9' => c - '0',
                'a'...'f' => c - 'a' + 10,
                'A'...'F' => c - 'A' + 10,
                else => return error.Syntax,
            };
            code = code * 16 + digit;
        }
        self.pos += 4;
        return code;
    }

    /// A string at `pos` (its opening quote), unescaped into new memory.
    fn string(self: *Reader) Error![]const u8 {
        self.pos += 1;
        var out: std.ArrayListUnmanaged(u8) = .empty;
        while (true) {
            if (self.pos >= self.text.len) return error.Syntax;
            const c = self.text[self.pos];
            self.pos += 1;
            switch (c) {
                '"' => return out.toOwnedSlice(self.allocator),
                '\\' => {
                    if (self.pos >= self.text.len) return error.Syntax;
                    const e = self.text[self.pos];
                    self.pos += 1;
                    const plain: ?u8 = switch (e) {
                        '"' => '"',
                        '\\' => '\\',
                        '/' => '/',
                        'b' => 8,
                        'f' => 12,
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        'u' => null,
                        else => return error.Syntax,
                    };
                    if (plain) |p| {
                        try out.append(self.allocator, p);
                        continue;
                    }
                    var code = try self.hex4();
                    if (code >= 0xDC00 and code <= 0xDFFF) return error.Syntax;
                    if (code >= 0xD800 and code <= 0xDBFF) { // a surrogate pair: \uD8xx\uDCxx
                        try self.literal("\\u");
                        const low = try self.hex4();
                        if (low < 0xDC00 or low > 0xDFFF) return error.Syntax;
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    }
                    var buf: [4]u8 = undefined;
                    const n = std.unicode.utf8Encode(code, &buf) catch return error.Syntax;
                    try out.appendSlice(self.allocator, buf[0..n]);
                },
                else => {
                    if (c < 0x20) return error.Syntax;
                    try out.append(self.allocator, c);
                },
            }
        }
    }
};

/// Writes one compact JSON value into `buf`. Call the methods in document order; `finish`
/// gives the text, or null when it did not fit (a guest's `too_large`).
pub const Writer = struct {
    buf: []u8,
    len: usize = 0,
    overflow: bool = false,
    /// Bit d: the container at depth d already holds an item (a comma comes first).
    filled: u64 = 0,
    depth: u6 = 0,
    after_key: bool = false,

    pub fn init(buf: []u8) Writer {
        return .{ .buf = buf };
    }

    pub fn finish(self: *Writer) ?[]const u8 {
        if (self.overflow or self.depth != 0) return null;
        return self.buf[0..self.len];
    }

    fn raw(self: *Writer, text: []const u8) void {
        if (self.overflow or self.len + text.len > self.buf.len) {
            self.overflow = true;
            return;
        }
        @memcpy(self.buf[self.len .. self.len + text.len], text);
        self.len += text.len;
    }

    /// The comma before an item, unless it is a member's value or its container's first.
    fn item(self: *Writer) void {
        if (self.after_key) {
            self.after_key = false;
            return;
        }
        const bit = @as(u64, 1) << self.depth;
        if (self.filled & bit != 0) self.raw(",");
        self.filled |= bit;
    }

    fn open(self: *Writer, bracket: []const u8) void {
        self.item();
        self.raw(bracket);
        self.depth += 1;
        self.filled &= ~(@as(u64, 1) << self.depth);
    }

    fn close(self: *Writer, bracket: []const u8) void {
        self.depth -= 1;
        self.raw(bracket);
    }

    pub fn beginObject(self: *Writer) void {
        self.open("{");
    }
    pub fn endObject(self: *Writer) void {
        self.close("}");
    }
    pub fn beginArray(self: *Writer) void {
        self.open("[");
    }
    pub fn endArray(self: *Writer) void {
        self.close("]");
    }

    /// An object member's key; the next call writes its value.
    pub fn key(self: *Writer, name: []const u8) void {
        self.item();
        self.quoted(name);
        self.raw(":");
        self.after_key = true;
    }

    pub fn string(self: *Writer, text: []const u8) void {
        self.item();
        self.quoted(text);
    }

    fn quoted(self: *Writer, text: []const u8) void {
        self.raw("\"");
        for (text) |c| {
            switch (c) {
                '"' => self.raw("\\\""),
                '\\' => self.raw("\\\\"),
                '\n' => self.raw("\\n"),
                '\r' => self.raw("\\r"),
                '\t' => self.raw("\\t"),
                8 => self.raw("\\b"),
                12 => self.raw("\\f"),
                '<' => self.raw("\\u003c"),
                0...7, 11, 14...0x1f => {
                    const hex = "0123456789abcdef";
                    self.raw(&[_]u8{ '\\', 'u', '0', '0', hex[c >> 4], hex[c & 15] });
                },
                else => self.raw(&[_]u8{c}),
            }
        }
        self.raw("\"");
    }

    pub fn int(self: *Writer, n: i64) void {
        self.decimal(Decimal.fromInt(n));
    }

    /// A decimal in plain notation, trailing fractional zeros dropped (`7700.5`, `7700`).
    pub fn decimal(self: *Writer, d: Decimal) void {
        self.item();
        if (d.scale > Decimal.max_scale) { // not a Decimal `parse` or `add` makes
            self.overflow = true;
            return;
        }
        var units = d.units;
        var scale = d.scale;
        while (scale > 0 and @rem(units, 10) == 0) : (scale -= 1) units = @divTrunc(units, 10);
        var magnitude: u64 = @abs(units);
        var text: [40]u8 = undefined;
        var i: usize = text.len;
        var written: u8 = 0;
        while (magnitude > 0 or written <= scale) : (written += 1) {
            if (written == scale and scale > 0) {
                i -= 1;
                text[i] = '.';
            }
            i -= 1;
            text[i] = @intCast('0' + magnitude % 10);
            magnitude /= 10;
        }
        if (units < 0) {
            i -= 1;
            text[i] = '-';
        }
        self.raw(text[i..]);
    }

    pub fn boolean(self: *Writer, b: bool) void {
        self.item();
        self.raw(if (b) "true" else "false");
    }

    pub fn null_(self: *Writer) void {
        self.item();
        self.raw("null");
    }

    /// A value written elsewhere (its JSON text, e.g. a number as the input wrote it).
    pub fn json(self: *Writer, text: []const u8) void {
        self.item();
        self.raw(text);
    }
};
