"""Packaging: kernels and recipes live inside the specbatch package, never top-level (a top-level
`kernels` would shadow the Hugging Face package of that name), and the console script works."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return p


def test_kernels_only_under_the_specbatch_namespace(tmp_path):
    # -P -E: no cwd / PYTHONPATH on sys.path, just what is installed
    code = """
import importlib.util, json, sys
import specbatch, specbatch.kernels, specbatch.cli
try:
    import kernels
    top = kernels.__file__
except ModuleNotFoundError:
    top = None
print(json.dumps({"top": top, "sub": specbatch.kernels.__file__, "in_modules": "kernels" in sys.modules}))
"""
    for cwd in (tmp_path, REPO):
        got = json.loads(_python(code, cwd, "-P", "-E").stdout)
        assert got["top"] is None, f"`import kernels` found {got['top']}"
        assert not got["in_modules"]
        assert Path(got["sub"]).name == "__init__.py"
        assert Path(got["sub"]).parent.name == "kernels"


def test_transformers_loads_and_runs_with_specbatch_imported(tiny_model):
    import specbatch.cli  # noqa: F401
    import specbatch.engine  # noqa: F401
    import specbatch.kernels  # noqa: F401
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = torch.tensor([tok("def add(a, b):")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert transformers.__version__


def test_checkout_root_does_not_shadow_hf_kernels():
    code = """
import sys
import specbatch.cli
from transformers.utils.import_utils import is_kernels_available
is_kernels_available()   # what transformers asks when it loads a model
m = sys.modules.get("kernels")
print(getattr(m, "__file__", None) if m is not None else "")
"""
    shadow = _python(code, REPO).stdout.strip()
    assert not shadow.startswith(str(REPO)), shadow


def test_builtin_recipes_are_package_resources():
    from specbatch.recipe import builtin_recipes, load_recipe, parse_recipe

    root = files("specbatch.recipes")
    yamls = {e.name.rsplit(".", 1)[0]: e for e in root.iterdir() if e.name.endswith((".yaml", ".yml"))}
    assert "vanilla" in yamls
    assert sorted(yamls) == builtin_recipes()
    for name, entry in yamls.items():
        data = yaml.safe_load(entry.read_text(encoding="utf-8"))
        assert parse_recipe(data, name).to_dict() == load_recipe(name).to_dict()
    assert load_recipe("vanilla").source == "<builtin>/vanilla.yaml"


def test_console_script(tmp_path):
    exe = shutil.which("specbatch") or shutil.which("specbatch", path=os.path.dirname(sys.executable))
    assert exe, "the `specbatch` console script is not installed"
    assert Path(exe).parent == Path(sys.executable).parent, exe
    p = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for command in ("run", "recipes", "inspect"):
        assert command in p.stdout
    p = subprocess.run([exe, "recipes", "vanilla"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["algorithm"] == "vanilla"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources (the working tree gets no build/ or egg-info)."""
    d = tmp_path_factory.mktemp("wheel")
    src = d / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "specbatch", src / "specbatch", ignore=ignore)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(d / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "No module named pip" in p.stderr:
        pytest.skip("pip is not available")
    assert p.returncode == 0, p.stderr
    (whl,) = glob.glob(str(d / "dist" / "*.whl"))
    return Path(whl)


@pytest.mark.slow
def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert top == {"specbatch"}
    # every package in the source tree ships
    pkgs = {"specbatch/" + str(p.parent.relative_to(REPO / "specbatch")) + "/__init__.py"
            for p in (REPO / "specbatch").rglob("__init__.py") if "__pycache__" not in p.parts}
    pkgs = {p.replace("/./", "/") for p in pkgs}
    assert {"specbatch/kernels/__init__.py", "specbatch/recipes/__init__.py"} <= pkgs
    assert pkgs <= set(names), sorted(pkgs - set(names))
    for y in (REPO / "specbatch" / "recipes").glob("*.yaml"):
        assert f"specbatch/recipes/{y.name}" in names
    if (REPO / "specbatch" / "assets" / "demo").is_dir():
        for f in (REPO / "specbatch" / "assets" / "demo").rglob("*"):
            if f.is_file():
                assert "specbatch/" + str(f.relative_to(REPO / "specbatch")) in names
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "specbatch = specbatch.cli:main" in zipfile.ZipFile(wheel).read(ep).decode()


@pytest.mark.slow
def test_installed_wheel_finds_its_resources(wheel, tmp_path):
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                        "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    code = f"""
import json, sys
sys.path.insert(0, {str(target)!r})
import specbatch, specbatch.kernels
from specbatch.recipe import builtin_recipes, load_recipe
from specbatch.job import resolve_model
try:
    import kernels
    top = kernels.__file__
except ModuleNotFoundError:
    top = None
print(json.dumps({{"file": specbatch.__file__, "kernels": specbatch.kernels.__file__, "top": top,
                  "recipes": builtin_recipes(), "model": load_recipe("vanilla").model,
                  "default": str(resolve_model("default"))}}))
"""
    got = json.loads(_python(code, tmp_path, "-P", "-E").stdout)
    assert got["file"].startswith(str(target)) and got["kernels"].startswith(str(target))
    assert got["top"] is None
    assert "vanilla" in got["recipes"]
    if got["model"] == "default" and (REPO / "specbatch" / "assets" / "demo").is_dir():
        assert got["default"].startswith(str(target))
        assert (Path(got["default"]) / "config.json").is_file()
