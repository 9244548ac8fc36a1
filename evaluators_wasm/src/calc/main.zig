//! calc: exact rational arithmetic over `+ - * / % **`, unary signs and parentheses
//! (semantics `calc/1`, docs/semantics/calc.md). ABI v1 (docs/abi.md): no imports, static
//! buffers, one call.
//!
//! Two passes over the input, mirrored by evaluators_wasm/reference/calc.py (which is what keeps
//! the two in agreement on *which* error an input with several problems gets):
//!   1. check: an operator-precedence (shunting-yard) parser with explicit stacks finds every
//!      `syntax` and `too_large` error, left to right, without doing any arithmetic;
//!   2. evaluate: the same parser again, applying each operator as it leaves the operator stack
//!      (postfix order), so operands are evaluated left to right.
//! Nothing recurses, so the 64 KiB guest stack is never at risk; the stacks are static arrays
//! sized by `max_depth`.
//!
//! Values are exact rationals in lowest terms. While numerator and denominator fit in i64 a value
//! stays `Small` and never touches the allocator (the common path: `17 * 23 + 91`); an i64
//! overflow falls back to `std.math.big.int.Managed`, and a big result that fits i64 again comes
//! back to `Small`. Big values are bounded by `max_bits`, and a power's size is estimated before it
//! is computed, so no single operation can take long.

const std = @import("std");
const Managed = std.math.big.int.Managed;
const Allocator = std.mem.Allocator;

const input_capacity = 1 << 20;
const output_capacity = 64 * 1024;
/// Digits in one literal (before and after the point, leading zeros included).
const max_literal_digits = 1000;
/// Nesting levels: open parentheses, unary signs and right operands of `**`.
const max_depth = 256;
/// Bit length bound of every numerator and denominator (lowest terms).
const max_bits = 32768;
/// Printed results satisfy 10^-4300 <= |x| < 10^4300 (or are zero).
const max_result_exponent = 4300;
const significant_digits = 28;
/// Both stacks are provably below 3 * (max_depth + 1) entries (docs/semantics/calc.md,
/// "Limits"); the capacity check in `pushOp`/`pushValue` is a guard, never reached.
const stack_capacity = 1024;

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

const Failure = error{ Syntax, TooLarge, DivisionByZero, Overflow, Domain, OutOfMemory };

var message_buf: [160]u8 = undefined;
/// The message of the last failure; set together with the error by `fail`.
var fail_message: []const u8 = "";

fn fail(err: Failure, comptime fmt: []const u8, args: anytype) Failure {
    fail_message = std.fmt.bufPrint(&message_buf, fmt, args) catch message_buf[0..];
    return err;
}

export fn evald_eval(input_len: i32) i32 {
    if (input_len < 0 or input_len > input_capacity) {
        return writeError("syntax", "input length outside the input buffer");
    }
    heap.reset();
    fail_message = "";
    const text = calculate(input_buf[0..@intCast(input_len)]) catch |err| {
        const code = switch (err) {
            error.Syntax => "syntax",
            error.TooLarge => "too_large",
            error.DivisionByZero => "division_by_zero",
            error.Overflow => "overflow",
            error.Domain => "domain",
            error.OutOfMemory => return writeError("too_large", "the evaluation ran out of memory"),
        };
        return writeError(code, fail_message);
    };
    return @intCast(text.len);
}

fn writeError(code: []const u8, message: []const u8) i32 {
    var n: usize = 0;
    for ([_][]const u8{ code, ":", message }) |part| {
        @memcpy(output_buf[n .. n + part.len], part);
        n += part.len;
    }
    return -@as(i32, @intCast(n));
}

fn calculate(input: []const u8) Failure![]const u8 {
    _ = try run(input, false);
    var value = try run(input, true);
    defer value.deinit();
    return render(&value);
}

// --- the per-call heap ----------------------------------------------------------------------------

const wasm_page = 64 * 1024;

