//! The evald evaluator ABI v1 (docs/abi.md) from a Rust guest's side.
//!
//! An evaluator is one pure function from the text of a span to a value or a typed error;
//! [`evaluator!`] turns such a function into the module's seven ABI exports (the input and
//! output buffers in static memory, `evald_eval` reading the one and writing the other) and
//! installs [`Arena`] as the allocator:
//!
//! ```ignore
//! use evald_guest::{evaluator, Error, Result};
//!
//! evaluator!(shout, input_capacity = 64, output_capacity = 64);
//!
//! fn shout(input: &str) -> Result<String> {
//!     if input.is_empty() {
//!         return Err(Error::syntax("expected a word"));
//!     }
//!     Ok(input.to_uppercase())
//! }
//! ```
//!
//! A policy (one JSON value in, one out) reads and writes with [`json`] (`json::parse`,
//! `json::Writer`, exact `json::Decimal` numbers).
//!
//! The manifest is not declared here: `evald build` embeds the folder's `manifest.json` and
//! `grammar.ebnf` with the SDK's one section writer (a module may hold one manifest).
//!
//! What a guest may not do ends as the host's typed outcome, as for a guest in any language: a
//! panic aborts (`panic = abort`: the `unreachable` instruction) and an out-of-bounds access
//! traps, both `guest_fault`; an allocation past the tenant's memory cap is a refused
//! `memory.grow`, then the allocation-failure abort, `memory_limit`.

#![no_std]

extern crate alloc;

use alloc::borrow::Cow;
use core::alloc::{GlobalAlloc, Layout};

pub mod json;

/// The ABI version `evald_abi_version` returns.
pub const ABI_VERSION: i32 = 1;

/// A guest error code (docs/abi.md, "Guest error codes"); the host adds its own for traps and
/// limits, which a guest never returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The input is not in the evaluator's language (includes invalid UTF-8).
    Syntax,
    /// A division or remainder by zero.
    DivisionByZero,
    /// A result exceeds the evaluator's documented numeric range.
    Overflow,
    /// An argument outside the operation's domain.
    Domain,
    /// An intermediate value or the input exceeds a documented size bound.
    TooLarge,
}

impl Code {
    /// Every guest code, in the order of docs/abi.md.
    pub const ALL: [Code; 5] =
        [Code::Syntax, Code::DivisionByZero, Code::Overflow, Code::Domain, Code::TooLarge];

    /// The code as the host reads it from the error payload.
    pub const fn name(self) -> &'static str {
        match self {
            Code::Syntax => "syntax",
            Code::DivisionByZero => "division_by_zero",
            Code::Overflow => "overflow",
            Code::Domain => "domain",
            Code::TooLarge => "too_large",
        }
    }
}

/// A guest error: a code and a short message for people (may be empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: Code,
    pub message: Cow<'static, str>,
}

impl Error {
    pub fn new(code: Code, message: impl Into<Cow<'static, str>>) -> Error {
        Error { code, message: message.into() }
    }
    pub fn syntax(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Code::Syntax, message)
    }
    pub fn division_by_zero(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Code::DivisionByZero, message)
    }
    pub fn overflow(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Code::Overflow, message)
    }
    pub fn domain(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Code::Domain, message)
    }
    pub fn too_large(message: impl Into<Cow<'static, str>>) -> Error {
        Error::new(Code::TooLarge, message)
    }
}

/// What an evaluator function returns: a value (any text) or a guest error.
pub type Result<T> = core::result::Result<T, Error>;

