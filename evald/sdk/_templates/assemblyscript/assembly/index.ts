// A template evald evaluator (ABI v1, docs/abi.md): an integer from 1 to 3999 in Roman
// numerals, "1994" -> "MCMXCIV". The evald-guest package defines the exports: the input and
// output buffers, and evald_eval calling `roman` on the input as a string.

import { Code, evaluator, fail } from "evald-guest";
export * from "evald-guest/abi";

const values: StaticArray<i32> = [1000, 900, 500, 400, 100, 90, 50, 40, 10, 9, 5, 4, 1];
const symbols: StaticArray<string> = [
  "M", "CM", "D", "CD", "C", "XC", "L", "XL", "X", "IX", "V", "IV", "I",
];

evaluator(roman, 64, 256); // the input and output buffers' capacities, in bytes

/** The value for one span, or `fail(code, message)`. */
function roman(input: string): string {
  if (input.length == 0) return fail(Code.Syntax, "expected a number");
  if (input.charCodeAt(0) == 0x30) return fail(Code.Syntax, "no leading zeros");
  let number = 0;
  for (let i = 0; i < input.length; i++) {
    const c = input.charCodeAt(i);
    if (c < 0x30 || c > 0x39) return fail(Code.Syntax, "expected decimal digits only");
    if (number <= 3999) number = number * 10 + (c - 0x30);
  }
  if (number > 3999) return fail(Code.Domain, "Roman numerals cover 1 to 3999");
  let out = "";
  for (let k = 0; k < values.length; k++) {
    while (number >= values[k]) {
      out += symbols[k];
      number -= values[k];
    }
  }
  return out;
}
