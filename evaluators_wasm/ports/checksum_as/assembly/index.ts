// checksum in AssemblyScript: CRC-32, SHA-256, Luhn and ISBN check digits (semantics
// `checksum/1`, docs/semantics/checksum.md), the same evaluator as
// evaluators_wasm/src/checksum/main.zig, check for check and message for message. The ABI is
// the evald-guest package's; this evaluator reads the input as bytes (a megabyte argument is
// hashed where it lies, never turned into a UTF-16 string).

import { Code, bytesEvaluator, fail, validUtf8 } from "evald-guest";
export * from "evald-guest/abi";

/** Digit-string arguments longer than this (separators not counted) are `too_large`. */
const MAX_DIGITS = 1000;
/** Longer than the longest function name (`isbn10_valid`); a longer word is refused unread. */
const MAX_NAME_LEN = 16;

const enum Function {
  None, Crc32, Sha256, LuhnDigit, LuhnValid, Isbn10Digit, Isbn10Valid, Isbn13Digit, Isbn13Valid,
}

const NAMES: StaticArray<string> = [
  "crc32", "sha256", "luhn_digit", "luhn_valid", "isbn10_digit", "isbn10_valid", "isbn13_digit",
  "isbn13_valid",
];

/** Where a parse failed: set with its message by `syntax`; `BAD` is never a position. */
const BAD: i32 = -1;
let failCode: Code = Code.Syntax;
let failMessage = "";

function failed(code: Code, message: string): i32 {
  failCode = code;
  failMessage = message;
  return BAD;
}

function evaluate(input: usize, length: i32): string {
  if (!validUtf8(input, length)) return fail(Code.Syntax, "input is not valid UTF-8");
  let pos = skipSpace(input, length, 0);
  const nameStart = pos;
  // Function names are short: stop early so a megabyte of letters costs nothing to refuse.
  while (pos < length && pos - nameStart <= MAX_NAME_LEN && isIdentChar(load<u8>(input + pos))) pos++;
  const fn = functionNamed(input + nameStart, pos - nameStart);
  if (fn == Function.None) {
    return fail(
      Code.Syntax,
      "expected crc32, sha256, luhn_digit, luhn_valid, isbn10_digit, isbn10_valid, isbn13_digit or isbn13_valid",
    );
  }
  pos = skipSpace(input, length, pos);
  if (pos >= length || load<u8>(input + pos) != 0x28) {
    return fail(Code.Syntax, "expected ( after the function name");
  }
  pos = skipSpace(input, length, pos + 1);
  // the argument: [argument, argument + argumentLength)
  if (parseCall(input, length, pos) == BAD) return fail(failCode, failMessage);
  if (fn == Function.Crc32) return hex(crc32(argument, argumentLength));
  if (fn == Function.Sha256) return sha256Hex(argument, argumentLength);
  const count = collectDigits(argument, argumentLength, fn == Function.Isbn10Valid);
  if (count == BAD) return fail(failCode, failMessage);
  return digitFunction(fn, count);
}

function functionNamed(name: usize, length: i32): Function {
  for (let k = 0; k < NAMES.length; k++) {
    const candidate = NAMES[k];
    if (candidate.length != length) continue;
    let same = true;
    for (let i = 0; i < length; i++) {
      if (<u32>load<u8>(name + i) != <u32>candidate.charCodeAt(i)) {
        same = false;
        break;
      }
    }
    if (same) return <Function>(k + 1);
  }
  return Function.None;
}

// @ts-ignore: decorator
@inline function isSpace(c: u8): bool {
  return c == 0x20 || c == 0x09 || c == 0x0a || c == 0x0d;
}

function skipSpace(input: usize, length: i32, pos: i32): i32 {
  while (pos < length && isSpace(load<u8>(input + pos))) pos++;
  return pos;
}

function isIdentChar(c: u8): bool {
  return (c >= 0x30 && c <= 0x39) || (c >= 0x41 && c <= 0x5a) || (c >= 0x61 && c <= 0x7a) ||
    c == 0x5f;
}