/// Bump allocation over memory grown on demand, with one free list per power-of-two size class so
/// that the temporaries of a long chain of big-number operations are reused. `reset` at the start
/// of every call forgets all of it: no state crosses calls, and nothing can leak between them.
const Heap = struct {
    const min_class = 4;
    const class_count = 27;

    base: usize = 0,
    top: usize = 0,
    limit: usize = 0,
    free_lists: [class_count]usize = [_]usize{0} ** class_count,

    fn reset(self: *Heap) void {
        const memory_end = @wasmMemorySize(0) * wasm_page;
        // Everything below the memory size at the first call is the module's own (data, stack).
        if (self.base == 0) self.base = memory_end;
        self.top = self.base;
        self.limit = memory_end;
        self.free_lists = [_]usize{0} ** class_count;
    }

    fn classOf(len: usize) usize {
        return std.math.log2_int_ceil(usize, @max(len, @as(usize, 1) << min_class));
    }

    fn alloc(ctx: *anyopaque, len: usize, alignment: std.mem.Alignment, _: usize) ?[*]u8 {
        const self: *Heap = @ptrCast(@alignCast(ctx));
        const class = classOf(len);
        if (class >= class_count or alignment.toByteUnits() > 16) return null;
        if (self.free_lists[class] != 0) {
            const address = self.free_lists[class];
            self.free_lists[class] = @as(*usize, @ptrFromInt(address)).*;
            return @ptrFromInt(address);
        }
        const size = @as(usize, 1) << @intCast(class);
        const start = std.mem.alignForward(usize, self.top, 16);
        const end = std.math.add(usize, start, size) catch return null;
        if (end > self.limit) {
            const pages = (end - self.limit + wasm_page - 1) / wasm_page;
            if (@wasmMemoryGrow(0, pages) < 0) return null;
            self.limit += pages * wasm_page;
        }
        self.top = end;
        return @ptrFromInt(start);
    }

    fn resize(_: *anyopaque, memory: []u8, _: std.mem.Alignment, new_len: usize, _: usize) bool {
        return new_len <= (@as(usize, 1) << @intCast(classOf(memory.len)));
    }

    fn remap(ctx: *anyopaque, memory: []u8, a: std.mem.Alignment, new_len: usize, r: usize) ?[*]u8 {
        return if (resize(ctx, memory, a, new_len, r)) memory.ptr else null;
    }

    fn free(ctx: *anyopaque, memory: []u8, _: std.mem.Alignment, _: usize) void {
        const self: *Heap = @ptrCast(@alignCast(ctx));
        const class = classOf(memory.len);
        const address = @intFromPtr(memory.ptr);
        @as(*usize, @ptrFromInt(address)).* = self.free_lists[class];
        self.free_lists[class] = address;
    }
};

var heap: Heap = .{};
const heap_vtable = Allocator.VTable{
    .alloc = Heap.alloc,
    .resize = Heap.resize,
    .remap = Heap.remap,
    .free = Heap.free,
};
const gpa = Allocator{ .ptr = &heap, .vtable = &heap_vtable };

// --- values ---------------------------------------------------------------------------------------

/// n/d in lowest terms, d >= 1, n != minInt(i64) (so that negation and abs are safe).
const Small = struct {
    n: i64,
    d: i64,
};

/// n/d in lowest terms, d > 0; at least one of them does not fit `Small`.
const Big = struct {
    n: Managed,
    d: Managed,
};

const Value = union(enum) {
    small: Small,
    big: Big,

    fn deinit(self: *Value) void {
        switch (self.*) {
            .small => {},
            .big => |*b| {
                b.n.deinit();
                b.d.deinit();
            },
        }
        self.* = .{ .small = .{ .n = 0, .d = 1 } };
    }
};

fn int(n: i64) Value {
    return .{ .small = .{ .n = n, .d = 1 } };
}

/// Replaces a small value by its big form (in place) and returns it.
fn makeBig(v: *Value) Failure!*Big {
    switch (v.*) {
        .big => return &v.big,
        .small => |s| {
            var n = try Managed.initSet(gpa, s.n);
            errdefer n.deinit();
            const d = try Managed.initSet(gpa, s.d);
            v.* = .{ .big = .{ .n = n, .d = d } };
            return &v.big;
        },
    }
}

fn isOne(m: *const Managed) bool {
    return m.isPositive() and m.len() == 1 and m.limbs[0] == 1;
}

fn fitsSmall(m: *const Managed) bool {
    return m.bitCountAbs() <= 63;
}

