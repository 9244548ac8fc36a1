//! A template evald policy (ABI v1, docs/abi.md): reads one JSON object, writes one JSON value.
//! {"age": 34, "components": [6500, 1200]} -> {"total":7700,"action":"book_appointment",
//! "reason":"eligible"}. `evald_json` (the SDK's JSON library) reads the input and writes the
//! value; manifest.json declares both as JSON Schemas, which `evald test` checks.

const std = @import("std");
const json = @import("evald_json");

const input_capacity = 4096;
const output_capacity = 256;

var input_buf: [input_capacity]u8 = undefined;
var output_buf: [output_capacity]u8 = undefined;
var heap: [32 * 1024]u8 = undefined; // the parsed input's memory, afresh at every call

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

const limit = json.Decimal.fromInt(10000);

/// Returns the value's length, or minus the length of `CODE:message` (an error).
export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_capacity) return fail("syntax", "input too long");
    var fba = std.heap.FixedBufferAllocator.init(&heap);
    const input = json.parse(fba.allocator(), input_buf[0..@intCast(input_len)]) catch |err|
        return fail("syntax", json.message(err));
    if (input != .object) return fail("syntax", "expected a JSON object");
    const age_value = input.get("age") orelse json.Value.null;
    const age: ?i64 = if (age_value == .null) null else age_value.int() orelse
        return fail("syntax", "age must be an integer or null");
    var total: ?json.Decimal = null;
    const components = input.get("components") orelse json.Value.null;
    if (components == .array) {
        for (components.array) |component| {
            const amount = component.decimal() orelse return fail("syntax", "bad component");
            total = (if (total) |t| t.add(amount) else amount) orelse
                return fail("too_large", "the total is too large");
        }
    } else if (components != .null) return fail("syntax", "components must be an array");

    var action: []const u8 = "book_appointment";
    var reason: []const u8 = "eligible";
    if (age == null or total == null) {
        action = "escalate_human";
        reason = "insufficient_info";
    } else if (age.? < 18) {
        action = "decline";
        reason = "under_age";
    } else if (total.?.order(limit) == .gt) {
        action = "decline";
        reason = "over_limit";
    }
    var out = json.Writer.init(&output_buf);
    out.beginObject();
    out.key("total");
    if (total) |t| out.decimal(t) else out.null_();
    out.key("action");
    out.string(action);
    out.key("reason");
    out.string(reason);
    out.endObject();
    const text = out.finish() orelse return fail("too_large", "the value does not fit");
    return @intCast(text.len);
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
