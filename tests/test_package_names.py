"""Our top-level import names must not be another installed distribution's.

transformers 5.25 made Hugging Face's `kernels` package a hard dependency and imports it as
`kernels`; our kernel package was called `kernels` too, so the checkout's directory shadowed it
and every transformers model class failed to import (CI, 2026-12-03: 26 failed, 164 errors).
The package is `tpllm_kernels` since. These checks fail on any such clash, whatever package a
future dependency brings."""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_DISTRIBUTION = "triton-tp-llm"
OUR_PACKAGES = sorted(p.name for p in ROOT.iterdir()
                      if (p / "__init__.py").exists() and p.name != "tests")


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-")


def test_the_package_list_is_what_pyproject_ships():
    assert set(OUR_PACKAGES) == {"backend", "client", "tpllm_kernels"}


@pytest.mark.parametrize("package", OUR_PACKAGES)
def test_no_other_distribution_installs_our_package_names(package):
    owners = {_normalized(d) for d in metadata.packages_distributions().get(package, [])}
    others = owners - {OUR_DISTRIBUTION}
    assert not others, (f"installed distribution(s) {sorted(others)} also provide the top-level "
                        f"package {package!r}; the checkout's {package}/ would shadow them")


@pytest.mark.parametrize("package", OUR_PACKAGES)
def test_our_names_import_from_this_checkout(package):
    module = importlib.import_module(package)
    assert Path(module.__file__).resolve().parent == ROOT / package


def test_transformers_hub_kernels_integration_imports():
    # The import that broke: it does `from kernels import ...` when Hugging Face's package is
    # installed, and must get that package, not ours.
    importlib.import_module("transformers.integrations.hub_kernels")
    import transformers

    assert transformers.LlamaForCausalLM.__name__ == "LlamaForCausalLM"
