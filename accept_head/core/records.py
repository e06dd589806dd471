"""What every measured record carries: the machine it was measured on (:func:`machine_info`) and sorted JSON."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from . import __version__


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The first processor of ``cpuinfo``: its model name, family/model numbers (``"25/1"``: AMD Zen 3 "Milan";
    ``"25/17"``: Zen 4 "Genoa" — both print "AMD EPYC" on some hosts) and which bf16 flags it has. Empty off Linux."""
    try:
        lines = Path(cpuinfo).read_text().split("\n\n", 1)[0].splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", ""),
        "cpu_family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
        "cpu_bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"}),
    }


def machine_info() -> dict:
    """Where the numbers were measured: the CPU (:func:`cpu_identity`), whether oneDNN multiplies bf16 there (False on
    AVX2-only CPUs, where bf16 products are emulated), the libraries."""
    cpu = {"cpu": platform.processor() or ""} | cpu_identity()
    import transformers

    return {
        **cpu,
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }


def where_measured(model: torch.nn.Module, cpuinfo: str = "/proc/cpuinfo") -> str:
    """One line naming where timings of ``model`` are taken: a CUDA card by name, a CPU by its model, family/model
    numbers and torch capability (:func:`cpu_identity`), with the threads and ``model``'s dtype — what a cost model
    recorded in a bundle needs to say, since another machine prices draft and target passes differently."""
    param = next(model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    if param.device.type == "cuda":
        return f"measured on {torch.cuda.get_device_name(param.device)}, {dtype}"
    cpu = cpu_identity(cpuinfo)
    name = cpu.get("cpu") or platform.processor() or "an unidentified CPU"
    family = f" (family/model {cpu['cpu_family_model']})" if cpu else ""
    return (
        f"measured on {param.device.type}: {name}{family}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, {dtype}"
    )


def command_line() -> str:
    """The command that is running, as a user would type it (``python -m eval ...`` for this CLI)."""
    import shlex

    if not sys.argv:
        return ""
    program = Path(sys.argv[0])
    head = "python -m eval" if program.name == "__main__.py" and program.parent.name == "eval" else program.name
    return " ".join([head, *(shlex.quote(arg) for arg in sys.argv[1:])])


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` as sorted, indented JSON (non-finite floats become null / "inf")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=True) + "\n")
    return path


def code_version() -> dict[str, Any]:
    """Package version and, when the code sits in a git checkout, its commit and whether it has local changes."""
    info: dict[str, Any] = {"package": "accept-head", "version": __version__, "git_commit": None}
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        commit = git("rev-parse", "HEAD")
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            info["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info
