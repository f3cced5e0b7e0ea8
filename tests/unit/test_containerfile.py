"""The Containerfile, checked statically.

It is not built here: no container registry can be reached from these machines, so the base
image (pytorch/pytorch from Docker Hub) cannot be pulled. What can be checked without a build is:
the base is the official PyTorch CUDA image whose torch satisfies pyproject's [train] pin, the
image installs this package with its training extra from files that exist and that the build
context (.dockerignore) lets through, and its entrypoint is `launch`. With a registry at hand,
LAUNCH4D_BUILD_IMAGE=1 builds it for real (test_builds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import tomllib

from tests.conftest import REPO

pytestmark = pytest.mark.unit

CONTAINERFILE = REPO / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_is_the_official_pytorch_cuda_image_matching_the_torch_pin():
    requirements = pytest.importorskip("packaging.requirements")
    (base,) = [args for word, args in instructions() if word == "FROM"]
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-(runtime|devel)", base)
    assert m, f"FROM {base}: not an official pytorch/pytorch CUDA tag"
    torch_version = m.group(1)
    (pin,) = [req for req in map(requirements.Requirement, pyproject()["project"]["optional-dependencies"]["train"])
              if req.name == "torch"]                         # (torchao is in the extra too)
    assert pin.specifier.contains(torch_version), f"base torch {torch_version} does not satisfy {pin}"
    assert float(m.group(2)) >= 12.0            # a CUDA build, not a CPU one


def test_installs_this_package_with_the_training_extra_and_runs_launch():
    steps = instructions()
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert re.search(r"pip install [^&]*\"\.\[train\]\"", runs), runs
    assert "launch --help" in runs                      # the console script is on PATH after the install
    (entry,) = [args for word, args in steps if word == "ENTRYPOINT"]
    assert json.loads(entry) == ["launch"]
    assert pyproject()["project"]["scripts"]["launch"] == "launcher.cli:main"


def test_everything_the_install_needs_is_copied_and_in_the_build_context():
    copied = set()
    for word, args in instructions():
        if word == "COPY":
            *sources, _dest = args.split()
            copied.update(sources)
    for source in copied:
        assert (REPO / source).exists(), source
    packages = {p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", pyproject()["project"]["readme"]} <= copied
    allowed = {ln[1:] for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.startswith("!")}
    assert copied <= allowed, "a COPY source is excluded from the build context by .dockerignore"


@pytest.mark.skipif(os.environ.get("LAUNCH4D_BUILD_IMAGE") != "1",
                    reason="no container registry is reachable from these machines (the base image cannot be "
                           "pulled); set LAUNCH4D_BUILD_IMAGE=1 where one is to build the image for real")
def test_builds():
    tool = shutil.which("podman") or shutil.which("docker")
    assert tool, "LAUNCH4D_BUILD_IMAGE=1 but neither podman nor docker is installed"
    tag = "launch4d-test:containerfile"
    subprocess.run([tool, "build", "-t", tag, "-f", str(CONTAINERFILE), str(REPO)], check=True)
    out = subprocess.run([tool, "run", "--rm", tag, "--help"], capture_output=True, text=True, check=True).stdout
    assert "preflight" in out and "submit" in out
