//! strop/1: string operations over Unicode code points (docs/semantics/strop.md).
//!
//! One left-to-right pass: every call is evaluated as soon as its closing parenthesis is read and
//! the first problem found is the error. The Python reference
//! (evaluators_wasm/reference/strop.py) has the same structure, so both report the same error,
//! with the same message, for an input with several problems.
//!
//! Memory is static and bounded by the limits: every string value is bump-allocated from `arena`,
//! whose size is the per-input budget of code points, so the budget check before each allocation
//! is also the bounds check. Nothing survives from one call to the next (`total` is reset).

const std = @import("std");

const input_cap = 1 << 20;
const output_cap = 64 * 1024;
const max_string = 100_000;
const max_total = 1_000_000;
const max_depth = 16;
const max_int_abs = 999_999_999;
const name_shown = 24; // characters of an unknown name quoted in the message

var input_buf: [input_cap]u8 = undefined;
var output_buf: [output_cap]u8 = undefined;
var arena: [max_total]u32 = undefined;
var kmp_table: [max_string]u32 = undefined;
var message_buf: [256]u8 = undefined;
var message: []const u8 = "";

export fn evald_abi_version() i32 {
    return 1;
}
export fn evald_input_ptr() i32 {
    return @intCast(@intFromPtr(&input_buf));
}
export fn evald_input_cap() i32 {
    return input_cap;
}
export fn evald_output_ptr() i32 {
    return @intCast(@intFromPtr(&output_buf));
}
export fn evald_output_cap() i32 {
    return output_cap;
}

const Error = error{ Syntax, Overflow, TooLarge };

fn fail(err: Error, comptime fmt: []const u8, args: anytype) Error {
    message = std.fmt.bufPrint(&message_buf, fmt, args) catch "(message too long)";
    return err;
}

export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_cap) {
        return writeError("syntax", "input length out of range");
    }
    const len: usize = @intCast(input_len);
    const out_len = run(input_buf[0..len]) catch |err| {
        const code = switch (err) {
            error.Syntax => "syntax",
            error.Overflow => "overflow",
            error.TooLarge => "too_large",
        };
        return writeError(code, message);
    };
    return @intCast(out_len);
}

fn writeError(code: []const u8, text: []const u8) i32 {
    const n = code.len + 1 + text.len;
    @memcpy(output_buf[0..code.len], code);
    output_buf[code.len] = ':';
    @memcpy(output_buf[code.len + 1 .. n], text);
    return -@as(i32, @intCast(n));
}

// Eight bytes at a time (SWAR): a 1 MiB input is scanned in a fraction of the fuel a byte loop
// costs, which keeps the largest inputs well inside the default fuel and deadline.
const ones: u64 = 0x0101010101010101;
const high_bits: u64 = 0x8080808080808080;

fn word64(s: []const u8, i: usize) u64 {
    return std.mem.readInt(u64, s[i..][0..8], .little);
}

/// Whether any byte of `w` equals `b` (exact: the classic has-zero-byte test on `w ^ b...b`).
fn hasByte(w: u64, comptime b: u8) bool {
    const x = w ^ (ones * b);
    return ((x -% ones) & ~x & high_bits) != 0;
}

/// Offset of the first byte of the first ill-formed UTF-8 sequence (the offset Python reports).
fn firstInvalidUtf8(s: []const u8) ?usize {
    var i: usize = 0;
    while (i < s.len) {
        while (i + 8 <= s.len and word64(s, i) & high_bits == 0) i += 8;
        if (i >= s.len) break;
        const b = s[i];
        if (b < 0x80) {
            i += 1;
            continue;
        }
        var extra: usize = 0;
        var lo: u8 = 0x80;
        var hi: u8 = 0xBF;
        switch (b) {
            0xC2...0xDF => extra = 1,
            0xE0 => {
                extra = 2;
                lo = 0xA0;
            },
            0xE1...0xEC, 0xEE, 0xEF => extra = 2,
            0xED => {
                extra = 2;
                hi = 0x9F;
            },
            0xF0 => {
                extra = 3;
                lo = 0x90;
            },
            0xF1...0xF3 => extra = 3,
            0xF4 => {
                extra = 3;
                hi = 0x8F;
            },
            else => return i,
        }
        if (i + extra >= s.len) return i;
        if (s[i + 1] < lo or s[i + 1] > hi) return i;
        var k: usize = 2;
        while (k <= extra) : (k += 1) {
            if (s[i + k] < 0x80 or s[i + k] > 0xBF) return i;
        }
        i += extra + 1;
    }
    return null;
}

