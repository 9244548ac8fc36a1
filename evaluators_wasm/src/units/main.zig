//! units: exact conversion between units of length, mass, volume, time, data size and
//! temperature (semantics `units/1`, docs/semantics/units.md). ABI v1 (docs/abi.md): no imports,
//! static buffers, one call.
//!
//! `NUMBER UNIT to UNIT`. The number is a decimal with at most 15 digits before and 15 after
//! the point; every factor is an exact decimal (or 5/9 for the Fahrenheit and Rankine degree),
//! so the result is an exact rational computed with i256 numerators and denominators. The bound
//! that keeps them far from 2^255 is proved in docs/semantics/units.md ("Why i256 suffices");
//! every operation is checked anyway and would answer `overflow` rather than wrap.
//!
//! Output: an exact integer in full; any other value rounded half-even to 15 significant digits,
//! trailing zeros removed, never in exponent notation.

const std = @import("std");

const input_capacity = 1 << 20;
const output_capacity = 64 * 1024;
/// Digits before the point, and after it, as written (leading and trailing zeros included).
const max_number_digits = 15;
const significant_digits = 15;

var input_buf: [input_capacity]u8 = undefined;
var output_buf: [output_capacity]u8 = undefined;

export fn evald_abi_version() i32 {
    return 1;
}
export fn evald_input_ptr() i32 {
    return @intCast(@intFromPtr(&input_buf));
}
export fn evald_input_cap() i32 {
    return input_capacity;
}
export fn evald_output_ptr() i32 {
    return @intCast(@intFromPtr(&output_buf));
}
export fn evald_output_cap() i32 {
    return output_capacity;
}

const Failure = error{ Syntax, TooLarge, Domain, Overflow };

/// The message of the last failure; set together with the error by `fail`.
var fail_message: []const u8 = "";

fn fail(err: Failure, message: []const u8) Failure {
    fail_message = message;
    return err;
}

export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_capacity) {
        return writeError("syntax", "input length outside the input buffer");
    }
    const value = evaluate(input_buf[0..@intCast(input_len)]) catch |err| {
        const code = switch (err) {
            error.Syntax => "syntax",
            error.TooLarge => "too_large",
            error.Domain => "domain",
            error.Overflow => "overflow",
        };
        return writeError(code, fail_message);
    };
    @memcpy(output_buf[0..value.len], value);
    return @intCast(value.len);
}

fn writeError(code: []const u8, message: []const u8) i32 {
    var n: usize = 0;
    for ([_][]const u8{ code, ":", message }) |part| {
        @memcpy(output_buf[n .. n + part.len], part);
        n += part.len;
    }
    return -@as(i32, @intCast(n));
}

// --- exact rationals ------------------------------------------------------------------------

/// A rational in lowest terms with `den > 0`. Every operation is overflow-checked.
const Rat = struct {
    num: i256,
    den: i256,

    fn make(num: i256, den: i256) Rat {
        const g = gcd(@abs(num), @abs(den));
        const sign: i256 = if (den < 0) -1 else 1;
        return .{ .num = exactDiv(num, @as(i256, @intCast(g))) * sign, .den = exactDiv(den, @as(i256, @intCast(g))) * sign };
    }

    fn mul(a: Rat, b: Rat) Failure!Rat {
        // Cross-reduce first: (a.num/g1 * b.num/g2) / (a.den/g2 * b.den/g1) is in lowest terms.
        const g1: i256 = @intCast(gcd(@abs(a.num), @abs(b.den)));
        const g2: i256 = @intCast(gcd(@abs(b.num), @abs(a.den)));
        const num = try checkedMul(exactDiv(a.num, g1), exactDiv(b.num, g2));
        if (num == 0) return .{ .num = 0, .den = 1 };
        return .{ .num = num, .den = try checkedMul(exactDiv(a.den, g2), exactDiv(b.den, g1)) };
    }

    fn div(a: Rat, b: Rat) Failure!Rat {
        std.debug.assert(b.num != 0); // divisors are unit factors, never zero
        return a.mul(make(b.den, b.num));
    }

    fn add(a: Rat, b: Rat) Failure!Rat {
        const num = try checkedAdd(try checkedMul(a.num, b.den), try checkedMul(b.num, a.den));
        return make(num, try checkedMul(a.den, b.den));
    }

    fn sub(a: Rat, b: Rat) Failure!Rat {
        return a.add(.{ .num = -b.num, .den = b.den });
    }
};

