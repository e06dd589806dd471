"""Every bad input a user can cause fails with a clear error before any work is done or anything is returned.

Decoder errors are checked to happen before either model runs (stub forward counters stay at 0); bundle errors
before any model is loaded, leaving the bundle folder untouched.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import TableLM, make_llama, make_pair, make_tokenizer

import accept_head.models.loading as loading
import accept_head.specdecpp.bundle as bundle_module
from accept_head import (
    AcceptanceHead,
    FixedK,
    HeadThreshold,
    ModelSpec,
    SpecDecPP,
    autoregressive_generate,
    check_same_tokenizer,
    speculative_generate,
)
from accept_head.acceptance.head import HEAD_WEIGHTS
from accept_head.specdecpp.bundle import CONFIG_NAME

VOCAB, POSITIONS = 8, 16


@pytest.fixture
def stubs() -> tuple[TableLM, TableLM]:
    generator = torch.Generator().manual_seed(0)
    return (
        TableLM(torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)),
        TableLM(torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)),
    )


def head_for(model: torch.nn.Module, extra: int = 0) -> AcceptanceHead:
    return AcceptanceHead(model.config.hidden_size + extra, depth=1)


def assert_untouched(*models: TableLM) -> None:
    assert [m.calls for m in models] == [0] * len(models), "a model ran before the error was raised"


# ---- tokenizer mismatch -------------------------------------------------------------------------------------------


def test_tokenizers_of_different_vocabularies_are_refused_naming_both_models() -> None:
    with pytest.raises(ValueError, match=r"'my-target'.*'my-draft'.*vocab size") as err:
        check_same_tokenizer(make_tokenizer(), make_tokenizer(extra_words=("zz",)), "my-target", "my-draft")
    assert "pick a draft" in str(err.value)


def test_tokenizers_with_different_special_tokens_are_refused() -> None:
    other = make_tokenizer()
    other.eos_token = "<bos>"
    with pytest.raises(ValueError, match="eos_token_id 3 vs 2"):
        check_same_tokenizer(make_tokenizer(), other)


def test_bundle_whose_draft_tokenizes_differently_is_refused_before_loading_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target_dir, draft_dir = make_pair(tmp_path)
    # Same vocabulary size and special tokens, but "f" (in the probe text) is a word only for the target.
    make_tokenizer(target_dir, extra_words=("f",))
    make_tokenizer(draft_dir, extra_words=("zz",))
    draft = make_llama(seed=1, hidden_size=16, num_layers=1)
    SpecDecPP(
        target=make_llama(seed=0, num_layers=3),
        draft=draft,
        head=head_for(draft),
        threshold=0.5,
        target_spec=ModelSpec(str(target_dir), dtype="float32"),
        draft_spec=ModelSpec(str(draft_dir), dtype="float32"),
    ).save_pretrained(tmp_path / "bundle")
    monkeypatch.setattr(bundle_module, "load_model", lambda spec: pytest.fail(f"loaded {spec.path} before the check"))
    with pytest.raises(ValueError, match=r"do not share a tokenizer: probe text") as err:
        SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert str(target_dir) in str(err.value) and str(draft_dir) in str(err.value)


def test_pair_with_different_vocab_sizes_is_refused(stubs) -> None:
    target, _ = stubs
    draft = TableLM(torch.zeros(POSITIONS, VOCAB + 1, VOCAB + 1))
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, draft, [1, 2], FixedK(2), max_new_tokens=4)
    assert_untouched(target, draft)


# ---- head, threshold, candidate bounds ------------------------------------------------------------------------------


def test_head_of_another_hidden_size_than_the_draft_is_refused(stubs) -> None:
    target, draft = stubs
    head = head_for(draft, extra=1)
    with pytest.raises(ValueError, match=f"hidden size {draft.config.hidden_size + 1}"):
        speculative_generate(target, draft, [1, 2], HeadThreshold(head, 0.5), max_new_tokens=4)
    with pytest.raises(ValueError, match=f"head hidden_size={draft.config.hidden_size + 1}"):
        SpecDecPP(target=target, draft=draft, head=head, threshold=0.5)
    assert_untouched(target, draft)


@pytest.mark.parametrize("threshold", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_threshold_outside_the_open_unit_interval_is_refused(stubs, threshold: float) -> None:
    target, draft = stubs
    head = head_for(draft)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        HeadThreshold(head, threshold)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        SpecDecPP(target=target, draft=draft, head=head, threshold=threshold)
    valid = SpecDecPP(target=target, draft=draft, head=head, threshold=0.5)
    with pytest.raises(ValueError, match=f"threshold={threshold}"):
        valid.generate([1, 2], max_new_tokens=4, threshold=threshold)
    assert_untouched(target, draft)


@pytest.mark.parametrize("k", [0, -3, 2.5])
def test_fixed_k_below_one_or_fractional_is_refused(k) -> None:
    with pytest.raises(ValueError, match=f"k={k}"):
        FixedK(k)


def test_max_candidates_below_min_candidates_is_refused(stubs) -> None:
    target, draft = stubs
    head = head_for(draft)
    with pytest.raises(ValueError, match="max_candidates=3 must be >= min_candidates=5"):
        HeadThreshold(head, 0.5, min_candidates=5, max_candidates=3)
    with pytest.raises(ValueError, match="max_candidates=3 must be >= min_candidates=5"):
        SpecDecPP(target=target, draft=draft, head=head, threshold=0.5, min_candidates=5, max_candidates=3)
    with pytest.raises(ValueError, match="max_candidates=0"):
        HeadThreshold(head, 0.5, min_candidates=0, max_candidates=0)


# ---- batch and context ----------------------------------------------------------------------------------------------


def test_batch_larger_than_one_raises_not_implemented(stubs) -> None:
    target, draft = stubs
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(NotImplementedError, match="batch size 1"):
        speculative_generate(target, draft, batch, FixedK(2), max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="batch size 1"):
        autoregressive_generate(target, batch, max_new_tokens=4)
    bundle = SpecDecPP(target=target, draft=draft, head=head_for(draft), threshold=0.5)
    for prompt in (batch, batch.tolist()):
        with pytest.raises(NotImplementedError, match="one prompt at a time"):
            bundle.generate(prompt, max_new_tokens=4)
    assert_untouched(target, draft)


def test_prompts_that_are_not_token_ids_of_the_vocabulary_are_refused(stubs) -> None:
    target, draft = stubs
    bundle = SpecDecPP(target=target, draft=draft, head=head_for(draft), threshold=0.5, tokenizer=make_tokenizer())
    cases = [
        (torch.tensor([[1.5, 2.0]]), "must hold integer token ids, not torch.float32"),
        (torch.ones(1, 2, 3, dtype=torch.long), r"must have shape \(T,\) or \(1, T\); got \(1, 2, 3\)"),
        ([1, 2.5], r"must hold integers; got 2.5 \(float\)"),
        ([1, VOCAB], f"token id {VOCAB} is outside the target's vocabulary of {VOCAB} ids"),
        (torch.tensor([-1, 2]), "token id -1 is outside"),
        ([{"role": "user"}], "chat message 0 is .*needs a 'role' and a 'content'"),
        ([{"role": "user", "content": "hi"}, {"content": "x"}], "chat message 1"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            bundle.generate(prompt, max_new_tokens=4)
    assert bundle.encode(torch.tensor([[1, 2]])) == bundle.encode([1, 2]) == [1, 2]
    assert_untouched(target, draft)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_zero_is_refused(stubs, temperature: float) -> None:
    target, draft = stubs
    with pytest.raises(ValueError, match=f"temperature={temperature} must be a finite number >= 0"):
        autoregressive_generate(target, [1, 2], max_new_tokens=4, temperature=temperature)
    bundle = SpecDecPP(target=target, draft=draft, head=head_for(draft), threshold=0.5)
    for tree in (False, True):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            bundle.generate([1, 2], max_new_tokens=4, temperature=temperature, tree=tree)
    assert_untouched(target, draft)


def test_tree_must_be_a_bool_and_seed_and_generator_are_not_both_given(stubs) -> None:
    target, draft = stubs
    bundle = SpecDecPP(target=target, draft=draft, head=head_for(draft), threshold=0.5)
    with pytest.raises(ValueError, match="tree='no' must be True"):
        bundle.generate([1, 2], max_new_tokens=4, tree="no")
    with pytest.raises(ValueError, match="tree=1 must be True"):
        bundle.decoding_rule(tree=1)
    with pytest.raises(ValueError, match="seed=0 and generator= were both given"):
        bundle.generate([1, 2], max_new_tokens=4, seed=0, generator=torch.Generator())
    assert_untouched(target, draft)


def test_prompt_longer_than_the_context_is_refused(stubs) -> None:
    target, draft = stubs
    prompt = list(range(VOCAB)) * 2  # 16 tokens = the stubs' whole context
    with pytest.raises(ValueError, match="The prompt has 16 tokens but TableLM has a context of 16"):
        speculative_generate(target, draft, prompt, FixedK(2), max_new_tokens=4)
    with pytest.raises(ValueError, match="context of 16"):
        autoregressive_generate(target, prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="context of 16"):
        SpecDecPP(target=target, draft=draft, head=head_for(draft), threshold=0.5).generate(prompt)
    assert_untouched(target, draft)


def test_prompt_longer_than_a_llama_context_is_refused() -> None:
    target = make_llama(max_position_embeddings=8)
    with pytest.raises(ValueError, match="The prompt has 9 tokens but LlamaForCausalLM has a context of 8"):
        speculative_generate(target, target, list(range(5, 14)), FixedK(2), max_new_tokens=4)


def test_empty_prompt_and_negative_budget_are_refused(stubs) -> None:
    target, draft = stubs
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, draft, [], FixedK(2), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        speculative_generate(target, draft, [1], FixedK(2), max_new_tokens=-1)
    assert_untouched(target, draft)


# ---- broken bundle folders ------------------------------------------------------------------------------------------


@pytest.fixture
def bundle_dir(stubs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A valid bundle folder whose model specs must never be loaded: a broken bundle fails before any loading."""
    target, draft = stubs
    SpecDecPP(
        target=target,
        draft=draft,
        head=head_for(draft),
        threshold=0.5,
        target_spec=ModelSpec("never/loaded/target"),
        draft_spec=ModelSpec("never/loaded/draft"),
    ).save_pretrained(tmp_path / "bundle")

    def refuse_to_load(spec):
        raise AssertionError(f"a broken bundle must fail before loading {spec.path}")

    monkeypatch.setattr(bundle_module, "load_model", refuse_to_load)
    return tmp_path / "bundle"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (a bundle also holds ``custom_generate/generate.py``) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bundle_without_head_weights_names_the_missing_file(bundle_dir: Path) -> None:
    (bundle_dir / HEAD_WEIGHTS).unlink()
    before = snapshot(bundle_dir)
    with pytest.raises(FileNotFoundError, match=str(bundle_dir / HEAD_WEIGHTS)):
        SpecDecPP.from_pretrained(bundle_dir)
    assert snapshot(bundle_dir) == before


