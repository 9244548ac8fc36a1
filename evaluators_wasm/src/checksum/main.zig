//! checksum: CRC-32, SHA-256, Luhn and ISBN check digits (semantics `checksum/1`,
//! docs/semantics/checksum.md). ABI v1 (docs/abi.md): no imports, static buffers, one call.
//!
//! A 1 MiB argument costs one pass for UTF-8 validation, one for decoding the literal (eight
//! bytes a step where there are no escapes) and one for the hash; all passes are linear, and
//! no memory is allocated beyond the static buffers.

const std = @import("std");
const Crc32 = std.hash.Crc32;
const Sha256 = std.crypto.hash.sha2.Sha256;

const input_capacity = 1 << 20;
const output_capacity = 64 * 1024;
/// Digit-string arguments longer than this (separators not counted) are `too_large`.
const max_digits = 1000;
/// Longer than the longest function name (`isbn10_valid`); a longer word is refused unread.
const max_name_len = 16;

var input_buf: [input_capacity]u8 = undefined;
/// The decoded string argument (escapes never make a string longer, so input size suffices).
var decoded_buf: [input_capacity]u8 = undefined;
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

const Failure = error{ Syntax, TooLarge, Domain };

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
    const input = input_buf[0..@intCast(input_len)];
    const value = evaluate(input) catch |err| {
        const code = switch (err) {
            error.Syntax => "syntax",
            error.TooLarge => "too_large",
            error.Domain => "domain",
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

const Function = enum {
    crc32,
    sha256,
    luhn_digit,
    luhn_valid,
    isbn10_digit,
    isbn10_valid,
    isbn13_digit,
    isbn13_valid,
};

fn isSpace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

fn skipSpace(input: []const u8, pos: usize) usize {
    var i = pos;
    while (i < input.len and isSpace(input[i])) i += 1;
    return i;
}

fn isIdentChar(c: u8) bool {
    return std.ascii.isAlphanumeric(c) or c == '_';
}

/// The value text lives here between `evaluate` and the copy into the output buffer.
var value_buf: [64]u8 = undefined;

fn evaluate(input: []const u8) Failure![]const u8 {
    if (!validUtf8(input)) return fail(error.Syntax, "input is not valid UTF-8");
    var pos = skipSpace(input, 0);
    const name_start = pos;
    // Function names are short: stop early so a megabyte of letters costs nothing to refuse.
    while (pos < input.len and pos - name_start <= max_name_len and isIdentChar(input[pos])) pos += 1;
    const function = std.meta.stringToEnum(Function, input[name_start..pos]) orelse return fail(
        error.Syntax,
        "expected crc32, sha256, luhn_digit, luhn_valid, isbn10_digit, isbn10_valid, isbn13_digit or isbn13_valid",
    );
    pos = skipSpace(input, pos);
    if (pos >= input.len or input[pos] != '(') return fail(error.Syntax, "expected ( after the function name");
    pos = skipSpace(input, pos + 1);
    const argument = try parseCall(input, pos);
    switch (function) {
        .crc32 => {
            const hex = std.fmt.bytesToHex(std.mem.toBytes(std.mem.nativeToBig(u32, Crc32.hash(argument))), .lower);
            @memcpy(value_buf[0..hex.len], &hex);
            return value_buf[0..hex.len];
        },
        .sha256 => {
            var digest: [Sha256.digest_length]u8 = undefined;
            Sha256.hash(argument, &digest, .{});
            const hex = std.fmt.bytesToHex(digest, .lower);
            @memcpy(value_buf[0..hex.len], &hex);
            return value_buf[0..hex.len];
        },
        else => return digitFunction(function, try collectDigits(argument, function == .isbn10_valid)),
    }
}

/// Parses `"literal" )` and trailing space from `start`; returns the decoded argument.
fn parseCall(input: []const u8, start: usize) Failure![]const u8 {
    var pos, const argument = try parseString(input, start);
    pos = skipSpace(input, pos);
    if (pos >= input.len or input[pos] != ')') return fail(error.Syntax, "expected ) after the argument");
    pos = skipSpace(input, pos + 1);
    if (pos != input.len) return fail(error.Syntax, "unexpected text after the closing )");
    return argument;
}

/// Decodes one double-quoted literal starting at `start` into `decoded_buf`; returns the index
/// after its closing quote and the decoded bytes. Escapes: \" \\ \n \t \uXXXX (a Unicode scalar
/// value, so no surrogates). Decoding never grows the text, so `decoded_buf` (as large as the
/// input buffer) always suffices; runs without quote or backslash are copied eight bytes a step.
fn parseString(input: []const u8, start: usize) Failure!struct { usize, []const u8 } {
    if (start >= input.len or input[start] != '"') return fail(error.Syntax, "expected a string literal \"...\"");
    var i = start + 1;
    var o: usize = 0;
    while (true) {
        while (i + 8 <= input.len) {
            const w = word(input, i);
            if (hasZeroByte(w ^ (ones * '"')) or hasZeroByte(w ^ (ones * '\\'))) break;
            std.mem.writeInt(u64, decoded_buf[o..][0..8], w, .little);
            i += 8;
            o += 8;
        }
        if (i >= input.len) return fail(error.Syntax, "unterminated string literal");
        const c = input[i];
        if (c == '"') return .{ i + 1, decoded_buf[0..o] };
        if (c != '\\') {
            decoded_buf[o] = c;
            i += 1;
            o += 1;
            continue;
        }
        if (i + 1 >= input.len) return fail(error.Syntax, "unterminated string literal");
        switch (input[i + 1]) {
            '"', '\\' => |e| decoded_buf[o] = e,
            'n' => decoded_buf[o] = '\n',
            't' => decoded_buf[o] = '\t',
            'u' => {
                if (i + 6 > input.len) return fail(error.Syntax, "\\u needs exactly four hex digits");
                var code_point: u21 = 0;
                for (input[i + 2 .. i + 6]) |h| {
                    const v = std.fmt.charToDigit(h, 16) catch return fail(error.Syntax, "\\u needs exactly four hex digits");
                    code_point = code_point * 16 + v;
                }
                if (code_point >= 0xD800 and code_point <= 0xDFFF) {
                    return fail(error.Syntax, "\\u escape of a surrogate (D800-DFFF) is not a character");
                }
                const n = std.unicode.utf8Encode(code_point, decoded_buf[o..][0..4]) catch unreachable;
                o += n - 1;
                i += 4;
            },
            else => return fail(error.Syntax, "unknown escape; use \\\" \\\\ \\n \\t or \\uXXXX"),
        }
        i += 2;
        o += 1;
    }
}

const ones: u64 = 0x0101010101010101;
const highs: u64 = 0x8080808080808080;

fn word(input: []const u8, i: usize) u64 {
    return std.mem.readInt(u64, input[i..][0..8], .little);
}

/// Nonzero exactly when some byte of `w` is zero (the classic SWAR test; exact for the lowest
/// zero byte, which is all `findQuoteOrBackslash` needs: it only asks "any?" and then scans).
fn hasZeroByte(w: u64) bool {
    return ((w -% ones) & ~w & highs) != 0;
}

/// Strict UTF-8 validation (what Python's decoder accepts: no overlong forms, no surrogates,
/// nothing above U+10FFFF, no truncated sequence), with an eight-bytes-per-step ASCII fast path:
/// wasm32 has no SIMD here, so std.unicode's vector fast path does not apply.
fn validUtf8(input: []const u8) bool {
    var i: usize = 0;
    const n = input.len;
    while (i < n) {
        if (i + 8 <= n and word(input, i) & highs == 0) {
            i += 8;
            continue;
        }
        const c = input[i];
        if (c < 0x80) {
            i += 1;
        } else if (c < 0xC2) {
            return false; // a continuation byte, or the lead of an overlong 2-byte form
        } else if (c < 0xE0) {
            if (i + 2 > n or !isCont(input[i + 1])) return false;
            i += 2;
        } else if (c < 0xF0) {
            if (i + 3 > n) return false;
            const lo: u8 = if (c == 0xE0) 0xA0 else 0x80; // overlong
            const hi: u8 = if (c == 0xED) 0x9F else 0xBF; // surrogates
            if (input[i + 1] < lo or input[i + 1] > hi or !isCont(input[i + 2])) return false;
            i += 3;
        } else if (c < 0xF5) {
            if (i + 4 > n) return false;
            const lo: u8 = if (c == 0xF0) 0x90 else 0x80; // overlong
            const hi: u8 = if (c == 0xF4) 0x8F else 0xBF; // above U+10FFFF
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

var digits_buf: [max_digits]u8 = undefined;

/// The digits of a digit-string argument (values 0-9, and 10 for `X`). Spaces and hyphens are
/// separators; `X`/`x` is accepted only where `allow_x`, and only as the last digit.
fn collectDigits(argument: []const u8, allow_x: bool) Failure![]const u8 {
    var count: usize = 0;
    var x_seen = false;
    for (argument) |c| {
        const digit: u8 = switch (c) {
            '0'...'9' => c - '0',
            'X', 'x' => if (allow_x) 10 else return badDigits(),
            ' ', '-' => continue,
            else => return badDigits(),
        };
        if (x_seen) return badDigits(); // X must be the last digit
        if (digit == 10) x_seen = true;
        if (count < max_digits) digits_buf[count] = digit;
        count += 1;
    }
    if (count == 0) return fail(error.Syntax, "the digit string has no digits");
    if (count > max_digits) return fail(error.TooLarge, "more than 1000 digits");
    return digits_buf[0..count];
}

fn badDigits() Failure {
    return fail(error.Syntax, "a digit string holds only digits 0-9, spaces and hyphens (ISBN-10 may end in X)");
}

fn digitFunction(function: Function, digits: []const u8) Failure![]const u8 {
    switch (function) {
        .luhn_digit => return digitText(luhnCheckDigit(digits)),
        .luhn_valid => {
            if (digits.len < 2) return fail(error.Domain, "luhn_valid needs at least 2 digits (payload and check digit)");
            const n = digits.len - 1;
            return boolText(luhnCheckDigit(digits[0..n]) == digits[n]);
        },
        .isbn10_digit => {
            if (digits.len != 9) return fail(error.Domain, "isbn10_digit needs exactly 9 digits");
            return digitText(isbn10CheckDigit(digits));
        },
        .isbn10_valid => {
            if (digits.len != 10) return fail(error.Domain, "isbn10_valid needs exactly 10 digits (the last may be X)");
            return boolText(isbn10CheckDigit(digits[0..9]) == digits[9]);
        },
        .isbn13_digit => {
            if (digits.len != 12) return fail(error.Domain, "isbn13_digit needs exactly 12 digits");
            return digitText(isbn13CheckDigit(digits));
        },
        .isbn13_valid => {
            if (digits.len != 13) return fail(error.Domain, "isbn13_valid needs exactly 13 digits");
            return boolText(isbn13CheckDigit(digits[0..12]) == digits[12]);
        },
        .crc32, .sha256 => unreachable,
    }
}

/// The digit that makes `payload ++ digit` pass the Luhn check: from the right, every other
/// payload digit starting with the rightmost is doubled (minus 9 when above 9).
fn luhnCheckDigit(payload: []const u8) u8 {
    var sum: u32 = 0;
    var double = true;
    var i = payload.len;
    while (i > 0) {
        i -= 1;
        var d: u32 = payload[i];
        if (double) {
            d *= 2;
            if (d > 9) d -= 9;
        }
        sum += d;
        double = !double;
    }
    return @intCast((10 - sum % 10) % 10);
}

/// Weights 10..2 over nine digits; 10 means `X`.
fn isbn10CheckDigit(payload: []const u8) u8 {
    var sum: u32 = 0;
    for (payload, 0..) |d, i| sum += @as(u32, d) * @as(u32, @intCast(10 - i));
    return @intCast((11 - sum % 11) % 11);
}

/// Weights 1, 3, 1, 3, ... over twelve digits.
fn isbn13CheckDigit(payload: []const u8) u8 {
    var sum: u32 = 0;
    for (payload, 0..) |d, i| sum += @as(u32, d) * (if (i % 2 == 0) @as(u32, 1) else 3);
    return @intCast((10 - sum % 10) % 10);
}

fn digitText(d: u8) []const u8 {
    value_buf[0] = if (d == 10) 'X' else '0' + d;
    return value_buf[0..1];
}

fn boolText(b: bool) []const u8 {
    return if (b) "true" else "false";
}
