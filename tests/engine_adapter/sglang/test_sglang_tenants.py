"""How a request's tenant options are read, carried and kept apart in SGLang's grammar cache."""

from __future__ import annotations

import gc

from engine_adapter import TokenCodec
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.serving._server_runtime import AdapterRuntime
from engine_adapter.sglang._tenants import TENANT_MARK, TenantKeys, split_key, take_options

CODEC = TokenCodec([b"a", b"b"])


def test_options_leave_custom_params() -> None:
    options, rest = take_options({"evald_token": "t", "thinking_budget": 5})
    assert options == {"evald_token": "t"} and rest == {"thinking_budget": 5}
    options, rest = take_options({"evald_token": "t", "evald_target": "h:1"})
    assert options == {"evald_token": "t", "evald_target": "h:1"} and rest is None
    assert take_options({"thinking_budget": 5}) == (None, {"thinking_budget": 5})
    assert take_options(None) == (None, None)


def test_the_key_names_the_runtime_and_its_revision_never_the_token() -> None:
    keys = TenantKeys()
    one = AdapterRuntime(AdapterConfig("unix:/x", "secret-token-a"), CODEC)
    two = AdapterRuntime(AdapterConfig("unix:/x", "secret-token-b"), CODEC)
    mark_one, held_one = keys.key(one, {"evald_token": "secret-token-a"})
    mark_two, _ = keys.key(two, None)
    assert mark_one != mark_two and "secret" not in mark_one + mark_two
    assert keys.key(one, {"evald_token": "secret-token-a"})[1] is held_one
    assert keys.key(one, {"evald_evaluators": "calc=c2"})[0] != mark_one  # renames key too
    one.set_listing([], one.revision + 1)  # the daemon's specs changed
    assert keys.key(one, {"evald_token": "secret-token-a"})[0] != mark_one
    key = '{"type": "structural_tag"}' + TENANT_MARK + mark_one
    assert split_key(key) == ('{"type": "structural_tag"}', mark_one)
    assert split_key('{"type": "structural_tag"}') == ('{"type": "structural_tag"}', None)


def test_the_operands_text_keys_a_computed_schemas_grammar() -> None:
    """``extracted`` properties are narrowed to ``evald_operands_from``: two texts are two
    grammars, and the keyed tenant carries the text to the compile."""
    keys = TenantKeys()
    one = AdapterRuntime(AdapterConfig("unix:/x", "secret-token-a"), CODEC)
    mark_a, held_a = keys.key(one, {"evald_operands_from": "I am 46"})
    mark_b, held_b = keys.key(one, {"evald_operands_from": "I am 12"})
    # the text never shows in the mark (a random hex digest may hold "46": ask for the words)
    assert mark_a != mark_b and "I am" not in mark_a and "I am" not in mark_b
    assert (held_a.operands_from, held_b.operands_from) == ("I am 46", "I am 12")
    options, rest = take_options({"evald_operands_from": "I am 46", "thinking_budget": 5})
    assert options == {"evald_operands_from": "I am 46"} and rest == {"thinking_budget": 5}


def test_a_requests_tenant_lives_as_long_as_the_request_whatever_else_arrives() -> None:
    """A flood of other requests cannot push a live request's tenant out before its grammar
    compiles (the old table kept 4,096 fingerprints and forgot the oldest); once nothing holds
    it, it is gone, so the table is bounded by the live requests."""
    keys = TenantKeys()
    real = AdapterRuntime(AdapterConfig("unix:/x", "real-token"), CODEC)
    mark, held = keys.key(real, {"evald_token": "real-token"})
    for i in range(10_000):
        junk = AdapterRuntime(AdapterConfig("unix:/x", f"junk-{i}"), CODEC)
        keys.key(junk, {"evald_token": f"junk-{i}"})
    gc.collect()
    assert keys.find(mark) is held and held.runtime is real
    assert len(keys) == 1
    del held
    gc.collect()
    assert keys.find(mark) is None and len(keys) == 0