/// Builds the value n/d from big integers the caller keeps owning (they may be swapped with
/// temporaries). `d` must be positive. Reduces to lowest terms unless `coprime`, checks the size
/// bound and comes back to `Small` when it fits.
fn finish(n: *Managed, d: *Managed, coprime: bool) Failure!Value {
    if (n.eqlZero()) return int(0);
    if (!coprime) {
        var g = try Managed.init(gpa);
        defer g.deinit();
        try g.gcd(n, d);
        if (!isOne(&g)) {
            var q = try Managed.init(gpa);
            defer q.deinit();
            var r = try Managed.init(gpa);
            defer r.deinit();
            try q.divTrunc(&r, n, &g);
            n.swap(&q);
            try q.divTrunc(&r, d, &g);
            d.swap(&q);
        }
    }
    if (n.bitCountAbs() > max_bits or d.bitCountAbs() > max_bits) {
        return fail(error.Overflow, "an intermediate value needs more than {d} bits", .{max_bits});
    }
    if (fitsSmall(n) and fitsSmall(d)) {
        return .{ .small = .{
            .n = n.toInt(i64) catch unreachable,
            .d = d.toInt(i64) catch unreachable,
        } };
    }
    var cn = try n.clone();
    errdefer cn.deinit();
    const cd = try d.clone();
    return .{ .big = .{ .n = cn, .d = cd } };
}

fn gcd64(a: u64, b: u64) u64 {
    var x = a;
    var y = b;
    while (y != 0) {
        const t = x % y;
        x = y;
        y = t;
    }
    return x;
}

fn gcd128(a: u128, b: u128) u128 {
    var x = a;
    var y = b;
    while (y != 0) {
        const t = x % y;
        x = y;
        y = t;
    }
    return x;
}

fn abs64(n: i64) u64 {
    return @abs(n);
}

fn checkedMul(a: i64, b: i64) ?i64 {
    const r = @mulWithOverflow(a, b);
    return if (r[1] != 0 or r[0] == std.math.minInt(i64)) null else r[0];
}

fn checkedAdd(a: i64, b: i64) ?i64 {
    const r = @addWithOverflow(a, b);
    return if (r[1] != 0 or r[0] == std.math.minInt(i64)) null else r[0];
}

// Small-path operations: null means "does not fit i64, use big integers".

fn smallAdd(a: Small, b: Small) ?Small {
    if (a.d == 1 and b.d == 1) return .{ .n = checkedAdd(a.n, b.n) orelse return null, .d = 1 };
    // Knuth's form: keeps intermediates small and the result in lowest terms.
    const g: i64 = @intCast(gcd64(@intCast(a.d), @intCast(b.d)));
    const ta = @divExact(a.d, g);
    const tb = @divExact(b.d, g);
    const s = checkedAdd(checkedMul(a.n, tb) orelse return null, checkedMul(b.n, ta) orelse return null) orelse return null;
    if (s == 0) return .{ .n = 0, .d = 1 };
    const g2: i64 = @intCast(gcd64(abs64(s), @intCast(g)));
    return .{ .n = @divExact(s, g2), .d = checkedMul(ta, @divExact(b.d, g2)) orelse return null };
}

fn smallMul(a: Small, b: Small) ?Small {
    if (a.d == 1 and b.d == 1) return .{ .n = checkedMul(a.n, b.n) orelse return null, .d = 1 };
    const g1: i64 = @intCast(gcd64(abs64(a.n), @intCast(b.d)));
    const g2: i64 = @intCast(gcd64(abs64(b.n), @intCast(a.d)));
    return .{
        .n = checkedMul(@divExact(a.n, g1), @divExact(b.n, g2)) orelse return null,
        .d = checkedMul(@divExact(a.d, g2), @divExact(b.d, g1)) orelse return null,
    };
}

/// b != 0.
fn smallDiv(a: Small, b: Small) ?Small {
    const inverse = Small{ .n = if (b.n < 0) -b.d else b.d, .d = @intCast(abs64(b.n)) };
    return smallMul(a, inverse);
}

/// Floored modulo; b != 0.
fn smallMod(a: Small, b: Small) ?Small {
    if (a.d == 1 and b.d == 1) {
        var r = @rem(a.n, b.n);
        if (r != 0 and (r < 0) != (b.n < 0)) r += b.n;
        return .{ .n = r, .d = 1 };
    }
    // (a.n * b.d) mod (b.n * a.d), over a.d * b.d: every product is below 2^126.
    const x = @as(i128, a.n) * b.d;
    const y = @as(i128, b.n) * a.d;
    var r = @rem(x, y);
    if (r != 0 and (r < 0) != (y < 0)) r += y;
    if (r == 0) return .{ .n = 0, .d = 1 };
    const den = @as(i128, a.d) * b.d;
    const g: i128 = @intCast(gcd128(@abs(r), @intCast(den)));
    const n = @divExact(r, g);
    const d = @divExact(den, g);
    if (n <= std.math.minInt(i64) or n > std.math.maxInt(i64) or d > std.math.maxInt(i64)) return null;
    return .{ .n = @intCast(n), .d = @intCast(d) };
}