let argument: usize = 0;
let argumentLength: i32 = 0;

/** Parses `"literal" )` and trailing space from `start` into `argument`; BAD on failure. */
function parseCall(input: usize, length: i32, start: i32): i32 {
  let pos = parseString(input, length, start);
  if (pos == BAD) return BAD;
  pos = skipSpace(input, length, pos);
  if (pos >= length || load<u8>(input + pos) != 0x29) {
    return failed(Code.Syntax, "expected ) after the argument");
  }
  pos = skipSpace(input, length, pos + 1);
  if (pos != length) return failed(Code.Syntax, "unexpected text after the closing )");
  return pos;
}

const ONES: u64 = 0x0101010101010101;
const HIGHS: u64 = 0x8080808080808080;

// @ts-ignore: decorator
@inline function hasZeroByte(w: u64): bool {
  return ((w - ONES) & ~w & HIGHS) != 0;
}

/** The index of the first `"` or `\\` from `i` (or `length`), eight bytes a step. */
function scanToQuoteOrBackslash(input: usize, length: i32, i: i32): i32 {
  while (i + 8 <= length) {
    const w = load<u64>(input + i);
    if (hasZeroByte(w ^ (ONES * 0x22)) || hasZeroByte(w ^ (ONES * 0x5c))) break;
    i += 8;
  }
  while (i < length) {
    const c = load<u8>(input + i);
    if (c == 0x22 || c == 0x5c) break;
    i++;
  }
  return i;
}

/**
 * Decodes one double-quoted literal starting at `start` into `argument`; returns the index after
 * its closing quote. Escapes: \" \\ \n \t \uXXXX (a Unicode scalar value, so no surrogates). A
 * literal without a backslash is used where it lies; otherwise it is decoded into this call's
 * heap (decoding never makes it longer).
 */
function parseString(input: usize, length: i32, start: i32): i32 {
  if (start >= length || load<u8>(input + start) != 0x22) {
    return failed(Code.Syntax, "expected a string literal \"...\"");
  }
  const body = start + 1;
  const i = scanToQuoteOrBackslash(input, length, body);
  if (i >= length) return failed(Code.Syntax, "unterminated string literal");
  if (load<u8>(input + i) == 0x22) {
    argument = input + body;
    argumentLength = i - body;
    return i + 1;
  }
  const decoded = heap.alloc(<usize>(length - body));
  memory.copy(decoded, input + body, <usize>(i - body));
  return decodeEscapes(input, length, i, decoded, i - body);
}

/** The rest of a literal from its first backslash at `i`, `o` bytes already in `decoded`. */
function decodeEscapes(input: usize, length: i32, i: i32, decoded: usize, o: i32): i32 {
  while (true) {
    if (i >= length) return failed(Code.Syntax, "unterminated string literal");
    const c = load<u8>(input + i);
    if (c == 0x22) {
      argument = decoded;
      argumentLength = o;
      return i + 1;
    }
    if (c != 0x5c) {
      store<u8>(decoded + o, c);
      i++;
      o++;
      continue;
    }
    if (i + 1 >= length) return failed(Code.Syntax, "unterminated string literal");
    const e = load<u8>(input + i + 1);
    if (e == 0x22 || e == 0x5c) {
      store<u8>(decoded + o, e);
      o++;
    } else if (e == 0x6e) {
      store<u8>(decoded + o, 0x0a);
      o++;
    } else if (e == 0x74) {
      store<u8>(decoded + o, 0x09);
      o++;
    } else if (e == 0x75) {
      if (i + 6 > length) return failed(Code.Syntax, "\\u needs exactly four hex digits");
      let codePoint: u32 = 0;
      for (let k = 2; k < 6; k++) {
        const v = hexValue(load<u8>(input + i + k));
        if (v < 0) return failed(Code.Syntax, "\\u needs exactly four hex digits");
        codePoint = codePoint * 16 + <u32>v;
      }
      if (codePoint >= 0xd800 && codePoint <= 0xdfff) {
        return failed(Code.Syntax, "\\u escape of a surrogate (D800-DFFF) is not a character");
      }
      o += encodeUtf8(codePoint, decoded + o);
      i += 4;
    } else {
      return failed(Code.Syntax, "unknown escape; use \\\" \\\\ \\n \\t or \\uXXXX");
    }
    i += 2;
  }
  return BAD; // not reached: the loop returns
}

