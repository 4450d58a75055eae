"""Optional libraries behind the ``tracking``, ``hf`` and ``eval`` extras of pyproject.toml.

The lab runs without them; a command or option that needs one asks for it by name, in one line.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from lab.runtime.config import ConfigError

# extra: the modules it brings (what the import names), as pyproject.toml lists them
EXTRAS = {"tracking": ("tensorboard", "wandb"), "hf": ("transformers", "safetensors"), "eval": ("lm_eval",)}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def extra_of(module: str) -> str:
    return next(extra for extra, modules in EXTRAS.items() if module in modules)


def require(module: str, what: str) -> ModuleType:
    """``module`` imported, or ConfigError naming the extra that installs it."""
    if not installed(module):
        extra = extra_of(module)
        raise ConfigError(f"{what} needs {module}, from the {extra} extra: pip install -e '.[{extra}]' "
                          f"(make setup installs every extra)")
    return importlib.import_module(module)
