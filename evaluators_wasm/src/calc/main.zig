//! calc: exact rational arithmetic over `+ - * / % **`, unary signs and parentheses
//! (semantics `calc/1`, docs/semantics/calc.md). ABI v1 (docs/abi.md): no imports, static
//! buffers, one call.
//!
//! One left-to-right pass: an operator-precedence (shunting-yard) parser with explicit stacks that
//! applies each operator as it leaves the operator stack (postfix order), so operands are
//! evaluated left to right. Every `syntax` and `too_large` error wins over every arithmetic error
//! (`division_by_zero`, `overflow`, `domain`), as if the whole input were parsed first: the first
//! arithmetic error is only recorded, evaluation stops, and parsing goes on to the end. This is
//! what evaluators_wasm/reference/calc.py does in two phases (parse, then evaluate), and what keeps
//! the two in agreement on *which* error an input with several problems gets.
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
const max_bits = 16384;
/// Printed results satisfy 10^-4300 <= |x| < 10^4300 (or are zero).
const max_result_exponent = 4300;
const significant_digits = 28;
/// Both stacks stay below 771 entries: the operator stack holds at most `max_depth` operators
/// that open a level (`(`, signs, `**`), plus at most two of `+ - * / %` per parenthesis level
/// (one per precedence; such an operator is never pushed above a sign or `**`, which it pops);
/// the value stack holds one left operand per binary operator on the operator stack, plus one.
/// The capacity checks in `pushOp`/`pushValue` are guards, never reached.
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
    var value = try run(input);
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
    if (!coprime and !isOne(d)) {
        var g = try Managed.init(gpa);
        defer g.deinit();
        try gcd(&g, n, d);
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
    // Move the limbs out; the caller is left with empty numbers to free.
    var cn = try Managed.init(gpa);
    errdefer cn.deinit();
    var cd = try Managed.init(gpa);
    cn.swap(n);
    cd.swap(d);
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

inline fn checkedMul(a: i64, b: i64) ?i64 {
    // Products of operands below 2^31 cannot overflow; skip the costly 128-bit check for them.
    const limit = 1 << 31;
    if (a > -limit and a < limit and b > -limit and b < limit) return a * b;
    const r = @mulWithOverflow(a, b);
    return if (r[1] != 0 or r[0] == std.math.minInt(i64)) null else r[0];
}

inline fn checkedAdd(a: i64, b: i64) ?i64 {
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

// --- big integer routines -------------------------------------------------------------------------
// std.math.big.int's gcd, setString and toString are general but slow for this workload (its gcd
// allocates and multiplies whole numbers in every Lehmer step; the string conversions move four
// decimal digits per pass on 32-bit limbs). These work on the limbs directly.

const Limb = std.math.big.Limb;
comptime {
    std.debug.assert(@bitSizeOf(Limb) == 32); // wasm32: the routines below assume 32-bit limbs
}
const chunk_base: u64 = 1_000_000_000; // 9 decimal digits per step

fn setLen(m: *Managed, len_in: usize) void {
    var len = len_in;
    while (len > 1 and m.limbs[len - 1] == 0) len -= 1;
    if (len == 0) {
        m.limbs[0] = 0;
        len = 1;
    }
    m.setMetadata(true, len);
}

/// r = the non-negative integer written by `digits` (ASCII 0-9 only).
fn setDecimal(r: *Managed, digits: []const u8) Failure!void {
    try r.ensureCapacity(digits.len / 9 + 2);
    var len: usize = 0;
    var pos: usize = 0;
    while (pos < digits.len) {
        const take = if (pos == 0 and digits.len % 9 != 0) digits.len % 9 else 9;
        var chunk: u64 = 0;
        var scale: u64 = 1;
        for (digits[pos .. pos + take]) |c| {
            chunk = chunk * 10 + (c - '0');
            scale *= 10;
        }
        pos += take;
        var carry = chunk;
        for (r.limbs[0..len]) |*limb| {
            const x = @as(u64, limb.*) * scale + carry;
            limb.* = @truncate(x);
            carry = x >> 32;
        }
        if (carry != 0) {
            r.limbs[len] = @intCast(carry);
            len += 1;
        }
    }
    setLen(r, len);
}

var decimal_buf: [max_result_exponent + 16]u8 = undefined;

/// The decimal digits of |n|, which must have at most 14,300 bits (in `decimal_buf`).
fn decimalDigits(n: *const Managed) Failure![]const u8 {
    const len = n.len();
    const work = try gpa.alloc(Limb, len);
    defer gpa.free(work);
    @memcpy(work, n.limbs[0..len]);
    var top = len;
    var end: usize = decimal_buf.len;
    while (true) {
        var rem: u64 = 0;
        var i = top;
        while (i > 0) {
            i -= 1;
            const x = (rem << 32) | work[i];
            work[i] = @intCast(x / chunk_base);
            rem = x % chunk_base;
        }
        while (top > 0 and work[top - 1] == 0) top -= 1;
        // Nine digits of the chunk, or only its significant ones for the leading chunk.
        var k: usize = 0;
        while (k < 9 and (top > 0 or rem != 0 or k == 0)) : (k += 1) {
            end -= 1;
            decimal_buf[end] = @intCast('0' + rem % 10);
            rem /= 10;
        }
        if (top == 0) break;
    }
    return decimal_buf[end..];
}

/// The top 62 bits of |m| >> shift, where shift = bit length of the larger operand - 62.
fn topBits(m: *const Managed, shift: usize) u64 {
    const index = shift / 32;
    const offset: u6 = @intCast(shift % 32);
    var window: u128 = 0;
    var k: usize = 3;
    while (k > 0) {
        k -= 1;
        const limb: u128 = if (index + k < m.len()) m.limbs[index + k] else 0;
        window = (window << 32) | limb;
    }
    return @truncate(window >> offset);
}

/// (t, w) = (a*x + b*y, c*x + d*y) for the cofactors of one Lehmer step: |a|, |b|, |c|, |d| < 2^30
/// and both results are non-negative, so every partial sum fits i64.
fn combine(t: *Managed, w: *Managed, x: *const Managed, y: *const Managed, k: [4]i64) void {
    const len = x.len();
    const ylen = y.len();
    var carry_t: i64 = 0;
    var carry_w: i64 = 0;
    for (0..len) |i| {
        const xi: i64 = x.limbs[i];
        const yi: i64 = if (i < ylen) y.limbs[i] else 0;
        const acc_t = k[0] * xi + k[1] * yi + carry_t;
        const acc_w = k[2] * xi + k[3] * yi + carry_w;
        t.limbs[i] = @truncate(@as(u64, @bitCast(acc_t)));
        w.limbs[i] = @truncate(@as(u64, @bitCast(acc_w)));
        carry_t = acc_t >> 32;
        carry_w = acc_w >> 32;
    }
    setLen(t, len);
    setLen(w, len);
}

/// r = gcd(|x|, |y|), Lehmer's algorithm (Knuth, TAOCP 4.5.2, Algorithm L) on 62-bit leading
/// parts: each step replaces about 30 bits of Euclid's multi-precision divisions by one linear
/// combination of the two numbers.
fn gcd(r: *Managed, x: *const Managed, y: *const Managed) Failure!void {
    // Shortcuts: a unit, or one number below 2^32 (one pass of single-limb remainders).
    if ((x.len() == 1 and x.limbs[0] == 1) or (y.len() == 1 and y.limbs[0] == 1)) return r.set(1);
    if (x.len() == 1 or y.len() == 1) {
        const big = if (x.len() == 1) y else x;
        const small: u64 = if (x.len() == 1) x.limbs[0] else y.limbs[0];
        if (small == 0) {
            try r.copy(big.toConst());
            r.abs();
            return;
        }
        var rem: u64 = 0;
        var i = big.len();
        while (i > 0) {
            i -= 1;
            rem = ((rem << 32) | big.limbs[i]) % small;
        }
        return r.set(gcd64(small, rem));
    }
    var u = try x.clone();
    defer u.deinit();
    u.abs();
    var v = try y.clone();
    defer v.deinit();
    v.abs();
    if (u.order(v) == .lt) u.swap(&v);
    const capacity = u.len() + 1;
    var t = try Managed.initCapacity(gpa, capacity);
    defer t.deinit();
    var w = try Managed.initCapacity(gpa, capacity);
    defer w.deinit();
    var q = try Managed.init(gpa);
    defer q.deinit();
    const limit: i64 = 1 << 30;
    while (v.len() > 2) {
        const shift = u.bitCountAbs() - 62;
        var uh: i64 = @intCast(topBits(&u, shift));
        var vh: i64 = @intCast(topBits(&v, shift));
        var a: i64 = 1;
        var b: i64 = 0;
        var c: i64 = 0;
        var d: i64 = 1;
        while (vh + c != 0 and vh + d != 0) {
            const quotient = @divFloor(uh + a, vh + c);
            if (quotient != @divFloor(uh + b, vh + d)) break;
            // Stopping early is always correct; this keeps every product below 2^60.
            if (quotient >= limit) break;
            const na = a - quotient * c;
            const nb = b - quotient * d;
            if (na >= limit or na <= -limit or nb >= limit or nb <= -limit) break;
            a = c;
            c = na;
            b = d;
            d = nb;
            const nu = uh - quotient * vh;
            uh = vh;
            vh = nu;
        }
        if (b == 0) {
            try q.divTrunc(&t, &u, &v);
            u.swap(&v);
            v.swap(&t);
        } else {
            try t.ensureCapacity(u.len());
            try w.ensureCapacity(u.len());
            combine(&t, &w, &u, &v, .{ a, b, c, d });
            u.swap(&t);
            v.swap(&w);
        }
    }
    // Both fit in 64 bits after one more division.
    if (!v.eqlZero()) {
        try q.divTrunc(&t, &u, &v);
        var p: u64 = v.toInt(u64) catch unreachable;
        var s: u64 = t.toInt(u64) catch unreachable;
        while (s != 0) {
            const m = p % s;
            p = s;
            s = m;
        }
        try r.set(p);
        return;
    }
    try r.copy(u.toConst());
}

// --- operators ------------------------------------------------------------------------------------

const Op = enum(u8) { add, sub, mul, div, mod, pow, neg, pos, open };

inline fn precedence(op: Op) u8 {
    return switch (op) {
        .add, .sub => 1,
        .mul, .div, .mod => 2,
        .neg, .pos => 3,
        .pow => 4,
        .open => 0,
    };
}

inline fn opensLevel(op: Op) bool {
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
    return switch (op) {
        .add, .sub => bigAdd(p, q, op == .sub),
        // Division multiplies by the inverse; the sign is moved to the numerator in bigMul.
        .mul => bigMul(&p.n, &p.d, &q.n, &q.d),
        .div => bigMul(&p.n, &p.d, &q.d, &q.n),
        .mod => bigMod(p, q),
        else => unreachable,
    };
}

/// Floored p mod q = ((p.n * q.d) mod (q.n * p.d)) / (p.d * q.d); q != 0.
fn bigMod(p: *const Big, q: *const Big) Failure!Value {
    var x = try Managed.init(gpa);
    defer x.deinit();
    var y = try Managed.init(gpa);
    defer y.deinit();
    var quotient = try Managed.init(gpa);
    defer quotient.deinit();
    var n = try Managed.init(gpa);
    defer n.deinit();
    var d = try Managed.init(gpa);
    defer d.deinit();
    try x.mul(&p.n, &q.d);
    try y.mul(&q.n, &p.d);
    try quotient.divFloor(&n, &x, &y);
    try d.mul(&p.d, &q.d);
    return finish(&n, &d, false);
}

/// r = a / g, exact.
fn divideExact(r: *Managed, a: *const Managed, g: *const Managed) Failure!void {
    var rest = try Managed.init(gpa);
    defer rest.deinit();
    try r.divTrunc(&rest, a, g);
}

/// p ± q, Knuth's way (TAOCP 4.5.1): the gcds are taken of the denominators and of a factor of
/// them, never of the (twice as long) unreduced numerator and denominator.
fn bigAdd(p: *const Big, q: *const Big, subtract: bool) Failure!Value {
    var n = try Managed.init(gpa);
    defer n.deinit();
    var d = try Managed.init(gpa);
    defer d.deinit();
    var t = try Managed.init(gpa);
    defer t.deinit();
    var g = try Managed.initSet(gpa, 1);
    defer g.deinit();
    if (!isOne(&p.d) and !isOne(&q.d)) try gcd(&g, &p.d, &q.d);
    if (isOne(&g)) {
        // Coprime denominators: (a*d ± c*b) / (b*d) is in lowest terms.
        try n.mul(&p.n, &q.d);
        try t.mul(&q.n, &p.d);
        if (subtract) try n.sub(&n, &t) else try n.add(&n, &t);
        try d.mul(&p.d, &q.d);
        return finish(&n, &d, true);
    }
    var pd = try Managed.init(gpa);
    defer pd.deinit();
    var qd = try Managed.init(gpa);
    defer qd.deinit();
    try divideExact(&pd, &p.d, &g);
    try divideExact(&qd, &q.d, &g);
    try n.mul(&p.n, &qd);
    try t.mul(&q.n, &pd);
    if (subtract) try n.sub(&n, &t) else try n.add(&n, &t);
    // gcd(numerator, b*d/g) = gcd(numerator, g).
    var g2 = try Managed.init(gpa);
    defer g2.deinit();
    try gcd(&g2, &n, &g);
    if (!isOne(&g2)) {
        try divideExact(&t, &n, &g2);
        n.swap(&t);
        try divideExact(&t, &q.d, &g2);
    } else {
        try t.copy(q.d.toConst());
    }
    try d.mul(&pd, &t);
    return finish(&n, &d, true);
}

/// (a/b) * (c/e) with the cross gcds taken first, so the product is in lowest terms. b or e may
/// be negative (division passes the divisor's numerator as e): the sign ends on the numerator.
fn bigMul(a: *const Managed, b: *const Managed, c: *const Managed, e: *const Managed) Failure!Value {
    // The four factors after cancelling the cross gcds; each points to its input or to a reduced
    // copy below.
    var reduced: [4]Managed = undefined;
    var reduced_count: usize = 0;
    defer for (reduced[0..reduced_count]) |*m| m.deinit();
    var f = [4]*const Managed{ a, b, c, e };
    var g = try Managed.init(gpa);
    defer g.deinit();
    var rest = try Managed.init(gpa);
    defer rest.deinit();
    // Pairs (numerator index, denominator index): a with e, c with b.
    for ([2][2]usize{ .{ 0, 3 }, .{ 2, 1 } }) |pair| {
        if (f[pair[0]].eqlZero() or isOne(f[pair[1]])) continue;
        try gcd(&g, f[pair[0]], f[pair[1]]);
        if (isOne(&g)) continue;
        for (pair) |index| {
            reduced[reduced_count] = try Managed.init(gpa);
            reduced_count += 1;
            const target = &reduced[reduced_count - 1];
            try target.divTrunc(&rest, f[index], &g);
            f[index] = target;
        }
    }
    var n = try Managed.init(gpa);
    defer n.deinit();
    var d = try Managed.init(gpa);
    defer d.deinit();
    try n.mul(f[0], f[2]);
    try d.mul(f[1], f[3]);
    if (!d.isPositive()) {
        n.negate();
        d.negate();
    }
    return finish(&n, &d, true);
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
    // 4. A result that certainly needs more than max_bits is refused before computing: x >= 2^(b-1)
    //    for a b-bit x, so x^k needs at least k*(b-1) + 1 bits. Otherwise the result has fewer
    //    than k*b < 2*max_bits bits and `finish` applies the exact bound.
    const size: u64 = switch (a.*) {
        .small => |s| @max(64 - @clz(abs64(s.n)), 64 - @clz(abs64(s.d))),
        .big => |*ab| @max(ab.n.bitCountAbs(), ab.d.bitCountAbs()),
    };
    const magnitude: u64 = switch (b.*) {
        .small => |s| abs64(s.n),
        .big => max_bits + 1,
    };
    if (magnitude > max_bits or magnitude * (size - 1) >= max_bits) {
        return fail(error.Overflow, "the power needs more than {d} bits", .{max_bits});
    }
    // 5. Compute.
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
    // p^k / q^k is in lowest terms: only the size bound is left to check.
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

/// Parser state.
const Pass = struct {
    ops_len: usize = 0,
    values_len: usize = 0,
    depth: usize = 0,
    /// The first arithmetic error; once set, the rest of the input is only parsed.
    deferred: ?Failure = null,

    inline fn pushOp(self: *Pass, op: Op, at: usize) Failure!void {
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

    inline fn popOp(self: *Pass) Op {
        self.ops_len -= 1;
        const op = ops[self.ops_len];
        if (opensLevel(op)) self.depth -= 1;
        return op;
    }

    inline fn top(self: *const Pass) ?Op {
        return if (self.ops_len == 0) null else ops[self.ops_len - 1];
    }

    inline fn pushValue(self: *Pass, v: Value) Failure!void {
        if (self.values_len == stack_capacity) return fail(error.TooLarge, "expression too complex", .{});
        values[self.values_len] = v;
        self.values_len += 1;
    }

    /// Pushes a literal's value, unless evaluation has stopped.
    inline fn operand(self: *Pass, input: []const u8, literal: Literal) void {
        if (self.deferred != null) return;
        const v = literalValue(input, literal) catch |err| return self.stop(err);
        self.pushValue(v) catch |err| return self.stop(err);
    }

    /// Applies an operator that leaves the stack, unless evaluation has stopped.
    inline fn evaluate(self: *Pass, op: Op) void {
        if (self.deferred != null) return;
        // The most common case, inline: integers that stay integers in i64.
        if (op != .neg and op != .pos and op != .pow) {
            const a = &values[self.values_len - 2];
            const b = &values[self.values_len - 1];
            if (a.* == .small and b.* == .small and a.small.d == 1 and b.small.d == 1) {
                const x = a.small.n;
                const y = b.small.n;
                const r = switch (op) {
                    .add => checkedAdd(x, y),
                    .sub => checkedAdd(x, -y),
                    .mul => checkedMul(x, y),
                    // Exact quotients and remainders only; zero divisors take the general path.
                    .div => if (y != 0 and @rem(x, y) == 0) @divExact(x, y) else null,
                    else => if (y > 0 and x >= 0) @rem(x, y) else null,
                };
                if (r) |n| {
                    a.small.n = n;
                    self.values_len -= 1;
                    return;
                }
            }
        }
        self.apply(op) catch |err| self.stop(err);
    }

    fn stop(self: *Pass, err: Failure) void {
        self.deferred = err;
        self.releaseValues();
    }

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

inline fn isWhitespace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

inline fn isDigit(c: u8) bool {
    return c >= '0' and c <= '9';
}

fn syntaxFound(comptime expected: []const u8, input: []const u8, pos: usize) Failure {
    if (pos >= input.len) return fail(error.Syntax, expected ++ "; found end of input", .{});
    const c = input[pos];
    if (c >= 0x21 and c <= 0x7e) return fail(error.Syntax, expected ++ "; found '{c}' at offset {d}", .{ c, pos });
    return fail(error.Syntax, expected ++ "; found byte 0x{x:0>2} at offset {d}", .{ c, pos });
}

/// Parses and evaluates the input; returns its value (owned by the caller).
fn run(input: []const u8) Failure!Value {
    var pass = Pass{};
    errdefer pass.releaseValues();
    var expect_operand = true;
    var pos: usize = 0;
    while (true) {
        while (pos < input.len and isWhitespace(input[pos])) pos += 1;
        if (expect_operand) {
            if (pos == input.len) return syntaxFound("expected a number, '(' or a sign", input, pos);
            switch (input[pos]) {
                '0'...'9', '.' => {
                    const literal = try scanLiteral(input, pos);
                    pass.operand(input, literal);
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
                pass.evaluate(op);
            }
            if (pass.deferred) |err| return err;
            pass.values_len = 0;
            return values[0];
        }
        const c = input[pos];
        if (c == ')') {
            while (pass.top()) |t| {
                if (t == .open) break;
                const op = pass.popOp();
                pass.evaluate(op);
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
                pass.evaluate(t);
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

inline fn scanLiteral(input: []const u8, start: usize) Failure!Literal {
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
        if (fraction.len == 0) {
            for (whole) |c| n = n * 10 + (c - '0');
            return int(@intCast(n));
        }
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
    try setDecimal(&n, digit_buf[0 .. whole.len + fraction.len]);
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
    const digits = try decimalDigits(n);
    if (digits.len > max_result_exponent) return outOfRange();
    var len: usize = 0;
    if (!n.isPositive()) {
        output_buf[0] = '-';
        len = 1;
    }
    @memcpy(output_buf[len .. len + digits.len], digits);
    return output_buf[0 .. len + digits.len];
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
    // The estimate is within 1 of floor(log10(p/q)), and rounding adds at most 1: far outside the
    // printable range, refuse before computing powers of ten.
    if (e >= max_result_exponent + 3 or e < -max_result_exponent - 3) return outOfRange();
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
    const text = try decimalDigits(&digits);
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
