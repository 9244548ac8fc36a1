"""The model backends behind the local engine: llama.cpp and transformers on the real SmolLM2.

What the engine relies on: ``forward`` extends the KV cache and returns the next-token logits,
``truncate``/``rollback`` restore *exactly* the state of a shorter sequence, a batch of tokens in
one forward means the same as feeding them one by one, and both runtimes run the same model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from engine_adapter.local import BACKEND_NAMES, BackendError, load_backend

PROMPT = "A box has 17 rows of 23 items, then 91 more are added. How many items are in the box?"


def _prompt_ids(tokenizer: Any, text: str = PROMPT) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return [int(t) for t in encoded["input_ids"]]


def _greedy(backend: Any, ids: list[int], n: int) -> list[int]:
    backend.reset()
    logits = backend.forward(ids)
    out = []
    for _ in range(n):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = backend.forward([token])
    return out


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(BackendError, match=r"unknown backend 'tpu'.*llama, hf"):
        load_backend("tpu")
    assert BACKEND_NAMES == ("llama", "hf")


@pytest.fixture(params=["llama", "hf"])
def backend(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.mark.model
def test_backend_describes_smollm2(backend: Any, smollm2_tokenizer: Any) -> None:
    assert backend.vocab_size == len(smollm2_tokenizer) == 49152
    assert backend.eos_token_id == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert backend.n_ctx >= 1024


@pytest.mark.model
def test_forward_returns_a_fresh_logits_row_and_tracks_the_cache(
    backend: Any, smollm2_tokenizer: Any
) -> None:
    ids = _prompt_ids(smollm2_tokenizer)
    backend.reset()
    first = backend.forward(ids)
    assert first.shape == (backend.vocab_size,) and first.dtype == torch.float32
    assert backend.n_tokens == len(ids) and backend.tokens == tuple(ids)
    kept = first.clone()
    second = backend.forward([int(torch.argmax(first))])
    # The caller owns the row: the next forward must not overwrite it.
    assert torch.equal(first, kept)
    assert not torch.equal(first, second)
    assert backend.n_tokens == len(ids) + 1


@pytest.mark.model
def test_rollback_restores_identical_next_token_logits(
    backend: Any, smollm2_tokenizer: Any
) -> None:
    ids = _prompt_ids(smollm2_tokenizer)
    continuation = _greedy(backend, ids, 6)
    backend.reset()
    backend.forward(ids)
    reference = backend.forward(continuation[:3])
    # Wander off with other tokens, then roll back and take the same path again.
    backend.forward(smollm2_tokenizer.encode(" something else entirely", add_special_tokens=False))
    backend.truncate(len(ids))
    again = backend.forward(continuation[:3])
    assert torch.equal(reference, again)
    # rollback(k) drops exactly k positions, and the same tokens give the same logits again.
    ahead = backend.forward(continuation[3:6])
    backend.rollback(3)
    assert backend.n_tokens == len(ids) + 3
    assert torch.equal(backend.forward(continuation[3:6]), ahead)


@pytest.mark.model
def test_one_forward_of_many_tokens_means_the_same_as_one_at_a_time(
    backend: Any, smollm2_tokenizer: Any
) -> None:
    """Injection forwards a whole result at once: the cache must end up meaning the same.

    transformers is exact to float rounding; llama.cpp's batched kernels quantize activations
    differently from its one-token kernels (logits differ by up to ~1 on a scale of ~25), so
    there the check is that the next-token ranking agrees at the top.
    """
    ids = _prompt_ids(smollm2_tokenizer)
    forced = smollm2_tokenizer.encode("<result>482</result>", add_special_tokens=False)
    backend.reset()
    backend.forward(ids)
    for token in forced:
        one_by_one = backend.forward([token])
    backend.truncate(len(ids))
    batched = backend.forward(forced)
    assert backend.n_tokens == len(ids) + len(forced)
    if backend.name == "hf":
        assert torch.allclose(one_by_one, batched, atol=1e-3)
    else:
        assert int(torch.argmax(batched)) in torch.topk(one_by_one, 3).indices.tolist()
        assert float((one_by_one - batched).abs().max()) < 2.0


@pytest.mark.model
def test_the_two_backends_agree_on_the_first_greedy_tokens(
    llama_backend: Any, hf_backend: Any, smollm2_tokenizer: Any
) -> None:
    """Q4_1 kernels vs fp32: same model, so the first tokens agree; they drift apart after a
    dozen or so, so nothing longer is compared."""
    ids = _prompt_ids(smollm2_tokenizer)
    llama_tokens = _greedy(llama_backend, ids, 4)
    assert _greedy(hf_backend, ids, 4) == llama_tokens
    # Teacher-forced on llama's own continuation, transformers ranks each llama choice near the
    # top: the runtimes read the same weights, tokenizer and chat template.
    continuation = _greedy(llama_backend, ids, 12)
    hf_backend.reset()
    logits = hf_backend.forward(ids)
    for token in continuation:
        assert token in torch.topk(logits, 5).indices.tolist()
        logits = hf_backend.forward([token])


@pytest.mark.model
def test_bad_requests_leave_the_cache_untouched(backend: Any, smollm2_tokenizer: Any) -> None:
    ids = _prompt_ids(smollm2_tokenizer)
    backend.reset()
    logits = backend.forward(ids)
    with pytest.raises(BackendError, match="at least one token"):
        backend.forward([])
    with pytest.raises(BackendError, match="out of range"):
        backend.forward([backend.vocab_size])
    with pytest.raises(BackendError, match="out of range"):
        backend.forward([-1])
    with pytest.raises(BackendError, match="context window"):
        backend.forward([0] * backend.n_ctx)
    with pytest.raises(BackendError, match="cannot truncate"):
        backend.truncate(len(ids) + 1)
    with pytest.raises(BackendError, match="negative"):
        backend.rollback(-1)
    assert backend.n_tokens == len(ids)
    # The cache still continues exactly where it was.
    token = int(torch.argmax(logits))
    after = backend.forward([token])
    backend.rollback(1)
    assert torch.equal(after, backend.forward([token]))


@pytest.mark.model
def test_hf_conversion_is_cached_as_plain_safetensors(hf_backend: Any) -> None:
    from engine_adapter.local import converted_model_dir

    folder = converted_model_dir()
    assert (folder / "model.safetensors").stat().st_size > 100_000_000
    config = json.loads((folder / "config.json").read_text())
    # Saved without the GGUF quantizer, so reloading does not dequantize again.
    assert "quantization_config" not in config
    assert config["vocab_size"] == hf_backend.vocab_size


# -- CPU choices and teardown (docs/local-engine.md, "CPU choices") ------------------------------


@pytest.mark.model
def test_llama_backend_never_loads_the_amx_buffer_type(llama_backend: Any) -> None:
    """The AMX buffer type crashes on some AMX CPUs. Whatever this CPU and this llama.cpp build
    have, the model is loaded so that the AMX buffer type cannot be used: either the build has
    no AMX kernels, or extra buffer types are off."""
    from engine_adapter.local._llama_backend import amx_compiled, model_params

    assert not (amx_compiled() and llama_backend.params.use_extra_bufts)
    assert model_params().use_extra_bufts is (not amx_compiled())


def test_an_amx_build_loads_with_extra_buffer_types_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule on a llama.cpp that has AMX kernels (a build this machine may not have)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from engine_adapter.local import _llama_backend

    amx_info = b"CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: amx_info)
    assert _llama_backend.amx_compiled()
    assert _llama_backend.model_params().use_extra_bufts is False
    plain_info = b"CPU : SSE3 = 1 | AVX512 = 1 | OPENMP = 1 | REPACK = 1 | "
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: plain_info)
    assert not _llama_backend.amx_compiled()
    assert _llama_backend.model_params().use_extra_bufts is True


def test_llama_cpp_is_built_without_amx_kernels() -> None:
    """The Makefile builds llama.cpp with -mno-amx-*: its system info must not list AMX (a
    second guard beside the model parameter; on a CPU without AMX it holds trivially)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    info = llama_cpp.llama_print_system_info().decode()
    assert "CPU :" in info, info
    assert "AMX" not in info, info


