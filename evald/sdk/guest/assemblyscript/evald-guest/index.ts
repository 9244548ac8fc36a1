// The evald evaluator ABI v1 (docs/abi.md) from an AssemblyScript guest's side.
//
// An evaluator is one pure function from the text of a span to a value or a typed error. The
// entry file re-exports the ABI (`export * from "evald-guest/abi"`) and registers its function
// once, at the top level:
//
//     import { evaluator, fail, Code } from "evald-guest";
//     export * from "evald-guest/abi";
//
//     evaluator(shout, 64, 64);  // the input and output buffers' capacities, in bytes
//
//     function shout(input: string): string {
//       if (input.length == 0) return fail(Code.Syntax, "expected a word");
//       return input.toUpperCase();
//     }
//
// The manifest is not declared here: `evald build` embeds the folder's manifest.json and
// grammar.ebnf with the SDK's one section writer (a module may hold one manifest).
//
// `evald build` compiles with the stub runtime (a bump allocator that never collects) and this
// module rewinds its heap at the start of every call, so a call's memory is its peak and nothing
// is left over for the next (docs/writing-evaluators.md says why that beats a collector here).
// What a guest may not do ends as the host's typed outcome, as for a guest in any language: a
// failed assertion, a `throw` or an out-of-bounds access traps (`guest_fault`), and an
// allocation past the tenant's memory cap is a refused `memory.grow`, then the stub's trap
// (`memory_limit`).

import { AL_MASK, BLOCK_OVERHEAD } from "rt/common";

/** The ABI version `evald_abi_version` returns. */
export const ABI_VERSION: i32 = 1;

/** A guest error code (docs/abi.md, "Guest error codes"); the host adds its own. */
export enum Code {
  /** The input is not in the evaluator's language (includes invalid UTF-8). */
  Syntax,
  /** A division or remainder by zero. */
  DivisionByZero,
  /** A result exceeds the evaluator's documented numeric range. */
  Overflow,
  /** An argument outside the operation's domain. */
  Domain,
  /** An intermediate value or the input exceeds a documented size bound. */
  TooLarge,
}

/** The code as the host reads it from the error payload. */
export function codeName(code: Code): string {
  switch (code) {
    case Code.Syntax: return "syntax";
    case Code.DivisionByZero: return "division_by_zero";
    case Code.Overflow: return "overflow";
    case Code.Domain: return "domain";
    default: return "too_large";
  }
}

/** An evaluator on text: the input, checked to be UTF-8, as a string. */
export type TextEvaluator = (input: string) => string;
/** An evaluator on bytes: `length` bytes at `input`, exactly as the model wrote them. */
export type BytesEvaluator = (input: usize, length: i32) => string;

let inputPtr: usize = 0;
let inputCap: i32 = 0;
let outputPtr: usize = 0;
let outputCap: i32 = 0;
let onText: TextEvaluator | null = null;
let onBytes: BytesEvaluator | null = null;

/** Registers the evaluator on text and places the buffers; call it once, at the top level. */
export function evaluator(evaluate: TextEvaluator, inputCapacity: i32, outputCapacity: i32): void {
  onText = evaluate;
  placeBuffers(inputCapacity, outputCapacity);
}

/** Registers an evaluator on raw bytes (rejecting invalid UTF-8 is then its job: `validUtf8`). */
export function bytesEvaluator(
  evaluate: BytesEvaluator, inputCapacity: i32, outputCapacity: i32,
): void {
  onBytes = evaluate;
  placeBuffers(inputCapacity, outputCapacity);
}

function placeBuffers(inputCapacity: i32, outputCapacity: i32): void {
  assert(inputPtr == 0, "register one evaluator, once");
  assert(inputCapacity >= 1 && outputCapacity >= 1, "buffer capacities are at least 1 byte");
  inputCap = inputCapacity;
  outputCap = outputCapacity;
  inputPtr = heap.alloc(<usize>inputCapacity);
  outputPtr = heap.alloc(<usize>outputCapacity);
}

let failed = false;
let failure: Code = Code.Syntax;
let failureMessage = "";

/**
 * Ends the evaluation with a guest error; return what it returns (`return fail(...)`). The
 * value the function returns after calling it is ignored.
 */
export function fail(code: Code, message: string = ""): string {
  failed = true;
  failure = code;
  failureMessage = message;
  return "";
}

// -- the heap, one call at a time ----------------------------------------------------------

// The stub runtime's first block: where its heap starts (rt/stub.ts, `startOffset`).
const heapStart: usize = ((__heap_base + BLOCK_OVERHEAD + AL_MASK) & ~AL_MASK) - BLOCK_OVERHEAD;
let heapKept: usize = 0;
let heapMeasured = false;

