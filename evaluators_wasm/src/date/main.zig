//! date/1: ISO-8601 calendar dates, proleptic Gregorian, years 0001-9999 (docs/semantics/date.md).
//!
//! One left-to-right pass: each `+ N unit` / `- N unit` step is applied as soon as its unit is
//! read and the first problem found is the error. The Python reference
//! (evaluators_wasm/reference/date.py) has the same structure, so both report the same error,
//! with the same message. Dates are handled as ordinals (0001-01-01 is day 1, as in Python's
//! `date.toordinal`), so every step is O(1) and a 1 MiB input of steps stays cheap.

const std = @import("std");

const input_cap = 1 << 20;
const output_cap = 64 * 1024;
const max_ordinal = 3_652_059; // 9999-12-31
const amount_cap = 1_000_000_000; // every amount of ten or more digits overflows, whatever the unit
const max_steps = 1000; // per input: keeps a 1 MiB input of steps far inside the fuel budget
const name_shown = 24; // characters of an unknown name quoted in the message

var input_buf: [input_cap]u8 = undefined;
var output_buf: [output_cap]u8 = undefined;
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

const Error = error{ Syntax, Overflow, Domain, TooLarge };

fn fail(err: Error, comptime fmt: []const u8, args: anytype) Error {
    message = std.fmt.bufPrint(&message_buf, fmt, args) catch "(message too long)";
    return err;
}

export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_cap) {
        return writeError("syntax", "input length out of range");
    }
    const len: usize = @intCast(input_len);
    const out = run(input_buf[0..len]) catch |err| {
        const code = switch (err) {
            error.Syntax => "syntax",
            error.Overflow => "overflow",
            error.Domain => "domain",
            error.TooLarge => "too_large",
        };
        return writeError(code, message);
    };
    return @intCast(out.len);
}

fn writeError(code: []const u8, text: []const u8) i32 {
    const n = code.len + 1 + text.len;
    @memcpy(output_buf[0..code.len], code);
    output_buf[code.len] = ':';
    @memcpy(output_buf[code.len + 1 .. n], text);
    return -@as(i32, @intCast(n));
}

const Date = struct { y: i64, m: i64, d: i64 };

const weekdays = [_][]const u8{ "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday" };
const days_before_month = [_]i64{ 0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334 };

fn isLeap(y: i64) bool {
    return @mod(y, 4) == 0 and (@mod(y, 100) != 0 or @mod(y, 400) == 0);
}

fn daysInMonth(y: i64, m: i64) i64 {
    const lengths = [_]i64{ 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31 };
    return lengths[@intCast(m - 1)] + @intFromBool(m == 2 and isLeap(y));
}

fn toOrdinal(date: Date) i64 {
    const y1 = date.y - 1;
    const before_year = y1 * 365 + @divFloor(y1, 4) - @divFloor(y1, 100) + @divFloor(y1, 400);
    const leap_day = @intFromBool(date.m > 2 and isLeap(date.y));
    return before_year + days_before_month[@intCast(date.m - 1)] + leap_day + date.d;
}

/// Howard Hinnant's civil_from_days, shifted so that ordinal 1 is 0001-01-01.
fn fromOrdinal(ordinal: i64) Date {
    const z = ordinal - 719_163 + 719_468; // days since 0000-03-01
    const era = @divFloor(z, 146_097);
    const doe = z - era * 146_097;
    const yoe = @divFloor(doe - @divFloor(doe, 1460) + @divFloor(doe, 36_524) - @divFloor(doe, 146_096), 365);
    const doy = doe - (365 * yoe + @divFloor(yoe, 4) - @divFloor(yoe, 100));
    const mp = @divFloor(5 * doy + 2, 153);
    const d = doy - @divFloor(153 * mp + 2, 5) + 1;
    const m = if (mp < 10) mp + 3 else mp - 9;
    return .{ .y = yoe + era * 400 + @intFromBool(m <= 2), .m = m, .d = d };
}

const Unit = enum { day, week, month, year };

/// `day`/`days`, `week`/`weeks`, `month`/`months`, `year`/`years`.
fn unitOf(word: []const u8) ?Unit {
    const singular = if (word.len > 0 and word[word.len - 1] == 's') word[0 .. word.len - 1] else word;
    return std.meta.stringToEnum(Unit, singular);
}

fn step(date: Date, amount: i64, unit: Unit) Error!Date {
    switch (unit) {
        .day, .week => {
            const ordinal = toOrdinal(date) + amount * @as(i64, if (unit == .week) 7 else 1);
            if (ordinal < 1 or ordinal > max_ordinal) return outOfRange();
            return fromOrdinal(ordinal);
        },
        .month, .year => {
            const months = date.y * 12 + date.m - 1 + amount * @as(i64, if (unit == .year) 12 else 1);
            const y = @divFloor(months, 12);
            if (y < 1 or y > 9999) return outOfRange();
            const m = @mod(months, 12) + 1;
            return .{ .y = y, .m = m, .d = @min(date.d, daysInMonth(y, m)) };
        },
    }
}

fn outOfRange() Error {
    return fail(error.Overflow, "result outside 0001-01-01..9999-12-31", .{});
}

fn isDigit(c: u8) bool {
    return c >= '0' and c <= '9';
}

/// Eight input bytes as one word: the scans of runs of ASCII and of spaces go a word at a time,
/// so a 1 MiB input costs a fraction of the fuel of a byte loop.
fn word64(s: []const u8, i: usize) u64 {
    return std.mem.readInt(u64, s[i..][0..8], .little);
}