fn powChecked(base: i64, exponent: u64) ?i64 {
    var result: i64 = 1;
    var b = base;
    var k = exponent;
    while (true) {
        if (k & 1 != 0) result = checkedMul(result, b) orelse return null;
        k >>= 1;
        if (k == 0) return result;
        b = checkedMul(b, b) orelse return null;
    }
}

// --- operators ------------------------------------------------------------------------------------

const Op = enum(u8) { add, sub, mul, div, mod, pow, neg, pos, open };

fn precedence(op: Op) u8 {
    return switch (op) {
        .add, .sub => 1,
        .mul, .div, .mod => 2,
        .neg, .pos => 3,
        .pow => 4,
        .open => 0,
    };
}

fn opensLevel(op: Op) bool {
    return switch (op) {
        .open, .neg, .pos, .pow => true,
        else => false,
    };
}

fn binary(op: Op, a: *Value, b: *Value) Failure!Value {
    switch (op) {
        .div, .mod => {
            const zero = switch (b.*) {
                .small => |s| s.n == 0,
                .big => |*bb| bb.n.eqlZero(),
            };
            if (zero) return fail(error.DivisionByZero, "'{s}' by zero", .{if (op == .div) "/" else "%"});
        },
        .pow => return power(a, b),
        else => {},
    }
    if (a.* == .small and b.* == .small) {
        const x = a.small;
        var y = b.small;
        const fast = switch (op) {
            .add => smallAdd(x, y),
            .sub => blk: {
                y.n = -y.n;
                break :blk smallAdd(x, y);
            },
            .mul => smallMul(x, y),
            .div => smallDiv(x, y),
            .mod => smallMod(x, y),
            else => unreachable,
        };
        if (fast) |r| return .{ .small = r };
    }
    const p = try makeBig(a);
    const q = try makeBig(b);
    var n = try Managed.init(gpa);
    defer n.deinit();
    var d = try Managed.init(gpa);
    defer d.deinit();
    var t = try Managed.init(gpa);
    defer t.deinit();
    switch (op) {
        .add, .sub => {
            try n.mul(&p.n, &q.d);
            try t.mul(&q.n, &p.d);
            if (op == .add) try n.add(&n, &t) else try n.sub(&n, &t);
            try d.mul(&p.d, &q.d);
        },
        .mul => {
            try n.mul(&p.n, &q.n);
            try d.mul(&p.d, &q.d);
        },
        .div => {
            try n.mul(&p.n, &q.d);
            try d.mul(&p.d, &q.n);
            if (!d.isPositive()) {
                n.negate();
                d.negate();
            }
        },
        .mod => {
            // (p.n * q.d) mod (q.n * p.d), floored, over p.d * q.d.
            var x = try Managed.init(gpa);
            defer x.deinit();
            var quotient = try Managed.init(gpa);
            defer quotient.deinit();
            try x.mul(&p.n, &q.d);
            try t.mul(&q.n, &p.d);
            try quotient.divFloor(&n, &x, &t);
            try d.mul(&p.d, &q.d);
        },
        else => unreachable,
    }
    return finish(&n, &d, false);
}