function hexValue(h: u8): i32 {
  if (h >= 0x30 && h <= 0x39) return h - 0x30;
  if (h >= 0x61 && h <= 0x66) return h - 0x61 + 10;
  if (h >= 0x41 && h <= 0x46) return h - 0x41 + 10;
  return -1;
}

/** Writes a code point below U+10000 (four hex digits) as UTF-8; returns the bytes written. */
function encodeUtf8(c: u32, at: usize): i32 {
  if (c < 0x80) {
    store<u8>(at, <u8>c);
    return 1;
  }
  if (c < 0x800) {
    store<u8>(at, <u8>(0xc0 | (c >> 6)));
    store<u8>(at + 1, <u8>(0x80 | (c & 0x3f)));
    return 2;
  }
  store<u8>(at, <u8>(0xe0 | (c >> 12)));
  store<u8>(at + 1, <u8>(0x80 | ((c >> 6) & 0x3f)));
  store<u8>(at + 2, <u8>(0x80 | (c & 0x3f)));
  return 3;
}

const digits = memory.data(MAX_DIGITS);

/**
 * The digits of a digit-string argument into `digits` (values 0-9, and 10 for `X`); returns
 * their count, or BAD. Spaces and hyphens are separators; `X`/`x` is accepted only where
 * `allowX`, and only as the last digit.
 */
function collectDigits(start: usize, length: i32, allowX: bool): i32 {
  let count = 0;
  let xSeen = false;
  for (let i = 0; i < length; i++) {
    const c = load<u8>(start + i);
    let digit: u8;
    if (c >= 0x30 && c <= 0x39) {
      digit = c - 0x30;
    } else if ((c == 0x58 || c == 0x78) && allowX) {
      digit = 10;
    } else if (c == 0x20 || c == 0x2d) {
      continue;
    } else {
      return badDigits();
    }
    if (xSeen) return badDigits(); // X must be the last digit
    if (digit == 10) xSeen = true;
    if (count < MAX_DIGITS) store<u8>(digits + count, digit);
    count++;
  }
  if (count == 0) return failed(Code.Syntax, "the digit string has no digits");
  if (count > MAX_DIGITS) return failed(Code.TooLarge, "more than 1000 digits");
  return count;
}

function badDigits(): i32 {
  return failed(
    Code.Syntax,
    "a digit string holds only digits 0-9, spaces and hyphens (ISBN-10 may end in X)",
  );
}

function digitFunction(fn: Function, count: i32): string {
  switch (fn) {
    case Function.LuhnDigit: return digitText(luhnCheckDigit(count));
    case Function.LuhnValid: {
      if (count < 2) {
        return fail(Code.Domain, "luhn_valid needs at least 2 digits (payload and check digit)");
      }
      return boolText(luhnCheckDigit(count - 1) == load<u8>(digits + count - 1));
    }
    case Function.Isbn10Digit: {
      if (count != 9) return fail(Code.Domain, "isbn10_digit needs exactly 9 digits");
      return digitText(isbn10CheckDigit());
    }
    case Function.Isbn10Valid: {
      if (count != 10) {
        return fail(Code.Domain, "isbn10_valid needs exactly 10 digits (the last may be X)");
      }
      return boolText(isbn10CheckDigit() == load<u8>(digits + 9));
    }
    case Function.Isbn13Digit: {
      if (count != 12) return fail(Code.Domain, "isbn13_digit needs exactly 12 digits");
      return digitText(isbn13CheckDigit());
    }
    default: {
      if (count != 13) return fail(Code.Domain, "isbn13_valid needs exactly 13 digits");
      return boolText(isbn13CheckDigit() == load<u8>(digits + 12));
    }
  }
}