/// Binary (Stein's) gcd: shifts and subtractions only. A 256-bit division is a long software
/// loop on wasm32, so Euclid's algorithm cost several times more fuel here. gcd(0, 0) is 1 so
/// that callers may always divide by it.
fn gcd(a: u256, b: u256) u256 {
    if (a == 0) return if (b == 0) 1 else b;
    if (b == 0) return a;
    if (a <= std.math.maxInt(u64) and b <= std.math.maxInt(u64)) return gcdNarrow(u64, @intCast(a), @intCast(b));
    return gcdNarrow(u256, a, b);
}

/// Stein's algorithm on nonzero `a`, `b`; the common case runs on native 64-bit integers.
fn gcdNarrow(comptime T: type, a: T, b: T) T {
    var x = a;
    var y = b;
    const shift: std.math.Log2Int(T) = @intCast(@ctz(x | y)); // both nonzero: below the width
    x >>= @intCast(@ctz(x));
    while (true) {
        y >>= @intCast(@ctz(y));
        if (x > y) std.mem.swap(T, &x, &y);
        y -= x;
        if (y == 0) return x << shift;
    }
}

/// `a / b` for a divisor of `a`; in native 64-bit arithmetic when both fit (the common case),
/// since a 256-bit division is a long software loop on wasm32.
fn exactDiv(a: i256, b: i256) i256 {
    const lo = std.math.minInt(i64);
    const hi = std.math.maxInt(i64);
    if (a >= lo and a <= hi and b >= lo and b <= hi and !(a == lo and b == -1)) {
        return @divExact(@as(i64, @intCast(a)), @as(i64, @intCast(b)));
    }
    return @divExact(a, b);
}

fn checkedMul(a: i256, b: i256) Failure!i256 {
    const lo = std.math.minInt(i64);
    const hi = std.math.maxInt(i64);
    if (a >= lo and a <= hi and b >= lo and b <= hi) { // the product fits i128: no overflow
        return @as(i128, @as(i64, @intCast(a))) * @as(i128, @as(i64, @intCast(b)));
    }
    const r = @mulWithOverflow(a, b);
    if (r[1] != 0) return fail(error.Overflow, "intermediate value exceeds 2^255");
    return r[0];
}

fn checkedAdd(a: i256, b: i256) Failure!i256 {
    const r = @addWithOverflow(a, b);
    if (r[1] != 0) return fail(error.Overflow, "intermediate value exceeds 2^255");
    return r[0];
}

/// An exact decimal constant, parsed at compile time.
fn dec(comptime text: []const u8) Rat {
    comptime {
        @setEvalBranchQuota(100_000);
        var num: i256 = 0;
        var den: i256 = 1;
        var after_point = false;
        for (text) |c| {
            if (c == '.') {
                after_point = true;
                continue;
            }
            num = num * 10 + (c - '0');
            if (after_point) den *= 10;
        }
        return Rat.make(num, den);
    }
}

// --- the unit table -------------------------------------------------------------------------

const Dimension = enum { length, mass, volume, time, data, temperature };

/// `value_in_base = (value + offset) * factor`. Base units: m, kg, L, s, byte, K. Only the
/// temperature scales have an offset.
const Unit = struct {
    names: []const []const u8,
    dimension: Dimension,
    factor: Rat,
    offset: Rat = .{ .num = 0, .den = 1 },
};

fn u(dimension: Dimension, comptime factor: []const u8, names: []const []const u8) Unit {
    return .{ .names = names, .dimension = dimension, .factor = dec(factor) };
}

