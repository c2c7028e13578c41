"""Whether the Docker-based classroom tests can run here (shared by
``tests/test_classroom_docker.py`` and ``tests/test_classroom_hub.py``)."""

from __future__ import annotations

import shutil
import subprocess


def docker_why_not(images: tuple[str, ...]) -> str | None:
    """Why a test needing a Docker engine and these images cannot run here, or None."""
    if not shutil.which("docker"):
        return "no docker CLI"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"`docker info` failed (no Docker engine): {info.stderr.strip()[:200]}"
    for image in images:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"image {image} is not built (docker/README.md: make classroom-images)"
    return None
