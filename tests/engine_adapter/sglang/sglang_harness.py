"""Plays SGLang's decode loop on the CPU with SGLang's own classes, for the adapter's tests.

:class:`MiniScheduler` does per step what SGLang 0.5.23's scheduler does with grammar objects:
``SamplingBatchInfo.update_regex_vocab_mask()`` (the real one: allocate, ``fill_vocab_mask_batched``
over the unfinished rows, move), ``apply_logits_bias`` (the grammar object's own
``apply_vocab_mask``, which runs xgrammar's CPU kernel), greedy sampling, then
``accept_token`` for each row as ``BatchResultProcessor._accept_grammar_tokens`` does (a refused
token aborts the request), and the finish checks (EOS, grammar terminated, length).

The "model" is :class:`ScriptedModel`: seeded noise plus a strong preference for the tokens that
continue a script, so the model *wants* to write a known text; the grammar mask decides what
it may write, and forced tokens override its preference. The values in the text come from the
real daemon, never from the script.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from evald.daemon import hash_token

#: Tokens of the test daemon's tenants (its config holds only their hashes).
TOKEN = "sglang-tenant-token-0123456789abcdef"
CALC_ONLY_TOKEN = "calc-only-token-0123456789abcdef"

CONFIG = f"""
[server]
threads = 2
shutdown_grace_s = 2

[[tenants]]
name = "local"
evaluators = ["*"]

[[tenants]]
name = "sglang"
token_sha256 = "{hash_token(TOKEN)}"
evaluators = ["*"]

[[tenants]]
name = "calc-only"
token_sha256 = "{hash_token(CALC_ONLY_TOKEN)}"
evaluators = ["calc"]
"""


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Sets (or, with None, removes) environment variables for the duration of the block."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: A result region (value or error) at the end of a span, in the script or the output.
_CLOSE = re.compile(rb"</result(?:_error)?>")


def popcount(row: Any) -> int:
    """Allowed tokens in one bitmask row (int32 words)."""
    return sum(bin(int(word) & 0xFFFFFFFF).count("1") for word in row.tolist())


class ScriptedModel:
    """Logits that prefer continuing ``script`` (longest matching token first), then EOS.

    After a result region the engine forced, the model picks up its script after its own
    result region (the one it wanted to write), like a model that reads on from the injected
    text. ``noise`` adds seeded random logits, so unscripted choices are arbitrary but legal.
    """

    def __init__(
        self, codec: Any, eos_id: int, script: str, *, seed: int = 0, noise: float = 1.0
    ) -> None:
        import torch

        self._codec = codec
        self._eos = eos_id
        self._script = script.encode()
        self._generator = torch.Generator().manual_seed(seed)
        self._noise = noise
        self._by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(codec.vocab_size):
            raw = codec.token_bytes(token_id)
            if raw:
                self._by_bytes.setdefault(raw, []).append(token_id)
        self._max_len = max(len(raw) for raw in self._by_bytes)

    def wants(self, text: bytes) -> bytes | None:
        """What the model still wants to write after ``text``; None when it is lost."""
        if self._script.startswith(text):
            return self._script[len(text) :]
        text_close = list(_CLOSE.finditer(text))
        script_close = list(_CLOSE.finditer(self._script))
        if not text_close or len(script_close) < len(text_close):
            return None
        after_text = text[text_close[-1].end() :]
        after_script = self._script[script_close[len(text_close) - 1].end() :]
        if after_script.startswith(after_text):
            return after_script[len(after_text) :]
        return None

    def logits(self, text: bytes, vocab_size: int) -> Any:
        import torch

        logits = torch.randn(vocab_size, generator=self._generator) * self._noise
        remaining = self.wants(text)
        if remaining == b"":
            logits[self._eos] += 100.0
        elif remaining:
            for size in range(1, min(len(remaining), self._max_len) + 1):
                for token_id in self._by_bytes.get(remaining[:size], ()):
                    logits[token_id] += 50.0 + 10.0 * size  # longest first, whatever the noise
        return logits


class RandomModel:
    """Seeded random logits with a pull towards closing brackets and tags, so spans close."""

    def __init__(self, codec: Any, *, seed: int, close_bonus: float = 4.0) -> None:
        import torch

        self._generator = torch.Generator().manual_seed(seed)
        self._bonus = torch.zeros(codec.vocab_size)
        for token_id in range(codec.vocab_size):
            if codec.token_bytes(token_id).startswith((b"</", b")")):
                self._bonus[token_id] = close_bonus

    def logits(self, text: bytes, vocab_size: int) -> Any:
        import torch

        return torch.randn(vocab_size, generator=self._generator) + self._bonus[:vocab_size]


@dataclass
class Row:
    """One request in the batch."""

    grammar: Any
    model: Any
    max_new_tokens: int = 80
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    aborted: str | None = None
    forced_steps: list[int] = field(default_factory=list)
    """Steps at which the adapter narrowed this row to one forced token."""


class MiniScheduler:
    """Steps a batch of rows as SGLang's scheduler does (see the module docstring)."""

    def __init__(self, codec: Any, eos_id: int, vocab_size: int, rows: Sequence[Row]) -> None:
        self.codec = codec
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.rows = list(rows)
        self.steps = 0

    def text(self, row: Row) -> str:
        return self.codec.decode(row.output_ids).decode("utf-8", errors="replace")

    def run(self, max_steps: int = 400) -> None:
        while any(not row.finished for row in self.rows) and self.steps < max_steps:
            self.step()
        assert all(row.finished for row in self.rows), "rows did not finish within max_steps"

    def step(self) -> None:
        import torch
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        active = [row for row in self.rows if not row.finished]
        size = len(active)
        info = SamplingBatchInfo(
            temperatures=torch.ones(size, 1),
            top_ps=torch.ones(size),
            top_ks=torch.ones(size, dtype=torch.int32),
            min_ps=torch.zeros(size),
            is_all_greedy=True,
            is_any_greedy=True,
            need_top_p_sampling=False,
            need_top_k_sampling=False,
            need_min_p_sampling=False,
            vocab_size=self.vocab_size,
            grammars=[row.grammar for row in active],
            device="cpu",
        )
        before = [getattr(row.grammar, "forced_steps", 0) for row in active]
        info.update_regex_vocab_mask()
        mask = info.grammar_mask.vocab_mask if info.grammar_mask is not None else None
        logits = torch.stack(
            [row.model.logits(self.codec.decode(row.output_ids), self.vocab_size) for row in active]
        )
        info.apply_logits_bias(logits)
        tokens = logits.argmax(dim=-1).tolist()
        for index, (row, token) in enumerate(zip(active, tokens, strict=True)):
            if getattr(row.grammar, "forced_steps", 0) > before[index]:
                assert mask is not None and popcount(mask[index]) == 1, "forced row not narrowed"
                row.forced_steps.append(self.steps)
            self._commit(row, int(token))
        self.steps += 1

    def _commit(self, row: Row, token: int) -> None:
        row.output_ids.append(token)
        grammar = row.grammar
        if grammar is not None:
            try:
                grammar.accept_token(token)
            except ValueError as exc:  # SGLang aborts the request (FINISH_ABORT)
                row.aborted = str(exc)
                row.finished = True
        if token == self.eos_id or len(row.output_ids) >= row.max_new_tokens:
            row.finished = True
        if grammar is not None and grammar.is_terminated():
            row.finished = True
        if grammar is not None:
            grammar.finished = row.finished


