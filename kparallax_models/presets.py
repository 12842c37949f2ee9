"""Model presets: the JSON files in ``kparallax_models/configs/`` (``configs/`` at the repository root) (one per preset, ``"model"`` says which model it configures).

``--config`` in the training scripts takes a preset name (``lm1b_small``) or a path to such a JSON file.
"""

import json
import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # also ./configs in the repository


def load(model, name_or_path):
    """The fields of preset ``name_or_path`` for ``model`` ("lm1b" or "resnet"), without the ``model`` key."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(CONFIG_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise ValueError(f"Unknown {model} preset {name_or_path!r}; choose one of {names(model)} or give a path to a "
                         f"JSON config. Received: {name_or_path!r}.")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.pop("model", None) != model:
        raise ValueError(f"{path} is not a {model} config (its 'model' field says otherwise). Received: {path}.")
    return data


def names(model):
    out = []
    for file in sorted(os.listdir(CONFIG_DIR)):
        if file.endswith(".json"):
            with open(os.path.join(CONFIG_DIR, file), encoding="utf-8") as f:
                if json.load(f).get("model") == model:
                    out.append(file[:-5])
    return out
