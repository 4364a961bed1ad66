"""One virtual environment per real peer (issue #27), outside the repository, pinned.

    python bench/realpeers/envs.py [--root /work/peers] [--python PY] [--rebuild] [PEER ...]

Each peer gets ``ROOT/<peer>`` with its own pinned release, and the same ONNX Runtime as
inferq's worker, so no peer's dependencies ever touch the shared ``.venv`` (nor each other's:
Ray, BentoML and MLServer pin different ``uvicorn``/``starlette``/``pydantic`` ranges). A
built venv carries ``inferq-peer.json``: the requirements it was built from and the versions
pip resolved. Rerunning reuses every venv whose stamp matches its requirements, so the call is
cheap and idempotent; ``--rebuild`` starts over. Not part of ``dev``: CI never builds these.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROOT = Path("/work/peers")
STAMP = "inferq-peer.json"
ONNXRUNTIME = "onnxruntime==1.32.0"
"""The release inferq's worker runs in the benchmark (the shared .venv's)."""


@dataclass(frozen=True)
class PeerEnv:
    name: str
    distribution: str
    """The package whose version is the peer's version."""
    requirements: tuple[str, ...]
    note: str = ""


PEERS: dict[str, PeerEnv] = {
    p.name: p
    for p in (
        PeerEnv(
            "triton",
            "nvidia-pytriton",
            ("nvidia-pytriton==0.7.0", ONNXRUNTIME),
            "bundles the real tritonserver binary and its Python backend",
        ),
        PeerEnv(
            "mlserver",
            "mlserver",
            # 1.7.1's inference worker process dies on uvloop 0.22+.
            ("mlserver==1.7.1", "uvloop<0.22", ONNXRUNTIME),
        ),
        PeerEnv("bentoml", "bentoml", ("bentoml==1.4.40", ONNXRUNTIME)),
        PeerEnv("litserve", "litserve", ("litserve==0.2.19", ONNXRUNTIME)),
        PeerEnv("kserve", "kserve", ("kserve==0.21.0", ONNXRUNTIME)),
        PeerEnv("rayserve", "ray", ("ray[serve]==2.60.0", ONNXRUNTIME)),
    )
}


def python_of(root: Path, peer: str) -> Path:
    return root / peer / "bin" / "python"


def stamp(root: Path, peer: str) -> dict[str, Any] | None:
    """What the peer's venv was built from, or None when it is missing or half built."""
    try:
        data: dict[str, Any] = json.loads((root / peer / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if python_of(root, peer).exists() else None


def installed(python: Path) -> dict[str, str]:
    """Distribution name (lower case) to version, as pip sees the venv."""
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


def run(argv: list[str]) -> None:
    """Run a build step quietly; on failure raise with its output's tail (pip's error)."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise BuildError(f"{' '.join(argv[:6])} ... exited {done.returncode}:\n{tail}")


class BuildError(RuntimeError):
    """A peer's venv did not build; the message ends with the failing step's output."""


def ensure(peer: PeerEnv, root: Path, python: str, *, rebuild: bool = False) -> dict[str, Any]:
    """The peer's venv, built unless a matching one exists; its stamp (versions included).
    Raises ``BuildError`` (with pip's output) when it does not install."""
    current = stamp(root, peer.name)
    if current and not rebuild and current["requirements"] == list(peer.requirements):
        return current
    venv = root / peer.name
    (venv / STAMP).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    run([python, "-m", "venv", "--clear", str(venv)])
    pip = [str(python_of(root, peer.name)), "-m", "pip", "install", "-q"]
    run([*pip, "--upgrade", "pip"])
    run([*pip, *peer.requirements])
    versions = installed(python_of(root, peer.name))
    data = {
        "peer": peer.name,
        "requirements": list(peer.requirements),
        "version": versions.get(peer.distribution),
        "onnxruntime": versions.get("onnxruntime"),
        "numpy": versions.get("numpy"),
        "python": subprocess.run(
            [
                str(python_of(root, peer.name)),
                "-c",
                "import platform; print(platform.python_version())",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip(),
        "note": peer.note,
        "built_s": round(time.monotonic() - t0),
        "packages": versions,
    }
    (venv / STAMP).write_text(json.dumps(data, indent=1))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peers", nargs="*", metavar="PEER", help=f"some of {', '.join(PEERS)}")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where the venvs go")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to base them on")
    parser.add_argument("--rebuild", action="store_true", help="rebuild even a matching venv")
    args = parser.parse_args()
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers: {', '.join(sorted(unknown))}")
    failed = []
    for name in args.peers or list(PEERS):
        try:
            data = ensure(PEERS[name], args.root, args.python, rebuild=args.rebuild)
        except BuildError as e:
            failed.append(name)
            print(f"{name}: did not install ({e})", flush=True)
            continue
        print(
            f"{name}: {PEERS[name].distribution} {data['version']}, onnxruntime "
            f"{data['onnxruntime']}, numpy {data['numpy']} in {args.root / name}",
            flush=True,
        )
    if failed:
        sys.exit(f"not installed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