const units = blk: {
    @setEvalBranchQuota(1_000_000);
    break :blk [_]Unit{
    // length (base: metre)
    u(.length, "1", &.{ "m", "meter", "meters", "metre", "metres" }),
    u(.length, "1000", &.{ "km", "kilometer", "kilometers", "kilometre", "kilometres" }),
    u(.length, "0.01", &.{ "cm", "centimeter", "centimeters", "centimetre", "centimetres" }),
    u(.length, "0.001", &.{ "mm", "millimeter", "millimeters", "millimetre", "millimetres" }),
    u(.length, "0.000001", &.{ "um", "\u{b5}m", "\u{3bc}m", "micrometer", "micrometers", "micrometre", "micrometres" }),
    u(.length, "0.000000001", &.{ "nm", "nanometer", "nanometers", "nanometre", "nanometres" }),
    u(.length, "0.0254", &.{ "in", "inch", "inches" }),
    u(.length, "0.3048", &.{ "ft", "foot", "feet" }),
    u(.length, "0.9144", &.{ "yd", "yard", "yards" }),
    u(.length, "1609.344", &.{ "mi", "mile", "miles" }),
    u(.length, "1852", &.{"nmi"}),
    // mass (base: kilogram)
    u(.mass, "1", &.{ "kg", "kilogram", "kilograms" }),
    u(.mass, "0.001", &.{ "g", "gram", "grams" }),
    u(.mass, "0.000001", &.{ "mg", "milligram", "milligrams" }),
    u(.mass, "0.000000001", &.{ "ug", "\u{b5}g", "\u{3bc}g", "microgram", "micrograms" }),
    u(.mass, "1000", &.{ "t", "tonne", "tonnes" }),
    u(.mass, "0.45359237", &.{ "lb", "lbs", "pound", "pounds" }),
    u(.mass, "0.028349523125", &.{ "oz", "ounce", "ounces" }),
    u(.mass, "6.35029318", &.{ "st", "stone" }),
    u(.mass, "0.00006479891", &.{ "gr", "grain", "grains" }),
    // volume (base: litre)
    u(.volume, "1", &.{ "L", "l", "liter", "liters", "litre", "litres" }),
    u(.volume, "0.001", &.{ "mL", "ml", "milliliter", "milliliters", "millilitre", "millilitres" }),
    u(.volume, "0.01", &.{ "cL", "cl" }),
    u(.volume, "0.1", &.{ "dL", "dl" }),
    u(.volume, "1000", &.{ "m3", "m\u{b3}" }),
    u(.volume, "0.001", &.{ "cm3", "cm\u{b3}", "cc" }),
    u(.volume, "0.016387064", &.{ "in3", "in\u{b3}" }),
    u(.volume, "28.316846592", &.{ "ft3", "ft\u{b3}" }),
    u(.volume, "3.785411784", &.{ "gal", "gallon", "gallons" }),
    u(.volume, "0.946352946", &.{ "qt", "quart", "quarts" }),
    u(.volume, "0.473176473", &.{ "pt", "pint", "pints" }),
    u(.volume, "0.2365882365", &.{ "cup", "cups" }),
    u(.volume, "0.0295735295625", &.{ "floz", "fl_oz" }),
    u(.volume, "0.01478676478125", &.{ "tbsp", "tablespoon", "tablespoons" }),
    u(.volume, "0.00492892159375", &.{ "tsp", "teaspoon", "teaspoons" }),
    u(.volume, "4.54609", &.{"imp_gal"}),
    u(.volume, "0.56826125", &.{"imp_pt"}),
    u(.volume, "0.0284130625", &.{"imp_floz"}),
    // time (base: second)
    u(.time, "1", &.{ "s", "sec", "second", "seconds" }),
    u(.time, "0.001", &.{ "ms", "millisecond", "milliseconds" }),
    u(.time, "0.000001", &.{ "us", "\u{b5}s", "\u{3bc}s", "microsecond", "microseconds" }),
    u(.time, "0.000000001", &.{ "ns", "nanosecond", "nanoseconds" }),
    u(.time, "60", &.{ "min", "minute", "minutes" }),
    u(.time, "3600", &.{ "h", "hr", "hour", "hours" }),
    u(.time, "86400", &.{ "d", "day", "days" }),
    u(.time, "604800", &.{ "wk", "week", "weeks" }),
    // data (base: byte)
    u(.data, "0.125", &.{ "bit", "bits" }),
    u(.data, "1", &.{ "B", "byte", "bytes" }),
    u(.data, "1000", &.{"kB"}),
    u(.data, "1000000", &.{"MB"}),
    u(.data, "1000000000", &.{"GB"}),
    u(.data, "1000000000000", &.{"TB"}),
    u(.data, "1000000000000000", &.{"PB"}),
    u(.data, "1000000000000000000", &.{"EB"}),
    u(.data, "1024", &.{"KiB"}),
    u(.data, "1048576", &.{"MiB"}),
    u(.data, "1073741824", &.{"GiB"}),
    u(.data, "1099511627776", &.{"TiB"}),
    u(.data, "1125899906842624", &.{"PiB"}),
    u(.data, "1152921504606846976", &.{"EiB"}),
    u(.data, "125", &.{"kbit"}),
    u(.data, "125000", &.{"Mbit"}),
    u(.data, "125000000", &.{"Gbit"}),
    u(.data, "125000000000", &.{"Tbit"}),
    // temperature (base: kelvin); K = (value + offset) * factor
    .{ .names = &.{ "K", "kelvin" }, .dimension = .temperature, .factor = dec("1") },
    .{ .names = &.{ "C", "\u{b0}C", "degC", "celsius" }, .dimension = .temperature, .factor = dec("1"), .offset = dec("273.15") },
    .{ .names = &.{ "F", "\u{b0}F", "degF", "fahrenheit" }, .dimension = .temperature, .factor = Rat.make(5, 9), .offset = dec("459.67") },
    .{ .names = &.{ "R", "\u{b0}R", "degR", "rankine" }, .dimension = .temperature, .factor = Rat.make(5, 9) },
    };
};

