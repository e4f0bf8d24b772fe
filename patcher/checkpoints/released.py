"""DeepSeek's released config.json files (patcher/data/released/), what `dsadapt model make --like` writes.

Values are the released files' own (docs/models.md, "Released checkpoints", says where each was
read and checked; a bookkeeping key that could not be checked, V2's ``transformers_version``, is
left out). Only ``num_hidden_layers`` (and ``num_nextn_predict_layers`` with ``--mtp``) change
when a model is made with fewer layers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from patcher.base.errors import UsageError

#: The Hugging Face repository each config.json was released in; the files themselves are
#: patcher/data/released/<name>.json (keys sorted, values as released).
REPOS = {"deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2": "deepseek-ai/DeepSeek-V2",
         "deepseek-v3": "deepseek-ai/DeepSeek-V3"}
_DATA = Path(__file__).resolve().parents[1] / "data" / "released"


def _load(name: str) -> dict[str, Any]:
    return json.loads((_DATA / f"{name}.json").read_text(encoding="utf-8"))


#: name -> the released config.json, as data
RELEASED: dict[str, dict[str, Any]] = {name: _load(name) for name in REPOS}


def released_config(like: str, layers: int | None = None, mtp: int | None = None) -> dict[str, Any]:
    """The released config.json of `like` (a copy), with `layers` decoder layers and `mtp` MTP
    modules (default: as released) when given."""
    if like not in RELEASED:
        raise UsageError(f"unknown model {like!r}", hint=f"one of: {', '.join(RELEASED)}")
    config = copy.deepcopy(RELEASED[like])
    full = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise UsageError(f"--layers {layers}: {REPOS[like]} has {full} decoder layers",
                             hint=f"pass --layers between 1 and {full}")
        config["num_hidden_layers"] = layers
    if mtp is not None:
        if mtp < 0:
            raise UsageError(f"--mtp {mtp}: must be 0 or more", hint="pass --mtp 0 to leave the MTP module out")
        if mtp and "num_nextn_predict_layers" not in config:
            raise UsageError(f"--mtp {mtp}: {REPOS[like]} has no multi-token-prediction module",
                             hint="MTP modules are DeepSeek-V3's (num_nextn_predict_layers)")
        if "num_nextn_predict_layers" in config:
            config["num_nextn_predict_layers"] = mtp
    return dict(sorted(config.items()))
