"""The sdist of python/ carries what its build needs: moka's C++ tree in moka-cpp/, where
python/CMakeLists.txt looks first, so `pip wheel moka-0.1.0.tar.gz` builds away from the checkout
(building it takes a minute: docs/PYTHON.md has the commands; here only its contents)."""
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdist_holds_the_package_and_every_folder_the_root_build_adds(tmp_path):
    build = f"from scikit_build_core.build import build_sdist; build_sdist({str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", build], cwd=ROOT / "python", check=True, capture_output=True)
    (sdist,) = tmp_path.glob("moka-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "CMakeLists.txt", "src/moka_ext.cpp", "moka/torch.py", "moka/py.typed"} <= names
    root_cmake = (ROOT / "CMakeLists.txt").read_text()
    # The folders the root CMakeLists.txt adds outside the tests, and the files it includes.
    folders = set(re.findall(r"^add_subdirectory\((\w+)\)", root_cmake, re.M)) - {"tests"}
    assert folders == {"src", "tools"}, "a new folder in the root build: add it to sdist.force-include"
    includes = re.findall(r"include\((cmake/[\w.]+)\)", root_cmake)
    needed = ["CMakeLists.txt", "include/moka/moka.hpp", "scripts/fetch_cutlass.sh", *includes,
              *(f"{folder}/CMakeLists.txt" for folder in folders)]
    for path in needed:
        assert f"moka-cpp/{path}" in names, path
    sources = {str(p.relative_to(ROOT)) for folder in ("src", "include", "tools")
               for p in (ROOT / folder).rglob("*") if p.is_file()}
    assert sources <= {name.removeprefix("moka-cpp/") for name in names}