/**
 * Rewinds the stub's heap to where the module's top level left it: the buffers and whatever
 * else the top level allocated (a `const` array of names) are kept, everything a call
 * allocated is given back. The first call measures the top level's share; later calls
 * re-reserve it in one block after the runtime's `__reset`.
 */
function rewindHeap(): void {
  if (!heapMeasured) {
    heapMeasured = true;
    heapKept = heap.alloc(0) - BLOCK_OVERHEAD - heapStart;
  }
  __reset();
  if (heapKept > 0) heap.alloc(heapKept - 2 * BLOCK_OVERHEAD);
}

// -- one call ------------------------------------------------------------------------------

/** What `evald_eval` does: returns the value's length, or minus the error payload's. */
export function runOnce(inputLen: i32): i32 {
  rewindHeap();
  failed = false;
  if (inputLen < 0 || inputLen > inputCap) {
    return writeError(Code.Syntax, "input length outside the input buffer");
  }
  let value: string;
  if (onBytes != null) {
    value = changetype<BytesEvaluator>(onBytes)(inputPtr, inputLen);
  } else {
    if (!validUtf8(inputPtr, inputLen)) return writeError(Code.Syntax, "input is not valid UTF-8");
    value = changetype<TextEvaluator>(onText)(String.UTF8.decodeUnsafe(inputPtr, <usize>inputLen));
  }
  if (failed) return writeError(failure, failureMessage);
  const length = String.UTF8.byteLength(value);
  if (length > outputCap) {
    return writeError(Code.TooLarge, "the value is longer than the output buffer");
  }
  return <i32>String.UTF8.encodeUnsafe(changetype<usize>(value), value.length, outputPtr);
}

/** Writes `CODE` or `CODE:message`, the message cut at a character boundary to fit. */
function writeError(code: Code, message: string): i32 {
  let n = put(0, String.UTF8.encode(codeName(code)));
  if (message.length > 0 && n + 1 < outputCap) {
    store<u8>(outputPtr + n, 0x3a); // ':'
    n = put(n + 1, String.UTF8.encode(message));
  }
  return -n;
}

function put(at: i32, bytes: ArrayBuffer): i32 {
  let take = min(bytes.byteLength, outputCap - at);
  const data = changetype<usize>(bytes);
  if (take < bytes.byteLength) {
    while (take > 0 && (load<u8>(data + take) & 0xc0) == 0x80) take--;
  }
  memory.copy(outputPtr + at, data, take);
  return at + take;
}

// -- what the ABI functions read -----------------------------------------------------------

export function inputPointer(): usize { return inputPtr; }
export function inputCapacity(): i32 { return inputCap; }
export function outputPointer(): usize { return outputPtr; }
export function outputCapacity(): i32 { return outputCap; }

// -- helpers -------------------------------------------------------------------------------

/**
 * Strict UTF-8, as Python's decoder and the host read it: no overlong forms, no surrogates,
 * nothing above U+10FFFF, no truncated sequence; eight ASCII bytes a step.
 */
export function validUtf8(start: usize, length: i32): bool {
  let i: usize = start;
  const end: usize = start + <usize>length;
  while (i < end) {
    if (i + 8 <= end && (load<u64>(i) & 0x8080808080808080) == 0) {
      i += 8;
      continue;
    }
    const c = load<u8>(i);
    if (c < 0x80) {
      i += 1;
    } else if (c < 0xc2) {
      return false; // a continuation byte, or the lead of an overlong 2-byte form
    } else if (c < 0xe0) {
      if (i + 2 > end || !continuation(load<u8>(i + 1))) return false;
      i += 2;
    } else if (c < 0xf0) {
      if (i + 3 > end) return false;
      const lo: u8 = c == 0xe0 ? 0xa0 : 0x80; // overlong
      const hi: u8 = c == 0xed ? 0x9f : 0xbf; // surrogates
      const c1 = load<u8>(i + 1);
      if (c1 < lo || c1 > hi || !continuation(load<u8>(i + 2))) return false;
      i += 3;
    } else if (c < 0xf5) {
      if (i + 4 > end) return false;
      const lo: u8 = c == 0xf0 ? 0x90 : 0x80; // overlong
      const hi: u8 = c == 0xf4 ? 0x8f : 0xbf; // above U+10FFFF
      const c1 = load<u8>(i + 1);
      if (c1 < lo || c1 > hi || !continuation(load<u8>(i + 2)) || !continuation(load<u8>(i + 3))) {
        return false;
      }
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

// @ts-ignore: decorator
@inline function continuation(c: u8): bool {
  return (c & 0xc0) == 0x80;
}