fn power(a: *Value, b: *Value) Failure!Value {
    // 1. The exponent must be an integer.
    const exponent_integer = switch (b.*) {
        .small => |s| s.d == 1,
        .big => |*bb| isOne(&bb.d),
    };
    if (!exponent_integer) return fail(error.Domain, "the exponent of ** must be an integer", .{});
    const exponent_negative = switch (b.*) {
        .small => |s| s.n < 0,
        .big => |*bb| !bb.n.isPositive(),
    };
    // 2. A zero base.
    const base_zero = switch (a.*) {
        .small => |s| s.n == 0,
        .big => |*ab| ab.n.eqlZero(),
    };
    if (base_zero) {
        if (exponent_negative) return fail(error.DivisionByZero, "0 raised to a negative power", .{});
        const exponent_zero = b.* == .small and b.small.n == 0;
        return int(if (exponent_zero) 1 else 0);
    }
    // 3. A base of 1 or -1 (never big: big values do not fit i64).
    if (a.* == .small and a.small.d == 1 and (a.small.n == 1 or a.small.n == -1)) {
        if (a.small.n == 1) return int(1);
        const odd = switch (b.*) {
            .small => |s| s.n & 1 != 0,
            .big => |*bb| bb.n.isOdd(),
        };
        return int(if (odd) -1 else 1);
    }
    // 4. Refuse before computing when |exponent| x max(bits(|numerator|), bits(denominator)) is
    //    beyond the bound (the result's size is at most that).
    const size: u64 = switch (a.*) {
        .small => |s| @max(64 - @clz(abs64(s.n)), 64 - @clz(abs64(s.d))),
        .big => |*ab| @max(ab.n.bitCountAbs(), ab.d.bitCountAbs()),
    };
    const magnitude: u64 = switch (b.*) {
        .small => |s| abs64(s.n),
        .big => max_bits + 1,
    };
    if (magnitude > max_bits or magnitude * size > max_bits) {
        return fail(error.Overflow, "the power would need more than {d} bits", .{max_bits});
    }
    // 5. Compute: p^k / q^k is already in lowest terms.
    const k: u32 = @intCast(magnitude);
    if (a.* == .small) {
        const s = a.small;
        if (powChecked(s.n, k)) |pn| {
            if (powChecked(s.d, k)) |pd| {
                if (!exponent_negative) return .{ .small = .{ .n = pn, .d = pd } };
                return .{ .small = .{ .n = if (pn < 0) -pd else pd, .d = @intCast(abs64(pn)) } };
            }
        }
    }
    const p = try makeBig(a);
    var n = try Managed.init(gpa);
    defer n.deinit();
    var d = try Managed.init(gpa);
    defer d.deinit();
    try n.pow(&p.n, k);
    try d.pow(&p.d, k);
    if (exponent_negative) {
        n.swap(&d);
        if (!d.isPositive()) {
            n.negate();
            d.negate();
        }
    }
    return finish(&n, &d, true);
}

fn negate(v: *Value) void {
    switch (v.*) {
        .small => |*s| s.n = -s.n,
        .big => |*b| b.n.negate(),
    }
}

// --- the parser -----------------------------------------------------------------------------------

var ops: [stack_capacity]Op = undefined;
var values: [stack_capacity]Value = undefined;

/// Parser state for one pass.
const Pass = struct {
    ops_len: usize = 0,
    values_len: usize = 0,
    depth: usize = 0,

    fn pushOp(self: *Pass, op: Op, at: usize) Failure!void {
        if (opensLevel(op)) {
            self.depth += 1;
            if (self.depth > max_depth) {
                return fail(error.TooLarge, "nesting deeper than {d} levels at offset {d}", .{ max_depth, at });
            }
        }
        if (self.ops_len == stack_capacity) return fail(error.TooLarge, "expression too complex", .{});
        ops[self.ops_len] = op;
        self.ops_len += 1;
    }

    fn popOp(self: *Pass) Op {
        self.ops_len -= 1;
        const op = ops[self.ops_len];
        if (opensLevel(op)) self.depth -= 1;
        return op;
    }

    fn top(self: *const Pass) ?Op {
        return if (self.ops_len == 0) null else ops[self.ops_len - 1];
    }

    fn pushValue(self: *Pass, v: Value) Failure!void {
        if (self.values_len == stack_capacity) return fail(error.TooLarge, "expression too complex", .{});
        values[self.values_len] = v;
        self.values_len += 1;
    }

    /// Applies an operator that leaves the stack (evaluating pass only).
    fn apply(self: *Pass, op: Op) Failure!void {
        switch (op) {
            .neg => negate(&values[self.values_len - 1]),
            .pos, .open => {},
            else => {
                const b = &values[self.values_len - 1];
                const a = &values[self.values_len - 2];
                defer b.deinit();
                const r = try binary(op, a, b);
                a.deinit();
                a.* = r;
                self.values_len -= 1;
            },
        }
    }

    fn releaseValues(self: *Pass) void {
        while (self.values_len > 0) {
            self.values_len -= 1;
            values[self.values_len].deinit();
        }
    }
};

fn isWhitespace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

fn isDigit(c: u8) bool {
    return c >= '0' and c <= '9';
}

fn syntaxFound(comptime expected: []const u8, input: []const u8, pos: usize) Failure {
    if (pos >= input.len) return fail(error.Syntax, expected ++ "; found end of input", .{});
    const c = input[pos];
    if (c >= 0x21 and c <= 0x7e) return fail(error.Syntax, expected ++ "; found '{c}' at offset {d}", .{ c, pos });
    return fail(error.Syntax, expected ++ "; found byte 0x{x:0>2} at offset {d}", .{ c, pos });
}

