//! checksum in Rust: CRC-32, SHA-256, Luhn and ISBN check digits (semantics `checksum/1`,
//! docs/semantics/checksum.md), the same evaluator as evaluators_wasm/src/checksum/main.zig,
//! check for check and message for message. The ABI is the evald-guest crate's.
//!
//! A 1 MiB argument costs one pass for UTF-8 validation (the crate's), one for decoding the
//! literal (none when it has no escape: the argument is then borrowed from the input) and one
//! for the hash.

use std::borrow::Cow;

use evald_guest::{evaluator, Error, Result};

evaluator!(evaluate, input_capacity = 1 << 20, output_capacity = 64 * 1024);

/// Digit-string arguments longer than this (separators not counted) are `too_large`.
const MAX_DIGITS: usize = 1000;
/// Longer than the longest function name (`isbn10_valid`); a longer word is refused unread.
const MAX_NAME_LEN: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Function {
    Crc32,
    Sha256,
    LuhnDigit,
    LuhnValid,
    Isbn10Digit,
    Isbn10Valid,
    Isbn13Digit,
    Isbn13Valid,
}

fn function_named(name: &[u8]) -> Option<Function> {
    Some(match name {
        b"crc32" => Function::Crc32,
        b"sha256" => Function::Sha256,
        b"luhn_digit" => Function::LuhnDigit,
        b"luhn_valid" => Function::LuhnValid,
        b"isbn10_digit" => Function::Isbn10Digit,
        b"isbn10_valid" => Function::Isbn10Valid,
        b"isbn13_digit" => Function::Isbn13Digit,
        b"isbn13_valid" => Function::Isbn13Valid,
        _ => return None,
    })
}

fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_space(input: &[u8], mut pos: usize) -> usize {
    while pos < input.len() && is_space(input[pos]) {
        pos += 1;
    }
    pos
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn evaluate(text: &str) -> Result<String> {
    let input = text.as_bytes();
    let mut pos = skip_space(input, 0);
    let name_start = pos;
    // Function names are short: stop early so a megabyte of letters costs nothing to refuse.
    while pos < input.len() && pos - name_start <= MAX_NAME_LEN && is_ident_char(input[pos]) {
        pos += 1;
    }
    let function = function_named(&input[name_start..pos]).ok_or_else(|| {
        Error::syntax(
            "expected crc32, sha256, luhn_digit, luhn_valid, isbn10_digit, isbn10_valid, \
             isbn13_digit or isbn13_valid",
        )
    })?;
    pos = skip_space(input, pos);
    if pos >= input.len() || input[pos] != b'(' {
        return Err(Error::syntax("expected ( after the function name"));
    }
    pos = skip_space(input, pos + 1);
    let argument = parse_call(input, pos)?;
    match function {
        Function::Crc32 => Ok(hex(&crc32(&argument).to_be_bytes())),
        Function::Sha256 => Ok(hex(&sha256(&argument))),
        _ => digit_function(function, &collect_digits(&argument, function == Function::Isbn10Valid)?),
    }
}

/// Parses `"literal" )` and trailing space from `start`; returns the decoded argument.
fn parse_call(input: &[u8], start: usize) -> Result<Cow<'_, [u8]>> {
    let (mut pos, argument) = parse_string(input, start)?;
    pos = skip_space(input, pos);
    if pos >= input.len() || input[pos] != b')' {
        return Err(Error::syntax("expected ) after the argument"));
    }
    pos = skip_space(input, pos + 1);
    if pos != input.len() {
        return Err(Error::syntax("unexpected text after the closing )"));
    }
    Ok(argument)
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Nonzero exactly when some byte of `w` is zero (the classic SWAR test).
fn has_zero_byte(w: u64) -> bool {
    (w.wrapping_sub(ONES) & !w & HIGHS) != 0
}

/// The index of the first `"` or `\\` from `i` (or the input's end), eight bytes a step.
fn scan_to_quote_or_backslash(input: &[u8], mut i: usize) -> usize {
    while i + 8 <= input.len() {
        let w = u64::from_le_bytes(input[i..i + 8].try_into().unwrap());
        if has_zero_byte(w ^ (ONES * u64::from(b'"'))) || has_zero_byte(w ^ (ONES * u64::from(b'\\'))) {
            break;
        }
        i += 8;
    }
    while i < input.len() && input[i] != b'"' && input[i] != b'\\' {
        i += 1;
    }
    i
}

/// Decodes one double-quoted literal starting at `start`; returns the index after its closing
/// quote and the decoded bytes. Escapes: \" \\ \n \t \uXXXX (a Unicode scalar value, so no
/// surrogates). A literal without a backslash is borrowed as it is.
fn parse_string(input: &[u8], start: usize) -> Result<(usize, Cow<'_, [u8]>)> {
    if start >= input.len() || input[start] != b'"' {
        return Err(Error::syntax("expected a string literal \"...\""));
    }
    let body = start + 1;
    let mut i = scan_to_quote_or_backslash(input, body);
    if i >= input.len() {
        return Err(Error::syntax("unterminated string literal"));
    }
    if input[i] == b'"' {
        return Ok((i + 1, Cow::Borrowed(&input[body..i])));
    }
    let mut decoded = Vec::with_capacity(input.len() - body);
    decoded.extend_from_slice(&input[body..i]);
    loop {
        if i >= input.len() {
            return Err(Error::syntax("unterminated string literal"));
        }
        let c = input[i];
        if c == b'"' {
            return Ok((i + 1, Cow::Owned(decoded)));
        }
        if c != b'\\' {
            decoded.push(c);
            i += 1;
            continue;
        }
        if i + 1 >= input.len() {
            return Err(Error::syntax("unterminated string literal"));
        }
        match input[i + 1] {
            e @ (b'"' | b'\\') => decoded.push(e),
            b'n' => decoded.push(b'\n'),
            b't' => decoded.push(b'\t'),
            b'u' => {
                let four = Error::syntax("\\u needs exactly four hex digits");
                if i + 6 > input.len() {
                    return Err(four);
                }
                let mut code_point: u32 = 0;
                for &h in &input[i + 2..i + 6] {
                    let v = (h as char).to_digit(16).ok_or_else(|| four.clone())?;
                    code_point = code_point * 16 + v;
                }
                let c = char::from_u32(code_point).ok_or_else(|| {
                    Error::syntax("\\u escape of a surrogate (D800-DFFF) is not a character")
                })?;
                decoded.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                i += 4;
            }
            _ => return Err(Error::syntax("unknown escape; use \\\" \\\\ \\n \\t or \\uXXXX")),
        }
        i += 2;
    }
}

/// The digits of a digit-string argument (values 0-9, and 10 for `X`). Spaces and hyphens are
/// separators; `X`/`x` is accepted only where `allow_x`, and only as the last digit.
fn collect_digits(argument: &[u8], allow_x: bool) -> Result<Vec<u8>> {
    let bad = || {
        Error::syntax(
            "a digit string holds only digits 0-9, spaces and hyphens (ISBN-10 may end in X)",
        )
    };
    let mut digits = Vec::new();
    let mut count = 0usize;
    let mut x_seen = false;
    for &c in argument {
        let digit = match c {
            b'0'..=b'9' => c - b'0',
            b'X' | b'x' if allow_x => 10,
            b' ' | b'-' => continue,
            _ => return Err(bad()),
        };
        if x_seen {
            return Err(bad()); // X must be the last digit
        }
        x_seen = digit == 10;
        if count < MAX_DIGITS {
            digits.push(digit);
        }
        count += 1;
    }
    if count == 0 {
        return Err(Error::syntax("the digit string has no digits"));
    }
    if count > MAX_DIGITS {
        return Err(Error::too_large("more than 1000 digits"));
    }
    Ok(digits)
}

fn digit_function(function: Function, digits: &[u8]) -> Result<String> {
    let exactly = |n: usize, message: &'static str| {
        if digits.len() == n {
            Ok(())
        } else {
            Err(Error::domain(message))
        }
    };
    Ok(match function {
        Function::LuhnDigit => digit_text(luhn_check_digit(digits)),
        Function::LuhnValid => {
            if digits.len() < 2 {
                return Err(Error::domain(
                    "luhn_valid needs at least 2 digits (payload and check digit)",
                ));
            }
            let n = digits.len() - 1;
            bool_text(luhn_check_digit(&digits[..n]) == digits[n])
        }
        Function::Isbn10Digit => {
            exactly(9, "isbn10_digit needs exactly 9 digits")?;
            digit_text(isbn10_check_digit(digits))
        }
        Function::Isbn10Valid => {
            exactly(10, "isbn10_valid needs exactly 10 digits (the last may be X)")?;
            bool_text(isbn10_check_digit(&digits[..9]) == digits[9])
        }
        Function::Isbn13Digit => {
            exactly(12, "isbn13_digit needs exactly 12 digits")?;
            digit_text(isbn13_check_digit(digits))
        }
        Function::Isbn13Valid => {
            exactly(13, "isbn13_valid needs exactly 13 digits")?;
            bool_text(isbn13_check_digit(&digits[..12]) == digits[12])
        }
        Function::Crc32 | Function::Sha256 => unreachable!(),
    })
}

