"""An HF config directory vLLM can load with dummy weights, from a profile or a path.

``model_dir("Qwen3.5-0.8B")`` writes the profile's ``config.json`` into a fresh temporary
directory (vLLM wants a directory), ``stable_model_dir`` into the same directory every time
(vLLM's compile cache keys on the path); a directory with ``config.json`` is used as it is,
a ``config.json`` path gives its directory. Qwen3.5 profiles hold the text model only; vLLM
0.24's text-only class still builds the multimodal processor, so the model runs as
``Qwen3_5ForConditionalGeneration`` with images and video off (``limit_mm_per_prompt``),
with Qwen3.5-0.8B's vision tower config (research/models.md; weights are dummy anyway).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def is_multimodal_wrapper(cfg: dict) -> bool:
    """Qwen3.5's layout: a ``text_config`` inside (served by the multimodal class)."""
    return isinstance(cfg.get("text_config"), dict)


def build_config(cfg: dict) -> dict:
    """The config.json vLLM gets for a profile's config (Qwen3.5: the multimodal wrapper)."""
    if not is_multimodal_wrapper(cfg) or cfg.get("vision_config"):
        return cfg
    from transformers import Qwen3_5Config
    out = Qwen3_5Config(text_config=cfg["text_config"], vision_config={
        "depth": 12, "hidden_size": 768, "out_hidden_size": cfg["text_config"]["hidden_size"],
        "intermediate_size": 3072, "num_heads": 12}).to_dict()
    out["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return out


def model_dir(model: str, out: str | None = None) -> str:
    """A directory holding a ``config.json`` for ``model`` (profile name, directory with
    config.json, or a config.json path). Paths are returned as they are (their directory);
    a profile is written to ``out`` (created) or a fresh temporary directory."""
    given = _given_dir(model)
    if given is not None:
        return given
    cfg = _profile_config(model)
    d = out or tempfile.mkdtemp(prefix=f"{Path(model).name or 'model'}-")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _given_dir(model: str) -> str | None:
    """The directory of a ``model`` given as a directory with config.json or as a
    config.json path; None for anything else (a profile name)."""
    p = Path(model)
    if p.is_dir() and (p / "config.json").is_file():
        return str(p.resolve())
    if p.is_file() and p.name == "config.json":
        return str(p.resolve().parent)
    return None


def _profile_config(model: str) -> dict:
    """The config.json vLLM gets for the profile ``model`` (:func:`build_config`)."""
    from ..tune.workload import load_config
    return build_config(load_config(model)[1])


def model_cache_root() -> str:
    """Where :func:`stable_model_dir` keeps profiles' config directories:
    ``FLTUNE_MODEL_CACHE``, else ``~/.cache/fltune/models``."""
    return (os.environ.get("FLTUNE_MODEL_CACHE")
            or str(Path.home() / ".cache" / "fltune" / "models"))


def stable_model_dir(model: str, root: str | None = None) -> str:
    """:func:`model_dir` at the same path every time for the same config: a profile's
    ``config.json`` goes to ``<root>/<name>-<digest of the config>/`` (written only where it
    is missing or differs, through a rename, so concurrent runs never read half a file);
    a directory or ``config.json`` path is used as it is.

    Why: vLLM's compile cache is keyed by a hash of its config, and the model's path is
    part of it (``ModelConfig.compute_hash`` does not ignore ``model``). With a fresh
    directory per run every run compiled the model again, minutes on the H200 for an arm
    that routes its GEMMs (max-autotune), and ``start_state="loaded"`` then had to start it
    a second time; from the same path a later run loads what an earlier one compiled
    (session 29: a cold 10-minute call measured one repetition after its compiles)."""
    given = _given_dir(model)
    if given is not None:
        return given
    text = json.dumps(_profile_config(model), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "._-" else "_"
                   for c in (Path(model).name or "model"))
    d = os.path.join(root or model_cache_root(), f"{name}-{digest}")
    os.makedirs(d, exist_ok=True)
    target = os.path.join(d, "config.json")
    try:
        with open(target) as f:
            if f.read() == text:
                return d
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".config-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    return d


def config_of(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)