fn lookup(name: []const u8) ?*const Unit {
    for (&units) |*unit| {
        for (unit.names) |candidate| {
            if (std.mem.eql(u8, candidate, name)) return unit;
        }
    }
    return null;
}

// --- parsing --------------------------------------------------------------------------------

fn isSpace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

/// The next whitespace-separated token at or after `pos.*`, or null at the end of the input.
fn nextToken(input: []const u8, pos: *usize) ?[]const u8 {
    var i = pos.*;
    while (i < input.len and isSpace(input[i])) i += 1;
    if (i == input.len) {
        pos.* = i;
        return null;
    }
    const start = i;
    while (i < input.len and !isSpace(input[i])) i += 1;
    pos.* = i;
    return input[start..i];
}

const Number = struct {
    negative: bool,
    int_digits: []const u8,
    frac_digits: []const u8,
};

fn evaluate(input: []const u8) Failure![]const u8 {
    if (!validUtf8(input)) return fail(error.Syntax, "input is not valid UTF-8");

    // NUMBER: -?digits(.digits)?, then optional whitespace, then the unit.
    var pos: usize = 0;
    while (pos < input.len and isSpace(input[pos])) pos += 1;
    const negative = pos < input.len and input[pos] == '-';
    if (negative) pos += 1;
    const int_start = pos;
    while (pos < input.len and std.ascii.isDigit(input[pos])) pos += 1;
    const int_digits = input[int_start..pos];
    if (int_digits.len == 0) return fail(error.Syntax, "expected a number such as 12.5 (digits, optionally a point and more digits)");
    var frac_digits: []const u8 = input[pos..pos];
    if (pos < input.len and input[pos] == '.') {
        const frac_start = pos + 1;
        pos = frac_start;
        while (pos < input.len and std.ascii.isDigit(input[pos])) pos += 1;
        frac_digits = input[frac_start..pos];
        if (frac_digits.len == 0) return fail(error.Syntax, "a decimal point must be followed by digits");
    }
    const number = Number{ .negative = negative, .int_digits = int_digits, .frac_digits = frac_digits };

    // UNIT to UNIT: exactly three whitespace-separated tokens.
    const from_name = nextToken(input, &pos) orelse return fail(error.Syntax, "expected a unit after the number, as in 12.5 km to mi");
    const keyword = nextToken(input, &pos) orelse return fail(error.Syntax, "expected 'to' and a target unit, as in 12.5 km to mi");
    if (!std.mem.eql(u8, keyword, "to")) return fail(error.Syntax, "expected 'to' between the units, as in 12.5 km to mi");
    const to_name = nextToken(input, &pos) orelse return fail(error.Syntax, "expected a target unit after 'to'");
    if (nextToken(input, &pos) != null) return fail(error.Syntax, "unexpected text after the target unit");

    const from = lookup(from_name) orelse return unknownUnit(from_name);
    const to = lookup(to_name) orelse return unknownUnit(to_name);

    if (number.int_digits.len > max_number_digits or number.frac_digits.len > max_number_digits) {
        return fail(error.TooLarge, "at most 15 digits before and 15 after the decimal point");
    }
    if (from.dimension != to.dimension) {
        return fail(error.Domain, "the units measure different things (for example length and mass); both must be of one kind");
    }
    return format(try convert(number, from, to));
}