fn isSpace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

fn isWord(c: u8) bool {
    return (c >= 'a' and c <= 'z') or c == '_';
}

const Parser = struct {
    text: []const u8,
    pos: usize = 0,
    steps: usize = 0,

    fn more(p: *Parser) bool {
        return p.pos < p.text.len;
    }

    fn atWord(p: *Parser) bool {
        return p.more() and isWord(p.text[p.pos]);
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
        if (!p.more() or p.text[p.pos] != c) {
            return fail(error.Syntax, "expected '{c}' at byte {d}", .{ c, p.pos });
        }
        p.pos += 1;
    }

    fn word(p: *Parser) []const u8 {
        const start = p.pos;
        var i = start;
        while (i < p.text.len and isWord(p.text[i])) i += 1;
        p.pos = i;
        return p.text[start..i];
    }

    /// Writes the result of the whole input into `output_buf`.
    fn top(p: *Parser) Error![]const u8 {
        p.skipWs();
        if (!p.atWord()) return formatDate(try p.dateExpr());
        const start = p.pos;
        const name = p.word();
        const Func = enum { weekday, day_of_year, days_between };
        const f = std.meta.stringToEnum(Func, name) orelse {
            p.pos = start;
            const shown = name[0..@min(name.len, name_shown)];
            return fail(error.Syntax, "unknown function '{s}' at byte {d}", .{ shown, start });
        };
        try p.expect('(');
        const first = try p.dateExpr();
        var second = first;
        if (f == .days_between) {
            try p.expect(',');
            second = try p.dateExpr();
        }
        try p.expect(')');
        return switch (f) {
            .weekday => weekdays[@intCast(@mod(toOrdinal(first) + 6, 7))],
            .day_of_year => formatInt(toOrdinal(first) - toOrdinal(.{ .y = first.y, .m = 1, .d = 1 }) + 1),
            .days_between => formatInt(toOrdinal(second) - toOrdinal(first)),
        };
    }

    fn dateExpr(p: *Parser) Error!Date {
        var value = try p.dateLiteral();
        while (true) {
            p.skipWs();
            if (!p.more() or (p.text[p.pos] != '+' and p.text[p.pos] != '-')) return value;
            const negative = p.text[p.pos] == '-';
            p.steps += 1;
            if (p.steps > max_steps) return fail(error.TooLarge, "more than {d} steps", .{max_steps});
            p.pos += 1;
            p.skipWs();
            const count = try p.amount();
            p.skipWs();
            const start = p.pos;
            const unit = unitOf(p.word()) orelse {
                p.pos = start;
                return p.syntax("expected a unit (days, weeks, months or years)");
            };
            value = try step(value, if (negative) -count else count, unit);
        }
    }

    fn dateLiteral(p: *Parser) Error!Date {
        p.skipWs();
        const shape = "dddd-dd-dd";
        var fields = [3]i64{ 0, 0, 0 };
        var field: usize = 0;
        for (shape) |kind| {
            const ok = p.more() and (if (kind == 'd') isDigit(p.text[p.pos]) else p.text[p.pos] == '-');
            if (!ok) return p.syntax("expected a date YYYY-MM-DD");
            if (kind == 'd') fields[field] = fields[field] * 10 + (p.text[p.pos] - '0') else field += 1;
            p.pos += 1;
        }
        const date = Date{ .y = fields[0], .m = fields[1], .d = fields[2] };
        if (date.y == 0) return fail(error.Domain, "year 0000 is outside 0001-9999", .{});
        if (date.m < 1 or date.m > 12) {
            return fail(error.Domain, "month {d:0>2} does not exist", .{@as(u64, @intCast(date.m))});
        }
        if (date.d < 1 or date.d > daysInMonth(date.y, date.m)) {
            return fail(error.Domain, "{d:0>4}-{d:0>2} has no day {d:0>2}", .{
                @as(u64, @intCast(date.y)), @as(u64, @intCast(date.m)), @as(u64, @intCast(date.d)),
            });
        }
        return date;
    }

    fn amount(p: *Parser) Error!i64 {
        const start = p.pos;
        const text = p.text;
        var i = start;
        var value: i64 = 0;
        while (i < text.len and isDigit(text[i])) : (i += 1) {
            value = @min(value * 10 + (text[i] - '0'), amount_cap);
        }
        p.pos = i;
        if (i == start) return p.syntax("expected a number of days, weeks, months or years");
        return value;
    }
};

fn formatDate(date: Date) []const u8 {
    return std.fmt.bufPrint(&output_buf, "{d:0>4}-{d:0>2}-{d:0>2}", .{
        @as(u64, @intCast(date.y)), @as(u64, @intCast(date.m)), @as(u64, @intCast(date.d)),
    }) catch unreachable;
}

fn formatInt(value: i64) []const u8 {
    return std.fmt.bufPrint(&output_buf, "{d}", .{value}) catch unreachable;
}

fn run(text: []const u8) Error![]const u8 {
    var i: usize = 0;
    while (i + 8 <= text.len and word64(text, i) & 0x8080808080808080 == 0) i += 8;
    for (text[i..], i..) |byte, at| {
        if (byte >= 0x80) return fail(error.Syntax, "non-ASCII byte at byte {d}", .{at});
    }
    var p = Parser{ .text = text };
    const result = try p.top();
    p.skipWs();
    if (p.more()) return p.syntax("unexpected text after the expression");
    if (@intFromPtr(result.ptr) != @intFromPtr(&output_buf)) @memcpy(output_buf[0..result.len], result);
    return result;
}
