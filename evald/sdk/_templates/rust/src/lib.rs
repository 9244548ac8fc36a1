//! A template evald evaluator (ABI v1, docs/abi.md): an integer from 1 to 3999 in Roman
//! numerals, "1994" -> "MCMXCIV". `evaluator!` (the evald-guest crate) defines the exports:
//! the input and output buffers, and `evald_eval` calling `roman` on the input as UTF-8.

use evald_guest::{evaluator, Error, Result};

evaluator!(roman, input_capacity = 64, output_capacity = 256);

const NUMERALS: [(u32, &str); 13] = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
    (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
];

/// The value for one span, or a guest error (`syntax`, `domain`, ...).
fn roman(input: &str) -> Result<String> {
    if input.is_empty() {
        return Err(Error::syntax("expected a number"));
    }
    if input.starts_with('0') {
        return Err(Error::syntax("no leading zeros"));
    }
    if !input.bytes().all(|c| c.is_ascii_digit()) {
        return Err(Error::syntax("expected decimal digits only"));
    }
    let mut number: u32 = match input.parse() {
        Ok(n) if n <= 3999 => n,
        _ => return Err(Error::domain("Roman numerals cover 1 to 3999")),
    };
    let mut out = String::new();
    for (value, symbol) in NUMERALS {
        while number >= value {
            out.push_str(symbol);
            number -= value;
        }
    }
    Ok(out)
}