/// Decodes the (already validated) UTF-8 sequence at `s[i]`; returns the code point and its size.
fn decodeAt(s: []const u8, i: usize) struct { cp: u32, len: usize } {
    const b = s[i];
    if (b < 0x80) return .{ .cp = b, .len = 1 };
    if (b < 0xE0) return .{ .cp = (@as(u32, b & 0x1F) << 6) | (s[i + 1] & 0x3F), .len = 2 };
    if (b < 0xF0) return .{
        .cp = (@as(u32, b & 0x0F) << 12) | (@as(u32, s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F),
        .len = 3,
    };
    return .{
        .cp = (@as(u32, b & 0x07) << 18) | (@as(u32, s[i + 1] & 0x3F) << 12) |
            (@as(u32, s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F),
        .len = 4,
    };
}

fn isSpace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

const Type = enum { str, int, any };
const Value = union(enum) { str: []const u32, int: i64 };
const Func = enum { count, len, reverse, upper, lower, substr, index, replace };

fn params(f: Func) []const Type {
    return switch (f) {
        .count, .index => &.{ .str, .str },
        .len, .reverse, .upper, .lower => &.{.str},
        .substr => &.{ .str, .int, .int },
        .replace => &.{ .str, .str, .str },
    };
}

fn resultType(f: Func) Type {
    return switch (f) {
        .count, .len, .index => .int,
        else => .str,
    };
}

const Parser = struct {
    text: []const u8,
    pos: usize = 0,
    /// Code points of every string value created so far; also the arena's fill level.
    total: usize = 0,

    fn more(p: *Parser) bool {
        return p.pos < p.text.len;
    }

    fn isAt(p: *Parser, c: u8) bool {
        return p.pos < p.text.len and p.text[p.pos] == c;
    }

    fn skipWs(p: *Parser) void {
        const text = p.text;
        var i = p.pos;
        while (i + 8 <= text.len and word64(text, i) == 0x2020202020202020) i += 8;
        while (i < text.len and isSpace(text[i])) i += 1;
        p.pos = i;
    }

    fn syntax(p: *Parser, what: []const u8) Error {
        return fail(error.Syntax, "{s} at byte {d}", .{ what, p.pos });
    }

    fn expect(p: *Parser, c: u8) Error!void {
        p.skipWs();
        if (!p.isAt(c)) return fail(error.Syntax, "expected '{c}' at byte {d}", .{ c, p.pos });
        p.pos += 1;
    }

    /// Admits a string of `n` code points at the arena's top under both limits.
    fn admit(p: *Parser, n: usize) Error![]u32 {
        if (n > max_string) {
            return fail(error.TooLarge, "string of {d} code points (max {d})", .{ n, max_string });
        }
        if (p.total + n > max_total) {
            return fail(error.TooLarge, "strings total over {d} code points", .{max_total});
        }
        const s = arena[p.total .. p.total + n];
        p.total += n;
        return s;
    }

    fn expr(p: *Parser, want: Type, depth: usize) Error!Value {
        p.skipWs();
        if (!p.more()) return p.syntax("expected a string, an integer or a call");
        const c = p.text[p.pos];
        if (c == '"') {
            if (want == .int) return p.syntax("expected an integer");
            return .{ .str = try p.literal() };
        }
        if (c == '-' or (c >= '0' and c <= '9')) {
            if (want == .str) return p.syntax("expected a string");
            return .{ .int = try p.integer() };
        }
        if (c >= 'a' and c <= 'z') return p.call(want, depth);
        return p.syntax("expected a string, an integer or a call");
    }

    fn hexDigit(c: u8) ?u32 {
        return switch (c) {
            '0'...'9' => c - '0',
            'a'...'f' => c - 'a' + 10,
            'A'...'F' => c - 'A' + 10,
            else => null,
        };
    }

    /// Reads a string literal into the arena's free space (locals, not `p.pos`, in the loop: this
    /// is the per-byte hot path of a 1 MiB input).
    fn literal(p: *Parser) Error![]const u32 {
        const text = p.text;
        const room = arena[p.total..];
        var i = p.pos + 1; // after the opening quote
        var n: usize = 0;
        while (true) {
            // Runs of plain ASCII (no quote, no backslash) eight bytes at a time. A chunk past the
            // room is counted but not stored: the literal is then refused by `admit` anyway.
            while (i + 8 <= text.len) : (i += 8) {
                const w = word64(text, i);
                if (w & high_bits != 0 or hasByte(w, '"') or hasByte(w, '\\')) break;
                if (n + 8 <= room.len) {
                    for (room[n .. n + 8], text[i .. i + 8]) |*o, c| o.* = c;
                }
                n += 8;
            }
            if (i >= text.len) {
                p.pos = i;
                return p.syntax("unterminated string");
            }
            const b = text[i];
            var cp: u32 = b;
            if (b == '"') {
                i += 1;
                break;
            } else if (b == '\\') {
                p.pos = i;
                cp = try p.escape();
                i = p.pos;
            } else if (b < 0x80) {
                i += 1;
            } else {
                const d = decodeAt(text, i);
                cp = d.cp;
                i += d.len;
            }
            if (n < room.len) room[n] = cp;
            n += 1;
        }
        p.pos = i;
        return p.admit(n);
    }

    /// The escape at `p.pos` (a backslash); advances past it.
    fn escape(p: *Parser) Error!u32 {
        const esc: u8 = if (p.pos + 1 < p.text.len) p.text[p.pos + 1] else 0;
        var cp: u32 = 0;
        switch (esc) {
            '"', '\\' => cp = esc,
            'n' => cp = '\n',
            't' => cp = '\t',
            'u' => {
                var k: usize = 2;
                while (k < 6) : (k += 1) {
                    const h = if (p.pos + k < p.text.len) hexDigit(p.text[p.pos + k]) else null;
                    cp = cp * 16 + (h orelse return p.invalidEscape());
                }
                if (cp >= 0xD800 and cp <= 0xDFFF) return p.syntax("\\u escape of a surrogate");
            },
            else => return p.invalidEscape(),
        }
        p.pos += if (esc == 'u') 6 else 2;
        return cp;
    }

    fn invalidEscape(p: *Parser) Error {
        return p.syntax("invalid escape (use \\\" \\\\ \\n \\t or \\uXXXX)");
    }

    fn integer(p: *Parser) Error!i64 {
        const negative = p.isAt('-');
        if (negative) p.pos += 1;
        const digits_start = p.pos;
        const text = p.text;
        var i = digits_start;
        var significant: usize = 0;
        var value: i64 = 0;
        while (i < text.len and text[i] >= '0' and text[i] <= '9') : (i += 1) {
            const d = text[i] - '0';
            if (significant > 0 or d != 0) significant += 1;
            if (significant <= 10) value = value * 10 + d;
        }
        p.pos = i;
        if (i == digits_start) return p.syntax("expected digits");
        if (significant > 10 or value > max_int_abs) {
            return fail(error.Overflow, "integer literal beyond ±{d}", .{max_int_abs});
        }
        return if (negative) -value else value;
    }

    fn call(p: *Parser, want: Type, depth: usize) Error!Value {
        const start = p.pos;
        while (p.more() and p.text[p.pos] >= 'a' and p.text[p.pos] <= 'z') p.pos += 1;
        const name = p.text[start..p.pos];
        const f = std.meta.stringToEnum(Func, name) orelse {
            p.pos = start;
            const shown = name[0..@min(name.len, name_shown)];
            return fail(error.Syntax, "unknown function '{s}' at byte {d}", .{ shown, start });
        };
        const result = resultType(f);
        if (want != .any and want != result) {
            p.pos = start;
            const kind = if (result == .int) "an integer" else "a string";
            return fail(error.Syntax, "{s} gives {s} at byte {d}", .{ name, kind, start });
        }
        try p.expect('(');
        if (depth + 1 > max_depth) {
            return fail(error.TooLarge, "calls nested deeper than {d}", .{max_depth});
        }
        var args: [3]Value = undefined;
        for (params(f), 0..) |param, i| {
            if (i > 0) try p.expect(',');
            args[i] = try p.expr(param, depth + 1);
        }
        try p.expect(')');
        return p.apply(f, args);
    }

    fn apply(p: *Parser, f: Func, args: [3]Value) Error!Value {
        const s = args[0].str;
        switch (f) {
            .len => return .{ .int = @intCast(s.len) },
            .count => return .{ .int = @intCast(countOf(s, args[1].str)) },
            .index => {
                const needle = args[1].str;
                if (needle.len == 0) return .{ .int = 0 };
                var finder = Finder.init(needle);
                const at = finder.next(s, 0) orelse return .{ .int = -1 };
                return .{ .int = @intCast(at) };
            },
            .reverse => {
                const out = try p.admit(s.len);
                for (s, 0..) |cp, i| out[s.len - 1 - i] = cp;
                return .{ .str = out };
            },
            .upper, .lower => {
                const out = try p.admit(s.len);
                for (s, out) |cp, *o| o.* = if (f == .upper) toUpper(cp) else toLower(cp);
                return .{ .str = out };
            },
            .substr => {
                const a = sliceIndex(args[1].int, s.len);
                const b = sliceIndex(args[2].int, s.len);
                const piece = if (b > a) s[a..b] else s[0..0];
                const out = try p.admit(piece.len);
                @memcpy(out, piece);
                return .{ .str = out };
            },
            .replace => return .{ .str = try p.replace(s, args[1].str, args[2].str) },
        }
    }

    fn replace(p: *Parser, s: []const u32, old: []const u32, new: []const u32) Error![]const u32 {
        const k = countOf(s, old);
        const size: i64 = @as(i64, @intCast(s.len)) +
            @as(i64, @intCast(k)) * (@as(i64, @intCast(new.len)) - @as(i64, @intCast(old.len)));
        if (size > max_string) {
            return fail(error.TooLarge, "result of {d} code points (max {d})", .{ size, max_string });
        }
        const out = try p.admit(@intCast(size));
        var w: usize = 0;
        if (old.len == 0) {
            for (s) |cp| {
                @memcpy(out[w .. w + new.len], new);
                out[w + new.len] = cp;
                w += new.len + 1;
            }
            @memcpy(out[w .. w + new.len], new);
            return out;
        }
        var finder = Finder.init(old);
        var from: usize = 0;
        while (finder.next(s, from)) |at| {
            @memcpy(out[w .. w + at - from], s[from..at]);
            w += at - from;
            @memcpy(out[w .. w + new.len], new);
            w += new.len;
            from = at + old.len;
        }
        @memcpy(out[w..], s[from..]);
        return out;
    }
};

/// Python's slice index rule: negative counts from the end, then clamp to [0, len].
fn sliceIndex(i: i64, len: usize) usize {
    const n: i64 = @intCast(len);
    var j = if (i < 0) i + n else i;
    if (j < 0) j = 0;
    if (j > n) j = n;
    return @intCast(j);
}

/// Non-overlapping occurrences, leftmost first; the empty needle occurs len + 1 times.
fn countOf(s: []const u32, needle: []const u32) usize {
    if (needle.len == 0) return s.len + 1;
    var finder = Finder.init(needle);
    var k: usize = 0;
    var from: usize = 0;
    while (finder.next(s, from)) |at| {
        k += 1;
        from = at + needle.len;
    }
    return k;
}

/// Knuth-Morris-Pratt search: linear in haystack + needle, so a 100,000-code-point pattern
/// against a 100,000-code-point string stays far inside the fuel budget.
const Finder = struct {
    needle: []const u32,

    fn init(needle: []const u32) Finder {
        kmp_table[0] = 0;
        var j: u32 = 0;
        var i: usize = 1;
        while (i < needle.len) : (i += 1) {
            while (j > 0 and needle[i] != needle[j]) j = kmp_table[j - 1];
            if (needle[i] == needle[j]) j += 1;
            kmp_table[i] = j;
        }
        return .{ .needle = needle };
    }

    /// Start of the first match at or after `from` (a fresh search: matches never overlap).
    fn next(f: *Finder, hay: []const u32, from: usize) ?usize {
        const m = f.needle.len;
        var j: usize = 0;
        var i = from;
        while (i < hay.len) : (i += 1) {
            while (j > 0 and hay[i] != f.needle[j]) j = kmp_table[j - 1];
            if (hay[i] == f.needle[j]) j += 1;
            if (j == m) return i + 1 - m;
        }
        return null;
    }
};

/// The case table of docs/semantics/strop.md (a subset of Unicode's simple case mapping).
fn toUpper(cp: u32) u32 {
    return switch (cp) {
        'a'...'z', 0xE0...0xF6, 0xF8...0xFE, 0x3B1...0x3C1, 0x3C3...0x3CB, 0x430...0x44F => cp - 32,
        0xFF => 0x178,
        0x3C2 => 0x3A3, // final sigma
        0x3AC => 0x386,
        0x3AD...0x3AF => cp - 37,
        0x3CC => 0x38C,
        0x3CD, 0x3CE => cp - 63,
        0x450...0x45F => cp - 80,
        else => cp,
    };
}

fn toLower(cp: u32) u32 {
    return switch (cp) {
        'A'...'Z', 0xC0...0xD6, 0xD8...0xDE, 0x391...0x3A1, 0x3A3...0x3AB, 0x410...0x42F => cp + 32,
        0x178 => 0xFF,
        0x386 => 0x3AC,
        0x388...0x38A => cp + 37,
        0x38C => 0x3CC,
        0x38E, 0x38F => cp + 63,
        0x400...0x40F => cp + 80,
        else => cp,
    };
}

fn run(text: []const u8) Error!usize {
    if (firstInvalidUtf8(text)) |at| return fail(error.Syntax, "invalid UTF-8 at byte {d}", .{at});
    var p = Parser{ .text = text };
    const value = try p.expr(.any, 0);
    p.skipWs();
    if (p.more()) return p.syntax("unexpected text after the expression");
    switch (value) {
        .int => |v| return (std.fmt.bufPrint(&output_buf, "{d}", .{v}) catch unreachable).len,
        .str => |s| return quote(s),
    }
}

/// Writes the canonical literal of `s`; `<`, `>` and control characters are \u-escaped so a
/// value never contains `<`.
fn quote(s: []const u32) Error!usize {
    var size: usize = 2;
    for (s) |cp| {
        size += switch (cp) {
            '"', '\\', '\n', '\t' => 2,
            0...0x08, 0x0B...0x1F, '<', '>' => 6,
            else => std.unicode.utf8CodepointSequenceLength(@intCast(cp)) catch unreachable,
        };
    }
    if (size > output_cap) {
        return fail(error.TooLarge, "result over {d} bytes", .{output_cap});
    }
    var w: usize = 0;
    output_buf[w] = '"';
    w += 1;
    const hex = "0123456789abcdef";
    for (s) |cp| {
        switch (cp) {
            '"', '\\' => {
                output_buf[w] = '\\';
                output_buf[w + 1] = @intCast(cp);
                w += 2;
            },
            '\n', '\t' => {
                output_buf[w] = '\\';
                output_buf[w + 1] = if (cp == '\n') 'n' else 't';
                w += 2;
            },
            0...0x08, 0x0B...0x1F, '<', '>' => {
                @memcpy(output_buf[w .. w + 4], "\\u00");
                output_buf[w + 4] = hex[cp >> 4];
                output_buf[w + 5] = hex[cp & 0xF];
                w += 6;
            },
            else => w += std.unicode.utf8Encode(@intCast(cp), output_buf[w..]) catch unreachable,
        }
    }
    output_buf[w] = '"';
    return w + 1;
}