fn unknownUnit(name: []const u8) Failure {
    if (std.mem.eql(u8, name, "KB") or std.mem.eql(u8, name, "kb")) {
        return fail(error.Syntax, "unknown unit; use kB (1000 bytes) or KiB (1024 bytes)");
    }
    if (std.mem.eql(u8, name, "month") or std.mem.eql(u8, name, "months") or std.mem.eql(u8, name, "year") or std.mem.eql(u8, name, "years") or std.mem.eql(u8, name, "y") or std.mem.eql(u8, name, "yr")) {
        return fail(error.Syntax, "months and years have no fixed length; use the date evaluator");
    }
    return fail(error.Syntax, "unknown unit (see docs/semantics/units.md for the list)");
}

fn convert(number: Number, from: *const Unit, to: *const Unit) Failure!Rat {
    var n: i256 = 0;
    for (number.int_digits) |c| n = n * 10 + (c - '0');
    var scale: i256 = 1;
    for (number.frac_digits) |c| {
        n = n * 10 + (c - '0');
        scale *= 10;
    }
    if (number.negative) n = -n;
    const value = Rat.make(n, scale);
    if (from.dimension != .temperature) return value.mul(try from.factor.div(to.factor));
    const kelvin = try (try value.add(from.offset)).mul(from.factor);
    if (kelvin.num < 0) return fail(error.Domain, "below absolute zero (0 K = -273.15 C = -459.67 F)");
    return (try kelvin.div(to.factor)).sub(to.offset);
}

// --- output ---------------------------------------------------------------------------------

var text_buf: [256]u8 = undefined;

