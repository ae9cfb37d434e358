"""The Docker image and compose file, checked without a Docker engine.

The Dockerfile is parsed instruction by instruction; the compose file is parsed as YAML and
its wiring checked; and the image's install step is replayed in a fresh virtualenv without
torch, proving the service installs, migrates and builds its app with no torch present.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ckptstore.service.db.schema import head_revision

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def test_dockerfile_builds_a_torch_free_non_root_service_image() -> None:
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    assert kinds[0] == "FROM" and instructions[0][1].startswith("python:3.11")
    assert set(kinds) <= {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "VOLUME", "HEALTHCHECK", "CMD"}
    for kind, arguments in instructions:
        if kind == "COPY":
            *sources, _target = shlex.split(arguments)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        if kind == "RUN":
            assert "torch" not in arguments.replace("find_spec('torch') is None", ""), (
                "the image must not install torch"
            )
            if arguments.startswith("pip install"):
                # The build fails if the server's commands cannot start without torch.
                assert "ckptstore serve --help" in arguments and "ckptstore db upgrade --help" in arguments
    copied = {shlex.split(a)[0] for k, a in instructions if k == "COPY"}
    assert {"service", "client", "migrations", "pyproject.toml"} <= copied
    assert ("USER", "ckptstore") in instructions, "the service must not run as root"
    assert ("EXPOSE", "8000") in instructions
    assert instructions[-1] == ("CMD", '["ckptstore", "serve"]')
    assert any(k == "HEALTHCHECK" and "/healthz" in a for k, a in instructions)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_compose_wires_the_service_to_postgres_and_minio() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "minio", "create-bucket", "migrate", "ckptstore"}
    service = services["ckptstore"]
    assert service["build"] == "." and service["command"] == ["ckptstore", "serve"]
    assert service["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "create-bucket": {"condition": "service_completed_successfully"},
    }
    assert services["migrate"]["command"] == ["ckptstore", "db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["create-bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    env = service["environment"]
    assert env["CKPTSTORE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in env["CKPTSTORE_DATABASE_URL"]
    bucket = env["CKPTSTORE_BLOBS"].removeprefix("s3://").split("/")[0]
    assert f"store/{bucket}" in services["create-bucket"]["command"][0]
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    assert env["CKPTSTORE_HOST"] == "0.0.0.0" and env["CKPTSTORE_TOKENS"].startswith("${CKPTSTORE_TOKENS:?")
    assert "8000:8000" in service["ports"]
    user = services["postgres"]["environment"]
    assert f"{user['POSTGRES_USER']}:{user['POSTGRES_PASSWORD']}@" in env["CKPTSTORE_DATABASE_URL"]
    assert env["CKPTSTORE_DATABASE_URL"].endswith("/" + user["POSTGRES_DB"])
    assert set(compose["volumes"]) == {"postgres-data", "minio-data"}


@pytest.mark.slow  # a fresh virtual environment and a pip install
def test_the_image_install_step_works_without_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # What the Dockerfile's RUN does: a plain (non-editable) install of the project, no torch.
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(ROOT)], capture_output=True, text=True, cwd=tmp_path
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env["CKPTSTORE_HOME"] = str(tmp_path / "home")
    probe = (
        "import importlib.util, ckptstore.service.api.server as s; "
        "assert importlib.util.find_spec('torch') is None; "
        "app = s.app_from_env(); print(len(app.openapi()['paths']))"
    )
    built = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    assert int(built.stdout) >= 10
    # The image's commands, through the installed entry point: `serve` and `db` need no torch.
    helped = subprocess.run(
        [str(venv / "bin" / "ckptstore"), "serve", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--workers" in helped.stdout
    upgraded = subprocess.run(
        [str(venv / "bin" / "ckptstore"), "db", "upgrade"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert upgraded.returncode == 0, upgraded.stderr[-3000:]
    assert f"at revision {head_revision()}" in upgraded.stdout  # app_from_env already migrated it
