// The ABI v1 exports (docs/abi.md). An evaluator's entry file re-exports them:
//
//     export * from "evald-guest/abi";
//
// and registers its function with `evaluator` (index.ts), which also places the buffers.

import {
  ABI_VERSION, inputCapacity, inputPointer, outputCapacity, outputPointer, runOnce,
} from "./index";

export function evald_abi_version(): i32 { return ABI_VERSION; }
export function evald_input_ptr(): i32 { return <i32>inputPointer(); }
export function evald_input_cap(): i32 { return inputCapacity(); }
export function evald_output_ptr(): i32 { return <i32>outputPointer(); }
export function evald_output_cap(): i32 { return outputCapacity(); }

/** Evaluates `input[0:inputLen]`: the value's length, or minus that of `CODE:message`. */
export function evald_eval(inputLen: i32): i32 { return runOnce(inputLen); }
