"""``python -m eval decode_speed`` on a tiny target: the three ways of decoding agree, and every timing is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import WORDS, make_llama, make_tokenizer

from accept_head.evaluation.decode_speed import forward_loop
from eval.__main__ import main


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decode-speed")
    make_llama(root / "target", tokenizer=make_tokenizer(), seed=0)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(3):
            f.write(json.dumps({"instruction": " ".join(WORDS[i * 5 : i * 5 + 6])}) + "\n")
    return root


def test_forward_loop_is_greedy_decoding() -> None:
    from accept_head import autoregressive_generate

    model = make_llama(seed=0)
    prompt = [2, 10, 11, 12]
    expected = autoregressive_generate(model, prompt, 12, temperature=0).sequences[0, len(prompt) :].tolist()
    assert forward_loop(model, torch.tensor([prompt]), 12) == expected


def test_decode_speed_times_three_decoders_that_agree(target_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "speed"
    argv = ["decode_speed", "--target.path", str(target_dir / "target"), "--target.dtype", "float32"]
    argv += ["--prompts", json.dumps([{"path": str(target_dir / "prompts.jsonl")}]), "--prompt_mode", "raw"]
    argv += ["--max_new_tokens", "6", "--repeats", "2", "--warmup", "1", "--output_dir", str(out)]
    payload = main(argv)
    stored = json.loads((out / "decode_speed.json").read_text())
    assert stored["results"].keys() == {"autoregressive", "generate", "forward_loop"}
    assert stored["greedy_identical"] == {"same": 6, "decodes": 6}  # 3 prompts x 2 repeats, autoregressive = HF
    assert stored["prompts"] == 3 and stored["device"] == "cpu"
    for result in stored["results"].values():
        assert result["tokens"] > 0 and result["seconds"] > 0 and result["cold_s"] > 0
        assert result["median_ms_per_token"] > 0
    assert stored["results"]["forward_loop"]["tokens"] == 3 * 2 * 6  # no EOS stop: every decode runs to the end
    per_token = {name: r["median_ms_per_token"] for name, r in stored["results"].items()}
    assert payload["autoregressive_over_generate"] == pytest.approx(per_token["autoregressive"] / per_token["generate"])
    assert "autoregressive_generate / generate" in capsys.readouterr().out


def test_decode_speed_refuses_empty_settings(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["decode_speed", "--repeats", "0", "--output_dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2 and "repeats >= 1" in capsys.readouterr().err