def test_default_threads_split_decode_from_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from engine_adapter.local._llama_backend import default_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default_threads() == (1, 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_threads() == (8, 16)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert default_threads() == (1, 2)


@pytest.mark.model
def test_llama_backend_uses_its_threads(llama_backend: Any) -> None:
    from engine_adapter.local._llama_backend import default_threads

    assert llama_backend.threads == default_threads()


@pytest.mark.model
def test_closed_llama_backend_refuses_to_forward(smollm2_tokenizer: Any) -> None:
    backend = load_backend("llama", n_ctx=256)
    assert int(torch.argmax(backend.forward(_prompt_ids(smollm2_tokenizer)))) >= 0
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        backend.forward([1])


@pytest.mark.model
@pytest.mark.parametrize("close", [False, True], ids=["never-closed", "closed"])
def test_a_script_exits_cleanly_with_or_without_closing_its_engine(close: bool) -> None:
    """A script that builds a LocalEngine and exits without closing it must not print a
    traceback from the model's release during interpreter teardown."""
    import subprocess
    import sys

    script = f"""
from engine_adapter import LocalEngine, load_backend, standard_evaluators
from engine_adapter.local._model_files import load_tokenizer
engine = LocalEngine(load_backend("llama", n_ctx=256), load_tokenizer(), standard_evaluators())
engine.backend.forward([1, 2, 3])
if {close}:
    with engine:
        pass
print("done")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    for bad in ("Traceback", "Exception ignored", "TypeError", "Error"):
        assert bad not in result.stderr, result.stderr