/// One pass over the input. The checking pass (`evaluate` false) returns a dummy value.
fn run(input: []const u8, comptime evaluate: bool) Failure!Value {
    var pass = Pass{};
    errdefer if (evaluate) pass.releaseValues();
    var expect_operand = true;
    var pos: usize = 0;
    while (true) {
        while (pos < input.len and isWhitespace(input[pos])) pos += 1;
        if (expect_operand) {
            if (pos == input.len) return syntaxFound("expected a number, '(' or a sign", input, pos);
            switch (input[pos]) {
                '0'...'9', '.' => {
                    const literal = try scanLiteral(input, pos);
                    if (evaluate) try pass.pushValue(try literalValue(input, literal));
                    pos = literal.end;
                    expect_operand = false;
                },
                '(' => {
                    try pass.pushOp(.open, pos);
                    pos += 1;
                },
                '-' => {
                    try pass.pushOp(.neg, pos);
                    pos += 1;
                },
                '+' => {
                    try pass.pushOp(.pos, pos);
                    pos += 1;
                },
                else => return syntaxFound("expected a number, '(' or a sign", input, pos),
            }
            continue;
        }
        if (pos == input.len) {
            while (pass.top()) |_| {
                const op = pass.popOp();
                if (op == .open) return fail(error.Syntax, "missing ')' at end of input", .{});
                if (evaluate) try pass.apply(op);
            }
            if (!evaluate) return int(0);
            pass.values_len = 0;
            return values[0];
        }
        const c = input[pos];
        if (c == ')') {
            while (pass.top()) |t| {
                if (t == .open) break;
                const op = pass.popOp();
                if (evaluate) try pass.apply(op);
            }
            if (pass.top() == null) return fail(error.Syntax, "unmatched ')' at offset {d}", .{pos});
            _ = pass.popOp();
            pos += 1;
            continue;
        }
        const op: Op = switch (c) {
            '+' => .add,
            '-' => .sub,
            '*' => if (pos + 1 < input.len and input[pos + 1] == '*') .pow else .mul,
            '/' => .div,
            '%' => .mod,
            else => return syntaxFound("expected an operator or ')'", input, pos),
        };
        const p = precedence(op);
        while (pass.top()) |t| {
            if (t == .open) break;
            const tp = precedence(t);
            if (tp > p or (tp == p and op != .pow)) {
                _ = pass.popOp();
                if (evaluate) try pass.apply(t);
            } else break;
        }
        try pass.pushOp(op, pos);
        pos += if (op == .pow) 2 else 1;
        expect_operand = true;
    }
}

const Literal = struct {
    start: usize,
    /// End of the digits before the point.
    whole_end: usize,
    /// Start of the digits after the point (== end when there is no point).
    fraction_start: usize,
    end: usize,
};

fn scanLiteral(input: []const u8, start: usize) Failure!Literal {
    var pos = start;
    while (pos < input.len and isDigit(input[pos])) {
        pos += 1;
        if (pos - start > max_literal_digits) return tooManyDigits(start);
    }
    const whole_end = pos;
    if (pos < input.len and input[pos] == '.') {
        pos += 1;
        const fraction_start = pos;
        while (pos < input.len and isDigit(input[pos])) {
            pos += 1;
            if ((whole_end - start) + (pos - fraction_start) > max_literal_digits) return tooManyDigits(start);
        }
        if (pos == fraction_start) return fail(error.Syntax, "'.' at offset {d} must be followed by a digit", .{whole_end});
        return .{ .start = start, .whole_end = whole_end, .fraction_start = fraction_start, .end = pos };
    }
    return .{ .start = start, .whole_end = whole_end, .fraction_start = pos, .end = pos };
}

fn tooManyDigits(start: usize) Failure {
    return fail(error.TooLarge, "number at offset {d} has more than {d} digits", .{ start, max_literal_digits });
}

const pow10_table = blk: {
    var table: [19]u64 = undefined;
    table[0] = 1;
    for (1..19) |i| table[i] = table[i - 1] * 10;
    break :blk table;
};

var digit_buf: [max_literal_digits]u8 = undefined;

fn literalValue(input: []const u8, lit: Literal) Failure!Value {
    const whole = input[lit.start..lit.whole_end];
    const fraction = input[lit.fraction_start..lit.end];
    if (whole.len + fraction.len <= 18) {
        var n: u64 = 0;
        for (whole) |c| n = n * 10 + (c - '0');
        for (fraction) |c| n = n * 10 + (c - '0');
        const d = pow10_table[fraction.len];
        const g = gcd64(n, d);
        if (n == 0) return int(0);
        return .{ .small = .{ .n = @intCast(n / g), .d = @intCast(d / g) } };
    }
    @memcpy(digit_buf[0..whole.len], whole);
    @memcpy(digit_buf[whole.len .. whole.len + fraction.len], fraction);
    var n = try Managed.init(gpa);
    defer n.deinit();
    n.setString(10, digit_buf[0 .. whole.len + fraction.len]) catch return error.OutOfMemory;
    var d = try pow10(@intCast(fraction.len));
    defer d.deinit();
    return finish(&n, &d, false);
}