def test_bundle_with_unreadable_head_weights_names_the_file(bundle_dir: Path) -> None:
    (bundle_dir / HEAD_WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"{bundle_dir / HEAD_WEIGHTS} is not a readable safetensors file"):
        SpecDecPP.from_pretrained(bundle_dir)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format_version": 1, "threshold": ', "is not valid JSON"),
        ("[1, 2, 3]", "must hold a JSON object"),
        ('{"format_version": 1, "head": {"hidden_size": 4, "depth": 0}}', "lacks the required key 'threshold'"),
    ],
)
def test_corrupt_config_json_names_the_file(bundle_dir: Path, content: str, message: str) -> None:
    (bundle_dir / CONFIG_NAME).write_text(content)
    before = snapshot(bundle_dir)
    with pytest.raises(ValueError, match=message) as err:
        SpecDecPP.from_pretrained(bundle_dir)
    assert str(bundle_dir / CONFIG_NAME) in str(err.value)
    assert snapshot(bundle_dir) == before


def test_bundle_without_config_json_is_not_a_bundle(bundle_dir: Path) -> None:
    (bundle_dir / CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="not a SpecDecPP bundle"):
        SpecDecPP.from_pretrained(bundle_dir)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SpecDecPP.from_pretrained(bundle_dir / "missing")