/// Defines the ABI v1 exports around an evaluator function and installs [`Arena`].
///
/// `evaluator!(f, input_capacity = N, output_capacity = M)` takes `fn f(&str) -> Result<V>`
/// (`V: AsRef<str>`, e.g. `String` or `&'static str`): the input is checked to be UTF-8 first
/// (`syntax` otherwise). `evaluator!(bytes f, ...)` takes `fn f(&[u8]) -> Result<V>` and hands
/// over the bytes exactly as the model wrote them; rejecting invalid UTF-8 is then `f`'s job.
/// The capacities are the buffers' sizes in bytes: the host refuses a longer input with
/// `input_too_large` without calling the guest, and a longer value ends as `too_large`.
#[macro_export]
macro_rules! evaluator {
    (bytes $evaluate:path, input_capacity = $input:expr, output_capacity = $output:expr $(,)?) => {
        $crate::__exports!(run_bytes, $evaluate, $input, $output);
    };
    ($evaluate:path, input_capacity = $input:expr, output_capacity = $output:expr $(,)?) => {
        $crate::__exports!(run_str, $evaluate, $input, $output);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __exports {
    ($run:ident, $evaluate:path, $input:expr, $output:expr) => {
        const _: () = assert!(
            $input >= 1 && $input <= i32::MAX as usize && $output >= 1
                && $output <= i32::MAX as usize,
            "buffer capacities are 1 to 2^31 - 1 bytes"
        );
        static mut __EVALD_INPUT: [u8; $input] = [0; $input];
        static mut __EVALD_OUTPUT: [u8; $output] = [0; $output];

        #[no_mangle]
        pub extern "C" fn evald_abi_version() -> i32 {
            $crate::ABI_VERSION
        }
        #[no_mangle]
        pub extern "C" fn evald_input_ptr() -> i32 {
            unsafe { __EVALD_INPUT.as_ptr() as usize as i32 }
        }
        #[no_mangle]
        pub extern "C" fn evald_input_cap() -> i32 {
            $input as i32
        }
        #[no_mangle]
        pub extern "C" fn evald_output_ptr() -> i32 {
            unsafe { __EVALD_OUTPUT.as_ptr() as usize as i32 }
        }
        #[no_mangle]
        pub extern "C" fn evald_output_cap() -> i32 {
            $output as i32
        }
        /// Returns the value's length, or minus the length of `CODE:message` (an error).
        #[no_mangle]
        pub extern "C" fn evald_eval(input_len: i32) -> i32 {
            unsafe { $crate::$run(&__EVALD_INPUT, &mut __EVALD_OUTPUT, input_len, $evaluate) }
        }

        #[cfg(target_arch = "wasm32")]
        #[global_allocator]
        static __EVALD_ARENA: $crate::Arena = $crate::Arena;
    };
}

/// One call of an evaluator on text: what `evald_eval` does for `evaluator!(f, ...)`.
///
/// Starts the call's arena, checks the length and the UTF-8, runs `evaluate` and writes its
/// value or error to `output`; returns what `evald_eval` returns.
pub fn run_str<V: AsRef<str>>(
    input: &[u8],
    output: &mut [u8],
    input_len: i32,
    evaluate: fn(&str) -> Result<V>,
) -> i32 {
    arena::reset();
    let result = received(input, input_len).and_then(|bytes| match core::str::from_utf8(bytes) {
        Ok(text) => evaluate(text),
        Err(_) => Err(Error::syntax("input is not valid UTF-8")),
    });
    write(output, result)
}

/// One call of an evaluator on raw bytes: what `evald_eval` does for `evaluator!(bytes f, ...)`.
pub fn run_bytes<V: AsRef<str>>(
    input: &[u8],
    output: &mut [u8],
    input_len: i32,
    evaluate: fn(&[u8]) -> Result<V>,
) -> i32 {
    arena::reset();
    let result = received(input, input_len).and_then(evaluate);
    write(output, result)
}

fn received(input: &[u8], input_len: i32) -> Result<&[u8]> {
    match usize::try_from(input_len) {
        Ok(len) if len <= input.len() => Ok(&input[..len]),
        _ => Err(Error::syntax("input length outside the input buffer")),
    }
}

fn write<V: AsRef<str>>(output: &mut [u8], result: Result<V>) -> i32 {
    match result {
        Ok(value) => {
            let bytes = value.as_ref().as_bytes();
            if bytes.len() > output.len() {
                let error = Error::too_large("the value is longer than the output buffer");
                return -(write_error(output, &error) as i32);
            }
            output[..bytes.len()].copy_from_slice(bytes);
            bytes.len() as i32
        }
        Err(error) => -(write_error(output, &error) as i32),
    }
}

/// Writes `CODE` or `CODE:message`, the message cut at a character boundary to fit.
fn write_error(output: &mut [u8], error: &Error) -> usize {
    let code = error.code.name().as_bytes();
    let mut n = code.len().min(output.len());
    output[..n].copy_from_slice(&code[..n]);
    if error.message.is_empty() || n + 1 >= output.len() {
        return n;
    }
    output[n] = b':';
    n += 1;
    let message = error.message.as_ref();
    let mut take = message.len().min(output.len() - n);
    while !message.is_char_boundary(take) {
        take -= 1;
    }
    output[n..n + take].copy_from_slice(&message.as_bytes()[..take]);
    n + take
}

/// The allocator `evaluator!` installs on wasm32: an arena that starts empty at every call.
///
/// An evaluation is one pure call whose value is copied out before it returns, and nothing may
/// survive it (the host zeroes the buffers, and in `fresh` isolation every call gets a new
/// instance anyway). So allocation is a pointer bump, freeing the last block gives it back,
/// and [`run_str`]/[`run_bytes`] rewind the arena at the start of each call: memory use is the
/// call's peak, the same on a reused instance as on a fresh one, and the allocator is a few
/// hundred bytes of code. It never grows memory ahead of need, so a refused `memory.grow` always
/// means the evaluation itself needed more than the tenant's cap (`memory_limit`). Heap data
/// kept in a `static` across calls is therefore not allowed: use `const` tables.
pub struct Arena;

unsafe impl GlobalAlloc for Arena {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        arena::bump(layout.size(), layout.align())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        arena::give_back(ptr as usize, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if arena::resize_last(ptr as usize, layout.size(), new_size) {
            return ptr;
        }
        let moved = arena::bump(new_size, layout.align());
        if !moved.is_null() {
            core::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
        }
        moved
    }
}

mod arena {
    //! The arena's state: `next` is the first free byte, `end` the end of linear memory.

    const PAGE: usize = 65536;
    static mut NEXT: usize = 0;
    static mut END: usize = 0;

    #[cfg(target_arch = "wasm32")]
    fn heap_start() -> usize {
        extern "C" {
            static __heap_base: u8;
        }
        unsafe { &__heap_base as *const u8 as usize }
    }

    #[cfg(target_arch = "wasm32")]
    fn memory_end() -> usize {
        core::arch::wasm32::memory_size(0) * PAGE
    }

    #[cfg(target_arch = "wasm32")]
    fn grow(pages: usize) -> bool {
        core::arch::wasm32::memory_grow(0, pages) != usize::MAX
    }

    // Off wasm32 (`cargo test` of an evaluator's logic on the host) the arena is not installed.
    #[cfg(not(target_arch = "wasm32"))]
    fn heap_start() -> usize {
        0
    }
    #[cfg(not(target_arch = "wasm32"))]
    fn memory_end() -> usize {
        0
    }
    #[cfg(not(target_arch = "wasm32"))]
    fn grow(_pages: usize) -> bool {
        false
    }

    /// Rewinds the arena to the heap's start (the first call also learns the memory's end).
    pub fn reset() {
        unsafe {
            if END == 0 {
                END = memory_end();
            }
            NEXT = heap_start();
        }
    }

    /// Makes `[.., end)` addressable, growing memory by exactly the pages that takes.
    unsafe fn reserve(end: usize) -> bool {
        if END == 0 {
            END = memory_end();
        }
        if end <= END {
            return true;
        }
        let pages = (end - END + PAGE - 1) / PAGE;
        if !grow(pages) {
            return false;
        }
        END += pages * PAGE;
        true
    }

    pub unsafe fn bump(size: usize, align: usize) -> *mut u8 {
        if NEXT == 0 {
            NEXT = heap_start();
        }
        let start = match NEXT.checked_add(align - 1) {
            Some(padded) => padded & !(align - 1),
            None => return core::ptr::null_mut(),
        };
        match start.checked_add(size) {
            Some(end) if reserve(end) => {
                NEXT = end;
                start as *mut u8
            }
            _ => core::ptr::null_mut(),
        }
    }

    pub unsafe fn give_back(start: usize, size: usize) {
        if start + size == NEXT {
            NEXT = start;
        }
    }

    /// Grows or shrinks the last block in place; false when `start` is not the last block or
    /// memory cannot grow.
    pub unsafe fn resize_last(start: usize, size: usize, new_size: usize) -> bool {
        if start + size != NEXT {
            return false;
        }
        match start.checked_add(new_size) {
            Some(end) if reserve(end) => {
                NEXT = end;
                true
            }
            _ => false,
        }
    }
}
