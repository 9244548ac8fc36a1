from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_SYNTAX: _ClassVar[ErrorCode]
    ERROR_CODE_DIVISION_BY_ZERO: _ClassVar[ErrorCode]
    ERROR_CODE_OVERFLOW: _ClassVar[ErrorCode]
    ERROR_CODE_DOMAIN: _ClassVar[ErrorCode]
    ERROR_CODE_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_FUEL_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_MEMORY_LIMIT: _ClassVar[ErrorCode]
    ERROR_CODE_STACK_OVERFLOW: _ClassVar[ErrorCode]
    ERROR_CODE_GUEST_FAULT: _ClassVar[ErrorCode]
    ERROR_CODE_INPUT_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_OUTPUT_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_EVALUATOR: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]
    ERROR_CODE_QUOTA_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_MODULE: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_SYNTAX: ErrorCode
ERROR_CODE_DIVISION_BY_ZERO: ErrorCode
ERROR_CODE_OVERFLOW: ErrorCode
ERROR_CODE_DOMAIN: ErrorCode
ERROR_CODE_TOO_LARGE: ErrorCode
ERROR_CODE_FUEL_EXHAUSTED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_MEMORY_LIMIT: ErrorCode
ERROR_CODE_STACK_OVERFLOW: ErrorCode
ERROR_CODE_GUEST_FAULT: ErrorCode
ERROR_CODE_INPUT_TOO_LARGE: ErrorCode
ERROR_CODE_OUTPUT_TOO_LARGE: ErrorCode
ERROR_CODE_UNKNOWN_EVALUATOR: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
ERROR_CODE_QUOTA_EXCEEDED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_INVALID_MODULE: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("evaluator", "input", "deadline_ms", "id")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    evaluator: str
    input: bytes
    deadline_ms: int
    id: str
    def __init__(self, evaluator: _Optional[str] = ..., input: _Optional[bytes] = ..., deadline_ms: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("id", "value", "error", "fuel_used", "eval_time_us", "semantics_version")
    ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FUEL_USED_FIELD_NUMBER: _ClassVar[int]
    EVAL_TIME_US_FIELD_NUMBER: _ClassVar[int]
    SEMANTICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    value: str
    error: Error
    fuel_used: int
    eval_time_us: int
    semantics_version: str
    def __init__(self, id: _Optional[str] = ..., value: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., fuel_used: _Optional[int] = ..., eval_time_us: _Optional[int] = ..., semantics_version: _Optional[str] = ...) -> None: ...

class EvaluateBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EvaluateRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[EvaluateRequest, _Mapping]]] = ...) -> None: ...

class EvaluateBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EvaluateResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[EvaluateResponse, _Mapping]]] = ...) -> None: ...

class EvaluatorInfo(_message.Message):
    __slots__ = ("name", "version", "tag", "input_grammar", "result_regex", "semantics_version", "description", "owner", "sha256", "examples", "literals", "input_schema", "result_schema")
    class LiteralsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    INPUT_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RESULT_REGEX_FIELD_NUMBER: _ClassVar[int]
    SEMANTICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    LITERALS_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RESULT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    tag: str
    input_grammar: str
    result_regex: str
    semantics_version: str
    description: str
    owner: str
    sha256: str
    examples: _containers.RepeatedCompositeFieldContainer[EvaluatorExample]
    literals: _containers.ScalarMap[str, str]
    input_schema: str
    result_schema: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., tag: _Optional[str] = ..., input_grammar: _Optional[str] = ..., result_regex: _Optional[str] = ..., semantics_version: _Optional[str] = ..., description: _Optional[str] = ..., owner: _Optional[str] = ..., sha256: _Optional[str] = ..., examples: _Optional[_Iterable[_Union[EvaluatorExample, _Mapping]]] = ..., literals: _Optional[_Mapping[str, str]] = ..., input_schema: _Optional[str] = ..., result_schema: _Optional[str] = ...) -> None: ...

class EvaluatorExample(_message.Message):
    __slots__ = ("input", "value", "question")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    input: str
    value: str
    question: str
    def __init__(self, input: _Optional[str] = ..., value: _Optional[str] = ..., question: _Optional[str] = ...) -> None: ...

class ListEvaluatorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEvaluatorsResponse(_message.Message):
    __slots__ = ("evaluators", "revision", "tenant")
    EVALUATORS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    evaluators: _containers.RepeatedCompositeFieldContainer[EvaluatorInfo]
    revision: int
    tenant: str
    def __init__(self, evaluators: _Optional[_Iterable[_Union[EvaluatorInfo, _Mapping]]] = ..., revision: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class RegisterEvaluatorRequest(_message.Message):
    __slots__ = ("module", "replace")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    module: bytes
    replace: bool
    def __init__(self, module: _Optional[bytes] = ..., replace: _Optional[bool] = ...) -> None: ...

class RegisterEvaluatorResponse(_message.Message):
    __slots__ = ("evaluator", "revision")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    evaluator: EvaluatorInfo
    revision: int
    def __init__(self, evaluator: _Optional[_Union[EvaluatorInfo, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class DeleteEvaluatorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteEvaluatorResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...