@pytest.mark.parametrize(
    ("version", "fix"),
    [(99, "Upgrade accept_head"), (0, "Upgrade"), (None, "Upgrade"), ("1", "write it as the number")],
)
def test_unknown_format_version_is_refused(bundle_dir: Path, version, fix: str) -> None:
    config = json.loads((bundle_dir / CONFIG_NAME).read_text())
    config["format_version"] = version
    (bundle_dir / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"format_version={version!r}.*{fix}"):
        SpecDecPP.from_pretrained(bundle_dir)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("threshold", "0.8", "threshold='0.8' must be a number"),
        ("greedy_threshold", True, "greedy_threshold=True must be a number"),
        ("min_candidates", "1", "min_candidates='1' must be an integer"),
        ("context_row", 1.5, "context_row=1.5 must be an integer"),
        ("temperature", "1.0", "temperature='1.0' must be a number"),
        ("temperature", -1, "temperature=-1 must be a finite number >= 0"),
        ("head", 3, "head=3 must be an object"),
        ("tree", [1], r"tree=\[1\] must be an object"),
        ("unscored", 1, "unscored=1 must be a string"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused_naming_the_file(bundle_dir: Path, key, value, message) -> None:
    config = json.loads((bundle_dir / CONFIG_NAME).read_text())
    config[key] = value
    (bundle_dir / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        SpecDecPP.from_pretrained(bundle_dir)
    assert str(bundle_dir / CONFIG_NAME) in str(err.value)


def test_unknown_head_config_keys_warn_and_a_file_is_not_a_bundle_folder(bundle_dir: Path, stubs) -> None:
    config = json.loads((bundle_dir / CONFIG_NAME).read_text())
    config["head"]["dept"] = 3
    (bundle_dir / CONFIG_NAME).write_text(json.dumps(config))
    target, draft = stubs
    with pytest.warns(UserWarning, match=r"head config: ignoring unknown keys \['dept'\]"):
        SpecDecPP.from_pretrained(bundle_dir, target=target, draft=draft, tokenizer=make_tokenizer())
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        SpecDecPP.from_pretrained(bundle_dir / CONFIG_NAME)


def test_machine_info_tells_cpus_of_one_name_apart(tmp_path) -> None:
    """Zen 3 and Zen 4 hosts both print "AMD EPYC": the family/model numbers and bf16 flags of the first processor
    tell them apart in every page that records the machine."""
    from accept_head.core.records import cpu_identity, machine_info

    cpuinfo = tmp_path / "cpuinfo"
    first = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    first += "flags\t\t: avx2 avx512f avx512_bf16\n"
    second = "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: other\nflags\t\t: avx2 amx_bf16\n"
    cpuinfo.write_text(first + "\n" + second)
    want = {"cpu": "AMD EPYC", "cpu_family_model": "25/17", "cpu_bf16_flags": ["avx512_bf16"]}
    assert cpu_identity(str(cpuinfo)) == want
    cpuinfo.write_text(first.replace("17", "1").replace(" avx512f avx512_bf16", ""))
    assert cpu_identity(str(cpuinfo))["cpu_family_model"] == "25/1"
    assert cpu_identity(str(cpuinfo))["cpu_bf16_flags"] == []
    assert cpu_identity(str(tmp_path / "missing")) == {}
    info = machine_info()
    assert isinstance(info["onednn_bf16"], bool) and "cpu_capability" in info


def test_a_measured_cost_model_names_the_cpu_its_capability_and_the_dtype(tmp_path) -> None:
    """A bundle's cost model prices passes on one machine: its source line says which, and in which dtype."""
    from accept_head.core.records import where_measured

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n")
    line = where_measured(torch.nn.Linear(2, 2).to(torch.bfloat16), str(cpuinfo))
    capability = torch.backends.cpu.get_cpu_capability()
    assert (
        line
        == f"measured on cpu: AMD EPYC (family/model 25/17), {capability}, {torch.get_num_threads()} threads, bfloat16"
    )
    assert where_measured(torch.nn.Linear(2, 2), str(tmp_path / "missing")).endswith(", float32")


def test_bf16_on_a_cpu_without_bf16_units_warns_and_names_the_fix(tmp_path, monkeypatch) -> None:
    make_llama(tmp_path / "model")
    cpuinfo = tmp_path / "cpuinfo"
    read_flags = loading.cpu_bf16_units.__wrapped__  # the uncached reader
    monkeypatch.setattr(loading, "cpu_bf16_units", lambda: read_flags(str(cpuinfo)))
    monkeypatch.setattr(loading, "bf16_emulated", lambda: False)  # where float32 rows are on, nothing to warn about

    def emulation_warnings(dtype: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loading.load_model(ModelSpec(path=str(tmp_path / "model"), dtype=dtype))
        return [str(w.message) for w in caught if "bf16 matrix units" in str(w.message)]

    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")  # AVX-512 without BF16 (e.g. Skylake-X)
    (message,) = emulation_warnings("bfloat16")
    assert "model" in message and "dtype='float32'" in message and "float32_rows=True" in message
    assert emulation_warnings("float32") == []
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert emulation_warnings("bfloat16") == []
    cpuinfo.unlink()  # unknown (not Linux): no warning
    assert read_flags(str(cpuinfo)) is None and emulation_warnings("bfloat16") == []
