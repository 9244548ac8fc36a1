"""A small reader for the parts of the WebAssembly binary format the ABI checks need.

wasmtime validates modules but its Python bindings do not expose custom sections, the start
function or memory declarations before compiling; reading them here keeps
:func:`evald.host._abi.validate_module` cheap and usable without an engine-compiled module. Only the
section headers and the type, import, function, memory, global, export and start sections are
decoded; function bodies are left to :mod:`evald.host._instrument`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "EXTERN_KINDS",
    "SECTION_ORDER",
    "VALTYPE_NAMES",
    "Export",
    "FuncType",
    "Import",
    "MemoryLimits",
    "ModuleInfo",
    "Reader",
    "Section",
    "WasmFormatError",
    "parse_module",
]

MAGIC = b"\0asm"
VERSION_1 = b"\x01\0\0\0"

EXTERN_KINDS = {0: "func", 1: "table", 2: "memory", 3: "global", 4: "tag"}
VALTYPE_NAMES = {
    0x7F: "i32",
    0x7E: "i64",
    0x7D: "f32",
    0x7C: "f64",
    0x7B: "v128",
    0x70: "funcref",
    0x6F: "externref",
}

#: Position of each known section id in the order the binary format requires (custom = 0 is
#: allowed anywhere and has no rank).
SECTION_ORDER = {
    1: 1,
    2: 2,
    3: 3,
    4: 4,
    5: 5,
    13: 6,
    6: 7,
    7: 8,
    8: 9,
    9: 10,
    12: 11,
    10: 12,
    11: 13,
}


class WasmFormatError(ValueError):
    """The bytes are not a WebAssembly module this reader understands."""


class Reader:
    """A cursor over bytes with the binary format's integer encodings."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def at_end(self) -> bool:
        return self.pos >= self.end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise WasmFormatError(f"unexpected end of data at offset {self.pos}")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def bytes(self, length: int) -> bytes:
        if length < 0 or self.pos + length > self.end:
            raise WasmFormatError(f"unexpected end of data at offset {self.pos}")
        value = self.data[self.pos : self.pos + length]
        self.pos += length
        return value

    def skip(self, length: int) -> None:
        if length < 0 or self.pos + length > self.end:
            raise WasmFormatError(f"unexpected end of data at offset {self.pos}")
        self.pos += length

    def uleb(self, bits: int = 32) -> int:
        result = shift = 0
        while True:
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
            if shift >= bits + 7:
                raise WasmFormatError(f"integer too long at offset {self.pos}")
        if result >= 1 << bits:
            raise WasmFormatError(f"integer out of range at offset {self.pos}")
        return result

    def sleb(self, bits: int = 32) -> int:
        result = shift = 0
        while True:
            byte = self.byte()
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
            if shift >= bits + 7:
                raise WasmFormatError(f"integer too long at offset {self.pos}")
        if byte & 0x40:
            result -= 1 << shift
        return result

    def name(self) -> str:
        raw = self.bytes(self.uleb())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WasmFormatError(f"a name is not valid UTF-8 at offset {self.pos}") from exc


@dataclass(frozen=True)
class Section:
    id: int
    start: int  # offset of the section id byte
    content_start: int
    end: int
    name: str | None = None  # custom sections only
    payload_start: int = 0  # custom sections: where the payload after the name starts


@dataclass(frozen=True)
class FuncType:
    params: tuple[int, ...]
    results: tuple[int, ...]

    def describe(self) -> str:
        def names(types: tuple[int, ...]) -> str:
            return ", ".join(VALTYPE_NAMES.get(t, hex(t)) for t in types)

        return f"({names(self.params)}) -> ({names(self.results)})"


@dataclass(frozen=True)
class Import:
    module: str
    name: str
    kind: str


@dataclass(frozen=True)
class Export:
    name: str
    kind: str
    index: int


@dataclass(frozen=True)
class MemoryLimits:
    minimum_pages: int
    maximum_pages: int | None
    shared: bool
    memory64: bool


