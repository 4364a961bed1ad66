"""``kustomize build`` for the kustomizations under ops/k8s, in Python, so the tests render them
where no kustomize (nor kubectl) is installed, as in CI.

It implements exactly the fields those kustomizations use, as kustomize does: ``resources``
(manifest files, and folders holding a kustomization, rendered first and in order), and
``images`` (``newName``, ``newTag``, ``digest``, on the containers and init containers of pod
templates). Any other field is an error, not a silent difference: a kustomization that starts
using one needs it implemented here (or kustomize in CI). Where kubectl is installed, the tests
also compare this with ``kubectl kustomize``, object by object.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "images"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """The kustomization uses what this renderer does not implement, or is broken."""


def build(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build folder`` prints (in kustomize's input order)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{folder}: fields this renderer does not implement: {unknown}")
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{folder}: not a Kustomization")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += build(path)
        elif path.is_file():
            if folder.resolve() not in path.parents:
                # kustomize's default load restrictor: files only from the kustomization's
                # own tree (folders elsewhere are bases, which may be anywhere).
                raise KustomizeError(f"{folder}: {entry} is a file outside its folder")
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        else:
            raise KustomizeError(f"{folder}: no such resource {entry}")
    ids = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise KustomizeError(f"{folder}: objects defined twice: {duplicates}")
    return [_set_images(o, kustomization.get("images", [])) for o in objects]


def _set_images(obj: dict[str, Any], images: list[dict[str, str]]) -> dict[str, Any]:
    if not images or obj["kind"] not in POD_TEMPLATE_KINDS:
        return obj
    obj = copy.deepcopy(obj)
    pod = obj["spec"]["template"]["spec"]
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        container["image"] = _image(container["image"], images)
    return obj


def _image(image: str, images: list[dict[str, str]]) -> str:
    name, tag = _split(image)
    for rule in images:
        if rule["name"] != name:
            continue
        unknown = set(rule) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise KustomizeError(f"images: fields this renderer does not implement: {unknown}")
        name = rule.get("newName", name)
        if "digest" in rule:
            return f"{name}@{rule['digest']}"
        tag = f":{rule['newTag']}" if "newTag" in rule else tag
        return f"{name}{tag}"
    return image


def _split(image: str) -> tuple[str, str]:
    """``registry:5000/inferq:0.1`` to (``registry:5000/inferq``, ``:0.1``)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, f"@{digest}"
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""
