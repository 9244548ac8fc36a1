//! A template evald evaluator (ABI v1, docs/abi.md): an integer from 1 to 3999 in Roman
//! numerals, "1994" -> "MCMXCIV". No imports; the host writes the input into `input_buf`,
//! calls `evald_eval(len)` and reads `output_buf[0..r]` (a value) or `[0..-r]` (an error).

const input_capacity = 64;
const output_capacity = 256;

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

/// Returns the value's length, or minus the length of `CODE:message` (an error).
export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_capacity) return fail("syntax", "input too long");
    const input = input_buf[0..@intCast(input_len)];
    if (input.len == 0) return fail("syntax", "expected a number");
    if (input[0] == '0') return fail("syntax", "no leading zeros");
    var number: u32 = 0;
    for (input) |c| {
        if (c < '0' or c > '9') return fail("syntax", "expected decimal digits only");
        if (number <= 3999) number = number * 10 + (c - '0');
    }
    if (number > 3999) return fail("domain", "Roman numerals cover 1 to 3999");
    return roman(number);
}

const values = [_]u32{ 1000, 900, 500, 400, 100, 90, 50, 40, 10, 9, 5, 4, 1 };
const symbols = [_][]const u8{
    "M", "CM", "D", "CD", "C", "XC", "L", "XL", "X", "IX", "V", "IV", "I",
};

fn roman(number: u32) i32 {
    var rest = number;
    var n: usize = 0;
    for (values, symbols) |value, symbol| {
        while (rest >= value) : (rest -= value) {
            @memcpy(output_buf[n .. n + symbol.len], symbol);
            n += symbol.len;
        }
    }
    return @intCast(n);
}

fn fail(code: []const u8, message: []const u8) i32 {
    const parts = [_][]const u8{ code, ":", message };
    var n: usize = 0;
    for (parts) |part| {
        @memcpy(output_buf[n .. n + part.len], part);
        n += part.len;
    }
    return -@as(i32, @intCast(n));
}