def expected_region(evaluator: str, content: str) -> str:
    """The result region the reference implementation gives for a span."""
    from evaluators_wasm.reference import GuestError, reference

    try:
        return f"<result>{reference(evaluator)(content.encode())}</result>"
    except GuestError as exc:
        return f"<result_error>{exc.code}</result_error>"


def spans_in(text: str, tag: str) -> list[tuple[str, str]]:
    """``(content, result region)`` of every ``<tag>…</tag>`` span followed by a result region."""
    pattern = re.compile(
        rf"<{tag}>(.*?)</{tag}>(<result>.*?</result>|<result_error>.*?</result_error>)", re.S
    )
    return [(m.group(1), m.group(2)) for m in pattern.finditer(text)]


# ---------------------------------------------------------------------- spawned SGLang processes
# SGLang starts its schedulers with multiprocessing *spawn* and each calls load_plugins(); these
# functions run in such children (importable by name: the parent's sys.path is passed on).


def child_enabled(results: Any) -> None:
    """A scheduler-like process with EVALD_TARGET set: hooks, refusals, one evaluated span."""
    report: dict[str, Any] = {}
    try:
        from engine_adapter.sglang import plugin

        try:
            plugin.verify_installed()
            report["before_load"] = "installed"
        except plugin.PluginError as exc:  # the real, unpatched classes
            report["before_load"] = str(exc)
        from sglang.srt.plugins import load_plugins

        load_plugins()
        report["hooks"] = plugin.verify_installed()
        report["scheduler_available"] = plugin.scheduler_available()
        from sglang.srt.server_args import ServerArgs

        refusals = {}
        for name, options, scheduling in [
            ("tp", {"tp_size": 2}, None),
            ("tp-inline", {"tp_size": 2}, "inline"),
            ("spec", {"speculative_algorithm": "NGRAM"}, None),
            ("backend", {"grammar_backend": "llguidance"}, None),
        ]:
            try:
                with environment(EVALD_SGLANG_SCHEDULING=scheduling):
                    ServerArgs(model_path="dummy", **options).resolve_once()
                refusals[name] = "accepted"
            except plugin.UnsupportedConfiguration as exc:
                refusals[name] = str(exc)
            except Exception as exc:
                refusals[name] = f"{type(exc).__name__}: {exc}"
        report["refusals"] = refusals

        from sglang.srt.constrained import base_grammar_backend

        from engine_adapter.local import load_tokenizer

        tokenizer = load_tokenizer()
        try:
            base_grammar_backend.create_grammar_backend(
                ServerArgs(model_path="dummy", pp_size=2), tokenizer, len(tokenizer)
            )
            report["scheduler_refusal"] = "accepted"
        except plugin.UnsupportedConfiguration as exc:
            report["scheduler_refusal"] = str(exc)

        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        from engine_adapter.sglang import structural_tag_for

        backend = XGrammarGrammarBackend(
            tokenizer, vocab_size=len(tokenizer), model_eos_token_ids=[tokenizer.eos_token_id]
        )
        tag = structural_tag_for(None, None, ["calc"], prefix="So <calc>")  # from the env
        grammar = backend.dispatch_structural_tag(json.dumps(tag))
        report["grammar"] = type(grammar).__name__
        codec = backend._evald_runtime.codec
        model = ScriptedModel(
            codec, tokenizer.eos_token_id, "So <calc>100 - 58</calc><result>0</result>."
        )
        row = Row(grammar, model)
        loop = MiniScheduler(codec, tokenizer.eos_token_id, len(tokenizer), [row])
        loop.run()
        report["text"] = loop.text(row)
        report["aborted"] = row.aborted
    except BaseException as exc:  # report, never hang the parent
        import traceback

        report["error"] = "".join(traceback.format_exception(exc))
    results.put(report)