/// Integers in full; anything else rounded half-even to 15 significant digits, without exponent.
fn format(r: Rat) Failure![]const u8 {
    var len: usize = 0;
    if (r.num < 0) {
        text_buf[0] = '-';
        len = 1;
    }
    const num: u256 = @abs(r.num);
    const den: u256 = @intCast(r.den);
    if (den == 1) return text_buf[0 .. len + writeInteger(num, text_buf[len..])];

    // digits[0..int_len] is the integer part (a single 0 when it is zero); fraction digits follow.
    var digits: [200]u8 = undefined;
    const int_len = writeInteger(num / den, &digits);
    for (digits[0..int_len]) |*d| d.* -= '0';
    var nd = int_len;
    var first_sig: ?usize = if (num / den != 0) 0 else null;
    var rem = num % den;
    while (first_sig == null or nd < first_sig.? + significant_digits + 1) {
        if (nd == digits.len) return fail(error.Overflow, "result needs too many digits");
        // rem < den, so rem * 10 fits 124 bits when den < 2^120: native-width division then.
        if (den < (1 << 120)) {
            const r10: u128 = @as(u128, @intCast(rem)) * 10;
            const d128: u128 = @intCast(den);
            digits[nd] = @intCast(r10 / d128);
            rem = r10 % d128;
        } else {
            rem *= 10;
            digits[nd] = @intCast(rem / den);
            rem %= den;
        }
        if (first_sig == null and digits[nd] != 0) first_sig = nd;
        nd += 1;
    }
    // Keep digits[0..cut]; digits[cut] decides, with everything after it as the sticky part.
    const cut = first_sig.? + significant_digits;
    var sticky = rem != 0;
    for (digits[cut + 1 .. nd]) |d| sticky = sticky or d != 0;
    const dropped = digits[cut];
    const round_up = dropped > 5 or (dropped == 5 and (sticky or digits[cut - 1] % 2 == 1));
    if (cut < int_len) @memset(digits[cut..int_len], 0); // integer digits past the cut are zeros
    var carry_out = false;
    if (round_up) {
        var i = cut;
        while (true) {
            if (i == 0) {
                carry_out = true;
                break;
            }
            i -= 1;
            if (digits[i] == 9) {
                digits[i] = 0;
            } else {
                digits[i] += 1;
                break;
            }
        }
    }
    // A carry out of the first digit means every kept digit was 9 and is now 0: 99.99... -> 100.
    // An integer part of 0 carries into itself (0.99... -> 1), never out.
    if (carry_out) {
        text_buf[len] = '1';
        len += 1;
    }
    for (digits[0..int_len]) |d| {
        text_buf[len] = '0' + d;
        len += 1;
    }
    var frac_end = cut;
    while (frac_end > int_len and digits[frac_end - 1] == 0) frac_end -= 1;
    if (frac_end > int_len) {
        text_buf[len] = '.';
        len += 1;
        for (digits[int_len..frac_end]) |d| {
            text_buf[len] = '0' + d;
            len += 1;
        }
    }
    return text_buf[0..len];
}

/// Writes the decimal digits of `value` (at least one) to `out`; returns how many.
fn writeInteger(value: u256, out: []u8) usize {
    var tmp: [80]u8 = undefined;
    var n: usize = 0;
    var v = value;
    while (v > std.math.maxInt(u64)) {
        tmp[n] = '0' + @as(u8, @intCast(v % 10));
        n += 1;
        v /= 10;
    }
    var small: u64 = @intCast(v); // the rest in native 64-bit arithmetic
    while (true) {
        tmp[n] = '0' + @as(u8, @intCast(small % 10));
        n += 1;
        small /= 10;
        if (small == 0) break;
    }
    for (0..n) |k| out[k] = tmp[n - 1 - k];
    return n;
}

// --- UTF-8 ----------------------------------------------------------------------------------

const highs: u64 = 0x8080808080808080;

/// Strict UTF-8 validation (what Python's decoder accepts: no overlong forms, no surrogates,
/// nothing above U+10FFFF, no truncated sequence), eight ASCII bytes a step.
fn validUtf8(input: []const u8) bool {
    var i: usize = 0;
    const n = input.len;
    while (i < n) {
        if (i + 8 <= n and std.mem.readInt(u64, input[i..][0..8], .little) & highs == 0) {
            i += 8;
            continue;
        }
        const c = input[i];
        if (c < 0x80) {
            i += 1;
        } else if (c < 0xC2) {
            return false;
        } else if (c < 0xE0) {
            if (i + 2 > n or !isCont(input[i + 1])) return false;
            i += 2;
        } else if (c < 0xF0) {
            if (i + 3 > n) return false;
            const lo: u8 = if (c == 0xE0) 0xA0 else 0x80;
            const hi: u8 = if (c == 0xED) 0x9F else 0xBF;
            if (input[i + 1] < lo or input[i + 1] > hi or !isCont(input[i + 2])) return false;
            i += 3;
        } else if (c < 0xF5) {
            if (i + 4 > n) return false;
            const lo: u8 = if (c == 0xF0) 0x90 else 0x80;
            const hi: u8 = if (c == 0xF4) 0x8F else 0xBF;
            if (input[i + 1] < lo or input[i + 1] > hi or !isCont(input[i + 2]) or !isCont(input[i + 3])) return false;
            i += 4;
        } else {
            return false;
        }
    }
    return true;
}

fn isCont(c: u8) bool {
    return c & 0xC0 == 0x80;
}
