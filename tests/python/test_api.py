"""The package's public surface as a user sees it: version, typing marker, documented arguments."""
import inspect
import re
from pathlib import Path

import pytest

import moka
from moka.torch import MoE, moe_experts

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_projects():
    pyproject = (ROOT / "python" / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert moka.__version__ == version
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert re.search(r"project\(moka VERSION ([0-9.]+)", cmake).group(1) == version


def test_the_package_is_marked_typed():
    # scikit-build-core's wheel.packages copies the whole python/moka directory into the wheel.
    assert (ROOT / "python" / "moka" / "py.typed").is_file()
    assert 'wheel.packages = ["moka"]' in (ROOT / "python" / "pyproject.toml").read_text()


def documented(function) -> str:
    doc = inspect.getdoc(function)
    assert doc, f"{function.__qualname__} has no docstring"
    return doc


@pytest.mark.parametrize("function", [MoE, MoE.forward, MoE.route, MoE.apply_experts, moe_experts, MoE.from_hf])
def test_every_public_argument_is_documented_with_its_type(function):
    doc = documented(function)
    target = MoE.__init__ if function is MoE else function
    for name, parameter in inspect.signature(target).parameters.items():
        if name in ("self", "cls"):
            continue
        if parameter.kind is parameter.VAR_KEYWORD:
            assert f"**{name}" in doc, (function, name)
            continue
        assert re.search(rf"^\s+(\w+, )*{name}(, \w+)* \(", doc, re.M), f"{function.__qualname__}: {name}"


def test_the_exceptions_are_documented():
    doc = documented(MoE)
    for kind in ("TypeError", "ValueError", "moka.Error"):
        assert f"{kind}:" in doc


def test_group_and_path_are_keyword_only_and_the_shapes_positional():
    parameters = inspect.signature(MoE.__init__).parameters
    for name in ("hidden", "intermediate", "experts", "top_k", "shared_intermediate"):
        assert parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name in ("group", "path"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
