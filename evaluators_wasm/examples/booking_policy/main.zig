//! booking_policy/1 (docs/writing-evaluators.md, "A policy"): the booking-eligibility policy of
//! the structured-output study, as a tenant's evaluator. Reads one JSON object
//! `{"age": int|null, "components": [number, ...]}` and writes
//! `{"total": number|null, "action": ..., "reason": ...}`:
//!
//!   age or components missing, null or empty   escalate_human     insufficient_info
//!   age < 18                                   decline            under_age
//!   age > 70                                   decline            over_age
//!   total <= 10000                             book_appointment   eligible
//!   10000 < total <= 12000                     offer_alternative  over_limit
//!   total > 12000                              decline            over_limit
//!
//! total is the exact decimal sum of the components (null when there are none). An input that
//! is not that object is `syntax`; a negative component is `domain`; a number beyond 18
//! significant digits or 18 decimals, or a sum beyond them, is `too_large`. The Python
//! reference is evaluators_wasm/reference/booking_policy.py.

const std = @import("std");
const json = @import("evald_json");

const input_capacity = 4096;
const output_capacity = 256;

var input_buf: [input_capacity]u8 = undefined;
var output_buf: [output_capacity]u8 = undefined;
/// The parsed input's memory: the reader allocates from it, and each call starts it afresh.
var heap: [64 * 1024]u8 = undefined;

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

const Decision = struct { action: []const u8, reason: []const u8 };
const limit_book = json.Decimal.fromInt(10000);
const limit_offer = json.Decimal.fromInt(12000);

/// Returns the value's length, or minus the length of `CODE:message` (an error).
export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_capacity) return fail("syntax", "input too long");
    var fba = std.heap.FixedBufferAllocator.init(&heap);
    const input = json.parse(fba.allocator(), input_buf[0..@intCast(input_len)]) catch |err|
        return fail(if (err == error.OutOfMemory) "too_large" else "syntax", json.message(err));
    if (input != .object) return fail("syntax", "expected a JSON object with age and components");
    const age_value = input.get("age") orelse json.Value.null;
    var age: ?i64 = null;
    if (age_value != .null) {
        age = age_value.int() orelse return fail("syntax", "age must be an integer or null");
    }
    const components = input.get("components") orelse json.Value{ .array = &.{} };
    if (components != .array and components != .null)
        return fail("syntax", "components must be an array of numbers or null");
    var total: ?json.Decimal = null;
    if (components == .array) {
        for (components.array) |component| {
            if (component != .number) return fail("syntax", "components must be numbers");
            const amount = component.decimal() orelse
                return fail("too_large", "a component has more than 18 digits or decimals");
            if (amount.units < 0) return fail("domain", "a component is negative");
            const sum = if (total) |t| t.add(amount) else amount;
            total = sum orelse return fail("too_large", "the total has more than 18 digits");
        }
    }
    const decision = decide(age, total);
    var out = json.Writer.init(&output_buf);
    out.beginObject();
    out.key("total");
    if (total) |t| out.decimal(t) else out.null_();
    out.key("action");
    out.string(decision.action);
    out.key("reason");
    out.string(decision.reason);
    out.endObject();
    const text = out.finish() orelse return fail("too_large", "the value does not fit");
    return @intCast(text.len);
}

fn decide(age: ?i64, total: ?json.Decimal) Decision {
    const years = age orelse return .{ .action = "escalate_human", .reason = "insufficient_info" };
    const sum = total orelse return .{ .action = "escalate_human", .reason = "insufficient_info" };
    if (years < 18) return .{ .action = "decline", .reason = "under_age" };
    if (years > 70) return .{ .action = "decline", .reason = "over_age" };
    if (sum.order(limit_book) != .gt)
        return .{ .action = "book_appointment", .reason = "eligible" };
    if (sum.order(limit_offer) != .gt)
        return .{ .action = "offer_alternative", .reason = "over_limit" };
    return .{ .action = "decline", .reason = "over_limit" };
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