fn pow10(k: u32) Failure!Managed {
    var ten = try Managed.initSet(gpa, 10);
    defer ten.deinit();
    var r = try Managed.init(gpa);
    errdefer r.deinit();
    try r.pow(&ten, k);
    return r;
}

// --- the canonical text ---------------------------------------------------------------------------

/// A rounded decimal: value = 0.DIGITS x 10^point, DIGITS without leading zeros.
const Decimal = struct {
    negative: bool,
    digits: [significant_digits + 1]u8 = undefined,
    len: usize = 0,
    point: i64 = 0,
};

fn outOfRange() Failure {
    return fail(error.Overflow, "the result is outside 10**-{d} <= |x| < 10**{d}", .{ max_result_exponent, max_result_exponent });
}

fn render(v: *Value) Failure![]const u8 {
    switch (v.*) {
        .small => |s| {
            if (s.d == 1) return writeInteger(s.n < 0, abs64(s.n));
            var dec = smallDecimal(s);
            return writeDecimal(&dec);
        },
        .big => |*b| {
            if (isOne(&b.d)) return writeBigInteger(&b.n);
            var dec = try bigDecimal(b);
            return writeDecimal(&dec);
        },
    }
}

fn writeInteger(negative: bool, magnitude: u64) []const u8 {
    var tmp: [20]u8 = undefined;
    var i: usize = tmp.len;
    var m = magnitude;
    while (true) {
        i -= 1;
        tmp[i] = @intCast('0' + m % 10);
        m /= 10;
        if (m == 0) break;
    }
    var n: usize = 0;
    if (negative) {
        output_buf[0] = '-';
        n = 1;
    }
    @memcpy(output_buf[n .. n + tmp.len - i], tmp[i..]);
    return output_buf[0 .. n + tmp.len - i];
}

fn writeBigInteger(n: *const Managed) Failure![]const u8 {
    // 2^14284 < 10^4300 < 2^14285: only a 14285-bit value needs its digits counted.
    if (n.bitCountAbs() > 14285) return outOfRange();
    const text = n.toString(gpa, 10, .lower) catch return error.OutOfMemory;
    defer gpa.free(text);
    const digits = if (text[0] == '-') text.len - 1 else text.len;
    if (digits > max_result_exponent) return outOfRange();
    @memcpy(output_buf[0..text.len], text);
    return output_buf[0..text.len];
}

/// Long division of |n| by d (d >= 2), 29 significant digits and a sticky bit, then half-even
/// rounding to 28. Everything fits u64/u128; no allocation.
fn smallDecimal(s: Small) Decimal {
    var dec = Decimal{ .negative = s.n < 0 };
    const q: u64 = @intCast(s.d);
    const p = abs64(s.n);
    var whole = p / q;
    var r = p % q;
    if (whole > 0) {
        var tmp: [20]u8 = undefined;
        var i: usize = tmp.len;
        while (whole > 0) : (whole /= 10) {
            i -= 1;
            tmp[i] = @intCast(whole % 10);
        }
        dec.len = tmp.len - i;
        @memcpy(dec.digits[0..dec.len], tmp[i..]);
        dec.point = @intCast(dec.len);
    }
    const narrow = q < (1 << 59);
    while (dec.len < significant_digits + 1 and r != 0) {
        var digit: u8 = undefined;
        if (narrow) {
            const x = r * 10;
            digit = @intCast(x / q);
            r = x % q;
        } else {
            const x = @as(u128, r) * 10;
            digit = @intCast(x / q);
            r = @intCast(x % q);
        }
        if (dec.len == 0 and digit == 0) {
            dec.point -= 1;
        } else {
            dec.digits[dec.len] = digit;
            dec.len += 1;
        }
    }
    if (dec.len == significant_digits + 1) {
        dec.len = significant_digits;
        roundHalfEven(&dec, dec.digits[significant_digits], r != 0);
    }
    return dec;
}