/**
 * The digit that makes `payload ++ digit` pass the Luhn check, over the first `count` digits:
 * from the right, every other payload digit starting with the rightmost is doubled (minus 9
 * when above 9).
 */
function luhnCheckDigit(count: i32): u8 {
  let sum: u32 = 0;
  let double = true;
  for (let i = count - 1; i >= 0; i--) {
    let d = <u32>load<u8>(digits + i);
    if (double) {
      d *= 2;
      if (d > 9) d -= 9;
    }
    sum += d;
    double = !double;
  }
  return <u8>((10 - sum % 10) % 10);
}

/** Weights 10..2 over the first nine digits; 10 means `X`. */
function isbn10CheckDigit(): u8 {
  let sum: u32 = 0;
  for (let i = 0; i < 9; i++) sum += <u32>load<u8>(digits + i) * <u32>(10 - i);
  return <u8>((11 - sum % 11) % 11);
}

/** Weights 1, 3, 1, 3, ... over the first twelve digits. */
function isbn13CheckDigit(): u8 {
  let sum: u32 = 0;
  for (let i = 0; i < 12; i++) sum += <u32>load<u8>(digits + i) * (i % 2 == 0 ? 1 : 3);
  return <u8>((10 - sum % 10) % 10);
}

function digitText(d: u8): string {
  return d == 10 ? "X" : String.fromCharCode(0x30 + d);
}

function boolText(b: bool): string {
  return b ? "true" : "false";
}

// --- hex text -----------------------------------------------------------------------------

const scratch = memory.data(64);

function hexDigit(v: u32): u8 {
  return <u8>(v < 10 ? 0x30 + v : 0x61 + v - 10);
}

function hex(word: u32): string {
  for (let k = 0; k < 8; k++) store<u8>(scratch + k, hexDigit((word >> (28 - 4 * k)) & 15));
  return String.UTF8.decodeUnsafe(scratch, 8);
}

// --- CRC-32 (the zlib/IEEE polynomial, reflected) -----------------------------------------

const crcTable = memory.data(256 * 4);
let crcTableReady = false;

function crc32(data: usize, length: i32): u32 {
  if (!crcTableReady) {
    for (let n: u32 = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >> 1) : c >> 1;
      store<u32>(crcTable + (n << 2), c);
    }
    crcTableReady = true;
  }
  let crc: u32 = 0xffffffff;
  const end = data + <usize>length;
  for (let p = data; p < end; p++) {
    crc = load<u32>(crcTable + (((crc ^ <u32>load<u8>(p)) & 0xff) << 2)) ^ (crc >> 8);
  }
  return ~crc;
}

// --- SHA-256 (FIPS 180-4) -----------------------------------------------------------------

const K: StaticArray<u32> = [
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];
const state = memory.data(8 * 4);
const schedule = memory.data(64 * 4);
const lastBlocks = memory.data(128);

function sha256Hex(data: usize, length: i32): string {
  const initial: StaticArray<u32> = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
  ];
  for (let k = 0; k < 8; k++) store<u32>(state + (k << 2), initial[k]);
  const whole = length & ~63;
  for (let p = 0; p < whole; p += 64) compress(data + p);
  // The tail, the 0x80 marker and the length in bits: one or two final blocks.
  const tail = length - whole;
  memory.fill(lastBlocks, 0, 128);
  memory.copy(lastBlocks, data + whole, <usize>tail);
  store<u8>(lastBlocks + tail, 0x80);
  const end = tail < 56 ? 64 : 128;
  store<u64>(lastBlocks + end - 8, bswap<u64>(<u64>length * 8));
  compress(lastBlocks);
  if (end == 128) compress(lastBlocks + 64);
  for (let k = 0; k < 8; k++) {
    const word = load<u32>(state + (k << 2));
    for (let j = 0; j < 8; j++) {
      store<u8>(scratch + 8 * k + j, hexDigit((word >> (28 - 4 * j)) & 15));
    }
  }
  return String.UTF8.decodeUnsafe(scratch, 64);
}

