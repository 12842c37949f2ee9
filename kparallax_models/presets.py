"""Model presets: the JSON files in ``kparallax_models/configs/`` (``configs/`` at the repository root) (one per preset, ``"model"`` says which model it configures).

``--config`` in the training scripts takes a preset name (``lm1b_small``) or a path to such a JSON file.
"""

import dataclasses
import json
import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # also ./configs in the repository


MODELS = ("lm1b", "resnet")


def load(model, name_or_path):
    """The fields of preset ``name_or_path`` for ``model`` ("lm1b" or "resnet"), without the ``model`` key."""
    path = _path(name_or_path)
    if not os.path.isfile(path):
        raise ValueError(f"Unknown {model} preset {name_or_path!r}; choose one of {names(model)} or give a path to a "
                         f"JSON config. Received: {name_or_path!r}.")
    data = _read(path, model)
    if data.get("model") != model:
        raise ValueError(f"Config {path} must say which model it configures with \"model\": \"{model}\" (the "
                         f"presets in {CONFIG_DIR} do). Received: \"model\": {json.dumps(data.get('model'))}.")
    return {k: v for k, v in data.items() if k != "model"}


def model_of(name_or_path):
    """Which of ``MODELS`` the preset or JSON config ``name_or_path`` configures (its ``model`` field)."""
    path = _path(name_or_path)
    if not os.path.isfile(path):
        raise ValueError(f"Unknown preset {name_or_path!r}; choose one of {names()} or give a path to a JSON config. "
                         f"Received: {name_or_path!r}.")
    model = _read(path, "lm1b").get("model")
    if model not in MODELS:
        raise ValueError(f"Config {path} must say which model it configures with \"model\": one of {list(MODELS)}. "
                         f"Received: \"model\": {json.dumps(model)}.")
    return model


def _path(name_or_path):
    return name_or_path if name_or_path.endswith(".json") else os.path.join(CONFIG_DIR, f"{name_or_path}.json")


def _read(path, model):
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not one (``model`` for the example)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"Config {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}. "
                             f"Fix the file (the presets in {CONFIG_DIR} show the format). Received: {path}.") from None
    if not isinstance(data, dict):
        kind = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(data), "null")
        raise ValueError(f"Config {path} must hold one JSON object of fields ({{\"model\": \"{model}\", ...}}, as the "
                         f"presets in {CONFIG_DIR}). Received: a JSON {kind}.")
    return data


def check_fields(config_class, name_or_path, fields):
    """Raises a ``ValueError`` naming the fields of ``fields`` that ``config_class`` (a dataclass) does not have."""
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"Config {name_or_path!r} has field(s) that {config_class.__name__} does not know: fix or "
                         f"drop them; its fields are {sorted(known)}. Received: {unknown}.")


def names(model=None):
    """The presets in ``CONFIG_DIR`` (of ``model`` only, if given)."""
    out = []
    for file in sorted(os.listdir(CONFIG_DIR)):
        if file.endswith(".json"):
            with open(os.path.join(CONFIG_DIR, file), encoding="utf-8") as f:
                if model is None or json.load(f).get("model") == model:
                    out.append(file[:-5])
    return out