@dataclass
class ModuleInfo:
    sections: list[Section] = field(default_factory=list)
    types: list[FuncType | None] = field(default_factory=list)  # None: a non-function type
    imports: list[Import] = field(default_factory=list)
    function_types: list[int] = field(default_factory=list)  # type index per defined function
    memories: list[MemoryLimits] = field(default_factory=list)
    global_count: int = 0
    exports: list[Export] = field(default_factory=list)
    start_function: int | None = None

    def custom_sections(self, name: str) -> list[Section]:
        return [s for s in self.sections if s.id == 0 and s.name == name]

    def section(self, section_id: int) -> Section | None:
        for section in self.sections:
            if section.id == section_id:
                return section
        return None

    def imported(self, kind: str) -> int:
        return sum(1 for imp in self.imports if imp.kind == kind)

    def function_type(self, index: int) -> FuncType | None:
        """The type of function ``index`` (imported functions come first)."""
        imported = [imp for imp in self.imports if imp.kind == "func"]
        if index < len(imported):
            return None  # imports are refused before anyone asks
        local = index - len(imported)
        if local >= len(self.function_types):
            return None
        type_index = self.function_types[local]
        return self.types[type_index] if type_index < len(self.types) else None


def _valtype(reader: Reader) -> int:
    code = reader.byte()
    if code in (0x64, 0x63):  # (ref ht) / (ref null ht): function references
        reader.sleb(33)
    return code


def _limits(reader: Reader) -> MemoryLimits:
    flags = reader.byte()
    memory64 = bool(flags & 0x04)
    bits = 64 if memory64 else 32
    minimum = reader.uleb(bits)
    maximum = reader.uleb(bits) if flags & 0x01 else None
    if flags & 0x08:  # custom page size
        reader.uleb()
    return MemoryLimits(minimum, maximum, bool(flags & 0x02), memory64)


def _parse_types(reader: Reader, info: ModuleInfo) -> None:
    for _ in range(reader.uleb()):
        form = reader.byte()
        if form != 0x60:  # a GC type (rec/sub/struct/array): not a function signature
            raise WasmFormatError(f"type form {form:#x} is not supported (GC types)")
        params = tuple(_valtype(reader) for _ in range(reader.uleb()))
        results = tuple(_valtype(reader) for _ in range(reader.uleb()))
        info.types.append(FuncType(params, results))


def _parse_imports(reader: Reader, info: ModuleInfo) -> None:
    for _ in range(reader.uleb()):
        module = reader.name()
        name = reader.name()
        kind = reader.byte()
        if kind == 0:
            reader.uleb()
        elif kind == 1:
            _valtype(reader)
            _limits(reader)
        elif kind == 2:
            _limits(reader)
        elif kind == 3:
            _valtype(reader)
            reader.byte()
        elif kind == 4:
            reader.byte()
            reader.uleb()
        else:
            raise WasmFormatError(f"unknown import kind {kind:#x}")
        info.imports.append(Import(module, name, EXTERN_KINDS[kind]))


def _parse_exports(reader: Reader, info: ModuleInfo) -> None:
    for _ in range(reader.uleb()):
        name = reader.name()
        kind = reader.byte()
        if kind not in EXTERN_KINDS:
            raise WasmFormatError(f"unknown export kind {kind:#x}")
        info.exports.append(Export(name, EXTERN_KINDS[kind], reader.uleb()))


def parse_module(wasm: bytes) -> ModuleInfo:
    """Reads the section layout and the declarations the ABI checks need.

    Raises:
        WasmFormatError: not a WebAssembly 1.0 binary, or a declaration it cannot read.
    """
    if wasm[:4] != MAGIC:
        raise WasmFormatError("missing the \\0asm magic number (is this a .wasm file?)")
    if wasm[4:8] != VERSION_1:
        raise WasmFormatError("unsupported binary version (expected a core module, version 1)")
    info = ModuleInfo()
    reader = Reader(wasm, 8)
    while not reader.at_end():
        start = reader.pos
        section_id = reader.byte()
        size = reader.uleb()
        content_start = reader.pos
        end = content_start + size
        if end > len(wasm):
            raise WasmFormatError(f"section {section_id} at offset {start} runs past the end")
        body = Reader(wasm, content_start, end)
        if section_id == 0:
            name = body.name()
            info.sections.append(Section(0, start, content_start, end, name, body.pos))
        else:
            info.sections.append(Section(section_id, start, content_start, end))
            if section_id == 1:
                _parse_types(body, info)
            elif section_id == 2:
                _parse_imports(body, info)
            elif section_id == 3:
                info.function_types = [body.uleb() for _ in range(body.uleb())]
            elif section_id == 5:
                info.memories = [_limits(body) for _ in range(body.uleb())]
            elif section_id == 6:
                info.global_count = body.uleb()
            elif section_id == 7:
                _parse_exports(body, info)
            elif section_id == 8:
                info.start_function = body.uleb()
        reader.pos = end
    return info