/// Rounds the digits of `dec` given the first dropped digit and whether anything after it is
/// non-zero.
fn roundHalfEven(dec: *Decimal, dropped: u8, sticky: bool) void {
    const last = dec.digits[dec.len - 1];
    const up = dropped > 5 or (dropped == 5 and (sticky or last % 2 == 1));
    if (!up) return;
    var i = dec.len;
    while (i > 0) {
        i -= 1;
        if (dec.digits[i] < 9) {
            dec.digits[i] += 1;
            return;
        }
        dec.digits[i] = 0;
    }
    // All nines: 99..9 + 1 = 100..0, one more digit before the point.
    dec.digits[0] = 1;
    dec.point += 1;
}

/// p/q >= 10^e (p, q > 0).
fn atLeastPowerOfTen(p: *const Managed, q: *const Managed, e: i64) Failure!bool {
    var scale = try pow10(@intCast(@abs(e)));
    defer scale.deinit();
    var t = try Managed.init(gpa);
    defer t.deinit();
    if (e >= 0) {
        try t.mul(q, &scale);
        return p.order(t) != .lt;
    }
    try t.mul(p, &scale);
    return t.order(q.*) != .lt;
}

/// N = round_half_even(|n|/d x 10^shift) with exactly 28 digits, by big integer division.
fn bigDecimal(b: *const Big) Failure!Decimal {
    var dec = Decimal{ .negative = !b.n.isPositive() };
    var p = try b.n.clone();
    defer p.deinit();
    p.abs();
    const q = &b.d;
    // e = floor(log10(p/q)): estimated from bit lengths, then corrected exactly.
    const bit_difference = @as(i64, @intCast(p.bitCountAbs())) - @as(i64, @intCast(q.bitCountAbs()));
    var e: i64 = @divFloor(bit_difference * 30103, 100000);
    while (try atLeastPowerOfTen(&p, q, e + 1)) e += 1;
    while (!try atLeastPowerOfTen(&p, q, e)) e -= 1;
    var shift: i64 = significant_digits - 1 - e;
    var num = try Managed.init(gpa);
    defer num.deinit();
    var den = try Managed.init(gpa);
    defer den.deinit();
    var scale = try pow10(@intCast(@abs(shift)));
    defer scale.deinit();
    if (shift >= 0) {
        try num.mul(&p, &scale);
        try den.copy(q.toConst());
    } else {
        try num.copy(p.toConst());
        try den.mul(q, &scale);
    }
    var digits = try Managed.init(gpa);
    defer digits.deinit();
    var rest = try Managed.init(gpa);
    defer rest.deinit();
    try digits.divTrunc(&rest, &num, &den);
    try rest.shiftLeft(&rest, 1);
    const half = rest.order(den);
    if (half == .gt or (half == .eq and digits.isOdd())) try digits.addScalar(&digits, 1);
    const text = digits.toString(gpa, 10, .lower) catch return error.OutOfMemory;
    defer gpa.free(text);
    // 10^28 after rounding up: one digit more, same leading "1000...".
    if (text.len == significant_digits + 1) shift -= 1;
    const exponent = significant_digits - 1 - shift;
    if (exponent >= max_result_exponent or exponent < -max_result_exponent) return outOfRange();
    for (0..significant_digits) |i| dec.digits[i] = text[i] - '0';
    dec.len = significant_digits;
    dec.point = exponent + 1;
    return dec;
}

fn writeDecimal(dec: *Decimal) []const u8 {
    var len = dec.len;
    while (len > 1 and dec.digits[len - 1] == 0) len -= 1;
    var n: usize = 0;
    if (dec.negative) {
        output_buf[0] = '-';
        n = 1;
    }
    const point = dec.point;
    if (point >= @as(i64, @intCast(len))) {
        for (dec.digits[0..len]) |dg| {
            output_buf[n] = '0' + dg;
            n += 1;
        }
        const zeros: usize = @intCast(point - @as(i64, @intCast(len)));
        @memset(output_buf[n .. n + zeros], '0');
        n += zeros;
    } else if (point > 0) {
        const whole: usize = @intCast(point);
        for (dec.digits[0..len], 0..) |dg, i| {
            if (i == whole) {
                output_buf[n] = '.';
                n += 1;
            }
            output_buf[n] = '0' + dg;
            n += 1;
        }
    } else {
        const zeros: usize = @intCast(-point);
        output_buf[n] = '0';
        output_buf[n + 1] = '.';
        n += 2;
        @memset(output_buf[n .. n + zeros], '0');
        n += zeros;
        for (dec.digits[0..len]) |dg| {
            output_buf[n] = '0' + dg;
            n += 1;
        }
    }
    return output_buf[0..n];
}
