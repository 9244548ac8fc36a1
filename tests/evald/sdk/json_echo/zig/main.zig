//! json_echo: reads one JSON value with evald_json and writes it back with its writer, numbers
//! as exact decimals where they fit (else as written), so a test can hold the library to
//! Python's json on any input.

const std = @import("std");
const json = @import("evald_json");

var input_buf: [16384]u8 = undefined;
var output_buf: [65536]u8 = undefined;
var heap: [256 * 1024]u8 = undefined;

export fn evald_abi_version() i32 {
    return 1;
}
export fn evald_input_ptr() i32 {
    return @intCast(@intFromPtr(&input_buf));
}
export fn evald_input_cap() i32 {
    return input_buf.len;
}
export fn evald_output_ptr() i32 {
    return @intCast(@intFromPtr(&output_buf));
}
export fn evald_output_cap() i32 {
    return output_buf.len;
}

export fn evald_eval(input_len: i32) i32 {
    var fba = std.heap.FixedBufferAllocator.init(&heap);
    const value = json.parse(fba.allocator(), input_buf[0..@intCast(input_len)]) catch |err|
        return fail(json.message(err));
    var out = json.Writer.init(&output_buf);
    write(&out, value);
    const text = out.finish() orelse return fail("too large");
    return @intCast(text.len);
}

fn write(out: *json.Writer, value: json.Value) void {
    switch (value) {
        .null => out.null_(),
        .bool => |b| out.boolean(b),
        .number => |text| if (value.decimal()) |d| out.decimal(d) else out.json(text),
        .string => |s| out.string(s),
        .array => |items| {
            out.beginArray();
            for (items) |item| write(out, item);
            out.endArray();
        },
        .object => |members| {
            out.beginObject();
            for (members) |member| {
                out.key(member.key);
                write(out, member.value);
            }
            out.endObject();
        },
    }
}

fn fail(message: []const u8) i32 {
    const code = "syntax:";
    @memcpy(output_buf[0..code.len], code);
    @memcpy(output_buf[code.len .. code.len + message.len], message);
    return -@as(i32, @intCast(code.len + message.len));
}
