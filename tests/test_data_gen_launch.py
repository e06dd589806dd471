"""``torchrun --nproc_per_node N -m data_gen``: each process labels the shard its rank names, on its own device, and
rank 0 merges them into the dataset one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from tiny_models import WORDS, make_pair

from accept_head.acceptance.labels import load_label_dataset
from accept_head.labelgen.run import config_for_rank, launcher_ranks, parse_config
from data_gen.cli import main

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int) -> Path:
    generator = torch.Generator().manual_seed(0)
    words = [w for w in WORDS if w.isalpha()]
    with path.open("w") as f:
        for row in range(n):
            picks = torch.randint(0, len(words), (3 + row % 4,), generator=generator).tolist()
            f.write(json.dumps({"instruction": f"{row} " + " ".join(words[i] for i in picks)}) + "\n")
    return path


def run_args(pair: tuple[Path, Path], prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--target.path", str(pair[0]), "--target.dtype", "float32",
        "--draft.path", str(pair[1]), "--draft.dtype", "float32",
        "--prompts", json.dumps([{"path": str(prompts), "field": "instruction"}]),
        "--output_dir", str(out),
        "--max_new_tokens", "10", "--batch_size", "2", "--k_max", "3", "--seed", "5", "--progress", "false",
        *extra,
    ]  # fmt: skip


def column_bytes(column: pa.ChunkedArray) -> bytes:
    """The values of a (possibly nested list) numeric column and the lengths of each list level, as raw bytes."""
    array = column.combine_chunks()
    parts = []
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        parts.append(np.diff(array.offsets.to_numpy()).tobytes())
        array = array.flatten()
    parts.append(array.to_numpy(zero_copy_only=False).tobytes())
    return b"".join(parts)


def test_launcher_ranks_read_torchruns_environment() -> None:
    assert launcher_ranks({}) is None and launcher_ranks({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launcher_ranks({"WORLD_SIZE": "4", "RANK": "6", "LOCAL_RANK": "2"}) == (6, 4, 2)
    with pytest.raises(ValueError, match="RANK is not set"):
        launcher_ranks({"WORLD_SIZE": "2"})


def test_each_rank_gets_its_shard_and_its_own_gpu(tmp_path: Path) -> None:
    base = ["--target.path", "t", "--draft.path", "d", "--prompts", "[{path: humaneval}]", "--output_dir", "o"]
    cfg = parse_config([*base, "--target.device", "cuda", "--draft.device", "cuda:0"])
    ranked = config_for_rank(cfg, rank=5, world=8, local_rank=1)
    assert ranked.shard == "5/8" and ranked.shard_index() == (5, 8)
    assert (ranked.target.device, ranked.draft.device) == ("cuda:1", "cuda:1")
    assert (cfg.target.device, cfg.shard) == ("cuda", None)  # the config itself is left alone
    on_cpu = config_for_rank(parse_config(base), rank=1, world=2, local_rank=1)
    assert (on_cpu.target.device, on_cpu.draft.device) == ("cpu", "cpu")
    with pytest.raises(ValueError, match=r"--shard=0/2 under a launcher.*drop --shard"):
        config_for_rank(parse_config([*base, "--shard", "0/2"]), rank=0, world=2, local_rank=0)


@pytest.mark.slow
@pytest.mark.parametrize("label_mode", ["rollout", "sample"])
def test_two_launched_processes_equal_one_process_byte_for_byte(tmp_path: Path, label_mode: str) -> None:
    pair = make_pair(tmp_path / "pair")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 7)  # 4 batches of 2: two per rank
    # One torch thread in both runs: torchrun gives each rank one, and another thread count changes the float
    # reduction order (a last-bit difference in target_logp on this 2-core machine with torch's default of 2).
    extra = ("--label_mode", label_mode, "--threads", "1")
    threads = torch.get_num_threads()
    try:
        main(run_args(pair, prompts, tmp_path / "one", *extra))
    finally:
        torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "data_gen"]
    done = subprocess.run(
        [*launch, *run_args(pair, prompts, tmp_path / "two", *extra)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "two" / "shards").iterdir()) == ["0-of-2", "1-of-2"]
    one, _ = load_label_dataset(tmp_path / "one")
    two, meta = load_label_dataset(tmp_path / "two")
    assert meta["stats"]["rows"] == len(one) == 7
    assert one.column_names == two.column_names
    assert one["prompt_id"] == two["prompt_id"]
    for name in one.column_names:
        if name not in ("prompt_id", "source"):
            assert column_bytes(one.data.column(name)) == column_bytes(two.data.column(name)), name