// @ts-ignore: decorator
@inline function sigma1(e: u32, f: u32, g: u32, h: u32, t: i32): u32 {
  return h + (rotr<u32>(e, 6) ^ rotr<u32>(e, 11) ^ rotr<u32>(e, 25)) + ((e & f) ^ (~e & g)) +
    unchecked(K[t]) + load<u32>(schedule + (<usize>t << 2));
}

// @ts-ignore: decorator
@inline function sigma0(a: u32, b: u32, c: u32): u32 {
  return (rotr<u32>(a, 2) ^ rotr<u32>(a, 13) ^ rotr<u32>(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
}

/**
 * One 64-byte block. The rounds are unrolled eight at a time with the working variables' names
 * rotating instead of their values (seven moves a round saved: fuel is per instruction).
 */
function compress(block: usize): void {
  for (let t = 0; t < 16; t++) store<u32>(schedule + (t << 2), bswap<u32>(load<u32>(block + (t << 2))));
  for (let t = 16; t < 64; t++) {
    const w15 = load<u32>(schedule + ((t - 15) << 2));
    const w2 = load<u32>(schedule + ((t - 2) << 2));
    const s0 = rotr<u32>(w15, 7) ^ rotr<u32>(w15, 18) ^ (w15 >> 3);
    const s1 = rotr<u32>(w2, 17) ^ rotr<u32>(w2, 19) ^ (w2 >> 10);
    store<u32>(
      schedule + (t << 2),
      load<u32>(schedule + ((t - 16) << 2)) + s0 + load<u32>(schedule + ((t - 7) << 2)) + s1,
    );
  }
  let a = load<u32>(state), b = load<u32>(state, 4), c = load<u32>(state, 8);
  let d = load<u32>(state, 12), e = load<u32>(state, 16), f = load<u32>(state, 20);
  let g = load<u32>(state, 24), h = load<u32>(state, 28);
  let t1: u32;
  for (let t = 0; t < 64; t += 8) {
    t1 = sigma1(e, f, g, h, t); d += t1; h = t1 + sigma0(a, b, c);
    t1 = sigma1(d, e, f, g, t + 1); c += t1; g = t1 + sigma0(h, a, b);
    t1 = sigma1(c, d, e, f, t + 2); b += t1; f = t1 + sigma0(g, h, a);
    t1 = sigma1(b, c, d, e, t + 3); a += t1; e = t1 + sigma0(f, g, h);
    t1 = sigma1(a, b, c, d, t + 4); h += t1; d = t1 + sigma0(e, f, g);
    t1 = sigma1(h, a, b, c, t + 5); g += t1; c = t1 + sigma0(d, e, f);
    t1 = sigma1(g, h, a, b, t + 6); f += t1; b = t1 + sigma0(c, d, e);
    t1 = sigma1(f, g, h, a, t + 7); e += t1; a = t1 + sigma0(b, c, d);
  }
  store<u32>(state, load<u32>(state) + a);
  store<u32>(state, load<u32>(state, 4) + b, 4);
  store<u32>(state, load<u32>(state, 8) + c, 8);
  store<u32>(state, load<u32>(state, 12) + d, 12);
  store<u32>(state, load<u32>(state, 16) + e, 16);
  store<u32>(state, load<u32>(state, 20) + f, 20);
  store<u32>(state, load<u32>(state, 24) + g, 24);
  store<u32>(state, load<u32>(state, 28) + h, 28);
}

// Registered last: AssemblyScript compiles `evaluate` here, and every global it reads must be
// declared by then.
bytesEvaluator(evaluate, 1 << 20, 64 * 1024);