/// The digit that makes `payload ++ digit` pass the Luhn check: from the right, every other
/// payload digit starting with the rightmost is doubled (minus 9 when above 9).
fn luhn_check_digit(payload: &[u8]) -> u8 {
    let mut sum: u32 = 0;
    for (i, &d) in payload.iter().rev().enumerate() {
        let mut d = u32::from(d);
        if i % 2 == 0 {
            d *= 2;
            if d > 9 {
                d -= 9;
            }
        }
        sum += d;
    }
    ((10 - sum % 10) % 10) as u8
}

/// Weights 10..2 over nine digits; 10 means `X`.
fn isbn10_check_digit(payload: &[u8]) -> u8 {
    let sum: u32 = payload.iter().enumerate().map(|(i, &d)| u32::from(d) * (10 - i as u32)).sum();
    ((11 - sum % 11) % 11) as u8
}

/// Weights 1, 3, 1, 3, ... over twelve digits.
fn isbn13_check_digit(payload: &[u8]) -> u8 {
    let sum: u32 =
        payload.iter().enumerate().map(|(i, &d)| u32::from(d) * if i % 2 == 0 { 1 } else { 3 }).sum();
    ((10 - sum % 10) % 10) as u8
}

fn digit_text(d: u8) -> String {
    String::from(if d == 10 { 'X' } else { char::from(b'0' + d) })
}

fn bool_text(b: bool) -> String {
    String::from(if b { "true" } else { "false" })
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

// --- CRC-32 (the zlib/IEEE polynomial, reflected) -----------------------------------------

const CRC_TABLE: [u32; 256] = crc_table();

const fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut n = 0;
    while n < 256 {
        let mut c = n as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        table[n] = c;
        n += 1;
    }
    table
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC_TABLE[((crc ^ u32::from(b)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

// --- SHA-256 (FIPS 180-4) -----------------------------------------------------------------

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

fn sha256(data: &[u8]) -> [u8; 32] {
    let mut state: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        compress(&mut state, block);
    }
    // The tail, the 0x80 marker and the length in bits: one or two final blocks.
    let tail = blocks.remainder();
    let mut last = [0u8; 128];
    last[..tail.len()].copy_from_slice(tail);
    last[tail.len()] = 0x80;
    let end = if tail.len() < 56 { 64 } else { 128 };
    last[end - 8..end].copy_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in last[..end].chunks_exact(64) {
        compress(&mut state, block);
    }
    let mut digest = [0u8; 32];
    for (out, word) in digest.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    digest
}

/// One 64-byte block. The rounds are unrolled eight at a time with the working variables'
/// names rotating instead of their values (seven moves a round saved: fuel is per instruction).
fn compress(state: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for (t, word) in block.chunks_exact(4).enumerate() {
        w[t] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
    }
    for t in 16..64 {
        let s0 = w[t - 15].rotate_right(7) ^ w[t - 15].rotate_right(18) ^ (w[t - 15] >> 3);
        let s1 = w[t - 2].rotate_right(17) ^ w[t - 2].rotate_right(19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16].wrapping_add(s0).wrapping_add(w[t - 7]).wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
    macro_rules! round {
        ($a:ident, $b:ident, $c:ident, $d:ident, $e:ident, $f:ident, $g:ident, $h:ident, $t:expr) => {
            let s1 = $e.rotate_right(6) ^ $e.rotate_right(11) ^ $e.rotate_right(25);
            let ch = ($e & $f) ^ (!$e & $g);
            let t1 = $h.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[$t]).wrapping_add(w[$t]);
            let s0 = $a.rotate_right(2) ^ $a.rotate_right(13) ^ $a.rotate_right(22);
            let maj = ($a & $b) ^ ($a & $c) ^ ($b & $c);
            $d = $d.wrapping_add(t1);
            $h = t1.wrapping_add(s0).wrapping_add(maj);
        };
    }
    for t in (0..64).step_by(8) {
        round!(a, b, c, d, e, f, g, h, t);
        round!(h, a, b, c, d, e, f, g, t + 1);
        round!(g, h, a, b, c, d, e, f, t + 2);
        round!(f, g, h, a, b, c, d, e, t + 3);
        round!(e, f, g, h, a, b, c, d, t + 4);
        round!(d, e, f, g, h, a, b, c, t + 5);
        round!(c, d, e, f, g, h, a, b, t + 6);
        round!(b, c, d, e, f, g, h, a, t + 7);
    }
    for (s, v) in state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
        *s = s.wrapping_add(v);
    }
}
